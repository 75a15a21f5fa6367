// What a run needs before its first example (weights, gradients, optimizer state), for the error when memory.limit
// (or the device) cannot even hold that: the same figures as `trainer plan` and the floor's memory report, so the
// message says how far off the budget is, not only that it was exceeded.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include "trainer/config.h"
#include "trainer/errors.h"

namespace trainer {

// `what` did not fit (loading the weights, applying LoRA, allocating the optimizer state): an OutOfMemoryAtFloor
// (exit 4) whose message lists weights, gradients and optimizer state from the architecture, their sum against
// memory.limit, and whose hint suggests what shrinks them.
OutOfMemoryAtFloor fixed_memory_error(const Config& config, const c10::Device& device, const std::string& what,
                                      const c10::OutOfMemoryError& error);

}  // namespace trainer
