// Counter-based random bits: every value is a pure function of (key, counter), so it does not depend on the
// order in which values are drawn, on how the work is split into micro-batches or ranks, on retries or on
// activation checkpointing's recompute. Dropout masks and bf16 stochastic rounding draw from here.
//
// The function: the counter's two 32-bit halves and the key's two halves go through three rounds of a 32-bit
// integer mixer (xorshift-multiply, multipliers below 2^31 so the tensor version computes it exactly in int64):
//   h = mix(mix(mix(lo ^ k0) ^ hi) ^ k1)
// For a fixed key and upper half it is a bijection of the lower half, so counters of one tensor never collide.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace trainer {

// One 64-bit key from its parts (seed, step, layer or tensor id, ...): a splitmix64 chain; order matters.
uint64_t counter_key(std::initializer_list<uint64_t> parts);

// 32 random bits for (key, counter); counters are taken as unsigned 64-bit values.
uint32_t counter_bits(uint64_t key, uint64_t counter);

// counter_bits(key, c) for each element c of `counters` (int64, any shape, any device), as int64 in [0, 2^32).
at::Tensor counter_bits(uint64_t key, const at::Tensor& counters);

// The counters of a grid of `sizes` = {R, n_1, ..., n_k}: element (r, i_1, ..., i_k) gets
// row_base[r] + i_1 * strides[0] + ... + i_k * strides[k-1] (row_base int64 [R] on the grid's device).
at::Tensor grid_counters(const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides);

// A keep-mask (bool, `sizes`, on row_base's device) whose element is true when counter_bits(key, its grid counter)
// >= p * 2^32, i.e. with probability 1 - p. On the CPU one parallel pass with no temporaries, eight counters at a
// time (an AVX2 clone on x86-64); on CUDA one kernel (counter_rng_cuda.cu); elsewhere counter_keep_mask_ops.
at::Tensor counter_keep_mask(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes,
                             at::IntArrayRef strides, double p);

// The same mask in tensor ops, in chunks of about `chunk_elements` counters so that the int64 temporaries stay
// bounded: what a device without a kernel of its own runs (public so the CPU tests compare it with the CPU kernel).
at::Tensor counter_keep_mask_ops(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes,
                                 at::IntArrayRef strides, double p, int64_t chunk_elements = int64_t{1} << 22);

// Writes fp32 `src` into bf16 `dst` (same number of elements, both contiguous, same device) with stochastic
// rounding: dst is one of the two bf16 neighbours of src, the upper one with probability equal to src's distance
// from the lower one over their gap, so E[dst] = src. Element i uses the low 16 bits of
// counter_bits(key, first_counter + i). Non-finite values are converted as they are. On the CPU it allocates
// nothing.
void stochastic_round_bf16_(const at::Tensor& dst, const at::Tensor& src, uint64_t key, int64_t first_counter);
// The same in tensor ops, in chunks of `chunk_elements`: what a device without a kernel of its own runs (public so
// the CPU tests compare the two). CUDA builds run a kernel of their own on CUDA tensors (counter_rng_cuda.cu).
void stochastic_round_bf16_ops_(const at::Tensor& dst, const at::Tensor& src, uint64_t key, int64_t first_counter,
                                int64_t chunk_elements = int64_t{1} << 22);

}  // namespace trainer
