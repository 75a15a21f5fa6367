// Hub ids on the command line and in configs (see hub_command.h): resolved into snapshot directories before any
// command reads them; `trainer download` fetches ahead.
#include "cli/hub_command.h"

#include <filesystem>
#include <ostream>

#include "trainer/errors.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

void print_would_download(const hub::Resolved& resolved, const std::string& what, std::ostream& out) {
  std::uint64_t total = 0;
  for (const auto& file : resolved.would_download) total += file.size;
  out << what << ": " << resolved.repo_id << "@" << resolved.revision << " is commit " << resolved.commit << "; "
      << (resolved.would_download.empty() ? std::string("every file is in the cache")
                                          : std::to_string(resolved.would_download.size()) + " file(s), " +
                                                hub::human_size(total) + ", would be downloaded")
      << "\n";
  for (const auto& file : resolved.would_download)
    out << "  " << file.path << "  " << hub::human_size(file.size) << "\n";
}

}  // namespace

HubResolution resolve_config_paths(Config& config, bool dry_run, bool metadata_only, std::ostream& out) {
  HubResolution result;
  const auto settings = hub::settings_from_environment();
  auto resolve_one = [&](std::string& path, const char* key, hub::FileSet files) {
    hub::ResolveOptions options;
    options.files = files;
    options.dry_run = dry_run;
    options.what = key;
    options.wait_timeout_s = config.distributed.timeout_s;  // all ranks of a node: one downloads, the others wait
    hub::Resolved resolved = hub::resolve(path, options, settings);
    if (!resolved.from_hub) return;
    if (dry_run) {
      print_would_download(resolved, key, out);
      if (!resolved.would_download.empty()) result.complete = false;
    }
    if (!fs::is_directory(resolved.local_path)) result.complete = false;
    path = resolved.local_path;
    result.resolved.push_back(std::move(resolved));
  };
  auto resolve_data = [&](std::vector<std::string>& entries, const char* key, const char* default_split) {
    std::vector<std::string> files;
    for (const auto& entry : entries) {
      const auto ref = hub::parse_dataset_ref(entry, default_split);
      if (!ref) {
        files.push_back(entry);
        continue;
      }
      hub::ResolveOptions options;
      options.files = hub::FileSet::kData;
      options.repo_type = hub::RepoType::kDataset;
      options.split = ref->split;
      options.config = ref->config;
      options.include = ref->include;
      options.dry_run = dry_run;
      options.what = key;
      options.wait_timeout_s = config.distributed.timeout_s;
      hub::Resolved resolved = hub::resolve(ref->id, options, settings);
      if (!resolved.from_hub) {
        files.push_back(entry);
        continue;
      }
      if (dry_run) {
        print_would_download(resolved, key, out);
        if (!resolved.would_download.empty()) result.complete = false;
      }
      files.insert(files.end(), resolved.files.begin(), resolved.files.end());
      result.resolved.push_back(std::move(resolved));
    }
    entries = std::move(files);
  };
  resolve_data(config.data.train_files, "data.train_files", "train");
  resolve_data(config.data.validation_files, "data.validation_files", "validation");
  const bool weights = !metadata_only && config.model.init == ModelInit::kPretrained;
  resolve_one(config.model.path, "model.path", weights ? hub::FileSet::kModel : hub::FileSet::kMetadata);
  if (!config.tokenizer.path.empty()) resolve_one(config.tokenizer.path, "tokenizer.path", hub::FileSet::kMetadata);
  if (!config.dpo.reference_model.empty())
    resolve_one(config.dpo.reference_model, "dpo.reference_model",
                metadata_only ? hub::FileSet::kMetadata : hub::FileSet::kModel);
  return result;
}

std::string resolve_flag_path(const std::string& name, const std::string& flag, hub::FileSet files) {
  hub::ResolveOptions options;
  options.files = files;
  options.what = flag;
  return hub::resolve(name, options).local_path;
}

int run_download(const DownloadOptions& options, std::ostream& out) {
  if (options.dataset) {
    const auto ref = hub::parse_dataset_ref(options.name, "");
    if (!ref)
      throw UsageError("trainer download --dataset: \"" + options.name + "\" is not a Hub dataset id",
                       "name it as on the Hub: org/name, org/name@revision, org/name:split or org/name:config:split");
    hub::ResolveOptions resolve_options;
    resolve_options.files = hub::FileSet::kData;
    resolve_options.repo_type = hub::RepoType::kDataset;
    resolve_options.split = ref->split;
    resolve_options.config = ref->config;
    resolve_options.include = options.include.empty() ? ref->include : options.include;
    resolve_options.dry_run = options.dry_run;
    resolve_options.what = "trainer download --dataset";
    const hub::Resolved resolved = hub::resolve(ref->id, resolve_options);
    if (options.dry_run) {
      print_would_download(resolved, "trainer download --dataset", out);
      for (const auto& file : resolved.files) out << "  data file: " << file << "\n";
      return kExitOk;
    }
    for (const auto& file : resolved.files) out << file << "\n";
    out << resolved.local_path << "\n";
    return kExitOk;
  }
  const auto id = hub::parse_hub_id(options.name);
  if (!id)
    throw UsageError("trainer download: \"" + options.name + "\" is not a Hub id",
                     "name a model as on the Hub: org/name, or org/name@revision (a branch, tag or commit)");
  std::error_code ec;
  if (fs::exists(options.name, ec))
    throw UsageError("trainer download: " + options.name + " is a local path here, not a Hub id",
                     "a local directory needs no download; run from another directory to fetch the Hub's " +
                         options.name);
  hub::ResolveOptions resolve_options;
  resolve_options.include = options.include;
  resolve_options.dry_run = options.dry_run;
  resolve_options.what = "trainer download";
  const hub::Resolved resolved = hub::resolve(options.name, resolve_options);
  if (options.dry_run) {
    print_would_download(resolved, "trainer download", out);
    return kExitOk;
  }
  out << resolved.local_path << "\n";
  return kExitOk;
}

}  // namespace trainer
