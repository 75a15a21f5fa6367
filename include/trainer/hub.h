// Models named by their Hugging Face Hub id (`google/flan-t5-xl`, `org/name@revision`): resolved in the
// huggingface_hub cache, which trainer shares with Python, and downloaded into it when missing (src/io/hub.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace trainer::hub {

// A Hub id as a user writes it: `name`, `org/name`, either with `@revision` (a branch, a tag or a commit).
struct HubId {
  std::string repo_id;            // "org/name" or "name"
  std::string revision = "main";  // as given, "main" when none was
  bool operator==(const HubId&) const = default;
};

// Whether `name` reads as a file system path rather than a Hub id: it starts with /, ./, ../ or ~, is . or .., or
// has more than one '/'. Such a name is never looked up on the Hub.
bool looks_like_path(const std::string& name);

// Parses `name`, `org/name`, `org/name@revision`. nullopt when `name` is not a well-formed id (a path, characters
// the Hub refuses in repo names, an empty part, a name of more than 96 characters).
std::optional<HubId> parse_hub_id(const std::string& name);

// A dataset on the Hub as data.train_files / validation_files name it, in the spellings of datasets'
// load_dataset(path, name, split=) and of the Hub's hf:// paths:
//   ORG/NAME[@REVISION]                 the key's split (train_files: train; validation_files: validation)
//   ORG/NAME[@REVISION]:SPLIT           a split
//   ORG/NAME[@REVISION]:CONFIG:SPLIT    a config's split
//   hf://datasets/ORG/NAME[@REVISION]/PATH   files of the repo (PATH may be a glob)
struct DatasetRef {
  std::string id;  // ORG/NAME[@REVISION], for resolve()
  std::string config, split;
  std::vector<std::string> include;  // hf:// paths: the glob inside the repo
};
// nullopt when `name` is not such a reference: an existing path, a glob, a name ending in a data file's
// extension (.jsonl, .gz, .parquet, .arrow, .json, ...), a path-like or malformed id.
std::optional<DatasetRef> parse_dataset_ref(const std::string& name, const std::string& default_split);

// True for a 40-hex-digit commit hash.
bool is_commit_hash(const std::string& revision);

// A model repo, or a dataset repo (data files: `trainer download --dataset`, Hub ids in data.train_files).
enum class RepoType { kModel, kDataset };

// "models--org--name" ("datasets--org--name"), the repo's folder in the cache.
std::string repo_folder_name(const std::string& repo_id, RepoType type = RepoType::kModel);

// The environment as huggingface_hub reads it. The token is kept here only to be sent in an Authorization header;
// nothing prints it.
struct HubSettings {
  std::string cache_dir;  // HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
                          // XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub
  std::string endpoint = "https://huggingface.co";  // HF_ENDPOINT, without a trailing '/'
  std::string token;      // HF_TOKEN, else the file HF_TOKEN_PATH, else HF_HOME/token; empty: none
  bool offline = false;   // HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to 1/true/yes/on
  double metadata_timeout_s = 10;  // HF_HUB_ETAG_TIMEOUT: connecting, and each metadata request
  double download_timeout_s = 10;  // HF_HUB_DOWNLOAD_TIMEOUT: a download that receives nothing this long is cut
  int retries = 5;                 // TRAINER_HUB_RETRIES: attempts after a cut connection or a 5xx, with back-off
  double retry_base_s = 1.0;       // TRAINER_HUB_RETRY_BASE_S: the first back-off (doubles each time)
};

// Reads the settings through `getenv` (the process environment by default; tests pass their own).
using Getenv = std::function<const char*(const char*)>;
HubSettings settings_from_environment(const Getenv& getenv = nullptr);

// Which files of a repo trainer fetches.
enum class FileSet {
  kModel,     // config, tokenizer, chat template, image processor, adapter files and the safetensors weights
  kMetadata,  // the same without weights (plan, inspect, data)
  kData,      // a dataset repo's Parquet files of one split (and config), as datasets' load_dataset picks them
};

struct ResolveOptions {
  FileSet files = FileSet::kModel;
  std::vector<std::string> include;  // globs (fnmatch) that replace the file set's selection (`trainer download`)
  bool dry_run = false;              // list what would be downloaded; download nothing
  std::string what = "model.path";   // the key or flag that named it, for messages
  RepoType repo_type = RepoType::kModel;
  // FileSet::kData: the split's files (empty: every split), and the config (the first folder of the Hub's converted
  // Parquet files, `CONFIG/SPLIT/0000.parquet`; empty: "default", or the repo's only one). A repo without Parquet
  // files of the split is read from the Hub's refs/convert/parquet branch.
  std::string split, config;
  // Waiting for another process (a rank of this node, another run) that downloads the same file: give up when its
  // part has not grown for this long; 0 waits as long as it takes.
  double wait_timeout_s = 0;
};

struct PlannedFile {
  std::string path;       // inside the repo
  std::uint64_t size = 0;
};

// Where a name led. For a local directory or file only `local_path` is set.
struct Resolved {
  std::string local_path;  // the directory (or file) to read: a snapshots/<commit> directory for a Hub id
  bool from_hub = false;
  std::string repo_id, revision, commit;
  std::vector<PlannedFile> downloaded;     // files fetched by this call
  std::vector<PlannedFile> would_download; // dry run: files the cache lacks
  bool from_cache_only = false;            // offline, or the Hub could not be reached
  std::vector<std::string> files;          // FileSet::kData: the selected data files (paths under local_path), sorted
};

// An existing local path wins; a path-like name that does not exist, or a malformed id, comes back unchanged (the
// caller's "does not exist" error follows); otherwise the Hub id is resolved in the cache and, unless offline, what
// the cache lacks is downloaded. Throws DataError (repo, revision or file not found; gated repo; pickled weights
// only; a failed download or a wrong checksum) and UsageError (offline with nothing cached).
Resolved resolve(const std::string& name, const ResolveOptions& options = {},
                 const HubSettings& settings = settings_from_environment());

// For a snapshots/<commit> directory of the cache: the repo id and commit it holds; nullopt for any other path.
struct SnapshotOrigin {
  std::string repo_id, commit;
};
std::optional<SnapshotOrigin> snapshot_origin(const std::string& path);

// Lowercase hex SHA-256 of bytes, and of a file's contents (the LFS etag is its bytes' SHA-256).
std::string sha256_hex(const std::string& bytes);
std::string sha256_file_hex(const std::string& path);

// "1.2 GB"-style sizes for the listing of files to download.
std::string human_size(std::uint64_t bytes);

}  // namespace trainer::hub
