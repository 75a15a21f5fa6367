// Hub ids resolved in the huggingface_hub cache, and what the cache lacks downloaded into it with libcurl, laid out
// exactly as huggingface_hub lays it out (blobs/, snapshots/, refs/, .no_exist/, .locks/), so Python and trainer
// share one cache. Facts about the protocol: /work/shared/HUB_NOTES.md and docs/models.md#hub-ids-and-the-cache.
#include "trainer/hub.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "io/hub_http.h"
#include "trainer/errors.h"

namespace trainer::hub {
namespace fs = std::filesystem;

// ---- names -------------------------------------------------------------------------------------------------------

bool looks_like_path(const std::string& name) {
  if (name.empty()) return false;
  if (name == "." || name == ".." || name.starts_with("/") || name.starts_with("./") || name.starts_with("../") ||
      name.starts_with("~"))
    return true;
  const std::string id_part = name.substr(0, name.find('@'));
  return std::count(id_part.begin(), id_part.end(), '/') > 1;
}

namespace {

// huggingface_hub's rule for a repo name part: letters, digits, '-', '_', '.'; not starting or ending with '-' or
// '.'; no "--" or "..".
bool valid_name_part(const std::string& part) {
  if (part.empty() || part.size() > 96) return false;
  for (const char c : part)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') return false;
  if (part.front() == '-' || part.front() == '.' || part.back() == '-' || part.back() == '.') return false;
  return part.find("--") == std::string::npos && part.find("..") == std::string::npos;
}

}  // namespace

std::optional<HubId> parse_hub_id(const std::string& name) {
  if (looks_like_path(name)) return std::nullopt;
  HubId id;
  const auto at = name.find('@');
  id.repo_id = name.substr(0, at);
  if (at != std::string::npos) {
    id.revision = name.substr(at + 1);
    // A revision is a branch, tag or commit: no empty one, no spaces or control characters, no "..".
    if (id.revision.empty() || id.revision.find("..") != std::string::npos || id.revision.starts_with("/") ||
        id.revision.ends_with("/"))
      return std::nullopt;
    for (const char c : id.revision)
      if (static_cast<unsigned char>(c) <= ' ' || c == '\\' || c == '?' || c == '#' || c == '%') return std::nullopt;
  }
  if (id.repo_id.size() > 96) return std::nullopt;
  const auto slash = id.repo_id.find('/');
  if (slash == std::string::npos) return valid_name_part(id.repo_id) ? std::optional(id) : std::nullopt;
  if (!valid_name_part(id.repo_id.substr(0, slash)) || !valid_name_part(id.repo_id.substr(slash + 1)))
    return std::nullopt;
  return id;
}

std::optional<DatasetRef> parse_dataset_ref(const std::string& name, const std::string& default_split) {
  std::error_code ec;
  if (name.empty() || fs::exists(name, ec) || name.find_first_of("*?[") != std::string::npos) {
    if (!name.starts_with("hf://")) return std::nullopt;
  }
  DatasetRef ref;
  constexpr std::string_view kScheme = "hf://datasets/";
  if (name.starts_with(kScheme)) {
    const std::string rest = name.substr(kScheme.size());
    // ORG/NAME[@REVISION] is the first two parts; a revision may not hold '/' here (as huggingface_hub's hf:// paths
    // spell refs/convert/parquet as refs%2Fconvert%2Fparquet).
    const std::size_t first = rest.find('/');
    const std::size_t second = first == std::string::npos ? std::string::npos : rest.find('/', first + 1);
    ref.id = rest.substr(0, second);
    if (second != std::string::npos && second + 1 < rest.size()) ref.include.push_back(rest.substr(second + 1));
    std::size_t at;
    while ((at = ref.id.find("%2F")) != std::string::npos) ref.id.replace(at, 3, "/");
    if (!parse_hub_id(ref.id) || ref.id.substr(0, ref.id.find('@')).find('/') == std::string::npos) return std::nullopt;
    return ref;
  }
  for (const char* extension : {".jsonl", ".gz", ".parquet", ".arrow", ".json", ".feather", ".ipc", ".csv", ".txt"})
    if (name.ends_with(extension)) return std::nullopt;
  std::vector<std::string> parts;
  for (std::size_t start = 0;;) {
    const std::size_t colon = name.find(':', start);
    parts.push_back(name.substr(start, colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (parts.size() > 3) return std::nullopt;
  for (const auto& part : parts)
    if (part.empty()) return std::nullopt;
  ref.id = parts[0];
  // A local folder with a split (a datasets folder, DIR:train) is not an id either.
  if (looks_like_path(ref.id) || fs::exists(ref.id, ec) || !parse_hub_id(ref.id) ||
      ref.id.find('/') == std::string::npos)
    return std::nullopt;
  ref.split = parts.size() > 1 ? parts.back() : default_split;
  if (parts.size() == 3) ref.config = parts[1];
  return ref;
}

bool is_commit_hash(const std::string& revision) {
  static const std::regex pattern("[0-9a-f]{40}");
  return std::regex_match(revision, pattern);
}

std::string repo_folder_name(const std::string& repo_id, RepoType type) {
  std::string folder = (type == RepoType::kDataset ? "datasets--" : "models--") + repo_id;
  for (std::size_t pos = 0; (pos = folder.find('/', pos)) != std::string::npos;) folder.replace(pos, 1, "--");
  return folder;
}

std::string human_size(std::uint64_t bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1000 && unit < 4) {
    value /= 1000;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return text;
}

// ---- settings ----------------------------------------------------------------------------------------------------

namespace {

bool is_true(const char* value) {
  if (!value) return false;
  std::string v(value);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::toupper(c); });
  return v == "1" || v == "ON" || v == "YES" || v == "TRUE";
}

double seconds_from(const char* value, double fallback, const char* name) {
  if (!value || !*value) return fallback;
  char* end = nullptr;
  const double v = std::strtod(value, &end);
  if (end == value || *end != '\0' || v <= 0)
    throw UsageError(std::string(name) + "=" + value + " is not a positive number of seconds",
                     std::string("set ") + name + " to e.g. 10, or unset it");
  return v;
}

}  // namespace

HubSettings settings_from_environment(const Getenv& getenv_function) {
  const Getenv get = getenv_function ? getenv_function : Getenv([](const char* name) { return std::getenv(name); });
  auto value = [&](const char* name) -> std::string {
    const char* v = get(name);
    return v ? std::string(v) : std::string();
  };
  HubSettings s;
  const std::string home = value("HOME");
  std::string xdg = value("XDG_CACHE_HOME");
  if (xdg.empty()) xdg = home + "/.cache";
  std::string hf_home = value("HF_HOME");
  if (hf_home.empty()) hf_home = xdg + "/huggingface";
  s.cache_dir = value("HF_HUB_CACHE");
  if (s.cache_dir.empty()) s.cache_dir = value("HUGGINGFACE_HUB_CACHE");
  if (s.cache_dir.empty()) s.cache_dir = hf_home + "/hub";
  if (const auto endpoint = value("HF_ENDPOINT"); !endpoint.empty()) s.endpoint = endpoint;
  while (s.endpoint.ends_with("/")) s.endpoint.pop_back();
  s.token = trimmed(value("HF_TOKEN"));
  if (s.token.empty()) {
    std::string token_path = value("HF_TOKEN_PATH");
    if (token_path.empty()) token_path = hf_home + "/token";
    std::ifstream file(token_path);
    if (file) {
      std::stringstream text;
      text << file.rdbuf();
      s.token = trimmed(text.str());
    }
  }
  s.offline = is_true(get("HF_HUB_OFFLINE")) || is_true(get("TRANSFORMERS_OFFLINE"));
  s.metadata_timeout_s = seconds_from(get("HF_HUB_ETAG_TIMEOUT"), s.metadata_timeout_s, "HF_HUB_ETAG_TIMEOUT");
  s.download_timeout_s = seconds_from(get("HF_HUB_DOWNLOAD_TIMEOUT"), s.download_timeout_s, "HF_HUB_DOWNLOAD_TIMEOUT");
  if (const char* retries = get("TRAINER_HUB_RETRIES"); retries && *retries)
    s.retries = std::max(0, std::atoi(retries));
  s.retry_base_s = seconds_from(get("TRAINER_HUB_RETRY_BASE_S"), s.retry_base_s, "TRAINER_HUB_RETRY_BASE_S");
  return s;
}

std::optional<SnapshotOrigin> snapshot_origin(const std::string& path) {
  const fs::path p = fs::path(path).lexically_normal();
  std::vector<std::string> parts;
  for (const auto& part : p) parts.push_back(part.string());
  while (!parts.empty() && parts.back().empty()) parts.pop_back();
  if (parts.size() < 3) return std::nullopt;
  const std::string& commit = parts[parts.size() - 1];
  const std::string& folder = parts[parts.size() - 3];
  if (parts[parts.size() - 2] != "snapshots" || !is_commit_hash(commit) || !folder.starts_with("models--"))
    return std::nullopt;
  std::string repo_id = folder.substr(8);
  const auto separator = repo_id.find("--");
  if (separator != std::string::npos) repo_id.replace(separator, 2, "/");
  return SnapshotOrigin{repo_id, commit};
}

namespace {

// ---- errors from the Hub -----------------------------------------------------------------------------------------

[[noreturn]] void throw_hub_error(const Response& response, const HubId& id, const std::string& file,
                                  const HubSettings& settings) {
  const std::string code = response.headers.count("x-error-code") ? response.headers.at("x-error-code") : "";
  const std::string message =
      response.headers.count("x-error-message") ? " (" + response.headers.at("x-error-message") + ")" : "";
  const std::string repo = id.repo_id;
  const std::string on = " on " + settings.endpoint;
  const std::string token_hint =
      settings.token.empty() ? "no token is set: set HF_TOKEN (or run `hf auth login`)"
                             : "the token in HF_TOKEN (or the token file) has no access to it";
  if (code == "GatedRepo" || ((response.status == 401 || response.status == 403) && code != "RepoNotFound"))
    throw DataError("GatedRepo: " + repo + " is gated or private" + on + message,
                    "accept its licence at " + settings.endpoint + "/" + repo +
                        " with your account and set HF_TOKEN to a token of that account (" + token_hint + ")");
  if (code == "RepoNotFound" || (response.status == 401 && code.empty()))
    throw DataError("RepoNotFound: " + repo + " does not exist" + on + ", or it is private" + message,
                    "check the id (org/name, as on the model's Hub page); for a private repo, " + token_hint +
                        "; a local directory must exist (or start with ./ or /)");
  if (code == "RevisionNotFound")
    throw DataError("RevisionNotFound: " + repo + " has no revision \"" + id.revision + "\"" + on + message,
                    "use a branch, tag or commit of the repo (e.g. " + repo + "@main)");
  if (code == "EntryNotFound" || response.status == 404)
    throw DataError("EntryNotFound: " + repo + "@" + id.revision + " has no file " + file + on + message,
                    "check the repo's files on " + settings.endpoint + "/" + repo);
  throw DataError("the Hub answered HTTP " + std::to_string(response.status) + " for " + file + " of " + repo +
                      "@" + id.revision + " (" + printable_url(response.url) + ")" + message,
                  "check HF_ENDPOINT (" + settings.endpoint + ") and try again later");
}

// ---- the cache ---------------------------------------------------------------------------------------------------

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return trimmed(text.str());
}

// Written to a unique temporary name and renamed over the target: readers see the old or the new, never half.
void write_file_atomically(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  const fs::path tmp = path.string() + "." + std::to_string(::getpid()) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      throw DataError("cannot write " + path.string(), "check the free space and permissions of the cache");
    }
  }
  fs::rename(tmp, path);
}

// A relative symlink snapshots/<commit>/<file> -> ../../blobs/<etag> (one more ../ per folder of the file),
// created under a temporary name and renamed into place.
void link_into_snapshot(const fs::path& snapshot, const std::string& file, const fs::path& blob) {
  const fs::path link = snapshot / file;
  fs::create_directories(link.parent_path());
  const fs::path target = fs::relative(blob, link.parent_path());
  std::error_code ec;
  if (fs::is_symlink(link, ec) && fs::read_symlink(link, ec) == target) return;
  const fs::path tmp = link.string() + "." + std::to_string(::getpid()) + ".tmp";
  fs::remove(tmp, ec);
  fs::create_symlink(target, tmp);
  fs::rename(tmp, link);
}

// flock on .locks/models--ORG--NAME/<etag>.lock, as huggingface_hub's filelock takes it: one process downloads a
// blob, the others wait and then find it in place. With `stall_timeout_s` > 0 a waiter gives up when the holder's
// part (`incomplete`) has not grown for that long (a rank waiting on its node's download: distributed.timeout_s).
class BlobLock {
 public:
  BlobLock(const fs::path& path, const fs::path& incomplete, double stall_timeout_s) {
    fs::create_directories(path.parent_path());
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw DataError("cannot open the lock file " + path.string() + ": " + std::strerror(errno),
                                 "check the permissions of the Hugging Face cache");
    using Clock = std::chrono::steady_clock;
    auto last_growth = Clock::now();
    std::uintmax_t last_size = 0;
    bool waited = false;
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) {
        const int error = errno;
        ::close(fd_);
        throw DataError("cannot lock " + path.string() + ": " + std::strerror(error));
      }
      if (!waited) spdlog::info("another process is downloading {}; waiting for it", incomplete.filename().string());
      waited = true;
      std::error_code ec;
      const std::uintmax_t size = fs::exists(incomplete, ec) ? fs::file_size(incomplete, ec) : 0;
      if (size != last_size) {
        last_size = size;
        last_growth = Clock::now();
      }
      if (stall_timeout_s > 0 && std::chrono::duration<double>(Clock::now() - last_growth).count() > stall_timeout_s) {
        ::close(fd_);
        throw DataError("waited " + std::to_string(static_cast<int>(stall_timeout_s)) + " s for another process "
                            "downloading " + incomplete.string() + ", which made no progress",
                        "is another trainer or Python process stuck on it? stop it, or delete " + path.string() +
                            " if none runs, and start again");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  ~BlobLock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  BlobLock(const BlobLock&) = delete;
  BlobLock& operator=(const BlobLock&) = delete;

 private:
  int fd_ = -1;
};

// ---- which files -------------------------------------------------------------------------------------------------

// The branch where the Hub keeps its Parquet conversion of every dataset (CONFIG/SPLIT/0000.parquet).
constexpr const char* kConvertedRevision = "refs/convert/parquet";

// The files trainer reads besides the weights (config, tokenizers, chat template, image processor, adapter).
const std::vector<std::string>& metadata_files() {
  static const std::vector<std::string> names = {
      "config.json",          "generation_config.json",   "tokenizer.json",     "tokenizer_config.json",
      "special_tokens_map.json", "added_tokens.json",     "spiece.model",       "tokenizer.model",
      "vocab.json",           "vocab.txt",                "merges.txt",         "chat_template.jinja",
      "chat_template.json",   "preprocessor_config.json", "adapter_config.json", "model.safetensors.index.json"};
  return names;
}

bool is_pickled(const std::string& path) {
  for (const char* suffix : {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
    if (path.ends_with(suffix)) return true;
  return false;
}

struct RemoteFile {
  std::string path;
  std::uint64_t size = 0;
  std::string lfs_sha256;  // empty for a regular (non-LFS) file
};

struct Remote {
  std::string etag;    // the blob's name: the LFS sha256, or the git blob sha1
  std::string commit;
  std::uint64_t size = 0;
  bool lfs = false;
};

std::string strip_etag(std::string etag) {
  if (etag.starts_with("W/")) etag = etag.substr(2);
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') etag = etag.substr(1, etag.size() - 2);
  return etag;
}

bool is_sha256_hex(const std::string& s) {
  static const std::regex pattern("[0-9a-f]{64}");
  return std::regex_match(s, pattern);
}

// The next page of a listing from `Link: <url>; rel="next"`.
std::string next_link(const Response& response) {
  const auto it = response.headers.find("link");
  if (it == response.headers.end()) return "";
  static const std::regex pattern("<([^>]+)>\\s*;\\s*rel=\"?next\"?");
  std::smatch match;
  return std::regex_search(it->second, match, pattern) ? match[1].str() : "";
}

class Resolver {
 public:
  Resolver(const HubId& id, const ResolveOptions& options, const HubSettings& settings)
      : id_(id), options_(options), settings_(settings), http_(settings),
        repo_dir_(fs::path(settings.cache_dir) / repo_folder_name(id.repo_id, options.repo_type)),
        locks_dir_(fs::path(settings.cache_dir) / ".locks" / repo_folder_name(id.repo_id, options.repo_type)) {}

  Resolved run() {
    Resolved result;
    result.from_hub = true;
    result.repo_id = id_.repo_id;
    result.revision = id_.revision;
    std::string cached = cached_commit();
    if (data() && settings_.offline && (cached.empty() || !has_cached_data(cached))) {
      // Only the Hub's converted Parquet files may be in the cache.
      const HubId own = id_;
      id_.revision = kConvertedRevision;
      const std::string converted = cached_commit();
      if (converted.empty() || !has_cached_data(converted)) id_ = own;
      else cached = converted;
    }
    if (settings_.offline) {
      if (cached.empty() || !fs::is_directory(repo_dir_ / "snapshots" / cached))
        throw UsageError(options_.what + ": " + name() + " is not in the Hugging Face cache (" + settings_.cache_dir +
                             "), and HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE forbid downloading it",
                         "download it once with the network on (`trainer download " + name() +
                             "`, or huggingface_hub's snapshot_download), or set " + options_.what +
                             " to a local model directory");
      return from_cache(result, cached);
    }
    std::vector<RemoteFile> listing;
    try {
      listing = list_files();
    } catch (const NetworkError& e) {
      if (!cached.empty() && fs::is_directory(repo_dir_ / "snapshots" / cached)) {
        spdlog::warn("{}: cannot reach {} ({}); going on with the cached snapshot {} of {}", options_.what,
                     settings_.endpoint, e.what(), cached, name());
        return from_cache(result, cached);
      }
      throw DataError(options_.what + ": cannot reach " + settings_.endpoint + " to download " + name() + " (" +
                          e.what() + "), and the Hugging Face cache (" + settings_.cache_dir +
                          ") holds no snapshot of it",
                      "check the network or HF_ENDPOINT; or set " + options_.what + " to a local model directory");
    }
    std::vector<RemoteFile> wanted = select(listing);
    const bool has_parquet = std::any_of(listing.begin(), listing.end(),
                                         [](const RemoteFile& file) { return file.path.ends_with(".parquet"); });
    if (data() && !has_parquet && options_.include.empty() && id_.revision != kConvertedRevision) {
      // No Parquet files in the repo itself (JSONL, CSV, a script): the Hub's conversion of it (every dataset has one).
      spdlog::info("{}: {} has no Parquet files; reading the Hub's conversion ({})", options_.what, name(),
                   kConvertedRevision);
      id_.revision = kConvertedRevision;
      listing = list_files();
      wanted = select(listing);
      result.revision = id_.revision;
    }
    if (data() && wanted.empty())
      throw DataError(options_.what + ": " + name() + " holds no Parquet files" +
                          (options_.split.empty() ? "" : " of the split \"" + options_.split + "\"") +
                          (options_.config.empty() ? "" : " in the config \"" + options_.config + "\"") + available(listing),
                      "name a split the dataset has (ORG/NAME:SPLIT, or ORG/NAME:CONFIG:SPLIT)");
    if (wanted.empty())
      throw DataError(name() + " holds none of the files trainer reads (config.json, tokenizer files, *.safetensors)",
                      options_.include.empty() ? "is it a model repo? check " + settings_.endpoint + "/" + id_.repo_id
                                               : "no file matches --include; list the repo's files on the Hub");

    // The commit: from the first file's metadata; every later request names it, so a branch that moves meanwhile
    // cannot mix two commits in one snapshot.
    Remote first = head(wanted.front().path, id_.revision);
    result.commit = first.commit;
    if (result.commit.empty())
      throw DataError(settings_.endpoint + " sent no X-Repo-Commit header for " + name(),
                      "is HF_ENDPOINT a Hugging Face Hub (or a mirror of one)?");
    const fs::path snapshot = repo_dir_ / "snapshots" / result.commit;
    if (options_.files == FileSet::kModel && options_.include.empty()) add_shards(listing, wanted, snapshot);

    std::vector<std::pair<RemoteFile, Remote>> to_fetch;
    for (const auto& file : wanted) {
      std::error_code ec;
      if (fs::exists(snapshot / file.path, ec)) continue;  // linked, and its blob in place
      Remote remote = file.path == wanted.front().path ? first : head(file.path, result.commit);
      if (!remote.commit.empty() && remote.commit != result.commit)
        throw DataError(name() + " moved to another commit while its files were listed (" + result.commit + ", then " +
                            remote.commit + ")",
                        "run again");
      to_fetch.emplace_back(file, remote);
    }
    if (options_.dry_run) {
      for (const auto& [file, remote] : to_fetch)
        if (!fs::exists(repo_dir_ / "blobs" / remote.etag)) result.would_download.push_back({file.path, remote.size});
      result.local_path = snapshot.string();
      return result;
    }
    for (const auto& [file, remote] : to_fetch) {
      if (fetch_blob(file.path, remote, result.commit)) result.downloaded.push_back({file.path, remote.size});
      link_into_snapshot(snapshot, file.path, repo_dir_ / "blobs" / remote.etag);
    }
    fs::create_directories(snapshot);
    const fs::path ref = repo_dir_ / "refs" / id_.revision;
    if (id_.revision != result.commit && (!fs::exists(ref) || read_text_file(ref) != result.commit))
      write_file_atomically(ref, result.commit);
    if (!data()) mark_absent(listing, result.commit);
    result.local_path = snapshot.string();
    for (const auto& file : wanted) result.files.push_back((snapshot / file.path).string());
    std::sort(result.files.begin(), result.files.end());
    spdlog::info("{}: {} is commit {} ({} file(s) downloaded) in {}", options_.what, name(), result.commit,
                 result.downloaded.size(), snapshot.string());
    return result;
  }

 private:
  std::string name() const { return id_.revision == "main" ? id_.repo_id : id_.repo_id + "@" + id_.revision; }

  // The commit the cache knows for the revision: the revision itself when it is a commit, else refs/<revision>.
  std::string cached_commit() const {
    if (is_commit_hash(id_.revision)) return id_.revision;
    const fs::path ref = repo_dir_ / "refs" / id_.revision;
    std::error_code ec;
    if (!fs::is_regular_file(ref, ec)) return "";
    const std::string commit = read_text_file(ref);
    return is_commit_hash(commit) ? commit : "";
  }

  Resolved from_cache(Resolved result, const std::string& commit) const {
    result.commit = commit;
    result.from_cache_only = true;
    const fs::path snapshot = repo_dir_ / "snapshots" / commit;
    result.local_path = snapshot.string();
    if (data()) {
      result.revision = id_.revision;
      for (const auto& file : select(snapshot_listing(commit))) result.files.push_back((snapshot / file.path).string());
      std::sort(result.files.begin(), result.files.end());
      if (result.files.empty())
        throw DataError(options_.what + ": the cached snapshot " + commit + " of " + name() + " holds no Parquet files" +
                            (options_.split.empty() ? "" : " of the split \"" + options_.split + "\""),
                        "download the split once with the network on (`trainer download --dataset`)");
    }
    // What the snapshot lacks and no .no_exist marker explains: the cache holds only part of the repo.
    if (options_.files == FileSet::kModel && options_.include.empty()) {
      std::error_code ec;
      bool has_weights = false;
      for (const auto& entry : fs::directory_iterator(snapshot, ec))
        if (entry.path().extension() == ".safetensors") has_weights = true;
      if (!has_weights && !fs::exists(repo_dir_ / ".no_exist" / commit / "model.safetensors"))
        spdlog::warn("{}: the cached snapshot {} of {} holds no *.safetensors weights", options_.what, commit, name());
    }
    spdlog::info("{}: {} is commit {} (from the cache, no download) in {}", options_.what, name(), commit,
                 snapshot.string());
    return result;
  }

  std::string api_url() const {
    return settings_.endpoint + (data_repo() ? "/api/datasets/" : "/api/models/") + id_.repo_id + "/tree/" +
           escape_path_part(id_.revision) + "?recursive=true";
  }

  std::string resolve_url(const std::string& file, const std::string& revision) const {
    return settings_.endpoint + (data_repo() ? "/datasets/" : "/") + id_.repo_id + "/resolve/" +
           escape_path_part(revision) + "/" + escape_path(file);
  }

  bool data_repo() const { return options_.repo_type == RepoType::kDataset; }
  bool data() const { return options_.files == FileSet::kData; }

  // The files of a cached snapshot, as a listing (offline: what select() picks from).
  std::vector<RemoteFile> snapshot_listing(const std::string& commit) const {
    std::vector<RemoteFile> files;
    const fs::path snapshot = repo_dir_ / "snapshots" / commit;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(snapshot, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec))
      if (fs::is_regular_file(it->path(), ec)) files.push_back({it->path().lexically_relative(snapshot).string(), 0, ""});
    return files;
  }

  bool has_cached_data(const std::string& commit) const {
    std::error_code ec;
    return fs::is_directory(repo_dir_ / "snapshots" / commit, ec) && !select(snapshot_listing(commit)).empty();
  }

  // " (its Parquet files: a, b, ...)" for a message, or nothing.
  static std::string available(const std::vector<RemoteFile>& listing) {
    std::string names;
    int shown = 0;
    for (const auto& file : listing)
      if (file.path.ends_with(".parquet") && shown++ < 8) names += (names.empty() ? "" : ", ") + file.path;
    return names.empty() ? "" : " (its Parquet files: " + names + (shown > 8 ? ", ..." : "") + ")";
  }

  // Whether a repo path is a data file of the split (and config): as datasets' default data-files patterns see a
  // split in a name (a folder named SPLIT, or SPLIT as a word of the file name: train-00000-of-00002.parquet,
  // data/train.parquet, my_train_0.parquet), and the config as the first folder of the Hub's conversion.
  bool is_data_file(const std::string& path, const std::string& config) const {
    if (!path.ends_with(".parquet")) return false;
    std::vector<std::string> parts;
    for (std::size_t start = 0;;) {
      const std::size_t slash = path.find('/', start);
      parts.push_back(path.substr(start, slash - start));
      if (slash == std::string::npos) break;
      start = slash + 1;
    }
    if (!config.empty() && (parts.size() < 2 || parts.front() != config)) return false;
    const std::string& split = options_.split;
    if (split.empty()) return true;
    for (std::size_t i = 0; i + 1 < parts.size(); ++i)
      if (parts[i] == split) return true;
    const std::string stem = parts.back().substr(0, parts.back().size() - 8);
    const auto is_separator = [](char c) { return c == '-' || c == '_' || c == '.' || c == ' ' || std::isdigit(static_cast<unsigned char>(c)); };
    for (std::size_t at = stem.find(split); at != std::string::npos; at = stem.find(split, at + 1)) {
      const bool starts = at == 0 || is_separator(stem[at - 1]);
      const bool ends = at + split.size() == stem.size() || is_separator(stem[at + split.size()]);
      if (starts && ends) return true;
    }
    return false;
  }

  // The config of the Hub's conversion to read: the one named, else "default", else the only one there is.
  std::string converted_config(const std::vector<RemoteFile>& listing) const {
    if (!options_.config.empty()) return options_.config;
    std::set<std::string> configs;
    for (const auto& file : listing)
      if (file.path.ends_with(".parquet") && file.path.find('/') != std::string::npos)
        configs.insert(file.path.substr(0, file.path.find('/')));
    if (configs.count("default") || configs.size() != 1) return "default";
    return *configs.begin();
  }

  std::vector<RemoteFile> select_data(const std::vector<RemoteFile>& listing) const {
    // The repo's own files: a config, when named, is their first folder as well (configs in folders).
    const bool converted = id_.revision == kConvertedRevision;
    const std::string config = converted ? converted_config(listing) : options_.config;
    std::vector<RemoteFile> wanted;
    for (const auto& file : listing)
      if (is_data_file(file.path, config)) wanted.push_back(file);
    std::sort(wanted.begin(), wanted.end(), [](const RemoteFile& a, const RemoteFile& b) { return a.path < b.path; });
    return wanted;
  }

  // A metadata request, retried on 5xx and cut connections; a connection that cannot be made at all is a
  // NetworkError for the caller (the cache may still serve).
  Response metadata(const std::string& method, const std::string& url, const std::string& file) {
    for (int attempt = 0;; ++attempt) {
      try {
        Response response = http_.follow(method, url);
        if (retriable_status(response.status) && attempt < settings_.retries) {
          spdlog::warn("{} answered HTTP {} for {} of {}; retrying", settings_.endpoint, response.status, file,
                       id_.repo_id);
          back_off(settings_, attempt + 1);
          continue;
        }
        return response;
      } catch (const NetworkError& e) {
        if (!e.transient() || attempt >= std::min(settings_.retries, 2)) throw;
        back_off(settings_, attempt + 1);
      }
    }
  }

  std::vector<RemoteFile> list_files() {
    std::vector<RemoteFile> files;
    std::string url = api_url();
    for (int page = 0; !url.empty(); ++page) {
      if (page > 1000) throw DataError("the file listing of " + name() + " does not end (more than 1000 pages)");
      Response response = metadata("GET", url, "the file listing");
      // The Hub down (5xx after the retries) is as the network down: a cached snapshot still serves.
      if (retriable_status(response.status))
        throw NetworkError(settings_.endpoint + " answered HTTP " + std::to_string(response.status), true);
      if (response.status != 200) throw_hub_error(response, id_, "(file listing)", settings_);
      nlohmann::json entries;
      try {
        entries = nlohmann::json::parse(response.body);
      } catch (const nlohmann::json::parse_error&) {
        throw DataError(settings_.endpoint + " answered the file listing of " + name() + " with something not JSON",
                        "is HF_ENDPOINT a Hugging Face Hub (or a mirror of one)?");
      }
      if (!entries.is_array()) throw DataError("the file listing of " + name() + " is not a JSON list");
      for (const auto& entry : entries) {
        if (!entry.is_object() || entry.value("type", "") != "file" || !entry.contains("path")) continue;
        RemoteFile file;
        file.path = entry["path"].get<std::string>();
        file.size = entry.value("size", std::uint64_t{0});
        if (entry.contains("lfs") && entry["lfs"].is_object()) {
          file.lfs_sha256 = entry["lfs"].value("oid", "");
          file.size = entry["lfs"].value("size", file.size);
        }
        // A path that would leave the snapshot is refused, whatever the server says.
        if (file.path.empty() || file.path.starts_with("/") || file.path.find("..") != std::string::npos) continue;
        files.push_back(std::move(file));
      }
      const std::string next = next_link(response);
      url = next.empty() ? "" : join_url(url, next);
    }
    return files;
  }

  std::vector<RemoteFile> select(const std::vector<RemoteFile>& listing) const {
    std::vector<RemoteFile> wanted;
    if (data() && options_.include.empty()) return select_data(listing);
    if (!options_.include.empty()) {
      for (const auto& file : listing) {
        bool match = false;
        for (const auto& glob : options_.include) match = match || ::fnmatch(glob.c_str(), file.path.c_str(), 0) == 0;
        if (!match) continue;
        if (is_pickled(file.path)) {
          spdlog::warn("{}: {} is pickled weights, which trainer never downloads", name(), file.path);
          continue;
        }
        wanted.push_back(file);
      }
      return order(wanted);
    }
    for (const auto& file : listing)
      if (std::find(metadata_files().begin(), metadata_files().end(), file.path) != metadata_files().end())
        wanted.push_back(file);
    if (options_.files == FileSet::kModel) {
      bool safetensors = false, pickled = false;
      for (const auto& file : listing) {
        if (file.path.find('/') != std::string::npos) continue;
        safetensors = safetensors || file.path.ends_with(".safetensors");
        pickled = pickled || is_pickled(file.path);
      }
      if (!safetensors && pickled)
        throw DataError(name() + " on " + settings_.endpoint + " has its weights only as pickled files (" +
                            pickled_names(listing) + "), which trainer never loads",
                        "convert them once in Python: m = AutoModelForCausalLM (AutoModelForSeq2SeqLM for T5)"
                        ".from_pretrained(\"" + id_.repo_id + "\"); m.save_pretrained(DIR, safe_serialization=True) "
                        "and AutoTokenizer.from_pretrained(\"" + id_.repo_id + "\").save_pretrained(DIR); then name "
                        "DIR instead of " + id_.repo_id);
    }
    return order(wanted);
  }

  static std::string pickled_names(const std::vector<RemoteFile>& listing) {
    std::string names;
    for (const auto& file : listing)
      if (file.path.find('/') == std::string::npos && is_pickled(file.path))
        names += (names.empty() ? "" : ", ") + file.path;
    return names;
  }

  // config.json first (its metadata names the commit), the rest as listed.
  static std::vector<RemoteFile> order(std::vector<RemoteFile> files) {
    std::stable_partition(files.begin(), files.end(), [](const RemoteFile& f) { return f.path == "config.json"; });
    return files;
  }

  // The weights: the shards model.safetensors.index.json names, else model.safetensors, else
  // adapter_model.safetensors, else every *.safetensors at the top of the repo.
  void add_shards(const std::vector<RemoteFile>& listing, std::vector<RemoteFile>& wanted, const fs::path& snapshot) {
    auto find = [&](const std::string& path) -> const RemoteFile* {
      for (const auto& file : listing)
        if (file.path == path) return &file;
      return nullptr;
    };
    std::vector<std::string> names;
    if (find("model.safetensors.index.json")) {
      std::string text;
      const fs::path cached = snapshot / "model.safetensors.index.json";
      if (fs::exists(cached)) {
        std::ifstream in(cached);
        std::stringstream s;
        s << in.rdbuf();
        text = s.str();
      } else {
        Response response = metadata("GET", resolve_url("model.safetensors.index.json", snapshot.filename().string()),
                                     "model.safetensors.index.json");
        if (response.status != 200) throw_hub_error(response, id_, "model.safetensors.index.json", settings_);
        text = response.body;
      }
      try {
        const auto index = nlohmann::json::parse(text);
        std::set<std::string> seen;
        for (const auto& [tensor, file] : index.at("weight_map").items())
          if (file.is_string() && seen.insert(file.get<std::string>()).second) names.push_back(file.get<std::string>());
      } catch (const nlohmann::json::exception& e) {
        throw DataError("model.safetensors.index.json of " + name() + " is not a valid index: " + e.what());
      }
    } else if (find("model.safetensors")) {
      names = {"model.safetensors"};
    } else if (find("adapter_model.safetensors")) {
      names = {"adapter_model.safetensors"};
    } else {
      for (const auto& file : listing)
        if (file.path.find('/') == std::string::npos && file.path.ends_with(".safetensors")) names.push_back(file.path);
    }
    for (const auto& shard : names) {
      const RemoteFile* file = find(shard);
      if (!file)
        throw DataError("model.safetensors.index.json of " + name() + " names " + shard + ", which the repo lacks",
                        "the repo is incomplete; report it to its owner or use another revision");
      if (shard.find("..") != std::string::npos || shard.starts_with("/"))
        throw DataError("model.safetensors.index.json of " + name() + " names the file " + shard + " outside the repo");
      wanted.push_back(*file);
    }
  }

  Remote head(const std::string& file, const std::string& revision) {
    Response response = metadata("HEAD", resolve_url(file, revision), file);
    if (response.status >= 400) throw_hub_error(response, id_, file, settings_);
    Remote remote;
    auto header = [&](const char* name) {
      const auto it = response.headers.find(name);
      return it == response.headers.end() ? std::string() : it->second;
    };
    remote.commit = header("x-repo-commit");
    const std::string linked = header("x-linked-etag");
    remote.etag = strip_etag(linked.empty() ? header("etag") : linked);
    const std::string size = header("x-linked-size").empty() ? header("content-length") : header("x-linked-size");
    remote.size = size.empty() ? 0 : std::strtoull(size.c_str(), nullptr, 10);
    remote.lfs = is_sha256_hex(remote.etag);
    static const std::regex safe_etag("[0-9A-Za-z_.-]{1,128}");
    if (!std::regex_match(remote.etag, safe_etag))
      throw DataError(settings_.endpoint + " sent no usable ETag for " + file + " of " + name(),
                      "is HF_ENDPOINT a Hugging Face Hub (or a mirror of one)?");
    return remote;
  }

  // Downloads one blob unless it is in place; true when this process downloaded it.
  bool fetch_blob(const std::string& file, const Remote& remote, const std::string& commit) {
    const fs::path blob = repo_dir_ / "blobs" / remote.etag;
    fs::create_directories(blob.parent_path());
    const BlobLock lock(locks_dir_ / (remote.etag + ".lock"), blob.string() + ".incomplete", options_.wait_timeout_s);
    if (fs::exists(blob)) return false;  // another process (or huggingface_hub) fetched it while we waited
    const fs::path incomplete = blob.string() + ".incomplete";
    const std::string url = resolve_url(file, commit);
    Progress progress;
    progress.name = file;
    progress.total = remote.size;
    progress.terminal = ::isatty(STDERR_FILENO) != 0;
    const auto started = std::chrono::steady_clock::now();
    std::string last_problem;
    for (int attempt = 0;; ++attempt) {
      if (attempt > settings_.retries)
        throw DataError("downloading " + file + " of " + name() + " failed after " + std::to_string(attempt) +
                            " attempts: " + last_problem,
                        "check the network and HF_ENDPOINT (" + settings_.endpoint + ") and run again: the part "
                        "already downloaded (" + incomplete.string() + ") is resumed");
      if (attempt > 0) {
        spdlog::warn("downloading {} of {}: {}; resuming (attempt {} of {})", file, name(), last_problem, attempt + 1,
                     settings_.retries + 1);
        back_off(settings_, attempt);
      }
      std::error_code ec;
      std::uint64_t offset = fs::exists(incomplete, ec) ? fs::file_size(incomplete, ec) : 0;
      if (remote.size > 0 && offset > remote.size) {
        fs::resize_file(incomplete, 0, ec);
        offset = 0;
      }
      if (remote.size > 0 && offset == remote.size) break;
      std::FILE* out = std::fopen(incomplete.c_str(), offset > 0 ? "ab" : "wb");
      if (!out) throw DataError("cannot write " + incomplete.string() + ": " + std::strerror(errno),
                                "check the free space and permissions of the Hugging Face cache (" +
                                    settings_.cache_dir + ")");
      FileSink sink;
      sink.file = out;
      progress.start_offset = offset;
      progress.started = std::chrono::steady_clock::now();
      Response response;
      bool cut = false;
      try {
        response = http_.follow("GET", url, offset, &sink, &progress);
      } catch (const NetworkError& e) {
        cut = true;
        last_problem = e.what();
      } catch (const DataError& e) {  // the disk: nothing of this blob is kept
        std::fclose(out);
        fs::remove(incomplete, ec);
        throw DataError("downloading " + file + " of " + name() + " into " + settings_.cache_dir + ": " + e.what(),
                        "free space in the Hugging Face cache (or set HF_HUB_CACHE to a larger disk) and run again");
      }
      const bool flushed = std::fflush(out) == 0;
      const int flush_errno = errno;
      std::fclose(out);
      if (progress.terminal) std::fprintf(stderr, "\r\033[K");
      if (!flushed) {
        fs::remove(incomplete, ec);
        throw DataError("downloading " + file + " of " + name() + ": cannot write " + incomplete.string() + ": " +
                            std::strerror(flush_errno),
                        "free space in the Hugging Face cache (or set HF_HUB_CACHE to a larger disk) and run again");
      }
      if (cut) continue;
      if (response.status == 416 && offset > 0) {  // the range is past the end: the server's file is shorter
        fs::resize_file(incomplete, 0, ec);
        last_problem = "the server refused to resume";
        continue;
      }
      if (response.status == 200 && offset > 0) {
        // The server ignored the Range: the body is the whole file, after the part already there.
        fs::resize_file(incomplete, 0, ec);
        last_problem = "the server did not resume (HTTP 200 to a Range request)";
        continue;
      }
      if (retriable_status(response.status)) {
        last_problem = "HTTP " + std::to_string(response.status);
        continue;
      }
      if (response.status != 200 && response.status != 206) {
        fs::remove(incomplete, ec);
        throw_hub_error(response, id_, file, settings_);
      }
      const std::uint64_t have = fs::file_size(incomplete, ec);
      if (remote.size == 0 || have == remote.size) break;
      if (have > remote.size) fs::resize_file(incomplete, 0, ec);
      last_problem =
          "the connection ended after " + std::to_string(have) + " of " + std::to_string(remote.size) + " bytes";
    }
    if (remote.lfs) {
      const std::string got = sha256_file_hex(incomplete.string());
      if (got != remote.etag) {
        std::error_code ec;
        fs::remove(incomplete, ec);
        throw DataError("downloaded " + file + " of " + name() + "@" + commit + " is corrupt: its SHA-256 is " + got +
                            ", the Hub's LFS etag says " + remote.etag + "; nothing was kept",
                        "run again; if it repeats, a proxy or mirror (HF_ENDPOINT=" + settings_.endpoint +
                            ") is changing the bytes");
      }
    }
    fs::rename(incomplete, blob);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    spdlog::info("downloaded {} of {} ({}, {:.1f} s{})", file, name(), human_size(remote.size), seconds,
                 remote.lfs ? ", SHA-256 checked" : "");
    return true;
  }

  // .no_exist/<commit>/<file> for the files trainer (and transformers) look for that the repo lacks.
  void mark_absent(const std::vector<RemoteFile>& listing, const std::string& commit) const {
    for (const auto& wanted : metadata_files()) {
      bool present = false;
      for (const auto& file : listing) present = present || file.path == wanted;
      if (present) continue;
      const fs::path marker = repo_dir_ / ".no_exist" / commit / wanted;
      std::error_code ec;
      if (fs::exists(marker, ec)) continue;
      fs::create_directories(marker.parent_path(), ec);
      std::ofstream touch(marker);
    }
  }

  HubId id_;
  const ResolveOptions& options_;
  const HubSettings& settings_;
  Http http_;
  fs::path repo_dir_, locks_dir_;
};

}  // namespace

Resolved resolve(const std::string& name, const ResolveOptions& options, const HubSettings& settings) {
  Resolved local;
  local.local_path = name;
  std::error_code ec;
  if (name.empty() || fs::exists(name, ec) || looks_like_path(name)) return local;
  const auto id = parse_hub_id(name);
  if (!id) return local;
  // Whatever a server or a library put into a message, the token never leaves in it.
  auto scrub = [&](std::string text) {
    if (settings.token.empty()) return text;
    for (std::size_t pos; (pos = text.find(settings.token)) != std::string::npos;)
      text.replace(pos, settings.token.size(), "[token]");
    return text;
  };
  try {
    return Resolver(*id, options, settings).run();
  } catch (const UsageError& e) {
    throw UsageError(scrub(e.what()), scrub(e.hint()));
  } catch (const DataError& e) {
    throw DataError(scrub(e.what()), scrub(e.hint()));
  } catch (const fs::filesystem_error& e) {
    throw DataError(options.what + ": " + name + ": the Hugging Face cache (" + settings.cache_dir +
                        ") cannot be written: " + e.what(),
                    "check its free space and permissions, or set HF_HUB_CACHE to another directory");
  }
}

}  // namespace trainer::hub
