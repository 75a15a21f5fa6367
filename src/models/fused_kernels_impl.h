// The loops of fused_kernels.h, compiled once per CPU capability: the including file defines CPU_CAPABILITY
// (DEFAULT or AVX2, and CPU_CAPABILITY_AVX2 with it) before including this, as ATen's kernel files are built.
// Every row is read into fp32 scratch, computed in fp32 with at::vec::Vectorized, and written in its own type.
#pragma once

#include <cmath>
#include <cstring>
#include <algorithm>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "models/fused_kernels.h"

namespace trainer::kernels::CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<c10::BFloat16>;
constexpr int64_t kW = Vec::size();

// n values of type `type` at src[offset..] into dst (fp32).
void load_row(const void* src, Elem type, int64_t offset, float* dst, int64_t n) {
  if (type == Elem::kFloat) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
    return;
  }
  const c10::BFloat16* s = static_cast<const c10::BFloat16*>(src) + offset;
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(BVec::loadu(s + i));
    lo.store(dst + i);
    hi.store(dst + i + kW);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(s[i]);
}

// n fp32 values into dst[offset..] of type `type` (bf16: round to nearest even, as ATen rounds).
void store_row(const float* src, void* dst, Elem type, int64_t offset, int64_t n) {
  if (type == Elem::kFloat) {
    std::memcpy(static_cast<float*>(dst) + offset, src, n * sizeof(float));
    return;
  }
  c10::BFloat16* d = static_cast<c10::BFloat16*>(dst) + offset;
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW)
    at::vec::convert_float_bfloat16(Vec::loadu(src + i), Vec::loadu(src + i + kW)).store(d + i);
  for (; i < n; ++i) d[i] = c10::BFloat16(src[i]);
}

// Round fp32 values to bf16 and back, in place (what a cast to bf16 and a later fp32 use of it give).
void round_bf16_in_place(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(Vec::loadu(v + i), Vec::loadu(v + i + kW)));
    lo.store(v + i);
    hi.store(v + i + kW);
  }
  for (; i < n; ++i) v[i] = static_cast<float>(c10::BFloat16(v[i]));
}

float sum_of_squares(const float* v, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const Vec a = Vec::loadu(v + i);
    acc = at::vec::fmadd(a, a, acc);
  }
  float total = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) total += v[i] * v[i];
  return total;
}

float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float total = at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

}  // namespace

void rms_norm_forward(const RmsNormForward& a, int64_t row_begin, int64_t row_end, float* scratch) {
  const int64_t d = a.dim;
  float* row = scratch;
  for (int64_t r = row_begin; r < row_end; ++r) {
    load_row(a.x, a.x_type, r * d, row, d);
    const float rstd = 1.f / std::sqrt(sum_of_squares(row, d) / static_cast<float>(d) + a.eps);
    if (a.rstd) a.rstd[r] = rstd;
    const Vec vr(rstd);
    int64_t i = 0;
    for (; i + kW <= d; i += kW) (Vec::loadu(row + i) * vr).store(row + i);
    for (; i < d; ++i) row[i] *= rstd;
    if (a.round_normed_bf16) round_bf16_in_place(row, d);
    i = 0;
    for (; i + kW <= d; i += kW) (Vec::loadu(a.weight + i) * Vec::loadu(row + i)).store(row + i);
    for (; i < d; ++i) row[i] = a.weight[i] * row[i];
    store_row(row, a.out, a.out_type, r * d, d);
  }
}

// y = w * round(x * rstd), rstd = (mean(x^2) + eps)^-1/2. With gn = g * w (the gradient of the normalised row):
//   dx = rstd * gn - x * rstd^3 * (gn . x) / dim,   dw += g * round(x * rstd).
void rms_norm_backward(const RmsNormBackward& a, int64_t row_begin, int64_t row_end, float* scratch) {
  const int64_t d = a.dim;
  float* x = scratch;
  float* g = scratch + d;
  float* normed = scratch + 2 * d;
  for (int64_t r = row_begin; r < row_end; ++r) {
    load_row(a.x, a.x_type, r * d, x, d);
    load_row(a.grad_out, a.grad_type, r * d, g, d);
    const float rstd = a.rstd[r];
    const Vec vr(rstd);
    if (a.grad_weight) {
      int64_t i = 0;
      for (; i + kW <= d; i += kW) (Vec::loadu(x + i) * vr).store(normed + i);
      for (; i < d; ++i) normed[i] = x[i] * rstd;
      if (a.round_normed_bf16) round_bf16_in_place(normed, d);
      i = 0;
      for (; i + kW <= d; i += kW)
        at::vec::fmadd(Vec::loadu(g + i), Vec::loadu(normed + i), Vec::loadu(a.grad_weight + i))
            .store(a.grad_weight + i);
      for (; i < d; ++i) a.grad_weight[i] += g[i] * normed[i];
    }
    if (a.grad_x) {
      int64_t i = 0;
      for (; i + kW <= d; i += kW) (Vec::loadu(g + i) * Vec::loadu(a.weight + i)).store(g + i);
      for (; i < d; ++i) g[i] *= a.weight[i];
      const float c = rstd * rstd * rstd * dot(g, x, d) / static_cast<float>(d);
      const Vec vc(c);
      i = 0;
      for (; i + kW <= d; i += kW)
        (vr * Vec::loadu(g + i) - vc * Vec::loadu(x + i)).store(normed + i);
      for (; i < d; ++i) normed[i] = rstd * g[i] - c * x[i];
      store_row(normed, a.grad_x, a.x_type, r * d, d);
    }
  }
}

}  // namespace trainer::kernels::CPU_CAPABILITY
