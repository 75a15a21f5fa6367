// The Hub client's HTTP requests with libcurl (see hub_http.h).
#include "io/hub_http.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include <curl/curl.h>

#include "trainer/version.h"

namespace trainer::hub {

std::string trimmed(std::string s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r\n") - first + 1);
}

namespace {

void global_curl_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::size_t collect_header(char* data, std::size_t size, std::size_t count, void* user) {
  auto* headers = static_cast<std::map<std::string, std::string>*>(user);
  const std::string line(data, size * count);
  if (line.starts_with("HTTP/")) headers->clear();  // a new response (after 100 Continue)
  const auto colon = line.find(':');
  if (colon != std::string::npos) (*headers)[lower(line.substr(0, colon))] = trimmed(line.substr(colon + 1));
  return size * count;
}

std::size_t collect_body(char* data, std::size_t size, std::size_t count, void* user) {
  auto* body = static_cast<std::string*>(user);
  if (body->size() > (64u << 20)) return 0;  // metadata is never this large
  body->append(data, size * count);
  return size * count;
}

std::size_t write_to_file(char* data, std::size_t size, std::size_t count, void* user) {
  auto* sink = static_cast<FileSink*>(user);
  if (sink->status == 0) curl_easy_getinfo(static_cast<CURL*>(sink->curl), CURLINFO_RESPONSE_CODE, &sink->status);
  const std::size_t n = size * count;
  if (sink->status != 200 && sink->status != 206) return n;  // an error page: discarded
  if (std::fwrite(data, 1, n, sink->file) != n) {
    sink->write_errno = errno ? errno : EIO;
    return 0;
  }
  sink->written += n;
  return n;
}

int show_progress(void* user, curl_off_t, curl_off_t now, curl_off_t, curl_off_t) {
  auto* p = static_cast<Progress*>(user);
  if (!p->terminal) return 0;
  const auto t = std::chrono::steady_clock::now();
  if (t - p->last_shown < std::chrono::milliseconds(500)) return 0;
  p->last_shown = t;
  const double seconds = std::chrono::duration<double>(t - p->started).count();
  const double rate = seconds > 0 ? static_cast<double>(now) / seconds : 0;
  const std::uint64_t have = p->start_offset + static_cast<std::uint64_t>(now);
  const double eta = rate > 0 && p->total > have ? static_cast<double>(p->total - have) / rate : 0;
  std::fprintf(stderr, "\r  %s: %s / %s, %s/s, ETA %.0f s   ", p->name.c_str(), human_size(have).c_str(),
               human_size(p->total).c_str(), human_size(static_cast<std::uint64_t>(rate)).c_str(), eta);
  std::fflush(stderr);
  return 0;
}

}  // namespace

// scheme://host:port of a URL, to tell whether a redirect leaves the endpoint's host.
std::string origin_of(const std::string& url) {
  CURLU* handle = curl_url();
  std::string origin;
  if (curl_url_set(handle, CURLUPART_URL, url.c_str(), 0) == CURLUE_OK) {
    char *scheme = nullptr, *host = nullptr, *port = nullptr;
    curl_url_get(handle, CURLUPART_SCHEME, &scheme, 0);
    curl_url_get(handle, CURLUPART_HOST, &host, 0);
    curl_url_get(handle, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT);
    origin = lower(std::string(scheme ? scheme : "") + "://" + (host ? host : "") + ":" + (port ? port : ""));
    curl_free(scheme);
    curl_free(host);
    curl_free(port);
  }
  curl_url_cleanup(handle);
  return origin;
}

// `location` (absolute, or relative to `base`) as an absolute URL.
std::string join_url(const std::string& base, const std::string& location) {
  CURLU* handle = curl_url();
  std::string joined = location;
  if (curl_url_set(handle, CURLUPART_URL, base.c_str(), 0) == CURLUE_OK &&
      curl_url_set(handle, CURLUPART_URL, location.c_str(), 0) == CURLUE_OK) {
    char* full = nullptr;
    if (curl_url_get(handle, CURLUPART_URL, &full, 0) == CURLUE_OK) joined = full;
    curl_free(full);
  }
  curl_url_cleanup(handle);
  return joined;
}

std::string printable_url(const std::string& url) { return url.substr(0, url.find('?')); }

std::string escape_path_part(const std::string& part) {
  char* escaped = curl_easy_escape(nullptr, part.c_str(), static_cast<int>(part.size()));
  std::string out = escaped ? escaped : part;
  curl_free(escaped);
  return out;
}

// Each '/'-separated part escaped, the slashes kept (a file in a folder).
std::string escape_path(const std::string& path) {
  std::string out;
  std::size_t start = 0;
  for (;;) {
    const auto slash = path.find('/', start);
    out += escape_path_part(path.substr(start, slash - start));
    if (slash == std::string::npos) break;
    out += "/";
    start = slash + 1;
  }
  return out;
}

Http::Http(const HubSettings& settings) : settings_(settings), endpoint_origin_(origin_of(settings.endpoint)) {
  global_curl_init();
}

Response Http::once(const std::string& method, const std::string& url, std::uint64_t range_from, FileSink* sink,
                    Progress* progress) const {
  CURL* curl = curl_easy_init();
  if (!curl) throw NetworkError("libcurl could not start a request", true);
  Response response;
  response.url = url;
  curl_slist* headers = curl_slist_append(nullptr, "Accept-Encoding: identity");
  // The token goes only to the endpoint's own host: never to a CDN or any other host a redirect names.
  std::string authorization;
  if (!settings_.token.empty() && origin_of(url) == endpoint_origin_) {
    authorization = "Authorization: Bearer " + settings_.token;
    headers = curl_slist_append(headers, authorization.c_str());
  }
  std::string range;
  if (range_from > 0) {
    range = "Range: bytes=" + std::to_string(range_from) + "-";
    headers = curl_slist_append(headers, range.c_str());
  }
  const std::string agent = std::string("trainer/") + kVersion + "; hf_hub-compatible";
  char error_text[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_USERAGENT, agent.c_str());
  curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_text);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, collect_header);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &response.headers);
  const long connect_ms = static_cast<long>(settings_.metadata_timeout_s * 1000);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, connect_ms);
  if (method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, connect_ms);
  } else if (sink) {
    sink->curl = curl;
    sink->status = 0;
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, write_to_file);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, sink);
    // A body that stalls (less than 1 byte/s for HF_HUB_DOWNLOAD_TIMEOUT seconds) is cut and resumed.
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(settings_.download_timeout_s)));
    if (progress) {
      curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, show_progress);
      curl_easy_setopt(curl, CURLOPT_XFERINFODATA, progress);
      curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
    }
  } else {
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, collect_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response.body);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(settings_.metadata_timeout_s)));
  }
  const CURLcode code = curl_easy_perform(curl);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  if (code == CURLE_WRITE_ERROR && sink && sink->write_errno != 0)
    throw DataError("cannot write the download: " + std::string(std::strerror(sink->write_errno)));
  if (code != CURLE_OK) {
    const bool transient = code != CURLE_UNSUPPORTED_PROTOCOL && code != CURLE_URL_MALFORMAT;
    throw NetworkError(printable_url(url) + ": " + (*error_text ? error_text : curl_easy_strerror(code)), transient);
  }
  return response;
}

Response Http::follow(const std::string& method, std::string url, std::uint64_t range_from, FileSink* sink,
                      Progress* progress) const {
  for (int hop = 0; hop < 10; ++hop) {
    Response response = once(method, url, range_from, sink, progress);
    const bool redirect = response.status >= 301 && response.status <= 308 && response.status != 304 &&
                          response.headers.count("location");
    if (!redirect) return response;
    const std::string& location = response.headers["location"];
    // As huggingface_hub: a HEAD follows only relative redirects (a renamed repo); an absolute one is the LFS
    // file's CDN, whose own answer lacks the Hub's headers.
    if (method == "HEAD" && (location.find("://") != std::string::npos || location.starts_with("//")))
      return response;
    const std::string next = join_url(url, location);
    url = next;
  }
  throw DataError("too many redirects from " + printable_url(url));
}

bool retriable_status(long status) { return status == 429 || status >= 500; }

void back_off(const HubSettings& settings, int attempt) {
  static thread_local std::mt19937 random(std::random_device{}());
  const double base = std::min(30.0, settings.retry_base_s * double(1 << std::min(attempt - 1, 10)));
  const double jittered = base * std::uniform_real_distribution<double>(0.8, 1.2)(random);
  std::this_thread::sleep_for(std::chrono::duration<double>(jittered));
}

}  // namespace trainer::hub
