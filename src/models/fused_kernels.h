// Raw CPU loops of the fused RMSNorm (fused_ops.cpp wraps them as an autograd function).
// Each loop is compiled twice, like ATen's kernels: once for the generic CPU (namespace DEFAULT) and once with
// AVX2+FMA (namespace AVX2, only called when the CPU has them), from fused_kernels_impl.h. Pointers only, no
// tensors, no std containers: the AVX2 object should instantiate as little inline code that other objects share
// (the linker keeps one copy of each, possibly the AVX2 one); the caller passes scratch memory.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace trainer::kernels {

// Element types the loops take: fp32 or bf16 activations, fp32 accumulation throughout.
enum class Elem : std::uint8_t { kFloat, kBFloat16 };

struct RmsNormForward {
  const void* x;          // (rows, dim), type x_type
  Elem x_type;
  const float* weight;    // (dim), already fp32
  void* out;              // (rows, dim), type out_type
  Elem out_type;
  float* rstd;            // (rows) 1/sqrt(mean(x^2) + eps), saved for backward; may be null
  int64_t dim;
  float eps;
  bool round_normed_bf16;  // x * rstd rounded to bf16 before the weight multiply (as the unfused composition)
};

struct RmsNormBackward {
  const void* x;        // (rows, dim), type x_type
  Elem x_type;
  const float* weight;  // (dim), fp32
  const float* rstd;    // (rows)
  const void* grad_out; // (rows, dim), type grad_type
  Elem grad_type;
  void* grad_x;         // (rows, dim), type x_type; may be null
  float* grad_weight;   // (dim) fp32 partial sum the rows are added into; may be null
  int64_t dim;
  bool round_normed_bf16;
};

#define TRAINER_DECLARE_KERNELS(NS)                                                                  \
  namespace NS {                                                                                     \
  void rms_norm_forward(const RmsNormForward& a, int64_t row_begin, int64_t row_end, float* scratch);   \
  void rms_norm_backward(const RmsNormBackward& a, int64_t row_begin, int64_t row_end, float* scratch); \
  }

TRAINER_DECLARE_KERNELS(DEFAULT)
TRAINER_DECLARE_KERNELS(AVX2)

#undef TRAINER_DECLARE_KERNELS

// Scratch floats the norm loops need: (1 forward, 3 backward) x dim.
inline constexpr int64_t kRmsNormScratchRows = 3;

}  // namespace trainer::kernels
