// CUDA kernels of the counter-based random bits (counter_rng.h): the dropout keep-mask and bf16 stochastic rounding
// in one pass each, the same bits as the CPU kernels. Compiled only in a CUDA build (TRAINER_WITH_CUDA), by nvcc, in
// their own library (counter_rng_cuda.cu). Plain types only, so nvcc never parses LibTorch's headers; counter_rng.cpp
// checks the tensors and calls these on the current stream.
#pragma once

#include <cstdint>
#include <string>

namespace trainer::cuda_kernels {

constexpr int kMaxKeepMaskDims = 8;  // counter_rng_kernels.cuh's kMaxGridDims

// out[e] = bits(key, row_base[r] + sum_d i_d * strides[d - 1]) >= threshold for every element e = (r, i_1, ..., i_k)
// of a contiguous bool grid of `dims` sizes (at most kMaxKeepMaskDims); row_base is int64 on the device. Returns "" or
// CUDA's error message.
std::string keep_mask(uint64_t key, const int64_t* row_base, int dims, const int64_t* sizes, const int64_t* strides,
                      uint32_t threshold, bool* out, void* stream);

// dst[i] (bf16 bits) = src[i] (fp32) rounded down after adding the low 16 bits of bits(key, first_counter + i);
// non-finite values converted as they are. Returns "" or CUDA's error message.
std::string stochastic_round_bf16(const float* src, uint16_t* dst, int64_t n, uint64_t key, int64_t first_counter,
                                  void* stream);

}  // namespace trainer::cuda_kernels
