// The state of LibTorch's random generators (dropout, sampling), for activation checkpointing's recomputation and
// for checkpoints (an exact resume).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace trainer {

at::Tensor get_rng_state(const c10::Device& device);
void set_rng_state(const c10::Device& device, const at::Tensor& state);

}  // namespace trainer
