// The CUDA kernels of counter_rng_cuda.h: the launch and the grid-stride loops around counter_rng_kernels.cuh's
// bodies (which the CPU tests run over every block and thread); GpuCounterRng.* compares them with the CPU kernel on
// a card.
#include "util/counter_rng_cuda.h"

#include <cuda_runtime.h>

#include "util/counter_rng_kernels.cuh"

namespace trainer::cuda_kernels {
namespace {

static_assert(kMaxKeepMaskDims == kMaxGridDims, "counter_rng_cuda.h and counter_rng_kernels.cuh name one limit");
constexpr int64_t kMaxBlocks = 65535LL * 32;  // a grid-stride loop covers the rest

__global__ void keep_mask_kernel(uint32_t k0, uint32_t k1, const int64_t* __restrict__ row_base, Grid grid,
                                 uint32_t threshold, int64_t blocks, int64_t chunks_per_line, bool* __restrict__ out) {
  for (int64_t block = blockIdx.x; block < blocks; block += gridDim.x)
    keep_mask_block(block, static_cast<int>(threadIdx.x), k0, k1, row_base, grid, threshold, chunks_per_line, out);
}

__global__ void stochastic_round_kernel(const float* __restrict__ src, uint16_t* __restrict__ dst, int64_t n,
                                        uint32_t k0, uint32_t k1, uint64_t first_counter) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    dst[i] = stochastic_round_element(__float_as_uint(src[i]), k0, k1, first_counter + static_cast<uint64_t>(i));
}

std::string launched() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? std::string() : std::string(cudaGetErrorString(error));
}

}  // namespace

std::string keep_mask(uint64_t key, const int64_t* row_base, int dims, const int64_t* sizes, const int64_t* strides,
                      uint32_t threshold, bool* out, void* stream) {
  if (dims < 1 || dims > kMaxKeepMaskDims) return "a grid of " + std::to_string(dims) + " dimensions (1 to 8)";
  const KeepMaskLaunch plan = keep_mask_launch(dims, sizes, strides);
  if (plan.blocks == 0) return "";
  const int64_t launch = plan.blocks < kMaxBlocks ? plan.blocks : kMaxBlocks;
  keep_mask_kernel<<<static_cast<unsigned>(launch), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), row_base, plan.grid, threshold, plan.blocks,
      plan.chunks_per_line, out);
  return launched();
}

std::string stochastic_round_bf16(const float* src, uint16_t* dst, int64_t n, uint64_t key, int64_t first_counter,
                                  void* stream) {
  if (n == 0) return "";
  const int64_t needed = (n + kThreads - 1) / kThreads;
  const int64_t launch = needed < kMaxBlocks ? needed : kMaxBlocks;
  stochastic_round_kernel<<<static_cast<unsigned>(launch), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, dst, n, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), static_cast<uint64_t>(first_counter));
  return launched();
}

}  // namespace trainer::cuda_kernels
