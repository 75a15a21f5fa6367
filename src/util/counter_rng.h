// STAND-IN for the lead's src/util/counter_rng.h (replaced on merging main): same API, so the dropout plumbing
// compiles and is tested before it lands.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace trainer {

uint64_t counter_key(std::initializer_list<uint64_t> parts);
uint32_t counter_bits(uint64_t key, uint64_t counter);
at::Tensor counter_bits(uint64_t key, const at::Tensor& counters);
at::Tensor counter_keep_mask(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides,
                             double p);

}  // namespace trainer
