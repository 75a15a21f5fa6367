// The image-classification task (ViT, CLIP vision classifiers): see image_task.cpp.
#pragma once

#include <memory>

#include "train/engine/task.h"
#include "train/engine/task_kind.h"

namespace trainer {

std::unique_ptr<Task> make_image_task(const TaskContext& context);
// The kind (task_kind.h): a ViT or CLIP vision model in model.path.
TaskKind image_task_kind();

}  // namespace trainer
