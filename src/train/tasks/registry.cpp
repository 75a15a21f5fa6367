// The kinds of task trainer trains (train/engine/task_kind.h): a new task is one folder in src/train/tasks/ and one
// line in task_kinds().
#include <filesystem>

#include <nlohmann/json.hpp>

#include "train/engine/task.h"
#include "train/engine/task_kind.h"
#include "train/tasks/contrastive/contrastive_task.h"
#include "train/tasks/image/image_task.h"
#include "train/tasks/preference/preference_task.h"
#include "train/tasks/text/text_task.h"
#include "trainer/model_dir.h"

namespace trainer {

const std::vector<TaskKind>& task_kinds() {
  // Asked in this order: the objectives first (they name their kind), then the model's config.json; text takes the
  // rest.
  static const std::vector<TaskKind> kinds = {
      contrastive_task_kind(),
      preference_task_kind(),
      image_task_kind(),
      text_task_kind(),
  };
  return kinds;
}

const TaskKind& task_kind(const Config& config) {
  const auto config_json = std::filesystem::path(config.model.path) / "config.json";
  const nlohmann::json model_config =
      std::filesystem::exists(config_json) ? read_json_file(config_json.string()) : nlohmann::json::object();
  for (const TaskKind& kind : task_kinds()) {
    if (!kind.recognises(config, model_config)) continue;
    if (kind.check) kind.check(config, model_config);
    return kind;
  }
  throw std::logic_error("no task kind takes this config: the registry's last kind must take every config");
}

const TaskKind* task_kind_named(const std::string& name) {
  for (const TaskKind& kind : task_kinds())
    if (kind.name == name) return &kind;
  return nullptr;
}

}  // namespace trainer
