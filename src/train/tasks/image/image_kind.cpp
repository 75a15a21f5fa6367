// The image-classification task's kind (train/engine/task_kind.h): a ViT or CLIP vision model in model.path; its
// plan lines, `trainer plan` and `trainer data`.
#include <string>

#include <nlohmann/json.hpp>

#include "data/jsonl.h"
#include "memory/planner.h"
#include "models/image/image_model.h"
#include "train/engine/task.h"
#include "train/engine/task_kind.h"
#include "train/tasks/image/image_task.h"

namespace trainer {

TaskKind image_task_kind() {
  TaskKind kind;
  kind.name = "image";
  kind.description = "image-classification";
  kind.recognises = [](const Config&, const nlohmann::json& model_config) {
    return is_image_model_config(model_config);
  };
  kind.make = make_image_task;
  kind.plan_lines = [](const Config& config, const TrainOptions&, int64_t world_size) {
    const auto train_files = data::expand_globs(config.data.train_files, "data.train_files");
    const auto validation_files = data::expand_globs(config.data.validation_files, "data.validation_files");
    const auto& t = config.training;
    TrainPlanLines lines;
    lines.before_device.emplace_back(
        "model", config.model.path + " (image classifier; " +
                     (config.model.init == ModelInit::kRandom ? "random initialisation from config.json"
                                                              : "pretrained weights") +
                     "; " + (t.linear_probe ? "linear probe: only the head trains" : "full fine-tune") + ")");
    lines.before_device.emplace_back(
        "data", std::to_string(train_files.size()) + " training source(s), " +
                    std::to_string(validation_files.size()) +
                    " validation source(s) (image folders, JSONL listings or Parquet/Arrow tables)" +
                    (config.data.augment ? "; augmented" : ""));
    lines.batch = std::to_string(t.batch_size) + " images per optimizer step; " +
                  (t.micro_batch_size.is_auto ? std::string("micro-batch auto (probed against memory)")
                                              : "micro-batch " + std::to_string(t.micro_batch_size.value));
    if (world_size > 1)
      lines.ranks = "each rank decodes and trains about " + std::to_string((t.batch_size + world_size - 1) / world_size) +
                    " images of every effective batch" +
                    (config.distributed.shard_optimizer ? "; optimizer state sharded over the ranks" : "");
    return lines;
  };
  kind.plan = [](const Config& config, std::ostream& out, int64_t world_size) {
    return run_image_plan(config, out, world_size, /*contrastive=*/false);
  };
  kind.fixed_memory = [](const Config& config, const nlohmann::json&, const c10::Device&, double,
                         const std::string&) { return plan_image_run(config, /*clip=*/false); };
  kind.data = [](const Config& config, std::ostream& out, const DataCommandOptions&) {
    return run_image_data(config, out);
  };
  return kind;
}

}  // namespace trainer
