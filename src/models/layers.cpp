// Layers shared by the architectures. Formulas follow transformers' modeling_t5.py and modeling_llama.py so that
// fp32 results agree to rounding.
#include "models/layers.h"

#include <ATen/ATen.h>

#include "models/fused_ops.h"
#include "models/linear4bit.h"
#include "trainer/errors.h"

namespace trainer {

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, const c10::TensorOptions& options)
    : in_features_(in_features), out_features_(out_features) {
  weight = at::empty({out_features, in_features}, options);
  register_parameter("weight", &weight);
  if (with_bias) {
    bias = at::empty({out_features}, options);
    register_parameter("bias", &bias);
  }
}

at::Tensor Linear::forward(const at::Tensor& x) const {
  at::Tensor y = quant_                ? linear4bit(x, weight, *quant_, bias, keep_dequantized_ ? &dequantized_ : nullptr)
                 : bias.defined()      ? at::linear(x, weight, bias)
                                       : at::linear(x, weight);
  return output_hook_ ? output_hook_(x, y, is_training()) : y;
}

void Linear::set_quantized(at::Tensor packed, const QuantState4bit& state) {
  unregister_parameters("weight.");
  dequantized_ = at::Tensor();
  quant_ = std::make_shared<QuantState4bit>(state);
  weight = std::move(packed);
  register_parameter("weight.absmax", &quant_->absmax);
  register_parameter("weight.quant_map", &quant_->quant_map);
  if (quant_->nested) {
    register_parameter("weight.nested_absmax", &quant_->nested_absmax);
    register_parameter("weight.nested_quant_map", &quant_->nested_quant_map);
  }
  register_parameter("weight." + quant_->state_key(), &quant_->state_json);
}

void Linear::keep_dequantized(bool keep) {
  keep_dequantized_ = keep && quant_ != nullptr;
  if (!keep_dequantized_) dequantized_ = at::Tensor();
}

void Linear::set_weight(at::Tensor full) {
  unregister_parameters("weight.");
  quant_.reset();
  keep_dequantized_ = false;
  dequantized_ = at::Tensor();
  weight = std::move(full);
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding, const c10::TensorOptions& options)
    : padding_idx(padding) {
  weight = at::empty({num_embeddings, dim}, options);
  register_parameter("weight", &weight);
}

at::Tensor Embedding::forward(const at::Tensor& ids) const { return at::embedding(weight, ids, padding_idx.value_or(-1)); }

NormWeight::NormWeight(int64_t dim, const c10::TensorOptions& options) {
  weight = at::ones({dim}, options);
  register_parameter("weight", &weight);
}

at::Tensor t5_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor fused = fused_rms_norm(x, weight, eps, RmsNormStyle::kT5);
  return fused.defined() ? fused : t5_rms_norm_unfused(x, weight, eps);
}

at::Tensor llama_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor fused = fused_rms_norm(x, weight, eps, RmsNormStyle::kLlama);
  return fused.defined() ? fused : llama_rms_norm_unfused(x, weight, eps);
}

at::Tensor t5_rms_norm_unfused(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor y = x * at::rsqrt(variance + eps);
  if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16) y = y.to(weight.scalar_type());
  return weight * y;
}

at::Tensor llama_rms_norm_unfused(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (x32 * at::rsqrt(variance + eps)).to(x.scalar_type());
}

at::Tensor activation(const at::Tensor& x, const std::string& name) {
  if (name == "relu") return at::relu(x);
  if (name == "gelu") return at::gelu(x);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  if (name == "silu" || name == "swish") return at::silu(x);
  if (name == "quick_gelu") return x * at::sigmoid(1.702 * x);  // CLIP's approximation
  throw DataError("unsupported activation '" + name + "'");
}

void check_activation(const std::string& name, const std::string& where) {
  for (const char* known : {"relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish", "quick_gelu"})
    if (name == known) return;
  throw DataError(where + ": unsupported activation '" + name + "'",
                  "supported: relu, gelu, gelu_new, gelu_pytorch_tanh, silu, quick_gelu");
}

at::Tensor additive_mask(const at::Tensor& allowed, c10::ScalarType dtype) {
  // The lowest finite value, as transformers uses: never -inf, so a bias added to it stays finite.
  const double lowest = dtype == at::kBFloat16 ? -3.3895313892515355e38
                        : dtype == at::kHalf   ? -65504.0
                        : dtype == at::kDouble ? -1.7976931348623157e308
                                               : -3.4028234663852886e38;
  return at::zeros(allowed.sizes(), allowed.options().dtype(dtype)).masked_fill(allowed.logical_not(), lowest);
}

at::Tensor padding_bias(const at::Tensor& attention_mask, c10::ScalarType dtype) {
  return additive_mask(attention_mask.to(at::kBool).unsqueeze(1).unsqueeze(1), dtype);  // (B, 1, 1, Tk)
}

at::Tensor causal_mask(const at::Tensor& key_attention_mask, int64_t query_length, int64_t offset,
                       std::optional<int64_t> sliding_window) {
  const int64_t key_length = key_attention_mask.size(1);
  const auto long_options = key_attention_mask.options().dtype(at::kLong);
  const at::Tensor q = at::arange(offset, offset + query_length, long_options).unsqueeze(1);  // (Tq, 1)
  const at::Tensor k = at::arange(key_length, long_options).unsqueeze(0);                    // (1, Tk)
  at::Tensor allowed = k <= q;
  if (sliding_window) allowed = allowed & (k > q - *sliding_window);
  // (B, 1, Tq, Tk): causal and not padding. A query that would see nothing (left padding) sees itself, so
  // softmax has a finite row; such positions are padding and never trained on.
  const at::Tensor mask = allowed.unsqueeze(0).unsqueeze(0) & key_attention_mask.to(at::kBool).unsqueeze(1).unsqueeze(1);
  const at::Tensor empty = mask.any(-1, /*keepdim=*/true).logical_not();
  return mask | (empty & (k == q).unsqueeze(0).unsqueeze(0));
}

at::Tensor segment_mask(const at::Tensor& query_segments, const at::Tensor& key_segments,
                        const at::Tensor& query_positions, const at::Tensor& key_positions, bool causal,
                        std::optional<int64_t> sliding_window) {
  const at::Tensor qs = query_segments.unsqueeze(2), ks = key_segments.unsqueeze(1);  // (B, Tq, 1), (B, 1, Tk)
  at::Tensor allowed = (qs == ks) & (ks != 0);
  if (causal || sliding_window) {
    const at::Tensor qp = query_positions.unsqueeze(2), kp = key_positions.unsqueeze(1);
    if (causal) allowed = allowed & (kp <= qp);
    if (sliding_window) allowed = allowed & (kp > qp - *sliding_window);
  }
  const at::Tensor empty = allowed.any(-1, /*keepdim=*/true).logical_not();
  return (allowed | empty).unsqueeze(1);
}

std::map<std::string, Linear*> linear_layers(Module& model) {
  std::map<std::string, Linear*> out;
  model.for_each_module([&](const std::string& name, Module& m) {
    if (auto* linear = dynamic_cast<Linear*>(&m)) out[name] = linear;
  });
  return out;
}

}  // namespace trainer
