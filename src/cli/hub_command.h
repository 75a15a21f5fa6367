// Where the command line meets the Hub (trainer/hub.h): model and tokenizer names in a config or a flag resolved
// once, early, into local snapshot directories, and `trainer download`.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

#include "trainer/config.h"
#include "trainer/hub.h"

namespace trainer {

// data.train_files / validation_files: a Hub dataset (hub::parse_dataset_ref) becomes the Parquet files of its split
// in the cache (the repo's own, or the Hub's conversion).
// model.path and tokenizer.path: a Hub id becomes its snapshot directory in the cache (downloaded when missing;
// metadata only with model.init=random or `metadata_only`), so everything after reads a local directory. With
// `dry_run` nothing is downloaded: the files that would be are listed on `out`, and the result says whether the
// run can go on (false: the plan needs files that are not yet here).
struct HubResolution {
  bool complete = true;                   // every file the run reads is in place
  std::vector<hub::Resolved> resolved;    // the names that were Hub ids
};
HubResolution resolve_config_paths(Config& config, bool dry_run, bool metadata_only, std::ostream& out);

// A directory named by a flag (--model, --adapter, --base): the local path to read.
std::string resolve_flag_path(const std::string& name, const std::string& flag,
                              hub::FileSet files = hub::FileSet::kModel);

struct DownloadOptions {
  std::string name;                   // NAME[@REVISION]; with `dataset`, also NAME[@REVISION][:CONFIG]:SPLIT
  std::vector<std::string> include;   // globs; empty: the files trainer reads
  bool dry_run = false;
  bool dataset = false;               // a dataset repo: its Parquet files (of the split, when named)
};

// `trainer download`: fetches into the cache, prints the snapshot directory on `out` (the last line).
int run_download(const DownloadOptions& options, std::ostream& out);

}  // namespace trainer
