// `trainer evaluate`: the evaluation a training run does (validation loss, and with evaluation.generate the
// generation metrics and predictions.jsonl) of a saved model, a checkpoint or a PEFT adapter, without training.
#pragma once

#include <iosfwd>
#include <string>

#include "trainer/config.h"

namespace trainer {

struct EvaluateOptions {
  std::string model_dir;   // a Hugging Face directory, checkpoint-N, or a PEFT adapter; empty: model.path
  std::string output_dir;  // predictions.jsonl and metrics.json; empty: checkpoint.output_dir/evaluations/evaluate
};

// Evaluates in one process on the config's device. An adapter directory is applied over its base: the adapter's
// base_model_name_or_path when that directory exists, else model.path. Prints the scores (and one JSON line of
// them) to `out` and writes output_dir/metrics.json. Throws UsageError without validation data.
int run_evaluate(const Config& config, const EvaluateOptions& options, std::ostream& out);

}  // namespace trainer
