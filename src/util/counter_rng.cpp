// Counter-based random bits (see counter_rng.h): a host function, a CPU kernel and the same function in tensor ops.
#include "util/counter_rng.h"

#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "util/cuda_device.h"
#if TRAINER_WITH_CUDA
#include "util/counter_rng_cuda.h"
#endif

namespace trainer {
namespace {

// The mixer's multipliers: odd, below 2^31 (so v * C stays below 2^63 for v < 2^32 in the int64 tensor version).
constexpr uint32_t kMul1 = 0x21f0aaadu;
constexpr uint32_t kMul2 = 0x735a2d97u;
constexpr int64_t kLow32 = 0xffffffffLL;

#pragma GCC diagnostic ignored "-Wpsabi"  // Lanes never crosses a call boundary: mix() is always inlined
using Lanes = uint32_t __attribute__((vector_size(32)));  // eight uint32 (GCC/Clang vector type)
constexpr Lanes kLane = {0, 1, 2, 3, 4, 5, 6, 7};

// The mixer on one uint32 or on eight (Lanes).
template <typename U>
__attribute__((always_inline)) inline U mix(U v) {
  v ^= v >> 16;
  v *= kMul1;
  v ^= v >> 15;
  v *= kMul2;
  v ^= v >> 15;
  return v;
}

inline uint32_t bits_of(uint32_t k0, uint32_t k1, uint64_t counter) {
  const auto lo = static_cast<uint32_t>(counter), hi = static_cast<uint32_t>(counter >> 32);
  return mix(mix(mix(lo ^ k0) ^ hi) ^ k1);
}

// The same mixer on int64 tensors holding values in [0, 2^32).
at::Tensor mix(at::Tensor v) {
  v = v.bitwise_xor(v.bitwise_right_shift(16));
  v = v.mul(static_cast<int64_t>(kMul1)).bitwise_and_(kLow32);
  v = v.bitwise_xor(v.bitwise_right_shift(15));
  v = v.mul(static_cast<int64_t>(kMul2)).bitwise_and_(kLow32);
  return v.bitwise_xor(v.bitwise_right_shift(15));
}

// The innermost loop of the CPU keep-mask, eight lanes at a time: on x86-64 compiled twice (AVX2, and the
// baseline SSE2) and picked when the program loads.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TRAINER_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TRAINER_CPU_CLONES
#endif

// out[i] = (bits of counter (hi << 32) + lo + i * stride) >= threshold for i < n, where lo + (n - 1) * stride stays
// below 2^32 (the caller checks), so the upper half is the same for the whole line.
TRAINER_CPU_CLONES void keep_line(uint32_t k0, uint32_t k1, uint32_t hi, uint32_t lo, uint32_t stride, int64_t n,
                                  uint32_t threshold, bool* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Lanes v = mix(mix(mix((lo + static_cast<uint32_t>(i) * stride + kLane * stride) ^ k0) ^ hi) ^ k1);
    const auto keep = v >= threshold;  // lanes of -1 (true) or 0
    for (int j = 0; j < 8; ++j) out[i + j] = keep[j] != 0;
  }
  for (; i < n; ++i) out[i] = bits_of(k0, k1, (uint64_t{hi} << 32) + lo + static_cast<uint64_t>(i) * stride) >= threshold;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void check_round_arguments(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == at::kBFloat16 && src.scalar_type() == at::kFloat,
              "stochastic_round_bf16_: fp32 into bf16");
  TORCH_CHECK(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous() && dst.device() == src.device(),
              "stochastic_round_bf16_: contiguous tensors of the same size on one device");
}

void check_grid(const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides) {
  TORCH_CHECK(!sizes.empty() && strides.size() + 1 == sizes.size(), "counter_keep_mask: one stride per dimension after the first");
  TORCH_CHECK(row_base.dim() == 1 && row_base.size(0) == sizes[0], "counter_keep_mask: row_base must have one value per row");
}

uint32_t threshold_for(double p) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout probability must be in [0, 1), got ", p);
  return static_cast<uint32_t>(std::llround(p * 4294967296.0));
}

}  // namespace

uint64_t counter_key(std::initializer_list<uint64_t> parts) {
  uint64_t key = 0x6a09e667f3bcc908ULL;
  for (const uint64_t part : parts) key = splitmix64(key ^ splitmix64(part));
  return key;
}

uint32_t counter_bits(uint64_t key, uint64_t counter) {
  return bits_of(static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), counter);
}

at::Tensor counter_bits(uint64_t key, const at::Tensor& counters) {
  TORCH_CHECK(counters.scalar_type() == at::kLong, "counter_bits: counters must be int64");
  const auto k0 = static_cast<int64_t>(static_cast<uint32_t>(key));
  const auto k1 = static_cast<int64_t>(static_cast<uint32_t>(key >> 32));
  const at::Tensor lo = counters.bitwise_and(kLow32), hi = counters.bitwise_right_shift(32).bitwise_and_(kLow32);
  return mix(mix(mix(lo.bitwise_xor_(k0)).bitwise_xor_(hi)).bitwise_xor_(k1));
}

at::Tensor grid_counters(const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides) {
  TORCH_CHECK(!sizes.empty() && strides.size() + 1 == sizes.size(), "grid_counters: one stride per dimension after the first");
  TORCH_CHECK(row_base.dim() == 1 && row_base.size(0) == sizes[0], "grid_counters: row_base must have one value per row");
  std::vector<int64_t> shape(sizes.size(), 1);
  shape[0] = sizes[0];
  at::Tensor counters = row_base.to(at::kLong).view(shape);
  for (std::size_t d = 1; d < sizes.size(); ++d) {
    std::vector<int64_t> along(sizes.size(), 1);
    along[d] = sizes[d];
    const auto index = at::arange(sizes[d], row_base.options().dtype(at::kLong)).mul_(strides[d - 1]).view(along);
    counters = counters + index;
  }
  return counters.expand(sizes).contiguous();
}

at::Tensor counter_keep_mask(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides,
                             double p) {
  const uint32_t threshold = threshold_for(p);
  check_grid(row_base, sizes, strides);
#if TRAINER_WITH_CUDA
  if (row_base.device().is_cuda() && static_cast<int>(sizes.size()) <= cuda_kernels::kMaxKeepMaskDims) {
    const c10::DeviceGuard on(row_base.device());  // the launch goes to the current device
    at::Tensor mask = at::empty(sizes, row_base.options().dtype(at::kBool));
    const at::Tensor bases = row_base.to(at::kLong).contiguous();
    const std::string error =
        cuda_kernels::keep_mask(key, bases.data_ptr<int64_t>(), static_cast<int>(sizes.size()), sizes.data(),
                                strides.data(), threshold, mask.data_ptr<bool>(), current_cuda_stream(mask.device()));
    TORCH_CHECK(error.empty(), "counter_keep_mask: the CUDA kernel failed: ", error);
    return mask;
  }
#endif
  if (!row_base.device().is_cpu()) return counter_keep_mask_ops(key, row_base, sizes, strides, p);
  at::Tensor mask = at::empty(sizes, at::TensorOptions().dtype(at::kBool));
  const at::Tensor bases = row_base.to(at::kLong).contiguous();
  const int64_t* base = bases.data_ptr<int64_t>();
  bool* out = mask.data_ptr<bool>();
  const auto k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  // Rows of the innermost dimension: each starts at a counter from its outer indices and steps by the last stride.
  const int64_t dims = static_cast<int64_t>(sizes.size());
  const int64_t inner = dims > 1 ? sizes[dims - 1] : 1;
  const int64_t inner_stride = dims > 1 ? strides[dims - 2] : 0;
  const int64_t lines = inner > 0 ? mask.numel() / inner : 0;
  at::parallel_for(0, lines, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, inner)), [&](int64_t begin, int64_t end) {
    for (int64_t line = begin; line < end; ++line) {
      // line -> (r, i_1, ..., i_{k-1}) in row-major order
      int64_t rest = line;
      int64_t counter = 0;
      for (int64_t d = dims - 2; d >= 1; --d) {
        counter += (rest % sizes[d]) * strides[d - 1];
        rest /= sizes[d];
      }
      counter += base[rest];
      bool* o = out + line * inner;
      const auto first = static_cast<uint64_t>(counter);
      const uint64_t lo = first & 0xffffffffu;
      if (inner_stride >= 0 && inner_stride <= static_cast<int64_t>(kLow32) &&
          lo + static_cast<uint64_t>(inner - 1) * static_cast<uint64_t>(inner_stride) <= 0xffffffffu) {
        keep_line(k0, k1, static_cast<uint32_t>(first >> 32), static_cast<uint32_t>(lo),
                  static_cast<uint32_t>(inner_stride), inner, threshold, o);
        continue;
      }
      for (int64_t i = 0; i < inner; ++i)  // the line's counters cross a multiple of 2^32
        o[i] = bits_of(k0, k1, static_cast<uint64_t>(counter + i * inner_stride)) >= threshold;
    }
  });
  return mask;
}

at::Tensor counter_keep_mask_ops(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes,
                                 at::IntArrayRef strides, double p, int64_t chunk_elements) {
  const auto threshold = static_cast<int64_t>(threshold_for(p));
  check_grid(row_base, sizes, strides);
  TORCH_CHECK(chunk_elements > 0, "counter_keep_mask_ops: chunk_elements must be positive");
  at::Tensor mask = at::empty(sizes, row_base.options().dtype(at::kBool));
  if (mask.numel() == 0) return mask;
  // Rows of one chunk: an element takes about 40 bytes of int64 temporaries at once, so a chunk bounds them. A row
  // larger than a chunk is split along its first inner dimension: (r, i_1) becomes a row of base
  // row_base[r] + i_1 * strides[0], recursively, until a row fits or one dimension is left.
  at::Tensor bases = row_base.to(at::kLong);
  std::vector<int64_t> grid(sizes.begin(), sizes.end()), steps(strides.begin(), strides.end());
  while (grid.size() > 1 && mask.numel() / grid[0] > chunk_elements) {
    bases = (bases.view({-1, 1}) + at::arange(grid[1], bases.options()).mul_(steps[0]).view({1, -1})).reshape({-1});
    grid[1] *= grid[0];
    grid.erase(grid.begin());
    steps.erase(steps.begin());
  }
  const at::Tensor flat = mask.view(grid);
  const int64_t per_row = mask.numel() / grid[0];
  const int64_t rows = std::max<int64_t>(1, chunk_elements / per_row);
  for (int64_t first = 0; first < grid[0]; first += rows) {
    const int64_t count = std::min(rows, grid[0] - first);
    std::vector<int64_t> part = grid;
    part[0] = count;
    flat.narrow(0, first, count).copy_(counter_bits(key, grid_counters(bases.narrow(0, first, count), part, steps))
                                           .ge(threshold));
  }
  return mask;
}

void stochastic_round_bf16_ops_(const at::Tensor& dst, const at::Tensor& src, uint64_t key, int64_t first_counter,
                                int64_t chunk_elements) {
  check_round_arguments(dst, src);
  TORCH_CHECK(chunk_elements > 0, "stochastic_round_bf16_ops_: chunk_elements must be positive");
  const int64_t n = src.numel();
  const at::Tensor in = src.view({-1}), out = dst.view({-1});
  // In chunks, so the int64 temporaries (about 40 bytes an element) stay bounded for a parameter of any size.
  for (int64_t begin = 0; begin < n; begin += chunk_elements) {
    const int64_t count = std::min(chunk_elements, n - begin);
    const at::Tensor part = in.narrow(0, begin, count);
    const at::Tensor counters =
        at::arange(first_counter + begin, first_counter + begin + count, src.options().dtype(at::kLong));
    const at::Tensor random = counter_bits(key, counters).bitwise_and_(0xffff).to(at::kInt);
    // For finite values the int32 sum cannot overflow: the largest finite pattern plus 0xffff stays below 0x7f810000
    // (negative values, sign bit set, only move away from the int32 limits).
    const at::Tensor rounded = part.view(at::kInt).add(random).bitwise_and_(-65536).view(at::kFloat);
    out.narrow(0, begin, count).copy_(at::where(part.isfinite(), rounded, part));
  }
}

void stochastic_round_bf16_(const at::Tensor& dst, const at::Tensor& src, uint64_t key, int64_t first_counter) {
#if TRAINER_WITH_CUDA
  if (src.device().is_cuda()) {
    check_round_arguments(dst, src);
    const c10::DeviceGuard on(src.device());
    const std::string error = cuda_kernels::stochastic_round_bf16(
        src.data_ptr<float>(), reinterpret_cast<uint16_t*>(dst.data_ptr<at::BFloat16>()), src.numel(), key,
        first_counter, current_cuda_stream(src.device()));
    TORCH_CHECK(error.empty(), "stochastic_round_bf16_: the CUDA kernel failed: ", error);
    return;
  }
#endif
  if (!src.device().is_cpu()) {
    stochastic_round_bf16_ops_(dst, src, key, first_counter);
    return;
  }
  check_round_arguments(dst, src);
  const int64_t n = src.numel();
  const float* in = src.data_ptr<float>();
  auto* out = dst.data_ptr<at::BFloat16>();
  const auto k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t u;
      std::memcpy(&u, in + i, sizeof u);
      if ((u & 0x7f800000u) == 0x7f800000u) {  // inf or NaN: as they are
        out[i] = at::BFloat16(in[i]);
        continue;
      }
      u += bits_of(k0, k1, static_cast<uint64_t>(first_counter + i)) & 0xffffu;
      out[i] = at::BFloat16(static_cast<uint16_t>(u >> 16), at::BFloat16::from_bits());
    }
  });
}

}  // namespace trainer
