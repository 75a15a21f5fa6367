// A model and its Hugging Face directory: build it from config.json, fill it from the safetensors weights (or
// HF's random initialisation), and save it back so that transformers' from_pretrained loads it unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/TensorOptions.h>

#include "models/model.h"
#include "trainer/config.h"

namespace trainer {

// Reads dir/config.json, builds the architecture with parameters of `options` and fills them: from the
// checkpoint (pretrained: every tensor checked by name and shape; missing, unexpected or misshapen tensors are
// one DataError listing them), or with the architecture's random initialisation from `seed` (random).
std::unique_ptr<LanguageModel> load_model(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                          uint64_t seed = 0);

// Writes config.json (the model's, unchanged) and the weights (canonical names only, tied aliases left out),
// sharded above max_shard_bytes, into dir.
void save_model(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes);

}  // namespace trainer
