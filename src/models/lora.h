// LoRA (Hu et al., 2021) applied to a built model from outside, computing exactly what PEFT's lora.Linear
// computes: y = x W^T + b + scaling * B(A(dropout(x))), with scaling = alpha / r (alpha / sqrt(r) with rsLoRA).
// The base weights are frozen (no gradients, hence no optimizer state); the adapters are fp32 parameters of their
// own module tree, named as PEFT saves them without the "base_model.model." prefix
// ("model.layers.0.self_attn.q_proj.lora_A.weight"), so the optimizer and checkpoints take them alone.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "models/dropout.h"
#include "models/layers.h"
#include "models/linear4bit.h"
#include "models/model.h"
#include "trainer/config.h"
#include "trainer/hf_weights.h"
#include "trainer/peft.h"

namespace trainer {

// One adapted linear layer: A (r, in) and B (out, r), fp32, on the base weight's device (on `device` when the base
// weight is still on the meta device: read later, unit by unit, by fully sharded weights).
class LoraLinear : public Module {
 public:
  LoraLinear(Linear& base, int64_t r, double scaling, double dropout, std::optional<c10::Device> device = std::nullopt);

  // The base layer's output `y` with the adapter's term added, in PEFT's order (dropout on A's input, scaling
  // after B) and dtypes (the input cast to the adapter's fp32, the sum cast back to y's dtype).
  at::Tensor adapt(const at::Tensor& x, const at::Tensor& y, bool training) const;
  // W + scaling * B A, computed in fp32 and returned in W's dtype (a 4-bit W is dequantized first and the sum
  // returned in the dtype it was quantized from).
  at::Tensor merged_weight() const;

  Linear& base() const { return *base_; }
  int64_t r() const { return r_; }
  double scaling() const { return scaling_; }

  at::Tensor lora_A, lora_B;
  std::shared_ptr<Dropout> lora_dropout;  // on A's input; keyed by the adapted layer's path
  // false: adapt() returns the base layer's output unchanged (PEFT's disable_adapter: DPO's reference model is the
  // base under the adapters).
  bool active = true;

 private:
  Linear* base_;  // owned by the model, which outlives its adapters' use
  int64_t r_;
  double scaling_;
};

// LoRA on one stacked parameter (E, out, in) of a mixture of experts' experts, in PEFT's layout (its ParamWrapper,
// which lora.target_parameters selects): lora_A (r * E, in) and lora_B (out, r * E), fp32. Expert e's delta is
// scaling * B_e A_e, with A_e = lora_A's rows [e r, (e + 1) r) and B_e = lora_B.view(out, r, E)[:, :, e] (B's
// columns interleave the experts). Here each expert is linear layers stacked by rows into its (out, in) slice
// (gate_up_proj: the gate's rows, then the up's; down_proj: one layer); each layer gets a hook adding its rows of the
// expert's term, so every expert's gradients flow into the two shared tensors. No dropout: PEFT refuses it there.
class LoraExperts : public Module {
 public:
  // parts[e]: expert e's layers, in row order; every expert alike.
  LoraExperts(std::vector<std::vector<Linear*>> parts, int64_t r, double scaling,
              std::optional<c10::Device> device = std::nullopt);

  int64_t experts() const { return static_cast<int64_t>(parts_.size()); }
  int64_t r() const { return r_; }
  double scaling() const { return scaling_; }
  int64_t in_features() const { return lora_A.size(1); }
  int64_t out_features() const { return lora_B.size(0); }
  const std::vector<std::vector<Linear*>>& parts() const { return parts_; }
  // Expert e's factors, views of lora_A (r, in) and lora_B (out, r).
  at::Tensor A(int64_t e) const;
  at::Tensor B(int64_t e) const;
  // A part's output `y` (its rows [row, row + rows) of expert e's slice) with those rows of the expert's term added,
  // computed as LoraLinear::adapt computes (input cast to fp32, scaling after B, the sum cast back to y's dtype).
  at::Tensor adapt(int64_t e, int64_t row, int64_t rows, const at::Tensor& x, const at::Tensor& y) const;
  // Before a pass over the experts: every expert's A_e and B_e as the outputs of one unbind each, so backward sums
  // the experts' gradients into A and B once (a slice per expert would add a zero-filled full-size gradient per
  // expert: with 128 experts, gigabytes per layer). adapt() slices directly when no pass began.
  void begin_pass();

  at::Tensor lora_A, lora_B;
  bool active = true;  // as LoraLinear::active

 private:
  std::vector<at::Tensor> pass_A_, pass_B_;  // begin_pass's views, per expert
  std::vector<std::vector<Linear*>> parts_;  // owned by the model
  int64_t r_;
  double scaling_;
};

// One stacked expert parameter that lora.target_parameters selects: the path its adapter is saved under and the
// experts' layers that hold it here (LoraExperts' parts).
struct LoraExpertTarget {
  std::string path;
  std::vector<std::vector<Linear*>> parts;
  std::function<void()>* pass_hook = nullptr;  // the block's (StackedExpertLayers::pass_hook)
};

// The adapters of one model: children named by the module path they adapt.
class LoraAdapters : public Module {
 public:
  explicit LoraAdapters(LoraConfig config) : config_(std::move(config)) {}
  const LoraConfig& config() const { return config_; }  // as applied: target_modules resolved
  const std::vector<std::pair<std::string, std::shared_ptr<LoraLinear>>>& layers() const { return layers_; }
  // Installs `layer` on its base linear layer's output.
  void add(const std::string& module_path, std::shared_ptr<LoraLinear> layer);
  // The adapted stacked expert parameters, by the path PEFT saves them under ("model.layers.0.mlp.experts" or, the
  // first of two, "model.layers.0.mlp.experts.base_layer").
  const std::vector<std::pair<std::string, std::shared_ptr<LoraExperts>>>& experts() const { return experts_; }
  // Installs `experts`' hooks on every part of every expert (and on the block's pass, with a target).
  void add_experts(const std::string& path, std::shared_ptr<LoraExperts> experts);
  void add_experts(const LoraExpertTarget& target, std::shared_ptr<LoraExperts> experts);
  int64_t trainable_parameters() const;
  // Turns every adapter on or off (LoraLinear::active).
  void set_active(bool active);

 private:
  LoraConfig config_;
  std::vector<std::pair<std::string, std::shared_ptr<LoraLinear>>> layers_;
  std::vector<std::pair<std::string, std::shared_ptr<LoraExperts>>> experts_;
};

// The adapters off for a scope (the base model alone, as PEFT's `with model.disable_adapter()`), on again after.
class AdaptersOff {
 public:
  explicit AdaptersOff(LoraAdapters* adapters) : adapters_(adapters) {
    if (adapters_) adapters_->set_active(false);
  }
  ~AdaptersOff() {
    if (adapters_) adapters_->set_active(true);
  }
  AdaptersOff(const AdaptersOff&) = delete;
  AdaptersOff& operator=(const AdaptersOff&) = delete;

 private:
  LoraAdapters* adapters_;
};

// PEFT's defaults by family, as lora.target_modules documents: q,v (T5), q_proj,v_proj (the decoder families),
// qkv_proj (Phi-3's fused attention projection, where PEFT has no default).
std::vector<std::string> default_lora_targets(LanguageModel& model);

// alpha / r, or alpha / sqrt(r) with rsLoRA.
double lora_scaling(double alpha, int64_t r, bool rslora);

// The paths of the linear layers `targets` selects by PEFT's rule: a module whose full name equals a target or
// ends with "." + target. A mixture of experts' experts are not modules in transformers 5 (StackedExpertLayers), so
// no target selects them, as in PEFT. Throws UsageError when a target selects nothing (naming
// lora.target_parameters when it would select experts only), or selects a module that is not a linear layer
// (trainer adapts linear layers only).
std::vector<std::string> lora_target_layers(LanguageModel& model, const std::vector<std::string>& targets);

// The stacked expert parameters `targets` selects by PEFT's rule for target_parameters: the key
// "<experts path>.<parameter>" (model.layers.0.mlp.experts.down_proj) equals a target or ends with "." + target.
// Several parameters of one block nest as PEFT nests their wrappers: gate_up_proj (registered first) under
// "base_layer." of down_proj. Throws UsageError for a target that selects nothing or names another parameter
// than gate_up_proj / down_proj, and on a model without such experts.
std::vector<LoraExpertTarget> lora_expert_targets(LanguageModel& model, const std::vector<std::string>& targets);

// Freezes every parameter of `model` (requires_grad off: no gradients, no optimizer state) and, with
// config.base_in_bf16, converts them to bf16. Then adds adapters on config.target_modules (the family's defaults
// when empty) and config.target_parameters (the experts), initialised as PEFT does: A kaiming-uniform with
// a = sqrt(5) (uniform in +-1/sqrt(in)) from a generator seeded with `seed`, B zeros, so the adapted model starts
// equal to the base. Throws UsageError for dropout on experts (PEFT refuses it). `device`: where the adapters live when
// the base is still on the meta device (fully sharded weights read it unit by unit later).
std::unique_ptr<LoraAdapters> apply_lora(LanguageModel& model, const LoraConfig& config, uint64_t seed,
                                         std::optional<c10::Device> device = std::nullopt);

// Freezes `model` and adds adapters on exactly the modules of a saved adapter, with its ranks (per module, as
// rank_pattern may give), scaling, dropout and weights. Throws DataError when a module is not in the model, or
// its shapes do not fit the layer.
std::unique_ptr<LoraAdapters> apply_peft_adapter(LanguageModel& model, const PeftAdapter& adapter,
                                                 const std::string& source);

// Copies a saved adapter's weights into `adapters` (resume): it must name the same modules with the same shapes,
// else one DataError, naming `source`, lists the differences.
void load_lora_weights(LoraAdapters& adapters, const PeftAdapter& adapter, const std::string& source);

// The adapters in PEFT's terms: the config (task type from the model's family) and the weights (the live fp32
// tensors, detached).
PeftAdapter to_peft_adapter(const LoraAdapters& adapters, const LanguageModel& model,
                            const std::string& base_model_name_or_path);

// Folds every adapter into its base weight (W + scaling * B A, in W's dtype) and removes the hooks: the model then
// computes the adapted function by itself, and save_model writes a plain Hugging Face model.
void merge_lora(LoraAdapters& adapters);

struct MergeOptions {
  std::string adapter_dir;
  std::string base_dir;        // empty: the adapter's base_model_name_or_path
  std::string output_dir;
  std::string dtype = "auto";  // auto (the base checkpoint's dtype), fp32 or bf16
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  // The adapter was trained over a base quantized on load (QLoRA): the base is quantized the same way, then every
  // layer dequantized, so the merge adds the adapter to the weights it was trained with. A base saved in 4 bits
  // is dequantized whatever this says.
  std::optional<Quantize4bitOptions> quantize;
};
struct MergeResult {
  std::string base_dir;
  std::size_t layers = 0;
  at::ScalarType dtype = at::kFloat;
};
// `trainer merge` and `train --merge`: loads the base model (on the CPU), applies the adapter, merges it and writes
// a full Hugging Face model to output_dir, with the tokenizer files of the base and of the adapter directory.
// Throws DataError for a missing base (it must be a local directory) or an adapter that does not fit it.
MergeResult merge_adapter(const MergeOptions& options);

}  // namespace trainer
