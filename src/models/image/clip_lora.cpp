// LoRA on CLIPModel (see clip_lora.h).
#include "models/image/clip_lora.h"

#include <filesystem>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "models/image/clip.h"
#include "models/image/image_lora.h"
#include "models/layers.h"
#include "trainer/errors.h"
#include "trainer/peft.h"
#include "trainer/safetensors.h"
#include "util/strings.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

// Escapes a module's last name for a regular expression (names are identifiers, but stay safe).
std::string regex_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::unique_ptr<ClipLoraAdapters> apply_clip_lora(ClipModel& model, const LoraConfig& config, uint64_t seed,
                                                  bool vision, bool text) {
  if (!vision && !text)
    throw UsageError("LoRA on CLIP with neither tower chosen adapts nothing", "choose the vision tower, the text "
                                                                              "tower or both");
  if (config.base_in_bf16)
    throw UsageError("lora.base_in_bf16 is not supported for CLIP", "set lora.base_in_bf16=false (use "
                                                                    "precision.mode=bf16-mixed to save activation "
                                                                    "memory)");
  LoraConfig applied = config;
  applied.enabled = true;
  if (applied.target_modules.empty()) applied.target_modules = {"q_proj", "v_proj"};
  std::vector<std::pair<std::string, Linear*>> selected;
  std::vector<bool> matched(applied.target_modules.size(), false);
  model.for_each_module([&](const std::string& name, Module& m) {
    const bool in_vision = name.starts_with("vision_model."), in_text = name.starts_with("text_model.");
    if (!((vision && in_vision) || (text && in_text))) return;
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
    throw UsageError("lora.target_modules: " + unmatched + " match no linear layer of CLIP's " +
                         (vision && text ? "towers" : vision ? "vision tower" : "text tower"),
                     "CLIP's layers: q_proj, k_proj, v_proj, out_proj (attention), fc1, fc2 (MLP)");
  {
    at::NoGradGuard no_grad;
    model.for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(false); });
  }
  auto adapters = std::make_unique<ClipLoraAdapters>(applied, vision, text);
  add_lora_layers(*adapters, selected, applied, seed);
  return adapters;
}

void write_clip_adapter(const std::string& dir, const ClipLoraAdapters& adapters,
                        const std::string& base_model_name_or_path) {
  const auto& c = adapters.config();
  std::set<std::string> targets;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [path, layer] : adapters.layers()) {
    targets.insert(last_name(path));
    tensors.emplace_back(std::string(kPeftKeyPrefix) + path + ".lora_A.weight", layer->lora_A.detach().contiguous());
    tensors.emplace_back(std::string(kPeftKeyPrefix) + path + ".lora_B.weight", layer->lora_B.detach().contiguous());
  }
  nlohmann::json target_modules;
  if (adapters.vision() && adapters.text()) {
    target_modules = std::vector<std::string>(targets.begin(), targets.end());
  } else {
    // One tower: PEFT full-matches a string against each module's name.
    std::string names;
    for (const auto& t : targets) names += (names.empty() ? "" : "|") + regex_escape(t);
    target_modules = std::string(adapters.vision() ? "vision_model" : "text_model") + "\\..*\\.(" + names + ")";
  }
  const nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", nullptr},
      {"base_model_name_or_path", base_model_name_or_path},
      {"revision", nullptr},
      {"inference_mode", true},
      {"r", c.r},
      {"lora_alpha", c.alpha},
      {"lora_dropout", c.dropout},
      {"target_modules", target_modules},
      {"use_rslora", c.rslora},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
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

void load_clip_adapter(const std::string& dir, ClipLoraAdapters& adapters) {
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
  for (const auto& [module, layer] : adapters.layers()) {
    fetch(std::string(kPeftKeyPrefix) + module + ".lora_A.weight", layer->lora_A);
    fetch(std::string(kPeftKeyPrefix) + module + ".lora_B.weight", layer->lora_B);
  }
}

}  // namespace trainer
