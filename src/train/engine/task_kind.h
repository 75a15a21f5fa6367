// The kinds of task trainer trains, and what depends on the kind outside a task's own code: one registry
// (tasks/registry.cpp), read by the engine (whose checkpoint a run may continue), the fixed-memory report, and the
// CLI's `trainer train` (its plan lines), `trainer plan` and `trainer data`. Nothing else decides the kind: a new
// task is one folder in src/train/tasks/ and one entry in the registry.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "memory/planner.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/run.h"

namespace trainer {

class Task;
struct TaskContext;

// What `trainer train` prints of a kind before the run starts; the CLI adds the device, the length, the memory and
// the output rows (and with data parallelism the ranks' rendezvous before `ranks`).
struct TrainPlanLines {
  std::vector<std::pair<std::string, std::string>> before_device;  // ("model", "..."), ("data", "..."), ...
  std::string batch;                                               // the "batch" row
  std::string ranks;                                               // what each rank does (data parallelism)
  std::vector<std::pair<std::string, std::string>> after_memory;   // ("lora", "...")
};

struct TaskKind {
  std::string name;         // train_state.json's "task"
  std::string description;  // what the name means to a user: "image-classification"
  // Whether this kind trains `config` with the model whose config.json is `model_config` (an empty object when
  // model.path has none). The registry asks the kinds in order; the last one takes every config.
  std::function<bool(const Config& config, const nlohmann::json& model_config)> recognises;
  // What this kind refuses in the pairing of config and model before anything loads (UsageError); may be empty.
  std::function<void(const Config& config, const nlohmann::json& model_config)> check;
  std::function<std::unique_ptr<Task>(const TaskContext& context)> make;
  // `trainer train`'s plan lines; `world_size` > 1 with data parallelism.
  std::function<TrainPlanLines(const Config& config, const TrainOptions& options, int64_t world_size)> plan_lines;
  // What one example is to the memory planner (language models: a DPO pair is two sequences and a reference); may
  // be empty where the kind plans otherwise (images).
  std::function<ExampleShape(const Config& config)> example_shape;
  // `trainer plan`: the memory plan, per rank with `world_size` > 1; returns the exit code.
  std::function<int(const Config& config, std::ostream& out, int64_t world_size)> plan;
  // The fixed part of a run (weights, gradients, optimizer state) as `trainer plan` counts it, for the report when
  // the budget is below it (train/fixed_memory.h).
  std::function<MemoryPlan(const Config& config, const nlohmann::json& model_config, const c10::Device& device,
                           double capacity, const std::string& budget)>
      fixed_memory;
  // `trainer data`: the data streamed once through the kind's loader (with `options.mapper` the kind's records).
  std::function<int(const Config& config, std::ostream& out, const DataCommandOptions& options)> data;
  // The kind's own record mapping for `trainer data` (preference pairs), or empty for data/record.h's.
  std::function<RecordMapper(const Config& config, const Tokenizer& tokenizer)> record_mapper;
};

// The kind that trains `config`: reads model.path's config.json (none: an empty object) and runs the kind's check.
const TaskKind& task_kind(const Config& config);
// The kind of this name (a checkpoint's "task"); null for a name no kind has.
const TaskKind* task_kind_named(const std::string& name);
// Every kind, in the order the registry asks them.
const std::vector<TaskKind>& task_kinds();

}  // namespace trainer
