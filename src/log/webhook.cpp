// The webhook sender (see webhook.h): libcurl (https for Discord) on one background thread with a bounded queue.
#include "log/webhook.h"

#include <cstdlib>

#include <curl/curl.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/errors.h"
#include "trainer/version.h"

namespace trainer {
namespace {

std::size_t discard_response(char*, std::size_t size, std::size_t count, void*) { return size * count; }

void global_curl_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

}  // namespace

std::string webhook_url_from_environment() {
  const char* url = std::getenv(kWebhookEnvironmentVariable);
  return url ? std::string(url) : std::string();
}

Webhook::Webhook(std::string url, WebhookOptions options) : url_(std::move(url)), options_(options) {
  if (!url_.starts_with("http://") && !url_.starts_with("https://"))
    throw UsageError(std::string(kWebhookEnvironmentVariable) + " is not an http:// or https:// URL",
                     std::string("set it to the webhook URL (e.g. a Discord channel's), or unset it"));
  global_curl_init();  // not thread-safe itself: done here, on the thread that creates the webhook
  thread_ = std::thread([this] { run(); });
}

Webhook::~Webhook() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    drain_deadline_ = std::chrono::steady_clock::now() + options_.drain_timeout;
  }
  wake_.notify_all();
  thread_.join();
}

void Webhook::post(const nlohmann::json& body) {
  {
    std::lock_guard lock(mutex_);
    if (queue_.size() >= options_.queue_capacity) {
      queue_.pop_front();
      ++dropped_;
    }
    queue_.push_back(body.dump());
  }
  wake_.notify_one();
}

int64_t Webhook::sent() const {
  std::lock_guard lock(mutex_);
  return sent_;
}

int64_t Webhook::failed() const {
  std::lock_guard lock(mutex_);
  return failed_;
}

int64_t Webhook::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

void Webhook::run() {
  for (;;) {
    std::string body;
    auto timeout = options_.timeout;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything is sent
      if (stopping_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(drain_deadline_ -
                                                                                std::chrono::steady_clock::now());
        if (left.count() <= 0) {
          dropped_ += static_cast<int64_t>(queue_.size());
          return;
        }
        timeout = std::min(timeout, left);
      }
      body = std::move(queue_.front());
      queue_.pop_front();
    }
    send(body, timeout);
  }
}

void Webhook::send(const std::string& body, std::chrono::milliseconds timeout) {
  CURL* curl = curl_easy_init();
  if (!curl) {
    warn("libcurl could not start a request");
    return;
  }
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip before the body
  const std::string agent = std::string("trainer/") + kVersion;
  curl_easy_setopt(curl, CURLOPT_URL, url_.c_str());
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_USERAGENT, agent.c_str());
  curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout.count()));
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(timeout.count()));
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for timeouts: this is not the main thread
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, discard_response);  // or libcurl prints the answer on stdout
  const CURLcode code = curl_easy_perform(curl);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  if (code == CURLE_OK && status >= 200 && status < 300) {
    std::lock_guard lock(mutex_);
    ++sent_;
    return;
  }
  // The messages name neither the URL nor the host: the URL is a secret.
  warn(code != CURLE_OK ? std::string(curl_easy_strerror(code)) : "HTTP status " + std::to_string(status));
}

void Webhook::warn(const std::string& what) {
  {
    std::lock_guard lock(mutex_);
    ++failed_;
  }
  // Only this thread counts warnings.
  if (warnings_ >= options_.max_warnings) return;
  ++warnings_;
  spdlog::warn("webhook: a notification was not delivered ({}){}", what,
               warnings_ == options_.max_warnings ? "; further webhook failures are not logged" : "");
}

}  // namespace trainer
