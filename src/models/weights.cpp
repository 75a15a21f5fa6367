// Loading and saving a model as a Hugging Face directory.
#include "models/weights.h"

#include <filesystem>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "trainer/errors.h"
#include "trainer/hf_weights.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

nlohmann::json read_config(const std::string& dir) {
  const auto path = fs::path(dir) / "config.json";
  std::ifstream file(path);
  if (!file) throw DataError("cannot open " + path.string(), "model.path must hold config.json");
  try {
    return nlohmann::json::parse(file);
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(path.string() + ": invalid JSON: " + e.what());
  }
}

}  // namespace

std::unique_ptr<LanguageModel> load_model(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                          uint64_t seed) {
  const auto info = inspect_model_dir(dir, init == ModelInit::kPretrained);
  auto model = build_model(read_config(dir), options);
  at::NoGradGuard no_grad;
  if (init == ModelInit::kRandom) {
    at::manual_seed(seed);
    // Initialise in fp32 and convert, so bf16 models start from the same numbers as fp32 ones.
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p = p.to(at::kFloat); });
    model->init_weights();
    model->for_each_parameter([&](const std::string&, at::Tensor& p) { p = p.to(options); });
    return model;
  }

  WeightSet weights = open_weights(info.weight_files);
  // A checkpoint with its own lm_head.weight has an untied head even where config.json says tied (transformers
  // does the same); one without it uses the embedding.
  if (model->lm_head_tied() && weights.contains("lm_head.weight")) model->untie_lm_head();

  std::map<std::string, std::string> alias_of;  // checkpoint alias -> our parameter
  for (const auto& [alias, canonical] : model->aliases()) alias_of[alias] = canonical;
  std::map<std::string, std::vector<int64_t>> expected;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) { expected[name] = p.sizes().vec(); });
  check_weight_names(weights, expected, alias_of, info.dir);

  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    p.copy_(weights.load(name, p.scalar_type()));  // one tensor at a time: peak memory is one tensor above the model
  });
  return model;
}

void save_model(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) { tensors.emplace_back(name, p.detach()); });
  save_weights(dir, tensors, max_shard_bytes);
  std::ofstream(fs::path(dir) / "config.json") << model.hf_config().dump(2) << "\n";
}

}  // namespace trainer
