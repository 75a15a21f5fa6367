// The tasks the engine trains, chosen from the config: a new task is one folder in src/train/tasks/ and one line
// here.
#include <filesystem>

#include <nlohmann/json.hpp>

#include "models/image_model.h"
#include "train/engine/task.h"
#include "train/tasks/contrastive/contrastive_task.h"
#include "train/tasks/image/image_task.h"
#include "train/tasks/preference/preference_data.h"
#include "train/tasks/preference/preference_task.h"
#include "train/tasks/text/text_task.h"
#include "trainer/model_dir.h"

namespace trainer {

std::unique_ptr<Task> make_task(const TaskContext& context) {
  const Config& config = context.config;
  if (config.training.objective == TrainingObjective::kContrastive) return make_contrastive_task(context);
  if (config.training.objective == TrainingObjective::kDpo) return make_preference_task(context);
  const auto config_json = std::filesystem::path(config.model.path) / "config.json";
  if (std::filesystem::exists(config_json) && is_image_model_config(read_json_file(config_json.string())))
    return make_image_task(context);
  return make_text_task(context);
}

std::function<RecordMapper(const Config& config, const Tokenizer& tokenizer)> task_record_mapper(const Config& config) {
  if (config.training.objective != TrainingObjective::kDpo) return {};
  return [](const Config& c, const Tokenizer& tokenizer) { return preference_mapper(c, tokenizer, /*keep_text=*/true); };
}

}  // namespace trainer
