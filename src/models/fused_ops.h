// Fused RMSNorm (Llama/Qwen2/Mistral RMSNorm, T5LayerNorm, the OLMo 2 and Gemma norms) for the CPU: one pass over each row forward, one
// backward, as a custom autograd function over the loops of fused_kernels.h. layers.cpp calls it where it applies
// (CPU tensors, fp32 or bf16) and falls back to the ATen composition elsewhere; both give the same values (fp32
// to rounding; in bf16 the fused backward keeps fp32 where the composition rounds intermediates to bf16).
// A fused gated activation (SwiGLU, gated-GELU) measured no faster than ATen's two kernels and is not kept
// (docs/benchmarks.md).
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace trainer {

// The unfused formulas differ only in what is rounded to low precision before the weight multiply.
enum class RmsNormStyle {
  kLlama,  // LlamaRMSNorm: normalised row cast to the input's dtype, then times the weight
  kT5,     // T5LayerNorm: normalised row in fp32, cast to the weight's dtype when that is bf16/fp16
  kFp32Product,  // Olmo2RMSNorm, GemmaRMSNorm (weight 1 + w): the product in fp32, cast to the input's dtype
};

// On unless TRAINER_FUSED_KERNELS=0 in the environment (read once); the benchmarks switch it in process.
bool fused_kernels_enabled();
void set_fused_kernels_enabled(bool enabled);

// The fused norm, or an undefined tensor when it does not apply (not CPU, a dtype other than fp32/bf16, a weight
// that is not (dim,)), so the caller runs the composition instead.
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, RmsNormStyle style);

}  // namespace trainer
