// The training run: tokenizer, model, data, optimizer, memory policy and the loop that wires them, with
// evaluation, metrics and the final save. Small named steps over one explicit state (STYLE.md 5).
#pragma once

#include <iosfwd>

#include "trainer/config.h"
#include "trainer/device.h"

namespace trainer {

// Trains as the config says on `device`; returns the exit code. Throws trainer::Error (OutOfMemoryAtFloor: 4).
int train(const Config& config, const ResolvedDevice& device, std::ostream& out);

}  // namespace trainer
