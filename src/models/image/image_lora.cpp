// LoRA for image classifiers (see image_lora.h).
#include "models/image/image_lora.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "models/layers.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"
#include "util/strings.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

// A module's name as transformers (5) names it in memory, which is what PEFT's adapter files use. ViT's checkpoint
// names (ours) differ from its in-memory names; other classifiers keep theirs.
std::string peft_name(const std::string& model_type, std::string name) {
  if (model_type != "vit") return name;
  replace_all(name, "vit.encoder.layer.", "vit.layers.");
  replace_all(name, ".attention.attention.query", ".attention.q_proj");
  replace_all(name, ".attention.attention.key", ".attention.k_proj");
  replace_all(name, ".attention.attention.value", ".attention.v_proj");
  replace_all(name, ".attention.output.dense", ".attention.o_proj");
  replace_all(name, ".intermediate.dense", ".mlp.fc1");
  replace_all(name, ".output.dense", ".mlp.fc2");
  return name;
}

std::string head_module_of(const ImageClassifier& model) {
  std::string head = model.head_prefix();
  if (!head.empty() && head.back() == '.') head.pop_back();
  return head;
}

}  // namespace

std::vector<std::string> default_image_lora_targets(const ImageClassifier& model) {
  if (model.model_type() == "vit") return {"query", "value"};
  return {"q_proj", "v_proj"};  // CLIP's names, as PEFT's default for CLIP
}

void add_lora_layers(LoraAdapters& adapters, const std::vector<std::pair<std::string, Linear*>>& layers,
                     const LoraConfig& config, uint64_t seed) {
  const double scaling = lora_scaling(config.alpha, config.r, config.rslora);
  at::Generator generator = at::detail::createCPUGenerator(seed);
  at::NoGradGuard no_grad;
  for (const auto& [path, linear] : layers) {
    auto layer = std::make_shared<LoraLinear>(*linear, config.r, scaling, config.dropout);
    // PEFT's reset_lora_parameters: kaiming_uniform_(a=sqrt(5)) on A (bound 1/sqrt(in)), B zero.
    const double bound = 1.0 / std::sqrt(static_cast<double>(layer->lora_A.size(1)));
    at::Tensor a = at::empty(layer->lora_A.sizes(), at::TensorOptions().dtype(at::kFloat));
    a.uniform_(-bound, bound, generator);
    layer->lora_A.copy_(a);
    adapters.add(path, std::move(layer));
  }
}

ImageLoraAdapters::ImageLoraAdapters(LoraConfig config, ImageClassifier& model)
    : LoraAdapters(std::move(config)), head_module_(head_module_of(model)) {
  const std::string prefix = model.head_prefix();
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (name.starts_with(prefix)) register_parameter(name, &p);  // the model's own slot: trained in place
  });
}

std::unique_ptr<ImageLoraAdapters> apply_image_lora(ImageClassifier& model, const LoraConfig& config, uint64_t seed) {
  LoraConfig applied = config;
  applied.enabled = true;
  if (applied.target_modules.empty()) applied.target_modules = default_image_lora_targets(model);
  const std::string head = model.head_prefix();
  std::vector<std::pair<std::string, Linear*>> selected;
  std::vector<bool> matched(applied.target_modules.size(), false);
  model.for_each_module([&](const std::string& name, Module& m) {
    if (name.starts_with(head)) return;
    auto* linear = dynamic_cast<Linear*>(&m);
    if (!linear) return;
    bool selects = false;
    for (std::size_t i = 0; i < applied.target_modules.size(); ++i) {
      const auto& t = applied.target_modules[i];
      if (name == t || name.ends_with("." + t)) selects = matched[i] = true;
    }
    if (selects) selected.emplace_back(name, linear);
  });
  std::string unmatched;
  for (std::size_t i = 0; i < matched.size(); ++i)
    if (!matched[i]) unmatched += (unmatched.empty() ? "" : ", ") + applied.target_modules[i];
  if (!unmatched.empty())
    throw UsageError("lora.target_modules: " + unmatched + " match no linear layer of the " + model.model_type() +
                         " backbone",
                     model.model_type() == "vit"
                         ? "ViT's layers: query, key, value, attention.output.dense, intermediate.dense, output.dense "
                           "(`trainer inspect MODEL_DIR` lists the parts)"
                         : "CLIP's layers: q_proj, k_proj, v_proj, out_proj (attention), fc1, fc2 (MLP) "
                           "(`trainer inspect MODEL_DIR` lists the parts)");
  {
    at::NoGradGuard no_grad;
    model.for_each_parameter([&](const std::string& name, at::Tensor& p) { p.requires_grad_(name.starts_with(head)); });
  }
  auto adapters = std::make_unique<ImageLoraAdapters>(applied, model);
  add_lora_layers(*adapters, selected, config, seed);
  return adapters;
}

void write_image_adapter(const std::string& dir, const ImageLoraAdapters& adapters, const ImageClassifier& model,
                         const std::string& base_model_name_or_path) {
  const auto& c = adapters.config();
  const std::string type = model.model_type();
  std::set<std::string> targets;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [path, layer] : adapters.layers()) {
    const std::string name = peft_name(type, path);
    targets.insert(last_name(name));
    tensors.emplace_back(std::string(kPeftKeyPrefix) + name + ".lora_A.weight", layer->lora_A.detach().contiguous());
    tensors.emplace_back(std::string(kPeftKeyPrefix) + name + ".lora_B.weight", layer->lora_B.detach().contiguous());
  }
  const std::string head = model.head_prefix();
  const_cast<ImageClassifier&>(model).for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (name.starts_with(head)) tensors.emplace_back(std::string(kPeftKeyPrefix) + name, p.detach().to(at::kFloat).contiguous());
  });
  const nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", nullptr},
      {"base_model_name_or_path", base_model_name_or_path},
      {"revision", nullptr},
      {"inference_mode", true},
      {"r", c.r},
      {"lora_alpha", c.alpha},
      {"lora_dropout", c.dropout},
      {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
      {"use_rslora", c.rslora},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"modules_to_save", {adapters.head_module()}},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"use_dora", false},
  };
  fs::create_directories(dir);
  write_safetensors((fs::path(dir) / kAdapterWeightsName).string(), tensors, {});
  write_text_file((fs::path(dir) / kAdapterConfigName).string(), config.dump(2) + "\n");
}

void load_image_adapter(const std::string& dir, ImageLoraAdapters& adapters, ImageClassifier& model) {
  const std::string path = (fs::path(dir) / kAdapterWeightsName).string();
  const auto file = SafetensorsFile::open(path);
  auto fetch = [&](const std::string& name, at::Tensor& into) {
    if (!file.find(name)) throw DataError(path + ": no tensor " + name, "resume from a checkpoint of this LoRA run");
    const at::Tensor t = file.load(name, at::kFloat);
    if (!t.sizes().equals(into.sizes()))
      throw DataError(path + ": " + name + " has another shape than this run's", "resume with the same lora settings");
    at::NoGradGuard no_grad;
    into.copy_(t);
  };
  const std::string type = model.model_type();
  for (const auto& [module, layer] : adapters.layers()) {
    const std::string name = std::string(kPeftKeyPrefix) + peft_name(type, module);
    fetch(name + ".lora_A.weight", layer->lora_A);
    fetch(name + ".lora_B.weight", layer->lora_B);
  }
  const std::string head = model.head_prefix();
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (name.starts_with(head)) fetch(std::string(kPeftKeyPrefix) + name, p);
  });
}

}  // namespace trainer
