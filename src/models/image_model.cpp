// Image classifiers by model_type (see image_model.h).
#include "models/image_model.h"

#include <filesystem>
#include <stdexcept>

#include "models/hf_config.h"
#include "models/vit.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {

namespace {
constexpr const char* kSupported = "supported image models: vit";
}

bool is_image_model_config(const nlohmann::json& config) {
  return hf::get_string(config, "model_type", "") == "vit";
}

std::unique_ptr<ImageClassifier> load_image_classifier(const std::string& dir, ModelInit init,
                                                       const c10::TensorOptions& options, uint64_t seed,
                                                       const std::vector<std::string>& labels) {
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  const nlohmann::json config = read_json_file(config_path);
  const std::string type = hf::get_string(config, "model_type", "");
  if (type == "vit") return load_vit(dir, init, options, seed, labels);
  throw DataError(config_path + ": model_type \"" + type + "\" is not an image classifier trainer knows", kSupported);
}

void save_image_classifier(ImageClassifier& model, const std::string& dir) {
  if (auto* vit = dynamic_cast<VitForImageClassification*>(&model)) return save_vit(*vit, dir);
  throw std::logic_error("save_image_classifier: no writer for model_type \"" + model.model_type() + "\"");
}

}  // namespace trainer
