// The preference task (training.objective=dpo): see preference_task.cpp.
#pragma once

#include <memory>

#include "memory/planner.h"
#include "train/engine/task.h"
#include "train/engine/task_kind.h"

namespace trainer {

std::unique_ptr<Task> make_preference_task(const TaskContext& context);
// The kind (task_kind.h): training.objective=dpo.
TaskKind preference_task_kind();

// What a pair is to the memory planner: two sequences of data.max_length through forward and backward, the
// reference's forward beside them, and for a full fine-tune (or dpo.reference_model) a frozen copy of the weights
// (with LoRA the reference is the base under the adapters: nothing more); with dpo.precompute_reference neither the
// reference's forward nor its copy (they ran before training).
ExampleShape preference_example_shape(const Config& config);

}  // namespace trainer
