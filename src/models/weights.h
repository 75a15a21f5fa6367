// A model and its Hugging Face directory: build it from config.json, fill it from the safetensors weights (or
// HF's random initialisation), and save it back so that transformers' from_pretrained loads it unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <c10/core/TensorOptions.h>

#include "models/linear4bit.h"
#include "models/model.h"
#include "trainer/config.h"
#include "trainer/hf_weights.h"

namespace trainer {

// Reads dir/config.json, builds the architecture with parameters of `options` and fills them: from the
// checkpoint (pretrained: every tensor checked by name and shape; missing, unexpected or misshapen tensors are
// one DataError listing them), or with the architecture's random initialisation from `seed` (random).
// With `quantize`, the linear layers quantizable_layers() names are quantized to 4 bits as they are read, one at
// a time (peak: the quantized model plus one full-precision layer). 4-bit layers a checkpoint holds
// (transformers + bitsandbytes' layout) load as they are, with or without `quantize`.
// With `on_demand` (pretrained, without `quantize`): the parameters stay on the meta device and *on_demand reads one
// parameter's values when asked (in the load's dtype, on the CPU; the files stay mapped while it lives), so that fully
// sharded weights never hold the whole model on a rank.
using WeightReader = std::function<at::Tensor(const std::string&)>;
std::unique_ptr<LanguageModel> load_model(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                          uint64_t seed = 0,
                                          const std::optional<Quantize4bitOptions>& quantize = std::nullopt,
                                          WeightReader* on_demand = nullptr);

// Writes config.json (the model's; with 4-bit layers, with the quantization_config transformers reads) and the
// weights (canonical names only, tied aliases left out; 4-bit layers in bitsandbytes' layout), sharded above
// max_shard_bytes, into dir.
void save_model(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes);
// save_model's files from weights that are not all in memory at once (fully sharded weights): `parameter(name)` gives
// a parameter's values (valid until its file is written), called in an order fixed by the model alone, also on the
// ranks that do not `write`.
void save_model_streamed(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes,
                         const std::function<at::Tensor(const std::string&)>& parameter, bool write);
// config.json as save_model writes it (with a quantization_config when the model has 4-bit layers).
void save_model_config(LanguageModel& model, const std::string& dir);

struct QuantizeDirResult {
  std::size_t layers = 0;  // linear layers in 4 bits
  int64_t bytes = 0;       // their packed codes and scales
};
// `trainer quantize`: loads model_dir (in its checkpoint's float dtype) quantizing on load, and writes it to
// output_dir in transformers + bitsandbytes' 4-bit layout with config.json's quantization_config and the
// tokenizer files. Throws DataError when model_dir is already quantized.
QuantizeDirResult quantize_model_dir_to(const std::string& model_dir, const std::string& output_dir,
                                        const Quantize4bitOptions& options,
                                        uint64_t max_shard_bytes = kDefaultMaxShardBytes);

}  // namespace trainer
