// The text task's kind (train/engine/task_kind.h): every config the other kinds do not take, with a language model
// (seq2seq or causal) in model.path; its plan lines, `trainer plan` and `trainer data`.
#include <filesystem>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "data/jsonl.h"
#include "memory/planner.h"
#include "train/engine/task.h"
#include "train/engine/task_kind.h"
#include "train/tasks/text/text_task.h"
#include "trainer/model_dir.h"

namespace trainer {

TrainPlanLines language_model_plan_lines(const Config& config, const TrainOptions& options, int64_t world_size,
                                         const std::string& unit) {
  const auto model = inspect_model_dir(config.model.path, config.model.init == ModelInit::kPretrained);
  const auto train_files = data::expand_globs(config.data.train_files, "data.train_files");
  const auto validation_files = data::expand_globs(config.data.validation_files, "data.validation_files");
  const auto& t = config.training;
  TrainPlanLines lines;
  lines.before_device.emplace_back(
      "model", model.dir + " (" + model.model_type + ", " + model.family + "; " +
                   (config.model.init == ModelInit::kRandom
                        ? std::string("random initialisation from config.json")
                        : human_bytes(static_cast<double>(model.weight_bytes)) + " of weights in " +
                              std::to_string(model.weight_files.size()) + " file(s)") +
                   ")");
  lines.before_device.emplace_back(
      "tokenizer", config.tokenizer.path.empty()
                       ? (model.tokenizer_file.empty() ? "(none in model.path: pre-tokenized records only)"
                                                       : model.tokenizer_file)
                       : config.tokenizer.path);
  lines.before_device.emplace_back("data", std::to_string(train_files.size()) + " training file(s), " +
                                               std::to_string(validation_files.size()) + " validation file(s)");
  lines.batch = std::to_string(t.batch_size) + " " + unit + " per optimizer step; " +
                (t.micro_batch_tokens > 0 ? "micro-batches of at most " + std::to_string(t.micro_batch_tokens) +
                                                " padded tokens"
                 : t.micro_batch_size.is_auto ? std::string("micro-batch auto (probed against memory)")
                                              : "micro-batch " + std::to_string(t.micro_batch_size.value));
  if (world_size > 1)
    lines.ranks = "each rank trains " +
                  (t.micro_batch_tokens > 0 ? std::string("a token-balanced share")
                                            : "about " + std::to_string((t.batch_size + world_size - 1) / world_size) +
                                                  " " + unit) +
                  " of every effective batch and tokenizes 1/" + std::to_string(world_size) +
                  " of the records (exchanged with the others)";
  if (config.lora.enabled) {
    const auto& l = config.lora;
    std::string targets;
    for (const auto& target : l.target_modules) targets += (targets.empty() ? "" : ",") + target;
    if (targets.empty())
      targets = model.family == "seq2seq" ? "q,v" : model.model_type == "phi3" ? "qkv_proj" : "q_proj,v_proj";
    std::ostringstream lora;
    for (const auto& target : l.target_parameters) targets += "," + target;  // the experts (PEFT's target_parameters)
    lora << "r=" << l.r << ", alpha " << l.alpha << (l.rslora ? " (rsLoRA)" : "") << ", on " << targets
         << (l.base_in_bf16 ? "; frozen base in bf16" : "; frozen base") << "; saved as a PEFT adapter"
         << (options.merge ? " and merged" : "");
    lines.after_memory.emplace_back("lora", lora.str());
  }
  return lines;
}

TaskKind text_task_kind() {
  TaskKind kind;
  kind.name = "text";
  kind.description = "text (language model)";
  kind.recognises = [](const Config&, const nlohmann::json&) { return true; };
  kind.make = make_text_task;
  kind.example_shape = [](const Config&) { return ExampleShape{}; };
  kind.plan_lines = [](const Config& config, const TrainOptions& options, int64_t world_size) {
    return language_model_plan_lines(config, options, world_size, "examples");
  };
  kind.plan = [](const Config& config, std::ostream& out, int64_t world_size) {
    return run_plan(config, out, world_size);
  };
  kind.fixed_memory = [](const Config& config, const nlohmann::json& model_config, const c10::Device& device,
                         double capacity, const std::string& budget) {
    return plan_memory(config, model_config, device, capacity, budget);
  };
  kind.data = [](const Config& config, std::ostream& out, const DataCommandOptions& options) {
    return run_data(config, out, options);
  };
  return kind;
}

}  // namespace trainer
