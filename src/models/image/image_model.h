// What every image classifier provides to the rest of trainer (training, evaluation, `predict`, `inspect`), and
// how one is loaded from or saved to a Hugging Face directory. Architectures (ViT, the CLIP vision tower) hold only
// the maths; LoRA, activation checkpointing, precision and the memory policy wrap them from outside, as for the
// text models (model.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "models/module.h"
#include "trainer/config.h"

namespace trainer {

class ImageClassifier : public Module {
 public:
  // config.json's model_type ("vit", "clip_vision_model", ...).
  virtual const std::string& model_type() const = 0;
  virtual const nlohmann::json& hf_config() const = 0;

  // pixel_values (B, C, H, W) -> logits (B, num_labels); = head(features(pixel_values)).
  virtual at::Tensor forward(const at::Tensor& pixel_values) { return head(features(pixel_values)); }
  // What the head reads (B, D): a linear probe may compute it once without autograd.
  virtual at::Tensor features(const at::Tensor& pixel_values) = 0;
  virtual at::Tensor head(const at::Tensor& features) const = 0;
  // Dotted-name prefix of the head's parameters ("classifier."): what a linear probe trains and PEFT's
  // modules_to_save names.
  virtual std::string head_prefix() const = 0;

  // Hugging Face's initialisation from the global generator; head_only re-initialises just the head.
  virtual void init_weights(bool head_only = false) = 0;

  virtual int64_t num_labels() const = 0;
  // The image size of config.json (positions are interpolated for other sizes).
  virtual int64_t image_size() const = 0;
  // The transformers image processor whose defaults apply when the directory has no preprocessor_config.json.
  virtual std::string image_processor_type() const { return "ViTImageProcessor"; }
  // Class names by id (config.json's id2label; "LABEL_i" where it has none).
  virtual const std::vector<std::string>& labels() const = 0;
  // Sets the classes (id2label/label2id in config.json) and rebuilds the head for their number.
  virtual void set_labels(const std::vector<std::string>& labels, const c10::TensorOptions& options) = 0;

  // Activation checkpointing installs a runner that recomputes each block in backward; empty: blocks run directly.
  void set_block_runner(BlockRunner runner) { block_runner_ = std::move(runner); }
  bool has_block_runner() const { return static_cast<bool>(block_runner_); }

 protected:
  at::Tensor run_block(const BlockFn& block, const std::vector<at::Tensor>& inputs) const {
    return block_runner_ ? block_runner_(block, inputs) : block(inputs);
  }

 private:
  BlockRunner block_runner_;
};

// A classifier config's class names: id2label by id, or LABEL_i for num_labels (transformers' default: 2).
std::vector<std::string> config_labels(const nlohmann::json& config);
// Writes id2label/label2id for `labels` into a config (and drops num_labels, which they imply).
void write_label_maps(nlohmann::json& config, const std::vector<std::string>& labels);

// Whether dir/config.json (or a parsed config) describes an image classifier this build knows.
bool is_image_model_config(const nlohmann::json& config);

// A classifier built from config.json alone (fp32, `labels` when given and different): HF's initialisation from
// `seed`, then every parameter moved to `options` (for the loaders' model.init=random).
void initialise_randomly(ImageClassifier& model, const c10::TensorOptions& options, uint64_t seed,
                         const std::vector<std::string>& labels);

// Reads dir/config.json and dispatches on model_type. A checkpoint without a head (or with a head for other classes
// when `labels` is given and differs) gets a new head from `seed`; init = random initialises everything from
// `seed`. An unknown model_type is a DataError naming the file and the supported types.
std::unique_ptr<ImageClassifier> load_image_classifier(const std::string& dir, ModelInit init,
                                                       const c10::TensorOptions& options, uint64_t seed = 0,
                                                       const std::vector<std::string>& labels = {});
// Writes config.json (id2label/label2id, architectures) and model.safetensors so that transformers'
// from_pretrained loads it.
void save_image_classifier(ImageClassifier& model, const std::string& dir);

}  // namespace trainer
