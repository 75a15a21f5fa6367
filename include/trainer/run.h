// The `train` command: resolve everything a run needs, print it, and train.
#pragma once

#include <iosfwd>

#include "trainer/config.h"

namespace trainer {

struct TrainOptions {
  bool dry_run = false;  // resolve and print the plan, then stop before touching the model weights
};

// Runs the train command on a validated config; returns the process exit code. Throws trainer::Error.
int run_train(const Config& config, const TrainOptions& options, std::ostream& out);

}  // namespace trainer
