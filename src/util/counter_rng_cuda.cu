// The CUDA kernels of counter_rng_cuda.h. The mixer is counter_rng.cpp's (same multipliers, same rounds): a change
// to one is a change to both, and GpuCounterRng.* compare them bit for bit on a card.
#include "util/counter_rng_cuda.h"

#include <cuda_runtime.h>

namespace trainer::cuda_kernels {
namespace {

constexpr uint32_t kMul1 = 0x21f0aaadu;
constexpr uint32_t kMul2 = 0x735a2d97u;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535LL * 32;  // a grid-stride loop covers the rest

__device__ __forceinline__ uint32_t mix(uint32_t v) {
  v ^= v >> 16;
  v *= kMul1;
  v ^= v >> 15;
  v *= kMul2;
  v ^= v >> 15;
  return v;
}

__device__ __forceinline__ uint32_t bits_of(uint32_t k0, uint32_t k1, uint64_t counter) {
  const auto lo = static_cast<uint32_t>(counter), hi = static_cast<uint32_t>(counter >> 32);
  return mix(mix(mix(lo ^ k0) ^ hi) ^ k1);
}

struct Grid {
  int dims;
  int64_t sizes[kMaxGridDims];
  int64_t strides[kMaxGridDims];  // strides[d - 1] for dimension d >= 1
};

// One block per (line, chunk of the line): a line is a run of the innermost dimension, whose first counter is
// computed once per thread from the line's outer indices; the threads then step along the line.
__global__ void keep_mask_kernel(uint32_t k0, uint32_t k1, const int64_t* __restrict__ row_base, Grid grid,
                                 uint32_t threshold, int64_t lines, int64_t chunks_per_line, bool* __restrict__ out) {
  const int last = grid.dims - 1;
  const int64_t inner = grid.dims > 1 ? grid.sizes[last] : 1;
  const uint64_t inner_stride = grid.dims > 1 ? static_cast<uint64_t>(grid.strides[last - 1]) : 0;
  for (int64_t block = blockIdx.x; block < lines * chunks_per_line; block += gridDim.x) {
    const int64_t line = block / chunks_per_line;
    const int64_t first = (block % chunks_per_line) * kThreads * 4;
    int64_t rest = line;
    uint64_t counter = 0;
    for (int d = last - 1; d >= 1; --d) {
      counter += static_cast<uint64_t>(rest % grid.sizes[d]) * static_cast<uint64_t>(grid.strides[d - 1]);
      rest /= grid.sizes[d];
    }
    counter += static_cast<uint64_t>(row_base[rest]);
    bool* o = out + line * inner;
    const int64_t end = first + kThreads * 4 < inner ? first + kThreads * 4 : inner;
    for (int64_t i = first + threadIdx.x; i < end; i += kThreads)
      o[i] = bits_of(k0, k1, counter + static_cast<uint64_t>(i) * inner_stride) >= threshold;
  }
}

__global__ void stochastic_round_kernel(const float* __restrict__ src, uint16_t* __restrict__ dst, int64_t n,
                                        uint32_t k0, uint32_t k1, uint64_t first_counter) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    uint32_t u = __float_as_uint(src[i]);
    if ((u & 0x7f800000u) == 0x7f800000u) {  // inf or NaN: as c10::BFloat16(float) converts them
      dst[i] = (u & 0x7fffffu) ? uint16_t{0x7fc0} : static_cast<uint16_t>(u >> 16);
      continue;
    }
    u += bits_of(k0, k1, first_counter + static_cast<uint64_t>(i)) & 0xffffu;
    dst[i] = static_cast<uint16_t>(u >> 16);
  }
}

std::string launched() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? std::string() : std::string(cudaGetErrorString(error));
}

}  // namespace

std::string keep_mask(uint64_t key, const int64_t* row_base, int dims, const int64_t* sizes, const int64_t* strides,
                      uint32_t threshold, bool* out, void* stream) {
  if (dims < 1 || dims > kMaxGridDims) return "a grid of " + std::to_string(dims) + " dimensions (1 to 8)";
  Grid grid{};
  grid.dims = dims;
  int64_t n = 1;
  for (int d = 0; d < dims; ++d) {
    grid.sizes[d] = sizes[d];
    n *= sizes[d];
    if (d + 1 < dims) grid.strides[d] = strides[d];
  }
  if (n == 0) return "";
  const int64_t inner = dims > 1 ? sizes[dims - 1] : 1;
  const int64_t lines = n / inner;
  const int64_t chunks = (inner + kThreads * 4 - 1) / (kThreads * 4);
  const int64_t blocks = lines * chunks < kMaxBlocks ? lines * chunks : kMaxBlocks;
  keep_mask_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), row_base, grid, threshold, lines, chunks, out);
  return launched();
}

std::string stochastic_round_bf16(const float* src, uint16_t* dst, int64_t n, uint64_t key, int64_t first_counter,
                                  void* stream) {
  if (n == 0) return "";
  const int64_t needed = (n + kThreads - 1) / kThreads;
  const int64_t blocks = needed < kMaxBlocks ? needed : kMaxBlocks;
  stochastic_round_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, dst, n, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), static_cast<uint64_t>(first_counter));
  return launched();
}

}  // namespace trainer::cuda_kernels
