// ViT image classification (transformers' ViTForImageClassification): patch embedding, class token, learned
// positions (bicubically interpolated when the image size differs from config.json's), pre-norm blocks with GELU,
// final LayerNorm and a linear head on the class token. Parameter names are the checkpoint's
// ("vit.encoder.layer.0.attention.attention.query.weight"); a ViTModel checkpoint (no "vit." prefix, no head) loads
// with a new head. Maths only: LoRA (Linear output hooks), activation checkpointing (the block runner) and
// precision are applied from outside, as for the text models.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <nlohmann/json.hpp>

#include "models/image/image_model.h"
#include "models/model.h"
#include "models/module.h"
#include "trainer/config.h"

namespace trainer {

class VitBody;

class VitForImageClassification : public ImageClassifier {
 public:
  // config: a ViT config.json (model_type "vit"); the classes from id2label (or num_labels), at least 2.
  VitForImageClassification(const nlohmann::json& config, const c10::TensorOptions& options);

  const std::string& model_type() const override;
  const nlohmann::json& hf_config() const override { return config_; }
  // pixel_values (B, C, H, W), H and W multiples of patch_size. features: the class token's final hidden state.
  at::Tensor features(const at::Tensor& pixel_values) override;
  at::Tensor head(const at::Tensor& features) const override;
  std::string head_prefix() const override { return "classifier."; }
  void init_weights(bool head_only = false) override;
  int64_t num_labels() const override { return num_labels_; }
  int64_t image_size() const override { return image_size_; }
  const std::vector<std::string>& labels() const override { return labels_; }
  void set_labels(const std::vector<std::string>& labels, const c10::TensorOptions& options) override;
  // The encoder layers ("vit.encoder.layer.i"); the embeddings, the final LayerNorm and the head are outside them.
  std::vector<const Module*> blocks() const override;

 private:
  nlohmann::json config_;
  int64_t num_labels_ = 0, image_size_ = 0;
  std::vector<std::string> labels_;
  std::shared_ptr<VitBody> vit_;
  at::Tensor classifier_weight_, classifier_bias_;
};

// Reads dir/config.json and the weights. A checkpoint without the head (a ViTModel, or a classifier for other
// classes when `labels` is given and differs) gets a new, randomly initialised head from `seed`; init = random
// initialises everything from `seed`. Missing or misshapen backbone tensors are one DataError listing them.
std::unique_ptr<VitForImageClassification> load_vit(const std::string& dir, ModelInit init,
                                                    const c10::TensorOptions& options, uint64_t seed = 0,
                                                    const std::vector<std::string>& labels = {});
// Writes config.json (with id2label/label2id and architectures = ViTForImageClassification) and
// model.safetensors so that transformers' from_pretrained loads it. With `parameter`, each tensor's values are fetched
// through it as its file is written, and only with `write` are files written (save_image_classifier_streamed).
void save_vit(VitForImageClassification& model, const std::string& dir,
              const std::function<at::Tensor(const std::string&)>& parameter = {}, bool write = true);
void save_vit_config(const VitForImageClassification& model, const std::string& dir);  // config.json alone

}  // namespace trainer
