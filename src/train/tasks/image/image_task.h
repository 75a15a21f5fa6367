// The image-classification task (ViT, CLIP vision classifiers): see image_task.cpp.
#pragma once

#include <memory>

#include "train/engine/task.h"

namespace trainer {

std::unique_ptr<Task> make_image_task(const TaskContext& context);

}  // namespace trainer
