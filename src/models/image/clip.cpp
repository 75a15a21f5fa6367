// CLIP: both towers, the contrastive head and the vision classifier (see clip.h). Classes in dependency order;
// shapes in comments. Formulas follow transformers' modeling_clip.py so that fp32 results agree to rounding.
#include "models/image/clip.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/dropout.h"
#include "models/hf_config.h"
#include "models/layers.h"
#include "trainer/errors.h"
#include "trainer/hf_weights.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

// One tower's config (text_config or vision_config), with CLIPTextConfig's / CLIPVisionConfig's defaults.
struct ClipTowerHyper {
  int64_t hidden, heads, head_dim, intermediate, layers;
  double eps, attention_dropout, initializer_range, initializer_factor;
  std::string act;
  // vision
  int64_t image_size = 0, patch_size = 0, channels = 0;
  // text
  int64_t vocab = 0, max_positions = 0, eos = 0;

  ClipTowerHyper(const nlohmann::json& c, bool vision) {
    hidden = hf::get_int(c, "hidden_size", vision ? 768 : 512);
    heads = hf::get_int(c, "num_attention_heads", vision ? 12 : 8);
    intermediate = hf::get_int(c, "intermediate_size", vision ? 3072 : 2048);
    layers = hf::get_int(c, "num_hidden_layers", 12);
    eps = hf::get_double(c, "layer_norm_eps", 1e-5);
    attention_dropout = hf::get_double(c, "attention_dropout", 0.0);
    initializer_range = hf::get_double(c, "initializer_range", 0.02);
    initializer_factor = hf::get_double(c, "initializer_factor", 1.0);
    act = hf::get_string(c, "hidden_act", "quick_gelu");
    const std::string where = vision ? "config.json: vision_config" : "config.json: text_config";
    if (hidden <= 0 || heads <= 0 || hidden % heads != 0)
      throw DataError(where + ".hidden_size " + std::to_string(hidden) + " is not a multiple of num_attention_heads " +
                      std::to_string(heads));
    check_activation(act, where + ".hidden_act");
    head_dim = hidden / heads;
    if (vision) {
      image_size = hf::get_int(c, "image_size", 224);
      patch_size = hf::get_int(c, "patch_size", 32);
      channels = hf::get_int(c, "num_channels", 3);
      if (patch_size <= 0 || image_size < patch_size)
        throw DataError(where + ": image_size " + std::to_string(image_size) + " holds no " +
                        std::to_string(patch_size) + " px patch");
    } else {
      vocab = hf::get_int(c, "vocab_size", 49408);
      max_positions = hf::get_int(c, "max_position_embeddings", 77);
      eos = hf::get_eos(c).value_or(49407);
    }
  }
};

const nlohmann::json& sub_config(const nlohmann::json& config, const char* key) {
  static const nlohmann::json empty = nlohmann::json::object();
  const auto* sub = hf::find(config, key);
  if (sub != nullptr && !sub->is_object())
    throw DataError(std::string("config.json: \"") + key + "\" must be an object");
  return sub != nullptr ? *sub : empty;
}

class ClipLayerNorm : public Module {
 public:
  ClipLayerNorm(int64_t dim, const c10::TensorOptions& o) {
    weight = at::ones({dim}, o);
    bias = at::zeros({dim}, o);
    register_parameter("weight", &weight);
    register_parameter("bias", &bias);
  }
  at::Tensor forward(const at::Tensor& x, double eps) const {
    return at::layer_norm(x, {weight.size(0)}, weight, bias, eps);
  }
  at::Tensor weight, bias;
};

// A module holding one tensor named "weight" (an embedding table, a convolution without bias).
class WeightHolder : public Module {
 public:
  WeightHolder(std::vector<int64_t> shape, const c10::TensorOptions& o) {
    weight = at::empty(shape, o);
    register_parameter("weight", &weight);
  }
  at::Tensor weight;
};

class ClipAttention : public Module {
 public:
  ClipAttention(const ClipTowerHyper& h, const c10::TensorOptions& o) : h_(h) {
    k_proj = register_module("k_proj", std::make_shared<Linear>(h.hidden, h.hidden, true, o));
    v_proj = register_module("v_proj", std::make_shared<Linear>(h.hidden, h.hidden, true, o));
    q_proj = register_module("q_proj", std::make_shared<Linear>(h.hidden, h.hidden, true, o));
    out_proj = register_module("out_proj", std::make_shared<Linear>(h.hidden, h.hidden, true, o));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.attention_dropout));
  }
  // (B, T, D) -> (B, T, D). allowed: boolean (B, 1, T, T), true = attend, or undefined (every position).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& allowed, bool training) const {
    const int64_t b = x.size(0), t = x.size(1);
    auto split = [&](const at::Tensor& y) { return y.view({b, t, h_.heads, h_.head_dim}).transpose(1, 2); };
    const at::Tensor q = split(q_proj->forward(x)), k = split(k_proj->forward(x)), v = split(v_proj->forward(x));
    const double scale = 1.0 / std::sqrt(static_cast<double>(h_.head_dim));
    at::Tensor out;
    if (dropout->explicit_attention(training)) {
      at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
      if (allowed.defined()) scores = scores + additive_mask(allowed, scores.scalar_type());
      const at::Tensor probabilities = at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
      out = at::matmul(dropout->attention(probabilities, true), v);  // (B, H, T, hd)
    } else {
      const std::optional<at::Tensor> mask = allowed.defined() ? std::optional<at::Tensor>(allowed) : std::nullopt;
      out = at::scaled_dot_product_attention(q, k, v, mask, dropout->sdpa_p(training), false, scale);
    }
    return out_proj->forward(out.transpose(1, 2).reshape({b, t, h_.hidden}));
  }
  std::shared_ptr<Linear> k_proj, v_proj, q_proj, out_proj;
  std::shared_ptr<Dropout> dropout;

 private:
  ClipTowerHyper h_;
};

class ClipMlp : public Module {
 public:
  ClipMlp(const ClipTowerHyper& h, const c10::TensorOptions& o) : act_(h.act) {
    fc1 = register_module("fc1", std::make_shared<Linear>(h.hidden, h.intermediate, true, o));
    fc2 = register_module("fc2", std::make_shared<Linear>(h.intermediate, h.hidden, true, o));
  }
  at::Tensor forward(const at::Tensor& x) const { return fc2->forward(activation(fc1->forward(x), act_)); }
  std::shared_ptr<Linear> fc1, fc2;

 private:
  std::string act_;
};

class ClipEncoderLayer : public Module {
 public:
  ClipEncoderLayer(const ClipTowerHyper& h, const c10::TensorOptions& o) : eps_(h.eps) {
    self_attn = register_module("self_attn", std::make_shared<ClipAttention>(h, o));
    layer_norm1 = register_module("layer_norm1", std::make_shared<ClipLayerNorm>(h.hidden, o));
    mlp = register_module("mlp", std::make_shared<ClipMlp>(h, o));
    layer_norm2 = register_module("layer_norm2", std::make_shared<ClipLayerNorm>(h.hidden, o));
  }
  // Pre-norm: x + attn(LN1(x)), then + mlp(LN2(.)). (B, T, D) -> (B, T, D)
  at::Tensor forward(const at::Tensor& x, const at::Tensor& allowed, bool training) const {
    const at::Tensor h = x + self_attn->forward(layer_norm1->forward(x, eps_), allowed, training);
    return h + mlp->forward(layer_norm2->forward(h, eps_));
  }
  std::shared_ptr<ClipAttention> self_attn;
  std::shared_ptr<ClipLayerNorm> layer_norm1, layer_norm2;
  std::shared_ptr<ClipMlp> mlp;

 private:
  double eps_;
};

class ClipLayers : public Module {
 public:
  void add(std::shared_ptr<ClipEncoderLayer> layer) {
    items.push_back(register_module(std::to_string(items.size()), std::move(layer)));
  }
  std::vector<std::shared_ptr<ClipEncoderLayer>> items;
};

// Runs a block with its module (the model's run_block: activation checkpointing, fully sharded units).
using LayerRunner = std::function<at::Tensor(const BlockFn&, const std::vector<at::Tensor>&, const Module*)>;

class ClipEncoder : public Module {
 public:
  ClipEncoder(const ClipTowerHyper& h, const c10::TensorOptions& o) {
    layers = register_module("layers", std::make_shared<ClipLayers>());
    for (int64_t i = 0; i < h.layers; ++i) layers->add(std::make_shared<ClipEncoderLayer>(h, o));
  }
  // Every block through `run`.
  at::Tensor forward(at::Tensor x, const at::Tensor& allowed, bool training, const LayerRunner& run) const {
    for (const auto& layer : layers->items) {
      BlockFn block = [layer, allowed, training](const std::vector<at::Tensor>& in) {
        return layer->forward(in[0], allowed, training);
      };
      x = run(block, {x}, layer.get());
    }
    return x;
  }
  void add_blocks(std::vector<const Module*>& out) const {
    for (const auto& layer : layers->items) out.push_back(layer.get());
  }
  std::shared_ptr<ClipLayers> layers;
};

class ClipVisionEmbeddings : public Module {
 public:
  ClipVisionEmbeddings(const ClipTowerHyper& h, const c10::TensorOptions& o) : h_(h) {
    const int64_t side = h.image_size / h.patch_size;
    class_embedding = at::empty({h.hidden}, o);
    register_parameter("class_embedding", &class_embedding);
    patch_embedding = register_module(
        "patch_embedding",
        std::make_shared<WeightHolder>(std::vector<int64_t>{h.hidden, h.channels, h.patch_size, h.patch_size}, o));
    position_embedding =
        register_module("position_embedding",
                        std::make_shared<WeightHolder>(std::vector<int64_t>{side * side + 1, h.hidden}, o));
  }

  // (B, C, H, W) -> (B, 1 + patches, D)
  at::Tensor forward(const at::Tensor& pixel_values) const {
    const at::Tensor& conv = patch_embedding->weight;
    const int64_t b = pixel_values.size(0), height = pixel_values.size(2), width = pixel_values.size(3);
    if (height % h_.patch_size != 0 || width % h_.patch_size != 0)
      throw UsageError("image of " + std::to_string(width) + " x " + std::to_string(height) +
                           " px is not a whole number of " + std::to_string(h_.patch_size) + " px patches",
                       "make the preprocessed size (preprocessor_config.json crop_size) a multiple of patch_size");
    const at::Tensor patches = at::conv2d(pixel_values.to(conv.scalar_type()), conv, {}, {h_.patch_size, h_.patch_size})
                                   .flatten(2)
                                   .transpose(1, 2);  // (B, patches, D), row by row
    // The parameters broadcast over the batch (no view of them), so that their gradients are always reduced into
    // fresh tensors: with one image a view's gradient would be the incoming gradient itself, and the autograd
    // engine would keep one buffer as the .grad of both the class and the position embeddings (accumulating a
    // second micro-batch into one would then corrupt the other).
    const at::Tensor x = at::cat({class_embedding.expand({b, 1, h_.hidden}), patches}, 1);
    return x + positions(height, width);
  }

  // The checkpoint's positions, or its patch grid resized bicubically (align_corners false) as transformers'
  // interpolate_pos_encoding does for another image size. (1 + patches, D)
  at::Tensor positions(int64_t height, int64_t width) const {
    const at::Tensor& table = position_embedding->weight;
    const int64_t stored = table.size(0) - 1;
    const int64_t wanted = (height / h_.patch_size) * (width / h_.patch_size);
    if (wanted == stored && height == width) return table;
    const auto side = static_cast<int64_t>(std::sqrt(static_cast<double>(stored)));
    const at::Tensor grid = table.slice(0, 1).reshape({1, side, side, h_.hidden}).permute({0, 3, 1, 2});
    const at::Tensor resized =
        at::upsample_bicubic2d(grid, {height / h_.patch_size, width / h_.patch_size}, /*align_corners=*/false);
    return at::cat({table.slice(0, 0, 1), resized.permute({0, 2, 3, 1}).reshape({-1, h_.hidden})}, 0);
  }

  at::Tensor class_embedding;
  std::shared_ptr<WeightHolder> patch_embedding, position_embedding;

 private:
  ClipTowerHyper h_;
};

class ClipTextEmbeddings : public Module {
 public:
  ClipTextEmbeddings(const ClipTowerHyper& h, const c10::TensorOptions& o) {
    token_embedding = register_module("token_embedding",
                                      std::make_shared<WeightHolder>(std::vector<int64_t>{h.vocab, h.hidden}, o));
    position_embedding = register_module(
        "position_embedding", std::make_shared<WeightHolder>(std::vector<int64_t>{h.max_positions, h.hidden}, o));
  }
  std::shared_ptr<WeightHolder> token_embedding, position_embedding;
};

// Normal(0, std) initialisation drawn in fp32 and converted, as transformers upcasts.
void normal_init(at::Tensor& t, double std) {
  t = at::empty(t.sizes(), t.options().dtype(at::kFloat)).normal_(0.0, std).to(t.options());
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// transformers' _init_weights for one tower's parameters (names relative to the tower).
void init_tower_parameter(const std::string& name, at::Tensor& p, const ClipTowerHyper& h) {
  const double f = h.initializer_factor, d = static_cast<double>(h.hidden);
  const double in_proj_std = std::pow(d, -0.5) * std::pow(2.0 * static_cast<double>(h.layers), -0.5) * f;
  const bool is_norm = name.find("layer_norm") != std::string::npos || name.find("layrnorm") != std::string::npos ||
                       name.find("layernorm") != std::string::npos;
  if (is_norm) {
    p = ends_with(name, ".bias") ? at::zeros_like(p) : at::ones_like(p);
  } else if (ends_with(name, ".bias")) {
    p = at::zeros_like(p);
  } else if (name.find("self_attn.out_proj.") != std::string::npos) {
    normal_init(p, std::pow(d, -0.5) * f);
  } else if (name.find("self_attn.") != std::string::npos || name.find("mlp.fc2.") != std::string::npos) {
    normal_init(p, in_proj_std);
  } else if (name.find("mlp.fc1.") != std::string::npos) {
    normal_init(p, std::pow(2.0 * d, -0.5) * f);
  } else if (ends_with(name, "class_embedding")) {
    normal_init(p, std::pow(d, -0.5) * f);
  } else if (name.find("token_embedding") != std::string::npos || h.image_size == 0) {
    normal_init(p, 0.02 * f);  // the text tower's embeddings
  } else {
    normal_init(p, h.initializer_range * f);  // the vision tower's patch and position embeddings
  }
}

// The weight files of a model directory and what each holds.
struct CheckpointIndex {
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<std::size_t, std::string>> where;  // checkpoint name -> (file, name)
};

CheckpointIndex open_checkpoint(const std::string& dir) {
  CheckpointIndex index;
  std::vector<std::string> paths;
  const fs::path root(dir), single = root / kWeightsFileName, sharded = root / kWeightsIndexName;
  if (fs::exists(single)) {
    paths.push_back(single.string());
  } else if (fs::exists(sharded)) {
    for (const auto& [name, file] : read_weight_map(sharded)) {
      const std::string path = (root / file).string();
      if (std::find(paths.begin(), paths.end(), path) == paths.end()) paths.push_back(path);
    }
  } else {
    throw DataError(dir + " holds no model.safetensors or model.safetensors.index.json",
                    "convert .bin weights with transformers' save_pretrained(safe_serialization=True), or set "
                    "model.init=random to start from config.json alone");
  }
  for (const auto& path : paths) index.files.push_back(SafetensorsFile::open(path));
  for (std::size_t f = 0; f < index.files.size(); ++f)
    for (const auto& tensor : index.files[f].tensors()) index.where[tensor.name] = {f, tensor.name};
  return index;
}

}  // namespace

// ----------------------------------------------------------------------------------------------------------------
// The towers

class ClipVisionTower : public Module {
 public:
  ClipVisionTower(const nlohmann::json& vision_config, const c10::TensorOptions& o) : hyper(vision_config, true) {
    embeddings = register_module("embeddings", std::make_shared<ClipVisionEmbeddings>(hyper, o));
    pre_layrnorm = register_module("pre_layrnorm", std::make_shared<ClipLayerNorm>(hyper.hidden, o));
    encoder = register_module("encoder", std::make_shared<ClipEncoder>(hyper, o));
    post_layernorm = register_module("post_layernorm", std::make_shared<ClipLayerNorm>(hyper.hidden, o));
  }
  // last_hidden_state (B, 1 + patches, D): the encoder's output, before post_layernorm.
  at::Tensor last_hidden_state(const at::Tensor& pixel_values, bool training, const LayerRunner& runner) const {
    const at::Tensor x = pre_layrnorm->forward(embeddings->forward(pixel_values), hyper.eps);
    return encoder->forward(x, {}, training, runner);
  }
  // pooler_output (B, D): post_layernorm of the class token.
  at::Tensor pooled(const at::Tensor& pixel_values, bool training, const LayerRunner& runner) const {
    return post_layernorm->forward(last_hidden_state(pixel_values, training, runner).select(1, 0), hyper.eps);
  }
  void init_weights() {
    at::NoGradGuard no_grad;
    for_each_parameter([&](const std::string& name, at::Tensor& p) { init_tower_parameter(name, p, hyper); });
  }

  ClipTowerHyper hyper;
  std::shared_ptr<ClipVisionEmbeddings> embeddings;
  std::shared_ptr<ClipLayerNorm> pre_layrnorm, post_layernorm;
  std::shared_ptr<ClipEncoder> encoder;
};

class ClipTextTower : public Module {
 public:
  ClipTextTower(const nlohmann::json& text_config, const c10::TensorOptions& o) : hyper(text_config, false) {
    embeddings = register_module("embeddings", std::make_shared<ClipTextEmbeddings>(hyper, o));
    encoder = register_module("encoder", std::make_shared<ClipEncoder>(hyper, o));
    final_layer_norm = register_module("final_layer_norm", std::make_shared<ClipLayerNorm>(hyper.hidden, o));
  }
  // pooler_output (B, D): final_layer_norm of the hidden state at the end-of-text token, found as transformers
  // does: the largest id for configs with eos_token_id 2 (written before the tokenizer's real id was stored),
  // else the first position holding eos_token_id (position 0 when a row has none).
  at::Tensor pooled(const at::Tensor& input_ids, const at::Tensor& attention_mask, bool training,
                    const LayerRunner& runner) const {
    const int64_t b = input_ids.size(0), t = input_ids.size(1);
    if (t > hyper.max_positions)
      throw UsageError("text of " + std::to_string(t) + " tokens is longer than the model's max_position_embeddings " +
                           std::to_string(hyper.max_positions),
                       "truncate captions to at most " + std::to_string(hyper.max_positions) + " tokens");
    const at::Tensor ids = input_ids.to(at::kLong);
    const at::Tensor x = at::embedding(embeddings->token_embedding->weight, ids) +
                         embeddings->position_embedding->weight.slice(0, 0, t);  // (B, T, D)
    const at::Tensor mask = attention_mask.defined() ? attention_mask : at::ones({b, t}, ids.options());
    const at::Tensor allowed = causal_mask(mask.to(ids.device()), t, 0, std::nullopt);  // (B, 1, T, T)
    const at::Tensor last = encoder->forward(x, allowed, training, runner);
    const at::Tensor position =
        hyper.eos == 2 ? ids.to(at::kInt).argmax(-1) : ids.eq(hyper.eos).to(at::kInt).argmax(-1);  // (B)
    const at::Tensor picked = last.gather(1, position.to(at::kLong).view({b, 1, 1}).expand({b, 1, last.size(2)}));
    return final_layer_norm->forward(picked.squeeze(1), hyper.eps);
  }
  void init_weights() {
    at::NoGradGuard no_grad;
    for_each_parameter([&](const std::string& name, at::Tensor& p) { init_tower_parameter(name, p, hyper); });
  }

  ClipTowerHyper hyper;
  std::shared_ptr<ClipTextEmbeddings> embeddings;
  std::shared_ptr<ClipEncoder> encoder;
  std::shared_ptr<ClipLayerNorm> final_layer_norm;
};

// ----------------------------------------------------------------------------------------------------------------
// The contrastive model

at::Tensor clip_contrastive_loss(const at::Tensor& image_features, const at::Tensor& text_features,
                                 const at::Tensor& logit_scale) {
  if (image_features.size(0) != text_features.size(0))
    throw UsageError("contrastive loss over " + std::to_string(image_features.size(0)) + " images and " +
                     std::to_string(text_features.size(0)) + " texts: the pairs must match one to one");
  const at::Tensor images = image_features.to(at::kFloat), texts = text_features.to(at::kFloat);
  const at::Tensor image_embeds = images / images.pow(2).sum(-1, true).pow(0.5);
  const at::Tensor text_embeds = texts / texts.pow(2).sum(-1, true).pow(0.5);
  const at::Tensor logits_per_text = at::matmul(text_embeds, image_embeds.t()) * logit_scale.to(at::kFloat).exp();
  const at::Tensor targets = at::arange(logits_per_text.size(0), logits_per_text.options().dtype(at::kLong));
  const at::Tensor caption_loss = at::cross_entropy_loss(logits_per_text, targets);
  const at::Tensor image_loss = at::cross_entropy_loss(logits_per_text.t(), targets);
  return (caption_loss + image_loss) / 2.0;
}

ClipModel::ClipModel(const nlohmann::json& config, const c10::TensorOptions& options) : config_(config) {
  projection_dim_ = hf::get_int(config, "projection_dim", 512);
  text_ = register_module("text_model", std::make_shared<ClipTextTower>(sub_config(config, "text_config"), options));
  vision_ = register_module("vision_model",
                            std::make_shared<ClipVisionTower>(sub_config(config, "vision_config"), options));
  visual_projection_ = at::empty({projection_dim_, vision_->hyper.hidden}, options);
  text_projection_ = at::empty({projection_dim_, text_->hyper.hidden}, options);
  logit_scale_ = at::full({}, hf::get_double(config, "logit_scale_init_value", 2.6592), options);
  register_parameter("visual_projection.weight", &visual_projection_);
  register_parameter("text_projection.weight", &text_projection_);
  register_parameter("logit_scale", &logit_scale_);
  assign_dropout_sites(*this);
}

const std::string& ClipModel::model_type() const {
  static const std::string type = "clip";
  return type;
}

std::vector<const Module*> ClipModel::blocks() const {
  std::vector<const Module*> out;
  vision_->encoder->add_blocks(out);
  text_->encoder->add_blocks(out);
  return out;
}

at::Tensor ClipModel::image_features(const at::Tensor& pixel_values) {
  const LayerRunner run = [this](const BlockFn& block, const std::vector<at::Tensor>& in, const Module* unit) {
    return run_block(block, in, unit);
  };
  return at::linear(vision_->pooled(pixel_values, is_training(), run), visual_projection_);
}

at::Tensor ClipModel::text_features(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  const LayerRunner run = [this](const BlockFn& block, const std::vector<at::Tensor>& in, const Module* unit) {
    return run_block(block, in, unit);
  };
  return at::linear(text_->pooled(input_ids, attention_mask, is_training(), run), text_projection_);
}

ClipOutput ClipModel::forward(const at::Tensor& pixel_values, const at::Tensor& input_ids,
                              const at::Tensor& attention_mask, bool return_loss) {
  const at::Tensor images = image_features(pixel_values), texts = text_features(input_ids, attention_mask);
  ClipOutput out;
  out.image_embeds = images / images.pow(2).sum(-1, true).pow(0.5);
  out.text_embeds = texts / texts.pow(2).sum(-1, true).pow(0.5);
  out.logits_per_text = at::matmul(out.text_embeds, out.image_embeds.t()) * logit_scale_.exp();
  out.logits_per_image = out.logits_per_text.t();
  if (return_loss) out.loss = clip_contrastive_loss(images, texts, logit_scale_);
  return out;
}

void ClipModel::clamp_logit_scale() {
  at::NoGradGuard no_grad;
  logit_scale_.clamp_(0.0, kClipMaxLogitScale);
}

void ClipModel::init_weights() {
  at::NoGradGuard no_grad;
  text_->init_weights();
  vision_->init_weights();
  const double f = hf::get_double(config_, "initializer_factor", 1.0);
  normal_init(visual_projection_, std::pow(static_cast<double>(vision_->hyper.hidden), -0.5) * f);
  normal_init(text_projection_, std::pow(static_cast<double>(text_->hyper.hidden), -0.5) * f);
  logit_scale_.fill_(hf::get_double(config_, "logit_scale_init_value", 2.6592));
}

int64_t ClipModel::image_size() const { return vision_->hyper.image_size; }
int64_t ClipModel::max_text_length() const { return text_->hyper.max_positions; }
int64_t ClipModel::eos_token_id() const { return text_->hyper.eos; }

// ----------------------------------------------------------------------------------------------------------------
// The classifier

nlohmann::json clip_classifier_config(const nlohmann::json& config) {
  const std::string type = hf::get_string(config, "model_type", "");
  if (type == "clip") return config;
  if (type != "clip_vision_model")
    throw DataError("config.json: model_type \"" + type + "\" is not a CLIP model",
                    "expected clip or clip_vision_model");
  // A vision tower's config becomes the vision_config of a CLIPConfig; the classes stay at the top level.
  nlohmann::json vision = config, out = nlohmann::json::object();
  out["model_type"] = "clip";
  for (const char* key : {"id2label", "label2id", "num_labels"}) {
    if (vision.contains(key)) {
      out[key] = vision[key];
      vision.erase(key);
    }
  }
  for (const char* key : {"architectures", "transformers_version", "dtype", "torch_dtype"}) vision.erase(key);
  if (vision.contains("projection_dim")) out["projection_dim"] = vision["projection_dim"];
  out["vision_config"] = vision;
  return out;
}

ClipVisionClassifier::ClipVisionClassifier(const nlohmann::json& config, const c10::TensorOptions& options)
    : config_(config) {
  labels_ = config_labels(config);
  num_labels_ = static_cast<int64_t>(labels_.size());
  if (num_labels_ < 2)
    throw DataError("config.json: an image classifier needs at least 2 classes, id2label/num_labels gives " +
                        std::to_string(num_labels_),
                    "one label is regression in transformers, which trainer does not train");
  vision_ = register_module("vision_model",
                            std::make_shared<ClipVisionTower>(sub_config(config, "vision_config"), options));
  classifier_weight_ = at::empty({num_labels_, vision_->hyper.hidden}, options);
  classifier_bias_ = at::zeros({num_labels_}, options);
  register_parameter("classifier.weight", &classifier_weight_);
  register_parameter("classifier.bias", &classifier_bias_);
  assign_dropout_sites(*this);
}

const std::string& ClipVisionClassifier::model_type() const {
  static const std::string type = "clip";
  return type;
}

int64_t ClipVisionClassifier::image_size() const { return vision_->hyper.image_size; }

std::vector<const Module*> ClipVisionClassifier::blocks() const {
  std::vector<const Module*> out;
  vision_->encoder->add_blocks(out);
  return out;
}

at::Tensor ClipVisionClassifier::features(const at::Tensor& pixel_values) {
  const LayerRunner run = [this](const BlockFn& block, const std::vector<at::Tensor>& in, const Module* unit) {
    return run_block(block, in, unit);
  };
  const at::Tensor last = vision_->last_hidden_state(pixel_values, is_training(), run);
  return last.slice(1, 1).mean(1);  // the patch tokens' mean, (B, D)
}

at::Tensor ClipVisionClassifier::head(const at::Tensor& features) const {
  return at::linear(features, classifier_weight_, classifier_bias_);
}

void ClipVisionClassifier::init_weights(bool head_only) {
  at::NoGradGuard no_grad;
  const double f = vision_->hyper.initializer_factor;
  normal_init(classifier_weight_, std::pow(static_cast<double>(vision_->hyper.hidden), -0.5) * f);
  classifier_bias_ = at::zeros_like(classifier_bias_);
  if (!head_only) vision_->init_weights();
}

void ClipVisionClassifier::set_labels(const std::vector<std::string>& labels, const c10::TensorOptions& options) {
  if (labels.size() < 2)
    throw DataError("an image classifier needs at least 2 classes, the data has " + std::to_string(labels.size()));
  labels_ = labels;
  num_labels_ = static_cast<int64_t>(labels.size());
  classifier_weight_ = at::empty({num_labels_, vision_->hyper.hidden}, options);
  classifier_bias_ = at::zeros({num_labels_}, options);
  write_label_maps(config_, labels);
}

// ----------------------------------------------------------------------------------------------------------------
// Loading and saving

namespace {

// Fills every parameter of `model` from the checkpoint tensor `source(name)` names, converted to options' dtype
// and moved to its device.
void fill_parameters(Module& model, const CheckpointIndex& checkpoint,
                     const std::map<std::string, std::string>& source, const c10::TensorOptions& options,
                     const std::string& skip_prefix = "") {
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (!skip_prefix.empty() && starts_with(name, skip_prefix)) return;
    const auto& [file, checkpoint_name] = checkpoint.where.at(source.at(name));
    at::Tensor loaded = checkpoint.files[file].load(checkpoint_name, dtype);
    p = options.device().is_cpu() ? loaded : loaded.to(options.device());
  });
}

nlohmann::json read_clip_config(const std::string& dir, bool classifier) {
  const std::string path = (fs::path(dir) / "config.json").string();
  const nlohmann::json config = read_json_file(path);
  const std::string type = hf::get_string(config, "model_type", "");
  if (type != "clip" && !(classifier && type == "clip_vision_model"))
    throw DataError(path + ": model_type \"" + type + "\" is not a CLIP model",
                    classifier ? "expected clip or clip_vision_model" : "expected clip (a CLIPModel directory)");
  return config;
}

}  // namespace

std::unique_ptr<ClipModel> load_clip(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                     uint64_t seed) {
  const nlohmann::json config = read_clip_config(dir, false);
  at::NoGradGuard no_grad;
  if (init == ModelInit::kRandom) {
    auto model = std::make_unique<ClipModel>(config, options.dtype(at::kFloat));
    at::manual_seed(seed);
    model->init_weights();
    model->for_each_parameter([&](const std::string&, at::Tensor& p) { p = p.to(options); });
    return model;
  }
  auto model = std::make_unique<ClipModel>(config, options.device(at::kMeta));
  const CheckpointIndex checkpoint = open_checkpoint(dir);
  ShapeMap expected, got;
  std::map<std::string, std::string> source;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    expected[name] = p.sizes().vec();
    source[name] = name;
  });
  for (std::size_t f = 0; f < checkpoint.files.size(); ++f)
    for (const auto& tensor : checkpoint.files[f].tensors())
      if (!ends_with(tensor.name, ".position_ids")) got[tensor.name] = tensor.shape;  // buffers older versions saved
  check_state_dict(expected, got, dir);
  fill_parameters(*model, checkpoint, source, options);
  return model;
}

void save_clip(ClipModel& model, const std::string& dir, uint64_t max_shard_bytes,
               const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
  save_module_weights(model, dir, max_shard_bytes, parameter, write);
  if (write) save_clip_config(model, dir);
}

void save_clip_config(const ClipModel& model, const std::string& dir) {
  fs::create_directories(dir);
  nlohmann::json config = model.hf_config();
  config["architectures"] = {"CLIPModel"};
  write_text_file((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

std::unique_ptr<ClipVisionClassifier> load_clip_classifier(const std::string& dir, ModelInit init,
                                                           const c10::TensorOptions& options, uint64_t seed,
                                                           const std::vector<std::string>& labels) {
  const nlohmann::json original = read_clip_config(dir, true);
  const bool vision_only = hf::get_string(original, "model_type", "") == "clip_vision_model";
  const nlohmann::json config = clip_classifier_config(original);
  at::NoGradGuard no_grad;
  if (init == ModelInit::kRandom) {
    auto model = std::make_unique<ClipVisionClassifier>(config, options.dtype(at::kFloat));
    initialise_randomly(*model, options, seed, labels);
    return model;
  }
  auto model = std::make_unique<ClipVisionClassifier>(config, options.device(at::kMeta));
  const CheckpointIndex checkpoint = open_checkpoint(dir);
  // Checkpoint names -> ours: "vision_model." and "classifier." as they are; a CLIPVisionModel saved by
  // transformers 5 has no "vision_model." prefix. The text tower, projections and logit_scale are not used.
  std::map<std::string, std::string> source;  // our name -> checkpoint name
  ShapeMap got;
  for (std::size_t f = 0; f < checkpoint.files.size(); ++f) {
    for (const auto& tensor : checkpoint.files[f].tensors()) {
      const std::string& name = tensor.name;
      if (ends_with(name, ".position_ids")) continue;
      std::string ours;
      if (starts_with(name, "vision_model.") || starts_with(name, "classifier.")) {
        ours = name;
      } else if (vision_only && !starts_with(name, "visual_projection.")) {
        ours = "vision_model." + name;
      } else {
        continue;  // text_model., text_projection., visual_projection., logit_scale
      }
      source[ours] = name;
      got[ours] = tensor.shape;
    }
  }
  const bool new_labels = !labels.empty() && labels != model->labels();
  const bool head_in_checkpoint = got.count("classifier.weight") && got.count("classifier.bias");
  if (new_labels) model->set_labels(labels, options.device(at::kMeta));
  const bool new_head = new_labels || !head_in_checkpoint;
  ShapeMap expected;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (new_head && starts_with(name, "classifier.")) return;
    expected[name] = p.sizes().vec();
  });
  if (new_head) {
    got.erase("classifier.weight");
    got.erase("classifier.bias");
  }
  check_state_dict(expected, got, dir);
  fill_parameters(*model, checkpoint, source, options, new_head ? "classifier." : "");
  if (new_head) {
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (starts_with(name, "classifier.")) p = at::empty(p.sizes(), options.dtype(at::kFloat));
    });
    at::manual_seed(seed);
    model->init_weights(/*head_only=*/true);
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (starts_with(name, "classifier.")) p = p.to(options);
    });
  }
  return model;
}

void save_clip_classifier(ClipVisionClassifier& model, const std::string& dir,
                          const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
  save_module_weights(model, dir, kDefaultMaxShardBytes, parameter, write);
  if (write) save_clip_classifier_config(model, dir);
}

void save_clip_classifier_config(const ClipVisionClassifier& model, const std::string& dir) {
  fs::create_directories(dir);
  nlohmann::json config = model.hf_config();
  config["architectures"] = {"CLIPForImageClassification"};
  write_label_maps(config, model.labels());
  write_text_file((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

}  // namespace trainer
