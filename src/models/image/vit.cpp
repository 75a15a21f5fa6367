// ViT image classification (see vit.h). Classes in dependency order; shapes in comments.
#include "models/image/vit.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

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
namespace {

struct VitHyper {
  int64_t hidden, heads, head_dim, intermediate, layers, image_size, patch_size, channels;
  double eps, initializer_range, hidden_dropout, attention_dropout;
  bool qkv_bias;
  std::string act;

  explicit VitHyper(const nlohmann::json& c) {
    hidden = hf::get_int(c, "hidden_size", 768);
    heads = hf::get_int(c, "num_attention_heads", 12);
    intermediate = hf::get_int(c, "intermediate_size", 3072);
    layers = hf::get_int(c, "num_hidden_layers", 12);
    image_size = hf::get_int(c, "image_size", 224);
    patch_size = hf::get_int(c, "patch_size", 16);
    channels = hf::get_int(c, "num_channels", 3);
    eps = hf::get_double(c, "layer_norm_eps", 1e-12);
    initializer_range = hf::get_double(c, "initializer_range", 0.02);
    hidden_dropout = hf::get_double(c, "hidden_dropout_prob", 0.0);
    attention_dropout = hf::get_double(c, "attention_probs_dropout_prob", 0.0);
    qkv_bias = hf::get_bool(c, "qkv_bias", true);
    act = hf::get_string(c, "hidden_act", "gelu");
    if (hidden <= 0 || heads <= 0 || hidden % heads != 0)
      throw DataError("config.json: hidden_size " + std::to_string(hidden) + " is not a multiple of num_attention_heads " +
                      std::to_string(heads));
    if (patch_size <= 0 || image_size % patch_size != 0)
      throw DataError("config.json: image_size " + std::to_string(image_size) + " is not a multiple of patch_size " +
                      std::to_string(patch_size));
    check_activation(act, "config.json: hidden_act");
    head_dim = hidden / heads;
  }
};

// A LayerNorm's weight and bias.
class LayerNormParams : public Module {
 public:
  LayerNormParams(int64_t dim, const c10::TensorOptions& o) {
    weight = at::ones({dim}, o);
    bias = at::zeros({dim}, o);
    register_parameter("weight", &weight);
    register_parameter("bias", &bias);
  }
  at::Tensor forward(const at::Tensor& x, double eps) const { return at::layer_norm(x, {weight.size(0)}, weight, bias, eps); }
  at::Tensor weight, bias;
};

// A module holding one Linear under a name ("output.dense", "intermediate.dense").
class DenseHolder : public Module {
 public:
  DenseHolder(int64_t in, int64_t out, const c10::TensorOptions& o) {
    dense = register_module("dense", std::make_shared<Linear>(in, out, true, o));
  }
  std::shared_ptr<Linear> dense;
};

class PatchEmbeddings : public Module {
 public:
  PatchEmbeddings(const VitHyper& h, const c10::TensorOptions& o) : patch_(h.patch_size) {
    projection = register_module("projection", std::make_shared<ConvParams>(h, o));
  }
  // (B, C, H, W) -> (B, H/P * W/P, D), patches row by row.
  at::Tensor forward(const at::Tensor& pixels) const {
    const at::Tensor x = at::conv2d(pixels, projection->weight, projection->bias, {patch_, patch_});
    return x.flatten(2).transpose(1, 2);
  }
  class ConvParams : public Module {
   public:
    ConvParams(const VitHyper& h, const c10::TensorOptions& o) {
      weight = at::empty({h.hidden, h.channels, h.patch_size, h.patch_size}, o);
      bias = at::zeros({h.hidden}, o);
      register_parameter("weight", &weight);
      register_parameter("bias", &bias);
    }
    at::Tensor weight, bias;
  };
  std::shared_ptr<ConvParams> projection;

 private:
  int64_t patch_;
};

class VitEmbeddings : public Module {
 public:
  VitEmbeddings(const VitHyper& h, const c10::TensorOptions& o) : h_(h) {
    const int64_t patches = (h.image_size / h.patch_size) * (h.image_size / h.patch_size);
    cls_token = at::zeros({1, 1, h.hidden}, o);
    position_embeddings = at::zeros({1, patches + 1, h.hidden}, o);
    register_parameter("cls_token", &cls_token);
    register_parameter("position_embeddings", &position_embeddings);
    patch_embeddings = register_module("patch_embeddings", std::make_shared<PatchEmbeddings>(h, o));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.hidden_dropout));
  }

  // (B, C, H, W) -> (B, 1 + patches, D)
  at::Tensor forward(const at::Tensor& pixels, bool training) const {
    const int64_t b = pixels.size(0), height = pixels.size(2), width = pixels.size(3);
    if (height % h_.patch_size != 0 || width % h_.patch_size != 0)
      throw UsageError("image of " + std::to_string(width) + " x " + std::to_string(height) +
                       " px is not a whole number of " + std::to_string(h_.patch_size) + " px patches",
                       "make the preprocessed size (preprocessor_config.json) a multiple of patch_size");
    const at::Tensor patches = patch_embeddings->forward(pixels);
    // Broadcast over the batch from (D) and (1 + patches, D), so that the parameters' gradients are always reduced
    // into fresh tensors: with one image the incoming gradient itself would become the .grad of both cls_token and
    // position_embeddings (one buffer), and accumulating a second micro-batch into one would corrupt the other.
    const at::Tensor x = at::cat({cls_token.squeeze(0).expand({b, 1, h_.hidden}), patches}, 1);
    return dropout->forward(x + positions(height, width).squeeze(0), training);
  }

  // The position embeddings for an image of height x width: the checkpoint's, or its patch grid resized
  // bicubically (align_corners false) as transformers' interpolate_pos_encoding does.
  at::Tensor positions(int64_t height, int64_t width) const {
    const int64_t stored = position_embeddings.size(1) - 1;
    const int64_t wanted = (height / h_.patch_size) * (width / h_.patch_size);
    if (wanted == stored && height == width) return position_embeddings;
    const auto side = static_cast<int64_t>(std::sqrt(static_cast<double>(stored)));
    const at::Tensor grid = position_embeddings.slice(1, 1).reshape({1, side, side, h_.hidden}).permute({0, 3, 1, 2});
    const at::Tensor resized = at::upsample_bicubic2d(grid, {height / h_.patch_size, width / h_.patch_size},
                                                      /*align_corners=*/false);
    return at::cat({position_embeddings.slice(1, 0, 1), resized.permute({0, 2, 3, 1}).reshape({1, -1, h_.hidden})}, 1);
  }

  at::Tensor cls_token, position_embeddings;
  std::shared_ptr<PatchEmbeddings> patch_embeddings;
  std::shared_ptr<Dropout> dropout;

 private:
  VitHyper h_;
};

class VitSelfAttention : public Module {
 public:
  VitSelfAttention(const VitHyper& h, const c10::TensorOptions& o) : h_(h) {
    query = register_module("query", std::make_shared<Linear>(h.hidden, h.hidden, h.qkv_bias, o));
    key = register_module("key", std::make_shared<Linear>(h.hidden, h.hidden, h.qkv_bias, o));
    value = register_module("value", std::make_shared<Linear>(h.hidden, h.hidden, h.qkv_bias, o));
    dropout = register_module("dropout", std::make_shared<Dropout>(h.attention_dropout));
  }
  // (B, T, D) -> (B, T, D), heads merged; no mask (every patch sees every patch).
  at::Tensor forward(const at::Tensor& x, bool training) const {
    const int64_t b = x.size(0), t = x.size(1);
    auto split = [&](const at::Tensor& y) { return y.view({b, t, h_.heads, h_.head_dim}).transpose(1, 2); };
    const at::Tensor q = split(query->forward(x)), k = split(key->forward(x)), v = split(value->forward(x));
    at::Tensor out;
    if (dropout->explicit_attention(training)) {
      const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(h_.head_dim)));
      const at::Tensor probabilities = at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type());
      out = at::matmul(dropout->attention(probabilities, true), v);  // (B, H, T, hd)
    } else {
      out = at::scaled_dot_product_attention(q, k, v, {}, dropout->sdpa_p(training));
    }
    return out.transpose(1, 2).reshape({b, t, h_.hidden});
  }
  std::shared_ptr<Linear> query, key, value;
  std::shared_ptr<Dropout> dropout;

 private:
  VitHyper h_;
};

class VitAttention : public Module {
 public:
  VitAttention(const VitHyper& h, const c10::TensorOptions& o) {
    attention = register_module("attention", std::make_shared<VitSelfAttention>(h, o));
    output = register_module("output", std::make_shared<DenseHolder>(h.hidden, h.hidden, o));
  }
  std::shared_ptr<VitSelfAttention> attention;
  std::shared_ptr<DenseHolder> output;
};

class VitLayer : public Module {
 public:
  VitLayer(const VitHyper& h, const c10::TensorOptions& o) : h_(h) {
    attention = register_module("attention", std::make_shared<VitAttention>(h, o));
    intermediate = register_module("intermediate", std::make_shared<DenseHolder>(h.hidden, h.intermediate, o));
    output = register_module("output", std::make_shared<DenseHolder>(h.intermediate, h.hidden, o));
    layernorm_before = register_module("layernorm_before", std::make_shared<LayerNormParams>(h.hidden, o));
    layernorm_after = register_module("layernorm_after", std::make_shared<LayerNormParams>(h.hidden, o));
    attention_dropout = register_module("attention_dropout", std::make_shared<Dropout>(h.hidden_dropout));
    mlp_dropout = register_module("mlp_dropout", std::make_shared<Dropout>(h.hidden_dropout));
  }
  // Pre-norm: x + attn(LN(x)), then + mlp(LN(.)). (B, T, D) -> (B, T, D)
  at::Tensor forward(const at::Tensor& x, bool training) const {
    const at::Tensor attended = attention->output->dense->forward(
        attention->attention->forward(layernorm_before->forward(x, h_.eps), training));
    const at::Tensor h = x + attention_dropout->forward(attended, training);
    const at::Tensor inner = activation(intermediate->dense->forward(layernorm_after->forward(h, h_.eps)), h_.act);
    return h + mlp_dropout->forward(output->dense->forward(inner), training);
  }
  std::shared_ptr<VitAttention> attention;
  std::shared_ptr<DenseHolder> intermediate, output;
  std::shared_ptr<LayerNormParams> layernorm_before, layernorm_after;
  std::shared_ptr<Dropout> attention_dropout, mlp_dropout;

 private:
  VitHyper h_;
};

class VitLayers : public Module {
 public:
  void add(std::shared_ptr<VitLayer> layer) { items.push_back(register_module(std::to_string(items.size()), layer)); }
  std::vector<std::shared_ptr<VitLayer>> items;
};

class VitEncoder : public Module {
 public:
  VitEncoder(const VitHyper& h, const c10::TensorOptions& o) {
    layer = register_module("layer", std::make_shared<VitLayers>());
    for (int64_t i = 0; i < h.layers; ++i) layer->add(std::make_shared<VitLayer>(h, o));
  }
  std::shared_ptr<VitLayers> layer;
};

void trunc_normal(at::Tensor& t, double std) {
  // HF's trunc_normal_(mean 0, std, a=-2, b=2): with std 0.02 the cut at +-2 (absolute) never binds in practice;
  // drawn in fp32 and converted, as HF upcasts.
  at::Tensor values = at::empty(t.sizes(), t.options().dtype(at::kFloat)).normal_(0.0, std).clamp_(-2.0, 2.0);
  t = values.to(t.options());
}

}  // namespace

class VitBody : public Module {
 public:
  VitBody(const VitHyper& h, const c10::TensorOptions& o) : hyper(h) {
    embeddings = register_module("embeddings", std::make_shared<VitEmbeddings>(h, o));
    encoder = register_module("encoder", std::make_shared<VitEncoder>(h, o));
    layernorm = register_module("layernorm", std::make_shared<LayerNormParams>(h.hidden, o));
  }
  VitHyper hyper;
  std::shared_ptr<VitEmbeddings> embeddings;
  std::shared_ptr<VitEncoder> encoder;
  std::shared_ptr<LayerNormParams> layernorm;
};

VitForImageClassification::VitForImageClassification(const nlohmann::json& config, const c10::TensorOptions& options)
    : config_(config) {
  const VitHyper h(config);
  image_size_ = h.image_size;
  labels_ = config_labels(config);
  num_labels_ = static_cast<int64_t>(labels_.size());
  // transformers treats one label as regression (MSE loss); a classifier needs two classes or more.
  if (num_labels_ < 2)
    throw DataError("config.json: an image classifier needs at least 2 classes, id2label/num_labels gives " +
                        std::to_string(num_labels_),
                    "one label is regression in transformers, which trainer does not train");
  vit_ = register_module("vit", std::make_shared<VitBody>(h, options));
  classifier_weight_ = at::empty({num_labels_, h.hidden}, options);
  classifier_bias_ = at::zeros({num_labels_}, options);
  register_parameter("classifier.weight", &classifier_weight_);
  register_parameter("classifier.bias", &classifier_bias_);
  assign_dropout_sites(*this);
}

at::Tensor VitForImageClassification::features(const at::Tensor& pixel_values) {
  const bool training = is_training();
  at::Tensor x = vit_->embeddings->forward(pixel_values.to(vit_->embeddings->cls_token.scalar_type()), training);
  for (const auto& layer : vit_->encoder->layer->items) {
    BlockFn block = [layer, training](const std::vector<at::Tensor>& in) { return layer->forward(in[0], training); };
    x = run_block(block, {x}, layer.get());
  }
  // Only the class token is read; LayerNorm is per position, so normalising it alone is the same numbers.
  return vit_->layernorm->forward(x.select(1, 0), vit_->hyper.eps);  // (B, D)
}

at::Tensor VitForImageClassification::head(const at::Tensor& features) const {
  return at::linear(features, classifier_weight_, classifier_bias_);
}

std::vector<const Module*> VitForImageClassification::blocks() const {
  std::vector<const Module*> out;
  for (const auto& layer : vit_->encoder->layer->items) out.push_back(layer.get());
  return out;
}

const std::string& VitForImageClassification::model_type() const {
  static const std::string type = "vit";
  return type;
}

void VitForImageClassification::init_weights(bool head_only) {
  at::NoGradGuard no_grad;
  const double std = vit_->hyper.initializer_range;
  trunc_normal(classifier_weight_, std);
  classifier_bias_ = at::zeros_like(classifier_bias_);
  if (head_only) return;
  for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (name.rfind("classifier.", 0) == 0) return;
    const bool is_norm = name.find("layernorm") != std::string::npos;
    const bool is_bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (is_norm) {
      p = is_bias ? at::zeros_like(p) : at::ones_like(p);
    } else if (is_bias) {
      p = at::zeros_like(p);
    } else {
      trunc_normal(p, std);  // Linear and Conv2d weights, cls_token, position_embeddings
    }
  });
}

void VitForImageClassification::set_labels(const std::vector<std::string>& labels, const c10::TensorOptions& options) {
  if (labels.size() < 2)
    throw DataError("an image classifier needs at least 2 classes, the data has " + std::to_string(labels.size()));
  labels_ = labels;
  num_labels_ = static_cast<int64_t>(labels.size());
  classifier_weight_ = at::empty({num_labels_, vit_->hyper.hidden}, options);
  classifier_bias_ = at::zeros({num_labels_}, options);
  write_label_maps(config_, labels);
}

namespace fs = std::filesystem;

std::unique_ptr<VitForImageClassification> load_vit(const std::string& dir, ModelInit init,
                                                    const c10::TensorOptions& options, uint64_t seed,
                                                    const std::vector<std::string>& labels) {
  // The weight files (the text models' inspect_model_dir knows only their model types).
  std::vector<std::string> weight_files;
  const fs::path root(dir), single = root / "model.safetensors", index = root / "model.safetensors.index.json";
  if (fs::exists(single)) {
    weight_files.push_back(single.string());
  } else if (fs::exists(index)) {
    for (const auto& [name, file] : read_weight_map(index)) {
      const std::string path = (root / file).string();
      if (std::find(weight_files.begin(), weight_files.end(), path) == weight_files.end()) weight_files.push_back(path);
    }
  }
  if (init == ModelInit::kPretrained && weight_files.empty())
    throw DataError(dir + " holds no model.safetensors or model.safetensors.index.json",
                    "convert .bin weights with transformers' save_pretrained(safe_serialization=True), or set "
                    "model.init=random to start from config.json alone");
  const nlohmann::json config = read_json_file((fs::path(dir) / "config.json").string());
  if (hf::get_string(config, "model_type", "") != "vit")
    throw DataError(dir + "/config.json: model_type \"" + hf::get_string(config, "model_type", "") +
                    "\" is not an image classifier this loader knows", "supported: vit");
  at::NoGradGuard no_grad;
  if (init == ModelInit::kRandom) {
    auto model = std::make_unique<VitForImageClassification>(config, options.dtype(at::kFloat));
    initialise_randomly(*model, options, seed, labels);
    return model;
  }
  auto model = std::make_unique<VitForImageClassification>(config, options.device(at::kMeta));
  // Checkpoint names: ViTForImageClassification's as they are; a ViTModel's get the "vit." prefix, its pooler
  // (unused by the classifier, as in transformers) is ignored.
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<std::size_t, std::string>> where;  // our name -> (file, checkpoint name)
  ShapeMap got;
  for (const auto& path : weight_files) files.push_back(SafetensorsFile::open(path));
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (const auto& tensor : files[f].tensors()) {
      std::string name = tensor.name;
      if (name.rfind("pooler.", 0) == 0 || name.rfind("vit.pooler.", 0) == 0) continue;
      if (name.rfind("vit.", 0) != 0 && name.rfind("classifier.", 0) != 0) name = "vit." + name;
      where[name] = {f, tensor.name};
      got[name] = tensor.shape;
    }
  }
  const bool new_labels = !labels.empty() && labels != model->labels();
  const bool head_in_checkpoint = where.count("classifier.weight") && where.count("classifier.bias");
  if (new_labels) model->set_labels(labels, options.device(at::kMeta));
  const bool new_head = new_labels || !head_in_checkpoint;
  ShapeMap expected;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (new_head && name.rfind("classifier.", 0) == 0) return;
    expected[name] = p.sizes().vec();
  });
  if (new_head) {
    got.erase("classifier.weight");
    got.erase("classifier.bias");
  }
  check_state_dict(expected, got, dir);
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (new_head && name.rfind("classifier.", 0) == 0) {
      p = at::empty(p.sizes(), options.dtype(at::kFloat));
      return;
    }
    const auto& [file, checkpoint_name] = where.at(name);
    at::Tensor loaded = files[file].load(checkpoint_name, dtype);
    p = options.device().is_cpu() ? loaded : loaded.to(options.device());
  });
  if (new_head) {
    at::manual_seed(seed);
    model->init_weights(/*head_only=*/true);
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (name.rfind("classifier.", 0) == 0) p = p.to(options);
    });
  }
  return model;
}

void save_vit(VitForImageClassification& model, const std::string& dir,
              const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
  save_module_weights(model, dir, /*max_shard_bytes=*/uint64_t{5} << 30, parameter, write);
  if (write) save_vit_config(model, dir);
}

void save_vit_config(const VitForImageClassification& model, const std::string& dir) {
  fs::create_directories(dir);
  nlohmann::json config = model.hf_config();
  config["architectures"] = {"ViTForImageClassification"};
  if (!config.contains("id2label")) write_label_maps(config, model.labels());
  write_text_file((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

}  // namespace trainer
