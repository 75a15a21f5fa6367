// PEFT adapter files (see trainer/peft.h). Field names and meanings follow PEFT's LoraConfig
// (peft/tuners/lora/config.py) and its save_pretrained, which strips the adapter name from the saved keys.
#include "trainer/peft.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

constexpr const char* kSuffixA = ".lora_A.weight";
constexpr const char* kSuffixB = ".lora_B.weight";

// A number as PEFT writes it: an integer when it is one (lora_alpha 16, not 16.0).
nlohmann::json number(double value) {
  if (std::nearbyint(value) == value && std::abs(value) < 1e15) return static_cast<int64_t>(value);
  return value;
}

bool is_null_or_empty(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return true;
  const auto& value = config[key];
  return value.is_null() || ((value.is_array() || value.is_object() || value.is_string()) && value.empty());
}

bool is_true(const nlohmann::json& config, const char* key) {
  return config.contains(key) && config[key].is_boolean() && config[key].get<bool>();
}

double get_number(const nlohmann::json& config, const char* key, double fallback, const std::string& file) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  if (!config[key].is_number()) throw DataError(file + ": \"" + key + "\" must be a number, got " + config[key].dump());
  return config[key].get<double>();
}

std::string get_string(const nlohmann::json& config, const char* key, const std::string& file) {
  if (!config.contains(key) || config[key].is_null()) return {};
  if (!config[key].is_string()) throw DataError(file + ": \"" + key + "\" must be a string, got " + config[key].dump());
  return config[key].get<std::string>();
}

PeftLoraConfig parse_config(const nlohmann::json& c, const std::string& file) {
  if (!c.is_object()) throw DataError(file + ": not a JSON object");
  const std::string peft_type = get_string(c, "peft_type", file);
  if (peft_type != "LORA")
    throw DataError(file + ": peft_type is \"" + peft_type + "\"; trainer reads LoRA adapters only",
                    "load this adapter with PEFT itself, or train a LoRA adapter (peft_type LORA)");
  // Features that change what the adapter computes or what its file holds: refuse rather than load them wrongly.
  std::vector<std::string> unsupported;
  if (is_true(c, "use_dora")) unsupported.push_back("use_dora=true (DoRA)");
  if (is_true(c, "lora_bias")) unsupported.push_back("lora_bias=true");
  if (is_true(c, "fan_in_fan_out")) unsupported.push_back("fan_in_fan_out=true (GPT-2 Conv1D layers)");
  if (c.contains("bias") && !c["bias"].is_null() && c["bias"] != "none")
    unsupported.push_back("bias=" + c["bias"].dump());
  for (const char* key : {"modules_to_save", "alpha_pattern", "layer_replication", "trainable_token_indices",
                          "alora_invocation_tokens"})
    if (!is_null_or_empty(c, key)) unsupported.push_back(std::string(key) + "=" + c[key].dump());
  if (!unsupported.empty()) {
    std::string list;
    for (const auto& u : unsupported) list += (list.empty() ? "" : ", ") + u;
    throw DataError(file + ": this adapter uses PEFT features trainer does not implement: " + list,
                    "trainer reads plain LoRA adapters (bias \"none\", no DoRA, no modules_to_save)");
  }

  PeftLoraConfig config;
  config.task_type = get_string(c, "task_type", file);
  config.base_model_name_or_path = get_string(c, "base_model_name_or_path", file);
  config.revision = get_string(c, "revision", file);
  const double r = get_number(c, "r", 8, file);
  if (r < 1 || std::nearbyint(r) != r) throw DataError(file + ": \"r\" must be a positive integer, got " + c["r"].dump());
  config.r = static_cast<int64_t>(r);
  config.lora_alpha = get_number(c, "lora_alpha", 8, file);
  config.lora_dropout = get_number(c, "lora_dropout", 0.0, file);
  if (config.lora_dropout < 0 || config.lora_dropout >= 1)
    throw DataError(file + ": \"lora_dropout\" must be in [0, 1), got " + std::to_string(config.lora_dropout));
  if (c.contains("use_rslora") && !c["use_rslora"].is_null()) {
    if (!c["use_rslora"].is_boolean()) throw DataError(file + ": \"use_rslora\" must be true or false");
    config.use_rslora = c["use_rslora"].get<bool>();
  }
  if (c.contains("target_modules")) {
    const auto& targets = c["target_modules"];
    if (targets.is_string()) {
      config.target_modules.push_back(targets.get<std::string>());
      config.target_modules_regex = true;
    } else if (targets.is_array()) {
      for (const auto& t : targets) {
        if (!t.is_string()) throw DataError(file + ": \"target_modules\" must hold strings, got " + t.dump());
        config.target_modules.push_back(t.get<std::string>());
      }
    } else if (!targets.is_null()) {
      throw DataError(file + ": \"target_modules\" must be a list of names or a regular expression");
    }
  }
  if (c.contains("target_parameters") && !c["target_parameters"].is_null()) {
    const auto& targets = c["target_parameters"];
    if (!targets.is_array())  // PEFT itself does not implement the regular-expression form
      throw DataError(file + ": \"target_parameters\" must be a list of parameter names, got " + targets.dump());
    for (const auto& t : targets) {
      if (!t.is_string()) throw DataError(file + ": \"target_parameters\" must hold strings, got " + t.dump());
      config.target_parameters.push_back(t.get<std::string>());
    }
  }
  return config;
}

}  // namespace

bool is_peft_adapter_dir(const std::string& dir) { return fs::exists(fs::path(dir) / kAdapterConfigName); }

void write_peft_adapter(const std::string& dir, const PeftAdapter& adapter) {
  const auto& c = adapter.config;
  const nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", c.task_type.empty() ? nlohmann::json() : nlohmann::json(c.task_type)},
      {"base_model_name_or_path", c.base_model_name_or_path},
      {"revision", c.revision.empty() ? nlohmann::json() : nlohmann::json(c.revision)},
      {"inference_mode", true},
      {"r", c.r},
      {"lora_alpha", number(c.lora_alpha)},
      {"lora_dropout", c.lora_dropout},
      {"target_modules", c.target_modules_regex && c.target_modules.size() == 1 ? nlohmann::json(c.target_modules[0])
                                                                                : nlohmann::json(c.target_modules)},
      {"target_parameters", c.target_parameters.empty() ? nlohmann::json() : nlohmann::json(c.target_parameters)},
      {"use_rslora", c.use_rslora},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"use_dora", false},
      {"lora_bias", false},
  };
  fs::create_directories(dir);
  NamedTensors tensors;
  for (const auto& [module, weights] : adapter.modules) {
    tensors.emplace_back(kPeftKeyPrefix + module + kSuffixA, weights.lora_A.detach());
    tensors.emplace_back(kPeftKeyPrefix + module + kSuffixB, weights.lora_B.detach());
  }
  write_safetensors((fs::path(dir) / kAdapterWeightsName).string(), tensors, {});
  const fs::path config_path = fs::path(dir) / kAdapterConfigName;
  const fs::path temp = config_path.string() + ".tmp";
  {
    std::ofstream out(temp);
    out << config.dump(2) << "\n";
    if (!out) throw DataError("cannot write " + temp.string(), "is the output directory writable and not full?");
  }
  fs::rename(temp, config_path);
}

PeftAdapter read_peft_adapter(const std::string& dir) {
  const fs::path config_path = fs::path(dir) / kAdapterConfigName;
  const fs::path weights_path = fs::path(dir) / kAdapterWeightsName;
  if (!fs::exists(config_path))
    throw DataError(config_path.string() + " is missing",
                    "an adapter directory holds adapter_config.json and adapter_model.safetensors (PEFT's "
                    "save_pretrained, or trainer with lora.enabled=true)");
  if (!fs::exists(weights_path))
    throw DataError(weights_path.string() + " is missing",
                    fs::exists(fs::path(dir) / "adapter_model.bin")
                        ? "this adapter was saved as adapter_model.bin (pickle); re-save it with PEFT's "
                          "save_pretrained(..., safe_serialization=True)"
                        : "an adapter directory holds adapter_config.json and adapter_model.safetensors");
  PeftAdapter adapter;
  adapter.config = parse_config(read_json_file(config_path.string()), config_path.string());

  const auto file = SafetensorsFile::open(weights_path.string());
  const std::string where = weights_path.string();
  std::vector<std::string> unexpected;
  for (const auto& info : file.tensors()) {
    const std::string& key = info.name;
    const bool is_a = key.ends_with(kSuffixA), is_b = key.ends_with(kSuffixB);
    if (!key.starts_with(kPeftKeyPrefix) || !(is_a || is_b)) {
      unexpected.push_back(key);
      continue;
    }
    const std::size_t prefix = std::string(kPeftKeyPrefix).size();
    const std::string module = key.substr(prefix, key.size() - prefix - std::string(kSuffixA).size());
    if (info.shape.size() != 2)
      throw DataError(where + ": " + key + " has " + std::to_string(info.shape.size()) + " dimensions; LoRA weights have 2");
    auto& weights = adapter.modules[module];
    (is_a ? weights.lora_A : weights.lora_B) = file.load(key, at::kFloat);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unexpected.size() && i < 8; ++i) list += "\n  " + unexpected[i];
    if (unexpected.size() > 8) list += "\n  ... (" + std::to_string(unexpected.size() - 8) + " more)";
    throw DataError(where + ": " + std::to_string(unexpected.size()) +
                        " tensor(s) are not LoRA weights (base_model.model.<module>.lora_A/lora_B.weight):" + list,
                    "trainer loads plain LoRA adapters on linear layers (no embedding adapters, no modules_to_save)");
  }
  if (adapter.modules.empty()) throw DataError(where + ": no LoRA weights in the file");
  for (const auto& [module, weights] : adapter.modules) {
    if (!weights.lora_A.defined() || !weights.lora_B.defined())
      throw DataError(where + ": " + module + " has " + (weights.lora_A.defined() ? "lora_A" : "lora_B") +
                      " but not " + (weights.lora_A.defined() ? "lora_B" : "lora_A"),
                      "the file is incomplete; save the adapter again");
    if (weights.lora_A.size(0) != weights.lora_B.size(1))
      throw DataError(where + ": " + module + ": lora_A is " + std::to_string(weights.lora_A.size(0)) + " x " +
                      std::to_string(weights.lora_A.size(1)) + " but lora_B is " + std::to_string(weights.lora_B.size(0)) +
                      " x " + std::to_string(weights.lora_B.size(1)) + "; their ranks differ");
  }
  return adapter;
}

}  // namespace trainer
