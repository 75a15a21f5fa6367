// The contrastive task (CLIP on image-caption pairs, training.objective=contrastive): see contrastive_task.cpp.
#pragma once

#include <memory>

#include <nlohmann/json_fwd.hpp>

#include "train/engine/task.h"
#include "train/engine/task_kind.h"

namespace trainer {

// Whether a config.json is a whole CLIP (CLIPModel: model_type "clip" with a text_config), what the contrastive
// objective trains.
bool is_clip_model_config(const nlohmann::json& config);

std::unique_ptr<Task> make_contrastive_task(const TaskContext& context);
// The kind (task_kind.h): training.objective=contrastive (a whole CLIP in model.path).
TaskKind contrastive_task_kind();

}  // namespace trainer
