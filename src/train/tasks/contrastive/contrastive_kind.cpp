// The contrastive task's kind (train/engine/task_kind.h): training.objective=contrastive, which needs a whole CLIP
// in model.path; its plan lines, `trainer plan` and `trainer data`.
#include <string>

#include <nlohmann/json.hpp>

#include "data/jsonl.h"
#include "memory/planner.h"
#include "train/engine/task.h"
#include "train/engine/task_kind.h"
#include "train/tasks/contrastive/contrastive_task.h"
#include "trainer/errors.h"

namespace trainer {

TaskKind contrastive_task_kind() {
  TaskKind kind;
  kind.name = "contrastive";
  kind.description = "contrastive (CLIP)";
  kind.recognises = [](const Config& config, const nlohmann::json&) {
    return config.training.objective == TrainingObjective::kContrastive;
  };
  kind.check = [](const Config& config, const nlohmann::json& model_config) {
    if (!is_clip_model_config(model_config))
      throw UsageError("training.objective=contrastive needs a CLIPModel directory (config.json with model_type "
                       "\"clip\" and a text_config); " + config.model.path + " is not one",
                       "point model.path at a directory CLIPModel.save_pretrained wrote (configs/models/tiny-clip is "
                       "the demo one)");
  };
  kind.make = make_contrastive_task;
  kind.plan_lines = [](const Config& config, const TrainOptions&, int64_t world_size) {
    const auto train_files = data::expand_globs(config.data.train_files, "data.train_files");
    const auto validation_files = data::expand_globs(config.data.validation_files, "data.validation_files");
    const auto& t = config.training;
    const bool batch_negatives = config.contrastive.negatives == ContrastiveNegativesMode::kBatch;
    TrainPlanLines lines;
    lines.before_device.emplace_back(
        "model", config.model.path + " (CLIP, contrastive image-text training; " +
                     (config.model.init == ModelInit::kRandom ? "random initialisation from config.json"
                                                              : "pretrained weights") +
                     "; " + (config.contrastive.freeze_image_tower ? "image tower locked" : "both towers train") + ")");
    lines.before_device.emplace_back(
        "data", std::to_string(train_files.size()) + " training file(s), " + std::to_string(validation_files.size()) +
                    " validation file(s) of image-caption pairs" + (config.data.augment ? "; augmented" : ""));
    lines.before_device.emplace_back(
        "negatives", std::string(enum_name(config.contrastive.negatives)) +
                         (batch_negatives
                              ? " (every pair of the effective batch, whatever the micro-batch: gradient caching)"
                              : " (only the pairs of the same micro-batch: the objective changes with the split)"));
    lines.batch = std::to_string(t.batch_size) + " image-caption pairs per optimizer step; " +
                  (t.micro_batch_size.is_auto ? std::string("micro-batch auto (probed against memory)")
                                              : "micro-batch " + std::to_string(t.micro_batch_size.value));
    if (world_size > 1)
      lines.ranks = "each rank embeds " + std::to_string(t.batch_size / world_size) +
                    (t.batch_size % world_size ? " or " + std::to_string(t.batch_size / world_size + 1)
                                               : std::string()) +
                    " pairs of every effective batch, decoding only those" +
                    (batch_negatives ? "; the embeddings of all " + std::to_string(t.batch_size) +
                                           " are gathered on every rank"
                                     : "; negatives within each rank's micro-batches (not one process's objective)") +
                    (config.distributed.shard_optimizer ? "; optimizer state sharded over the ranks" : "");
    return lines;
  };
  kind.plan = [](const Config& config, std::ostream& out, int64_t world_size) {
    return run_image_plan(config, out, world_size, /*contrastive=*/true);
  };
  kind.fixed_memory = [](const Config& config, const nlohmann::json&, const c10::Device&, double,
                         const std::string&) { return plan_image_run(config, /*clip=*/true); };
  kind.data = [](const Config& config, std::ostream& out, const DataCommandOptions&) {
    return run_image_data(config, out);
  };
  return kind;
}

}  // namespace trainer
