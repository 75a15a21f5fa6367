// Evaluation by generation for the text task (evaluation.generate): the model answers validation prompts in
// batches with the key-value cache (models/generation.h), the answers are scored against the records' targets
// (eval/metrics.h: exact match, ROUGE, BLEU, chrF) and written as predictions.jsonl. Shared by training's
// evaluations and `trainer evaluate`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "models/model.h"
#include "trainer/config.h"
#include "trainer/data.h"

namespace trainer {

class StepSync;

class EvaluationMicroBatch;
namespace distributed {
class Communicator;
}

// The decoding settings of evaluation.generate_*: the model's generation_config.json (in `model_dir`, when there)
// as transformers applies it, then every evaluation.generate_* key that is set. Without either, the length limit is
// data.max_target_length for seq2seq models and 64 for causal ones. Sampling is seeded by training.seed.
GenerateOptions evaluation_generate_options(const Config& config, ModelFamily family,
                                            const std::filesystem::path& model_dir);

struct GenerationScores {
  std::map<std::string, double> metrics;  // evaluation.generate_metrics' names -> values
  int64_t examples = 0;                   // scored (over every rank)
  int64_t skipped = 0;                    // causal examples without a prompt (nothing to answer)
};

// Generates for the validation examples of `validation` (the first evaluation.generate_examples, or all), each
// rank its contiguous share, in batches of `micro` prompts (halved on out-of-memory; training's memory policy is
// never touched), then gathers every rank's answers so that every rank returns the same scores. A seq2seq
// example's prompt is its input and its reference its target; a causal example's prompt is the part its labels
// leave out (prompt/completion records) and its reference the completion; the EOS of either is left out. Texts
// come from `tokenizer` (pre-tokenized data with no tokenizer: the ids, space-separated). With a non-empty
// `predictions_path`, this process writes one JSON line per example there: {"index", "prompt", "reference",
// "prediction"}. Every rank must call it (collectives).
// `sync` with fully sharded weights (the model evaluated unit by unit, every forward a collective): every rank runs
// as many batches as the rank with the most (the others generate for a one-token prompt, unused) and each batch as
// many decoding steps as the longest of that round (GenerateOptions::pace).
GenerationScores evaluate_by_generation(LanguageModel& model, const Tokenizer& tokenizer, DataLoader& validation,
                                        const Config& config, const GenerateOptions& options,
                                        EvaluationMicroBatch& micro, distributed::Communicator* world,
                                        const std::filesystem::path& predictions_file, StepSync* sync = nullptr);

// output_dir/evaluations/step-N/predictions.jsonl: where training writes the answers of evaluation step N.
std::filesystem::path predictions_path(const std::filesystem::path& output_dir, int64_t step);

}  // namespace trainer
