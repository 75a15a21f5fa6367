// Batched generation with the key-value cache: greedy, sampling and beam search over several prompts at once, as
// transformers' generate chooses tokens (left padding for causal prompts, the encoder run once for seq2seq), and
// the defaults a model's generation_config.json sets.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/model.h"

namespace trainer {

// The new token ids of each prompt (each given without padding), ending at an EOS (included) or after
// max_new_tokens. Prompts are padded here: causal ones on the left, seq2seq ones on the right. The model runs
// on its own device, in inference mode; its training mode is restored afterwards.
std::vector<std::vector<int64_t>> generate_batch(LanguageModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                                 const GenerateOptions& options);

// The decoding settings of a generation_config.json (transformers' GenerationConfig keys: max_new_tokens, or
// max_length for seq2seq models, num_beams, length_penalty, early_stopping, no_repeat_ngram_size, do_sample,
// temperature, top_p, top_k, eos_token_id, pad_token_id) over `options`: keys the file lacks keep their value.
// do_sample false means greedy whatever the temperature; do_sample true without a temperature samples at 1.0 and
// without a top_k keeps transformers' 50. Throws DataError naming the key for a value of the wrong type.
void apply_generation_config(const nlohmann::json& generation_config, ModelFamily family, GenerateOptions& options);

}  // namespace trainer
