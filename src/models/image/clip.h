// CLIP (transformers' CLIPModel) and its vision tower as an image classifier (CLIPForImageClassification).
// The vision tower: patch embedding without bias, a class embedding, learned positions (bicubically interpolated
// for other image sizes), pre_layrnorm, pre-norm blocks (quick_gelu or gelu per hidden_act), post_layernorm on the
// class token. The text tower: token + position embeddings, causal self-attention, final_layer_norm, pooled at the
// end-of-text token. Projections without bias map both to the shared space; logit_scale is learned in log space.
// Parameter names are the checkpoint's ("vision_model.encoder.layers.0.self_attn.q_proj.weight"). Maths only:
// LoRA, activation checkpointing, precision and gradient caching (train/tasks/contrastive/contrastive.h) wrap it from outside.
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

class ClipVisionTower;
class ClipTextTower;

// What CLIPModel returns. Embeddings are L2-normalised; logits_per_image (B_img, B_txt) = scale * img . txt^T.
struct ClipOutput {
  at::Tensor image_embeds, text_embeds;           // (B, P), normalised
  at::Tensor logits_per_image, logits_per_text;   // (B, B) and its transpose
  at::Tensor loss;                                // scalar when asked for, else undefined
};

// The symmetric InfoNCE loss of CLIPModel(return_loss=True) from the projected, not yet normalised embeddings of
// matching pairs (row i of each is pair i): normalises both, scales the cosine similarities by exp(logit_scale)
// and averages the image->text and text->image cross-entropies. Computed in fp32 whatever the embeddings' dtype.
at::Tensor clip_contrastive_loss(const at::Tensor& image_features, const at::Tensor& text_features,
                                 const at::Tensor& logit_scale);

// CLIP's cap on the logit scale: exp(logit_scale) <= 100.
inline constexpr double kClipMaxLogitScale = 4.605170185988092;  // ln(100)

// Its blocks (ShardableModule::blocks) are the vision tower's encoder layers, then the text tower's: activation
// checkpointing and fully sharded data parallelism wrap them from outside.
class ClipModel : public ShardableModule {
 public:
  // config: a CLIPConfig config.json (model_type "clip", text_config, vision_config, projection_dim).
  ClipModel(const nlohmann::json& config, const c10::TensorOptions& options);

  const std::string& model_type() const override;
  const nlohmann::json& hf_config() const { return config_; }
  std::vector<const Module*> blocks() const override;
  // get_image_features: pixel_values (B, C, H, W) -> (B, P), projected, not normalised. Positions are
  // interpolated when H x W differs from vision_config.image_size.
  at::Tensor image_features(const at::Tensor& pixel_values);
  // get_text_features: input_ids (B, T), attention_mask (B, T) of 0/1 or undefined -> (B, P), not normalised.
  at::Tensor text_features(const at::Tensor& input_ids, const at::Tensor& attention_mask = {});
  // CLIPModel.forward: both towers, normalised embeddings, logits; the loss when return_loss.
  ClipOutput forward(const at::Tensor& pixel_values, const at::Tensor& input_ids, const at::Tensor& attention_mask,
                     bool return_loss);

  // The learned temperature, log scale (scalar). The forward uses exp(logit_scale) as transformers does;
  // clamp_logit_scale() keeps it in [0, ln 100] and is what a training loop calls after every optimizer step
  // (CLIP's and open_clip's cap: logits are never scaled by more than 100).
  at::Tensor& logit_scale() { return logit_scale_; }
  void clamp_logit_scale();

  // Prefixes of the towers' parameters (including their projections): what freezing a tower (LiT) freezes.
  static constexpr const char* kVisionPrefixes[] = {"vision_model.", "visual_projection."};
  static constexpr const char* kTextPrefixes[] = {"text_model.", "text_projection."};

  // transformers' CLIP initialisation from the global generator.
  void init_weights();

  int64_t image_size() const;
  int64_t projection_dim() const { return projection_dim_; }
  int64_t max_text_length() const;
  int64_t eos_token_id() const;

 private:
  nlohmann::json config_;
  int64_t projection_dim_ = 0;
  std::shared_ptr<ClipVisionTower> vision_;
  std::shared_ptr<ClipTextTower> text_;
  at::Tensor visual_projection_, text_projection_, logit_scale_;
};

// The CLIP vision tower with a linear head (CLIPForImageClassification): the head reads the mean of the final
// hidden states of the patch tokens (the class token and post_layernorm are not used, as in transformers).
class ClipVisionClassifier : public ImageClassifier {
 public:
  // config: a CLIPConfig (model_type "clip", vision_config; classes from id2label/num_labels at its top level).
  ClipVisionClassifier(const nlohmann::json& config, const c10::TensorOptions& options);

  const std::string& model_type() const override;
  const nlohmann::json& hf_config() const override { return config_; }
  at::Tensor features(const at::Tensor& pixel_values) override;  // (B, D)
  at::Tensor head(const at::Tensor& features) const override;
  std::string head_prefix() const override { return "classifier."; }
  void init_weights(bool head_only = false) override;
  int64_t num_labels() const override { return num_labels_; }
  int64_t image_size() const override;
  std::string image_processor_type() const override { return "CLIPImageProcessor"; }
  const std::vector<std::string>& labels() const override { return labels_; }
  void set_labels(const std::vector<std::string>& labels, const c10::TensorOptions& options) override;
  std::vector<const Module*> blocks() const override;  // the vision tower's encoder layers

 private:
  nlohmann::json config_;
  int64_t num_labels_ = 0;
  std::vector<std::string> labels_;
  std::shared_ptr<ClipVisionTower> vision_;
  at::Tensor classifier_weight_, classifier_bias_;
};

// A config.json of a CLIP vision tower ("clip_vision_model") or of a whole CLIP ("clip") as the CLIPConfig a
// CLIPForImageClassification has: model_type "clip" with the vision_config (text_config kept when present).
nlohmann::json clip_classifier_config(const nlohmann::json& config);

// Loads a CLIPModel directory (model.safetensors or a sharded index); init = random builds it from config.json
// with transformers' initialisation from `seed`. Missing, unexpected or misshapen tensors are one DataError.
std::unique_ptr<ClipModel> load_clip(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                     uint64_t seed = 0);
// Writes config.json (architectures CLIPModel) and the weights (sharded above max_shard_bytes) so that
// CLIPModel.from_pretrained loads them. With `parameter`, each tensor's values are fetched through it as its file is
// written, and only with `write` are files written (fully sharded weights: every rank fetches, rank 0 writes).
void save_clip(ClipModel& model, const std::string& dir, uint64_t max_shard_bytes = 5'000'000'000ull,
               const std::function<at::Tensor(const std::string&)>& parameter = {}, bool write = true);
void save_clip_config(const ClipModel& model, const std::string& dir);  // config.json alone

// Loads a CLIPForImageClassification, CLIPModel, CLIPVisionModel or CLIPVisionModelWithProjection directory as a
// classifier: the vision tower's weights (with or without the "vision_model." prefix), the head when the checkpoint
// has one for the same classes, else a new one from `seed` (text tower, projections and logit_scale are ignored).
std::unique_ptr<ClipVisionClassifier> load_clip_classifier(const std::string& dir, ModelInit init,
                                                           const c10::TensorOptions& options, uint64_t seed = 0,
                                                           const std::vector<std::string>& labels = {});
// Writes a directory CLIPForImageClassification.from_pretrained loads, with id2label/label2id (`parameter` and
// `write` as for save_clip).
void save_clip_classifier(ClipVisionClassifier& model, const std::string& dir,
                          const std::function<at::Tensor(const std::string&)>& parameter = {}, bool write = true);
void save_clip_classifier_config(const ClipVisionClassifier& model, const std::string& dir);  // config.json alone

}  // namespace trainer
