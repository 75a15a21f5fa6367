// Layers shared by the architectures: linear, embedding, the two RMS norms, activations, masks.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include "models/module.h"

namespace trainer {

// A wrapper's change to a linear layer's output, installed from outside (LoRA adds its low-rank term here):
// (input, output of x W^T + b, training) -> the output the layer returns. Models never set one.
using LinearOutputHook = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& y, bool training)>;

struct QuantState4bit;  // models/linear4bit.h

// y = x W^T (+ b). Weight (out, in) as in PyTorch and the checkpoints.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, const c10::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x) const;
  void set_output_hook(LinearOutputHook hook) { output_hook_ = std::move(hook); }
  bool has_output_hook() const { return static_cast<bool>(output_hook_); }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  // A 4-bit weight, set from outside (models/linear4bit.h): `weight` then holds the packed codes and the state
  // is registered beside it under bitsandbytes' names ("weight.absmax", ...). set_weight puts a full-precision
  // (out, in) weight back. quantized() is null for a full-precision layer.
  void set_quantized(at::Tensor packed, const QuantState4bit& state);
  void set_weight(at::Tensor full);
  const QuantState4bit* quantized() const { return quant_.get(); }
  // The state's scalar fields may be set in place (fully sharded loading quantizes a layer after its tensors'
  // shapes were laid out: its nested_offset comes with the values); the tensors' slots stay where they are.
  QuantState4bit* quantized() { return quant_.get(); }
  // A 4-bit layer may keep its weight dequantized (memory.dequantized_base): computed at the first use, then reused
  // by every forward and backward until it is dropped (keep false, a new weight, or another device or dtype). The
  // same bits either way: only when the dequantization runs changes.
  void keep_dequantized(bool keep);
  bool keeps_dequantized() const { return keep_dequantized_; }
  // The kept copy, undefined until the first use (or when not kept).
  const at::Tensor& dequantized() const { return dequantized_; }

  at::Tensor weight;
  at::Tensor bias;  // undefined when the layer has none

 private:
  int64_t in_features_, out_features_;
  std::shared_ptr<QuantState4bit> quant_;
  bool keep_dequantized_ = false;
  mutable at::Tensor dequantized_;  // the kept dequantized weight (keep_dequantized), filled by forward
  LinearOutputHook output_hook_;
};

class Embedding : public Module {
 public:
  // A padding_idx row gets no gradient, as in torch.nn.Embedding (Llama-family checkpoints may name one).
  Embedding(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
            const c10::TensorOptions& options);
  at::Tensor forward(const at::Tensor& ids) const;
  at::Tensor weight;
  std::optional<int64_t> padding_idx;
};

// T5LayerNorm: variance in fp32, the product in the weight's dtype when that is half precision.
at::Tensor t5_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// LlamaRMSNorm / Qwen2RMSNorm: normalise in fp32, cast back to the input dtype, then multiply.
at::Tensor llama_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Both run the fused kernel of models/fused_ops.h where it applies (CPU, fp32/bf16) and otherwise these, the ATen
// compositions transformers writes (the reference of the fused kernel's tests and benchmark).
at::Tensor t5_rms_norm_unfused(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor llama_rms_norm_unfused(const at::Tensor& x, const at::Tensor& weight, double eps);

// A parameter holder for a norm's weight, named "weight".
class NormWeight : public Module {
 public:
  NormWeight(int64_t dim, const c10::TensorOptions& options);
  at::Tensor weight;
};

// Activation by its transformers name: relu, gelu, gelu_new, gelu_pytorch_tanh, silu/swish, quick_gelu.
at::Tensor activation(const at::Tensor& x, const std::string& name);
// Throws DataError for a name activation() does not know.
void check_activation(const std::string& name, const std::string& where);

// Additive float mask from a boolean one (true = attend): 0 where attended, the dtype's lowest value where not.
at::Tensor additive_mask(const at::Tensor& allowed, c10::ScalarType dtype);

// Additive float mask (B, 1, 1, Tk) from a 0/1 attention mask: 0 where attended, the dtype's lowest value where
// not (as transformers does), so it can be added to a position bias.
at::Tensor padding_bias(const at::Tensor& attention_mask, c10::ScalarType dtype);

// Boolean mask (B, 1, Tq, Tk), true = attend: causal, key padding, optional sliding window; a query position that
// would see nothing sees itself, so no row is empty. `offset` is the position of the first query (generation with a cache).
at::Tensor causal_mask(const at::Tensor& key_attention_mask, int64_t query_length, int64_t offset,
                       std::optional<int64_t> sliding_window);

// Boolean mask (B, 1, Tq, Tk), true = attend, for packed rows: a query attends only to keys of its own segment
// (segment ids (B, Tq) and (B, Tk), 0 = padding, never attended), with `causal` only to keys at or before its
// position (position ids within the segment), and with a sliding window only to the last `window` of them. A
// padding query, which would see nothing, sees every key, so no softmax row is empty (its output is never used).
at::Tensor segment_mask(const at::Tensor& query_segments, const at::Tensor& key_segments,
                        const at::Tensor& query_positions, const at::Tensor& key_positions, bool causal,
                        std::optional<int64_t> sliding_window);

// Every Linear of a model by its dotted module name.
std::map<std::string, Linear*> linear_layers(Module& model);

}  // namespace trainer
