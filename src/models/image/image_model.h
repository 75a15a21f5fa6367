// What every image classifier provides to the rest of trainer (training, evaluation, `predict`, `inspect`), and
// how one is loaded from or saved to a Hugging Face directory. Architectures (ViT, the CLIP vision tower) hold only
// the maths; LoRA, activation checkpointing, precision and the memory policy wrap them from outside, as for the
// text models (model.h).
#pragma once

#include <cstdint>
#include <functional>
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

// Its blocks (the encoder layers, ShardableModule::blocks) run through run_block: activation checkpointing and fully
// sharded data parallelism wrap them from outside; model_type() is config.json's ("vit", "clip").
class ImageClassifier : public ShardableModule {
 public:
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
};

// A classifier config's class names: id2label by id, or LABEL_i for num_labels (transformers' default: 2).
std::vector<std::string> config_labels(const nlohmann::json& config);
// Writes id2label/label2id for `labels` into a config (and drops num_labels, which they imply).
void write_label_maps(nlohmann::json& config, const std::vector<std::string>& labels);

// The parameters of `model` under their names into dir's weight files (split into shards above max_shard_bytes, as
// save_state_dict does): the model's own values, or each fetched through `parameter` as its file is written (fully
// sharded weights; without `write` they are only fetched). What the image models' save functions share.
void save_module_weights(Module& model, const std::string& dir, uint64_t max_shard_bytes,
                         const std::function<at::Tensor(const std::string&)>& parameter = {}, bool write = true);

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
// Fully sharded weights: the same files, each parameter's values fetched by name through `parameter` as its file is
// written (every rank calls it, with the same names in the same order; rank 0 with `write`, the others only fetch).
void save_image_classifier_streamed(ImageClassifier& model, const std::string& dir,
                                    const std::function<at::Tensor(const std::string&)>& parameter, bool write);
// config.json alone, as save_image_classifier writes it (a checkpoint whose weights are in the ranks' parts).
void save_image_classifier_config(ImageClassifier& model, const std::string& dir);

}  // namespace trainer
