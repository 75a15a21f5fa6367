// The preference task (training.objective=dpo): see preference_task.cpp.
#pragma once

#include <memory>

#include "train/engine/task.h"

namespace trainer {

std::unique_ptr<Task> make_preference_task(const TaskContext& context);

}  // namespace trainer
