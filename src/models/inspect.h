// `trainer inspect DIR`: what a model is and what training it costs in memory, without loading its weights.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

namespace trainer {

struct InspectOptions {
  int64_t lora_r = 8;
};

// Prints architecture, parameter counts by group, checkpoint dtype and bytes, and the memory that weights,
// gradients and AdamW state need in each precision mode and with LoRA. Throws DataError for a bad directory.
void inspect_model(const std::string& dir, const InspectOptions& options, std::ostream& out);

}  // namespace trainer
