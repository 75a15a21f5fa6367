// The preference task's kind (train/engine/task_kind.h): training.objective=dpo on a language model; its plan lines,
// `trainer plan` (a pair's two sequences and the reference) and `trainer data` (the pairs' records).
#include <string>

#include <nlohmann/json.hpp>

#include "memory/planner.h"
#include "train/engine/task.h"
#include "train/engine/task_kind.h"
#include "train/tasks/preference/preference_data.h"
#include "train/tasks/preference/preference_task.h"
#include "train/tasks/text/text_task.h"

namespace trainer {

ExampleShape preference_example_shape(const Config& config) {
  ExampleShape shape;
  shape.sequences = 2;
  // dpo.precompute_reference: the reference ran before training (its copy, if any, freed): nothing while training.
  const bool precomputed = config.dpo.precompute_reference;
  shape.reference_forward = !precomputed;
  shape.reference_weights = !precomputed && (!config.lora.enabled || !config.dpo.reference_model.empty());
  shape.unit = "pair";
  shape.unit_note = "two sequences at data.max_length";
  return shape;
}

TaskKind preference_task_kind() {
  TaskKind kind;
  kind.name = "dpo";  // train_state.json's "task" since the task came
  kind.description = "preference (DPO)";
  kind.recognises = [](const Config& config, const nlohmann::json&) {
    return config.training.objective == TrainingObjective::kDpo;
  };
  kind.make = make_preference_task;
  kind.example_shape = preference_example_shape;
  kind.plan_lines = [](const Config& config, const TrainOptions& options, int64_t world_size) {
    return language_model_plan_lines(config, options, world_size, "pairs");
  };
  kind.plan = [](const Config& config, std::ostream& out, int64_t world_size) {
    return run_plan(config, out, world_size, preference_example_shape(config));
  };
  kind.fixed_memory = [](const Config& config, const nlohmann::json& model_config, const c10::Device& device,
                         double capacity, const std::string& budget) {
    return plan_memory(config, model_config, device, capacity, budget, preference_example_shape(config));
  };
  kind.data = [](const Config& config, std::ostream& out, const DataCommandOptions& options) {
    return run_data(config, out, options);
  };
  kind.record_mapper = [](const Config& config, const Tokenizer& tokenizer) {
    return preference_mapper(config, tokenizer, /*keep_text=*/true);
  };
  return kind;
}

}  // namespace trainer
