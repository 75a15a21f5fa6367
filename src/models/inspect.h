// `trainer inspect DIR`: what a model is and what training it costs in memory, without loading its weights.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace trainer {

struct InspectOptions {
  int64_t lora_r = 8;
  std::vector<std::string> lora_targets;  // empty: the family's defaults
  std::vector<std::string> lora_parameters;  // a mixture of experts' experts (lora.target_parameters)
};

// Prints architecture, parameter counts by group, checkpoint dtype and bytes, and the memory that weights,
// gradients and AdamW state need in each precision mode and with LoRA (the
// adapters counted by applying them to the shape-only model, as training does). Throws DataError for a bad directory.
void inspect_model(const std::string& dir, const InspectOptions& options, std::ostream& out);

// An image classifier's memory at its configured size (models/image/image_model.h): fixed bytes (weights, gradients,
// AdamW state) of a full fine-tune or a linear probe, and an estimate of the activations one image keeps for
// backward in fp32.
struct ImageMemoryEstimate {
  int64_t parameters = 0, head_parameters = 0, image_size = 0, tokens = 0;
  double full_fixed = 0, probe_fixed = 0, activations_per_image = 0;
};
ImageMemoryEstimate estimate_image_memory(const std::string& dir);

}  // namespace trainer
