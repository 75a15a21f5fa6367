// LoRA for image classifiers, applied from outside as for the text models (lora.h): adapters on the backbone's
// linear layers (attention and MLP projections), the base frozen, the classification head trained in full, and
// the result saved as a PEFT adapter whose head is in `modules_to_save`, so that peft.PeftModel.from_pretrained on
// transformers' classifier loads it with the same logits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/image/image_model.h"
#include "models/lora.h"

namespace trainer {

// The adapters and the head: what a LoRA run of an image classifier trains (and the optimizer's parameters).
class ImageLoraAdapters : public LoraAdapters {
 public:
  ImageLoraAdapters(LoraConfig config, ImageClassifier& model);
  const std::string& head_module() const { return head_module_; }  // "classifier"

 private:
  std::string head_module_;
};

// PEFT's default targets for an image classifier: query, value (ViT); q_proj, v_proj (CLIP).
std::vector<std::string> default_image_lora_targets(const ImageClassifier& model);

// Adds one adapter per (module path, linear layer) to `adapters` (r, alpha, rslora, dropout from `config`),
// initialised as PEFT does: A uniform in +-1/sqrt(in) drawn in order from a generator seeded with `seed`, B zero,
// so the adapted model starts equal to the base. Shared by the image classifiers and CLIP (clip_lora.h).
void add_lora_layers(LoraAdapters& adapters, const std::vector<std::pair<std::string, Linear*>>& layers,
                     const LoraConfig& config, uint64_t seed);

// Freezes the backbone, adds adapters to the linear layers named by config.target_modules (last names, e.g.
// query, value; empty: default_image_lora_targets) with lora_A drawn from `seed`, and leaves the head trainable. A target that
// matches no linear layer is a UsageError naming it.
std::unique_ptr<ImageLoraAdapters> apply_image_lora(ImageClassifier& model, const LoraConfig& config, uint64_t seed);

// Writes dir/adapter_config.json and dir/adapter_model.safetensors in PEFT's format (module names as transformers
// names them in memory, the head under modules_to_save).
void write_image_adapter(const std::string& dir, const ImageLoraAdapters& adapters, const ImageClassifier& model,
                         const std::string& base_model_name_or_path);
// Loads what write_image_adapter wrote into `adapters` (and the model's head), for a resume. DataError when a
// tensor is missing or misshapen.
void load_image_adapter(const std::string& dir, ImageLoraAdapters& adapters, ImageClassifier& model);

}  // namespace trainer
