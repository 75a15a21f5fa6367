// The training run: tokenizer, model, data, optimizer, memory policy and the loop that wires them, with
// evaluation, metrics and the final save. Small named steps over one explicit state (STYLE.md 5).
#pragma once

#include <iosfwd>

#include "trainer/config.h"
#include "trainer/device.h"
#include "trainer/run.h"

namespace trainer {

// Trains as the config says on `device`; returns the exit code. Throws trainer::Error (OutOfMemoryAtFloor: 4).
// With options.resume / resume_from, continues from a checkpoint: weights, optimizer state, step, data position,
// RNG state and the memory policy's micro-batch, so the run reaches the weights an uninterrupted run would.
int train(const Config& config, const ResolvedDevice& device, const TrainOptions& options, std::ostream& out);

}  // namespace trainer
