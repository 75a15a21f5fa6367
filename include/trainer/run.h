// The `train` command: resolve everything a run needs, print it, and train.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

#include "trainer/config.h"

namespace trainer {

struct TrainOptions {
  bool dry_run = false;  // resolve and print the plan, then stop before touching the model weights
  bool resume = false;   // continue from the newest complete checkpoint in checkpoint.output_dir
  std::string resume_from;  // or from this checkpoint directory
  // With resume: no complete checkpoint yet is a fresh start, not an error (--resume-if-present: one command for a
  // job's first start and its restarts, e.g. under torchrun --max-restarts).
  bool resume_if_present = false;
  bool merge = false;       // LoRA: also write output_dir/final-merged, the base with the adapters merged
  std::string config_file;             // where the config came from, and its --set overrides: the start-up
  std::vector<std::string> overrides;  // table says which of them gave each changed value
  // Resume although settings that break the run's exactness or its model differ from the checkpoint's.
  bool allow_config_change = false;
  // Resume although the train data or the tokenizer changed: a new epoch over the new data starts at the
  // checkpoint's step.
  bool allow_data_change = false;
};

// Runs the train command on a validated config; returns the process exit code. Throws trainer::Error.
int run_train(const Config& config, const TrainOptions& options, std::ostream& out);

}  // namespace trainer
