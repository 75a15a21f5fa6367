// Loading and saving a model as a Hugging Face directory.
#include "models/weights.h"

#include <filesystem>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "trainer/errors.h"
#include "trainer/hf_weights.h"
#include "trainer/safetensors.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;


std::unique_ptr<LanguageModel> load_model(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                          uint64_t seed) {
  const auto info = inspect_model_dir(dir, init == ModelInit::kPretrained);
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  const auto device = options.device();
  at::NoGradGuard no_grad;
  if (init == ModelInit::kRandom) {
    // Initialise in fp32 and convert, so bf16 models start from the same numbers as fp32 ones.
    auto model = build_model(read_json_file((fs::path(dir) / "config.json").string()), options.dtype(at::kFloat));
    at::manual_seed(seed);
    model->init_weights();
    model->for_each_parameter([&](const std::string&, at::Tensor& p) { p = p.to(options); });
    return model;
  }
  auto model = build_model(read_json_file((fs::path(dir) / "config.json").string()), options.device(at::kMeta));

  // Every tensor's file and shape from the headers alone (no data read yet).
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<std::size_t, const TensorInfo*>> where;  // name -> (file, tensor)
  for (const auto& path : info.weight_files) files.push_back(SafetensorsFile::open(path));
  ShapeMap got;
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (const auto& tensor : files[f].tensors()) {
      if (where.count(tensor.name))
        throw DataError(tensor.name + " is in both " + files[where[tensor.name].first].path() + " and " +
                        files[f].path());
      where[tensor.name] = {f, &tensor};
      got[tensor.name] = tensor.shape;
    }
  }
  // A checkpoint with its own lm_head.weight has an untied head even where config.json says tied (transformers
  // does the same); one without it uses the embedding.
  if (model->lm_head_tied() && where.count("lm_head.weight")) model->untie_lm_head();
  // Tied aliases (older T5 checkpoints repeat shared.weight as encoder/decoder.embed_tokens.weight) stand for
  // their canonical parameter when that is missing, and are ignored when it is there.
  for (const auto& [alias, canonical] : model->aliases()) {
    auto it = where.find(alias);
    if (it == where.end()) continue;
    if (!where.count(canonical)) {
      where[canonical] = it->second;
      got[canonical] = got[alias];
    }
    where.erase(it);
    got.erase(alias);
  }
  ShapeMap expected;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) { expected[name] = p.sizes().vec(); });
  check_state_dict(expected, got, info.dir);

  // The model was built on the meta device: each parameter becomes its loaded tensor, converted once, so the
  // weights never exist twice (peak: the model plus one tensor in conversion).
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    const auto& [file, tensor] = where.at(name);
    at::Tensor loaded = files[file].load(tensor->name, dtype);
    p = device.is_cpu() ? loaded : loaded.to(device);
  });
  return model;
}

void save_model(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) { tensors.emplace_back(name, p.detach()); });
  save_state_dict(dir, tensors, max_shard_bytes);
  write_text_file((fs::path(dir) / "config.json").string(), model.hf_config().dump(2) + "\n");
}

}  // namespace trainer
