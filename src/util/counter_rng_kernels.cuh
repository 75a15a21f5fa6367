// The bodies of trainer's CUDA kernels for counter-based random bits (counter_rng_cuda.cu), as functions of a block
// and a thread index, so that the CPU tests run the same code over every block and thread
// (CounterRngKernels.*, which define TRAINER_KERNEL_FUNCTION as plain `inline`) before a card ever does. The mixer is
// counter_rng.cpp's (same multipliers, same rounds): a change to one is a change to both.
#pragma once

#include <cstdint>

#ifndef TRAINER_KERNEL_FUNCTION
#define TRAINER_KERNEL_FUNCTION __device__ __forceinline__
#endif

namespace trainer::cuda_kernels {

constexpr int kMaxGridDims = 8;
constexpr int kThreads = 256;
constexpr int64_t kPerThread = 4;  // elements of a line each thread of a block takes

struct Grid {
  int dims;
  int64_t sizes[kMaxGridDims];
  int64_t strides[kMaxGridDims];  // strides[d - 1] for dimension d >= 1
};

// On the host: the grid of a keep-mask and its launch (blocks = lines * chunks per line). n == 0: no blocks.
struct KeepMaskLaunch {
  Grid grid;
  int64_t blocks, chunks_per_line;
};
inline KeepMaskLaunch keep_mask_launch(int dims, const int64_t* sizes, const int64_t* strides) {
  KeepMaskLaunch launch{};
  launch.grid.dims = dims;
  int64_t n = 1;
  for (int d = 0; d < dims; ++d) {
    launch.grid.sizes[d] = sizes[d];
    n *= sizes[d];
    if (d + 1 < dims) launch.grid.strides[d] = strides[d];
  }
  const int64_t inner = dims > 1 ? sizes[dims - 1] : 1;
  launch.chunks_per_line = (inner + kThreads * kPerThread - 1) / (kThreads * kPerThread);
  launch.blocks = n == 0 ? 0 : n / inner * launch.chunks_per_line;
  return launch;
}

TRAINER_KERNEL_FUNCTION uint32_t mix(uint32_t v) {
  v ^= v >> 16;
  v *= 0x21f0aaadu;
  v ^= v >> 15;
  v *= 0x735a2d97u;
  v ^= v >> 15;
  return v;
}

TRAINER_KERNEL_FUNCTION uint32_t bits_of(uint32_t k0, uint32_t k1, uint64_t counter) {
  const auto lo = static_cast<uint32_t>(counter), hi = static_cast<uint32_t>(counter >> 32);
  return mix(mix(mix(lo ^ k0) ^ hi) ^ k1);
}

// Block `block` of the keep-mask covers one chunk of kThreads * kPerThread elements of one line (a run of the
// innermost dimension): the line's first counter comes from its outer indices, then the block's threads step along
// the chunk. Blocks: lines * chunks_per_line.
TRAINER_KERNEL_FUNCTION void keep_mask_block(int64_t block, int thread, uint32_t k0, uint32_t k1,
                                             const int64_t* row_base, const Grid& grid, uint32_t threshold,
                                             int64_t chunks_per_line, bool* out) {
  const int last = grid.dims - 1;
  const int64_t inner = grid.dims > 1 ? grid.sizes[last] : 1;
  const uint64_t inner_stride = grid.dims > 1 ? static_cast<uint64_t>(grid.strides[last - 1]) : 0;
  const int64_t line = block / chunks_per_line;
  const int64_t first = (block % chunks_per_line) * kThreads * kPerThread;
  int64_t rest = line;
  uint64_t counter = 0;
  for (int d = last - 1; d >= 1; --d) {
    counter += static_cast<uint64_t>(rest % grid.sizes[d]) * static_cast<uint64_t>(grid.strides[d - 1]);
    rest /= grid.sizes[d];
  }
  counter += static_cast<uint64_t>(row_base[rest]);
  bool* o = out + line * inner;
  const int64_t end = first + kThreads * kPerThread < inner ? first + kThreads * kPerThread : inner;
  for (int64_t i = first + thread; i < end; i += kThreads)
    o[i] = bits_of(k0, k1, counter + static_cast<uint64_t>(i) * inner_stride) >= threshold;
}

// Element i of bf16 stochastic rounding: the fp32 bits plus the low 16 random bits, cut to the upper half;
// infinities and NaN as c10::BFloat16(float) converts them.
TRAINER_KERNEL_FUNCTION uint16_t stochastic_round_element(uint32_t u, uint32_t k0, uint32_t k1, uint64_t counter) {
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x7fffffu) ? uint16_t{0x7fc0} : static_cast<uint16_t>(u >> 16);
  u += bits_of(k0, k1, counter) & 0xffffu;
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace trainer::cuda_kernels
