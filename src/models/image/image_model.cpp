// Image classifiers by model_type (see image_model.h).
#include "models/image/image_model.h"

#include <filesystem>
#include <stdexcept>

#include <ATen/ATen.h>

#include "models/image/clip.h"
#include "models/hf_config.h"
#include "models/image/vit.h"
#include "trainer/errors.h"
#include "trainer/hf_weights.h"
#include "trainer/model_dir.h"

namespace trainer {

namespace {
constexpr const char* kSupported =
    "supported image models: vit, clip (CLIPModel, CLIPForImageClassification), clip_vision_model";
}

std::vector<std::string> config_labels(const nlohmann::json& c) {
  std::vector<std::string> labels;
  if (const auto* id2label = hf::find(c, "id2label"); id2label && id2label->is_object() && !id2label->empty()) {
    labels.resize(id2label->size());
    for (const auto& [key, value] : id2label->items()) {
      std::size_t id = 0;
      try {
        id = std::stoul(key);
      } catch (const std::exception&) {
        throw DataError("config.json: id2label key \"" + key + "\" is not a class number");
      }
      if (id >= labels.size() || !value.is_string())
        throw DataError("config.json: id2label must map 0..N-1 to class names; got \"" + key + "\": " + value.dump());
      labels[id] = value.get<std::string>();
    }
    return labels;
  }
  const int64_t n = hf::get_int(c, "num_labels", 2);
  for (int64_t i = 0; i < n; ++i) labels.push_back("LABEL_" + std::to_string(i));
  return labels;
}

void write_label_maps(nlohmann::json& config, const std::vector<std::string>& labels) {
  nlohmann::json id2label = nlohmann::json::object(), label2id = nlohmann::json::object();
  for (std::size_t i = 0; i < labels.size(); ++i) {
    id2label[std::to_string(i)] = labels[i];
    label2id[labels[i]] = i;
  }
  config["id2label"] = id2label;
  config["label2id"] = label2id;
  config.erase("num_labels");
}

bool is_image_model_config(const nlohmann::json& config) {
  const std::string type = hf::get_string(config, "model_type", "");
  return type == "vit" || type == "clip" || type == "clip_vision_model";
}

std::unique_ptr<ImageClassifier> load_image_classifier(const std::string& dir, ModelInit init,
                                                       const c10::TensorOptions& options, uint64_t seed,
                                                       const std::vector<std::string>& labels) {
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  const nlohmann::json config = read_json_file(config_path);
  const std::string type = hf::get_string(config, "model_type", "");
  if (type == "vit") return load_vit(dir, init, options, seed, labels);
  if (type == "clip" || type == "clip_vision_model") return load_clip_classifier(dir, init, options, seed, labels);
  throw DataError(config_path + ": model_type \"" + type + "\" is not an image classifier trainer knows", kSupported);
}

void save_image_classifier(ImageClassifier& model, const std::string& dir) {
  save_image_classifier_streamed(model, dir, {}, true);
}

void save_image_classifier_streamed(ImageClassifier& model, const std::string& dir,
                                    const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
  if (auto* vit = dynamic_cast<VitForImageClassification*>(&model)) return save_vit(*vit, dir, parameter, write);
  if (auto* clip = dynamic_cast<ClipVisionClassifier*>(&model))
    return save_clip_classifier(*clip, dir, parameter, write);
  throw std::logic_error("save_image_classifier: no writer for model_type \"" + model.model_type() + "\"");
}

void save_image_classifier_config(ImageClassifier& model, const std::string& dir) {
  if (auto* vit = dynamic_cast<VitForImageClassification*>(&model)) return save_vit_config(*vit, dir);
  if (auto* clip = dynamic_cast<ClipVisionClassifier*>(&model)) return save_clip_classifier_config(*clip, dir);
  throw std::logic_error("save_image_classifier_config: no writer for model_type \"" + model.model_type() + "\"");
}

void save_module_weights(Module& model, const std::string& dir, uint64_t max_shard_bytes,
                         const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
  if (write) std::filesystem::create_directories(dir);
  NamedTensors planned;  // the shapes and dtypes the files are planned by; the values come when each file is written
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    planned.emplace_back(name, parameter ? at::empty(p.sizes(), p.options().device(at::kMeta)) : p.detach());
  });
  save_state_dict_streamed(dir, planned, [&](std::size_t i) {
    return parameter ? parameter(planned[i].first) : planned[i].second;
  }, max_shard_bytes, write);
}

void initialise_randomly(ImageClassifier& model, const c10::TensorOptions& options, uint64_t seed,
                         const std::vector<std::string>& labels) {
  if (!labels.empty() && labels != model.labels()) model.set_labels(labels, options.dtype(at::kFloat));
  at::manual_seed(seed);
  model.init_weights();
  model.for_each_parameter([&](const std::string&, at::Tensor& p) { p = p.to(options); });
}

}  // namespace trainer
