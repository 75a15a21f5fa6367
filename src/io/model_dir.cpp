// Looks at a Hugging Face model directory without loading any weights.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"
#include "trainer/hf_weights.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;

const std::vector<std::pair<std::string, std::string>>& supported_model_types() {
  static const std::vector<std::pair<std::string, std::string>> types = {
      {"t5", "seq2seq"},      {"llama", "causal"},   {"qwen2", "causal"},  {"mistral", "causal"},
      {"qwen3", "causal"},    {"smollm3", "causal"}, {"olmo2", "causal"},  {"granite", "causal"},
      {"gemma2", "causal"},   {"gemma3_text", "causal"}, {"gemma3", "causal"},
      {"gemma4_text", "causal"}, {"gemma4", "causal"}, {"phi3", "causal"},
      {"qwen3_moe", "causal"},   {"mixtral", "causal"},   {"qwen2_moe", "causal"}, {"olmoe", "causal"}};
  return types;
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw DataError("cannot open " + path);
  try {
    return nlohmann::json::parse(file);
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(path + ": invalid JSON: " + e.what());
  }
}

ModelDirInfo inspect_model_dir(const std::string& dir, bool need_weights) {
  const fs::path root(dir);
  if (!fs::is_directory(root))
    throw DataError("model directory " + dir + " does not exist",
                    "model.path must name a Hugging Face model directory (the one save_pretrained writes)");
  const fs::path config_path = root / "config.json";
  if (!fs::exists(config_path))
    throw DataError(config_path.string() + " is missing",
                    fs::exists(root / "adapter_config.json")
                        ? "this is a LoRA adapter, not a model: `trainer merge --adapter " + dir +
                              " --output DIR` writes the base model with it merged"
                        : "a Hugging Face model directory holds config.json");
  const auto config = read_json_file(config_path.string());

  ModelDirInfo info;
  info.dir = dir;
  if (!config.is_object() || !config.contains("model_type") || !config["model_type"].is_string())
    throw DataError(config_path.string() + ": no \"model_type\" string", "is this a transformers config.json?");
  info.model_type = config["model_type"].get<std::string>();
  std::string names;
  for (const auto& [type, family] : supported_model_types()) {
    names += (names.empty() ? "" : ", ") + type;
    if (type == info.model_type) info.family = family;
  }
  if (info.family.empty())
    throw DataError(config_path.string() + ": model_type \"" + info.model_type + "\" is not supported",
                    "supported model types: " + names);

  const fs::path single = root / "model.safetensors";
  const fs::path index = root / "model.safetensors.index.json";
  if (fs::exists(single)) {
    info.weight_files.push_back(single.string());
  } else if (fs::exists(index)) {
    for (const auto& [name, file] : read_weight_map(index)) {
      const auto path = (root / file).string();
      if (std::find(info.weight_files.begin(), info.weight_files.end(), path) == info.weight_files.end())
        info.weight_files.push_back(path);
    }
  }
  for (const auto& file : info.weight_files) {
    if (!fs::exists(file)) throw DataError("weight file " + file + " is missing", "copy the whole model directory");
    info.weight_bytes += fs::file_size(file);
  }
  if (need_weights && info.weight_files.empty())
    throw DataError(dir + " holds no model.safetensors or model.safetensors.index.json",
                    "convert .bin weights with transformers' save_pretrained(safe_serialization=True), or set "
                    "model.init=random to start from config.json alone");
  for (const char* name : {"tokenizer.json", "spiece.model", "tokenizer.model"})
    if (info.tokenizer_file.empty() && fs::exists(root / name)) info.tokenizer_file = (root / name).string();
  return info;
}

void copy_tokenizer_files(const std::string& from_dir, const std::string& to_dir) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                           "spiece.model", "tokenizer.model", "generation_config.json"}) {
    const fs::path from = fs::path(from_dir) / name;
    if (fs::exists(from)) fs::copy_file(from, fs::path(to_dir) / name, fs::copy_options::overwrite_existing);
  }
}

}  // namespace trainer
