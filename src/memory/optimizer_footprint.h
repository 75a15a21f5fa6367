// What an optimizer's state costs, from the config alone: the bytes of state per trainable parameter, whether
// AdamW takes ATen's fused kernel (which decides its update scratch) and, sharded (ZeRO-1), which rank owns which
// parameter's state. The memory planner counts them before any optimizer exists; the optimizers of train/optim are
// built to them (optimizer.h includes this header, and tests/unit/train/optimizer_test.cpp checks state_bytes()
// against optimizer_state_bytes()). In memory/, below train/, so that the planner includes nothing of train/
// (docs/architecture.md#layers).
#pragma once

#include <cstdint>
#include <vector>

#include <c10/util/ArrayRef.h>

#include "trainer/config.h"

namespace trainer {

// optimizer.state_dtype=int8, as bitsandbytes' AdamW8bit: blocks of 256 elements (BLOCKSIZE_2STATE), fp32 moments
// for parameters under 4096 elements (min_8bit_size).
inline constexpr int64_t kInt8Block = 256;
inline constexpr int64_t kInt8MinSize = 4096;

// Whether AdamW runs ATen's fused kernel (_fused_adamw_: one vectorised pass per tensor, about 5x faster on a
// CPU than its chunked update in train/optim/optimizer.cpp) rather than the chunked update: when every trainable
// parameter and both moments are fp32 (precision fp32 or bf16-mixed, or LoRA adapters; optimizer.state_dtype fp32).
// bf16 weights or moments need stochastic rounding or Kahan compensation, which the kernel does not do.
bool adamw_uses_fused_kernel(const OptimizerConfig& config, bool bf16_trainable_parameters);

// Bytes of optimizer state (Kahan compensation included) for one trainable parameter of `sizes` in the dtype given
// by `bf16_param`: what Optimizer::state_bytes() counts, for the planner before any weight exists.
int64_t optimizer_state_bytes(const OptimizerConfig& config, c10::IntArrayRef sizes, bool bf16_param);

// The owner rank of each parameter (by element count, in the optimizer's order) among `world` ranks: largest first
// to the least-loaded rank (ties: the lower rank, then the earlier parameter), so each rank holds about 1/world of
// the elements whenever no single parameter is larger than that. Depends only on the sizes: every rank agrees.
std::vector<int> shard_owners(const std::vector<int64_t>& numels, int world);

}  // namespace trainer
