// LoRA adapters in PEFT's format: the adapter_config.json and adapter_model.safetensors that PEFT's
// save_pretrained writes and PeftModel.from_pretrained reads. Only the files: src/models/lora.h applies them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trainer {

inline constexpr const char* kAdapterConfigName = "adapter_config.json";
inline constexpr const char* kAdapterWeightsName = "adapter_model.safetensors";
// PEFT's saved keys are "base_model.model.<module path>.lora_A.weight" (the adapter name is left out).
inline constexpr const char* kPeftKeyPrefix = "base_model.model.";

// The adapter_config.json fields trainer reads and writes.
struct PeftLoraConfig {
  std::string task_type;  // "SEQ_2_SEQ_LM" or "CAUSAL_LM"; empty when the file gives none
  std::string base_model_name_or_path;
  std::string revision;   // the base's Hub revision (trainer writes the commit of a base named by Hub id); empty: none
  int64_t r = 8;          // the default rank; rank_pattern may give some modules another (their shapes say which)
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  std::vector<std::string> target_modules;  // a regular expression (PEFT's string form) is kept as one entry
  bool target_modules_regex = false;        // target_modules[0] is that regular expression (written as a string)
  // Parameters adapted by PEFT's ParamWrapper: a mixture of experts' stacked experts ("mlp.experts.gate_up_proj").
  // Their weights are saved under the experts' module path, nested by "base_layer." when one module has several
  // (PEFT wraps a module's parameters in the order the module registers them, the last one outermost).
  std::vector<std::string> target_parameters;
  bool use_rslora = false;
};

// One adapted linear layer: A (r, in) and B (out, r); or one stacked parameter of E experts: A (r * E, in) and
// B (out, r * E), PEFT's layout (models/lora.h).
struct LoraWeights {
  at::Tensor lora_A;
  at::Tensor lora_B;
};

struct PeftAdapter {
  PeftLoraConfig config;
  // module path ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.base_layer") -> weights
  std::map<std::string, LoraWeights> modules;
};

// Whether `dir` holds an adapter (adapter_config.json).
bool is_peft_adapter_dir(const std::string& dir);

// Writes dir/adapter_config.json and dir/adapter_model.safetensors (created if needed; each file written under a
// temporary name and renamed). Tensors are saved as they are (trainer's adapters are fp32).
void write_peft_adapter(const std::string& dir, const PeftAdapter& adapter);

// Reads an adapter that PEFT or trainer saved; tensors come back in fp32 on the CPU. Throws DataError naming the
// file for anything trainer cannot reproduce exactly: another peft_type, DoRA, LoRA biases, bias other than "none",
// modules_to_save, alpha_pattern, fan_in_fan_out, layer replication, trainable tokens, target_parameters as a
// regular expression; keys that are not
// lora_A/lora_B weights; a module with only one of the two; shapes that do not fit together.
PeftAdapter read_peft_adapter(const std::string& dir);

}  // namespace trainer
