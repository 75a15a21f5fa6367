// What a training task plugs into the one engine (engine.h). The engine owns everything a run does whatever it
// trains: resume (finding, checking and restoring every piece of state), the optimizer, the memory policy, data
// parallelism and loss scaling, the micro-batch probe, the loop and the agreed stop, the attempt loop (run_attempts
// in train/engine/attempts.h) with its out-of-memory retries, escalations and device moves, evaluation's schedule, its own
// micro-batch and the ranks' agreement on it, the checkpoint writer, retention, reporting and the summary. A task
// says what differs: the model, the data and its batches, forward and backward over a split, the evaluation's
// metrics and the files a saved model consists of. A new task is one folder in src/train/tasks/ and one line in
// task_kinds() (tasks/registry.cpp, task_kind.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "train/engine/attempts.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/run.h"

namespace trainer {

class Module;
class ShardableModule;
class Optimizer;
class MemoryPolicy;
class GradScaler;
class Reporter;
namespace distributed {
class Communicator;
}

// What every task is handed when it is made.
struct TaskContext {
  const Config& config;
  distributed::Communicator* world = nullptr;  // data parallelism; null in one process
  bool primary = true;                         // rank 0 (or one process): writes files and reports
};

// What a task counts per step: target tokens, images, image-caption pairs.
struct Counted {
  std::string state_key;  // train_state.json's key of the running total: "tokens_seen", "images_seen", "pairs_seen"
  std::string name;       // the summary: "target tokens", "images", "image-caption pairs"
  std::string unit;       // per second, in the progress line and the summary: "tokens", "images", "pairs"
  bool eval_perplexity = true;  // exp(validation loss) is a perplexity (a language model's loss per token)
};

// One effective batch as the task's loader hands it out; the engine passes it back to the task's step.
struct TaskBatch {
  virtual ~TaskBatch() = default;
  int64_t epoch = 0;  // of the loader's cursor when it was made
};

// What the engine built for the task's step.
class EvaluationMicroBatch;

struct StepParts {
  Optimizer& optimizer;
  MemoryPolicy& policy;
  StepSync* sync = nullptr;      // data parallelism
  GradScaler* scaler = nullptr;  // precision.mode=fp16-mixed
  c10::Device device{c10::kCPU};
  // What the optimizer steps on: the task's trainable(), or with fully sharded weights this rank's pieces of them
  // (each named as its parameter), where a task changes master values after an update (CLIP's logit scale cap).
  Module* optimized = nullptr;
  // Fully sharded weights (null otherwise): runs `f` with the model evaluated unit by unit as the engine's evaluation
  // runs it (the root and the head gathered throughout, each block for its forward), `micro`'s tries agreed by every
  // rank (an out-of-memory error on one fails every rank's try, and all halve together). Every rank calls it at the
  // same point: DPO's reference pass before training.
  std::function<void(EvaluationMicroBatch& micro, const std::function<void()>& f)> evaluate_unit_by_unit;
};

// Evaluation's own micro-batch (evaluation.micro_batch_size; kept from one evaluation to the next): an out-of-memory
// error halves it and the same part runs again; training's memory policy is never touched. At micro-batch 1 one
// process rethrows the error; with data parallelism this rank stops computing (run() returns false from then on) but
// the task goes on through its batches so the ranks' exchanges stay matched, and the engine's agreement afterwards
// stops every rank with one error that names the ranks.
class EvaluationMicroBatch {
 public:
  // `what` names the work and its micro-batch in the warnings ("evaluation" and "evaluation micro-batch").
  EvaluationMicroBatch(int64_t start, distributed::Communicator* world, std::string what = "evaluation")
      : micro_(start), world_(world), what_(std::move(what)) {}
  // Runs `part` with the current micro-batch until it fits; false when this rank ran out of memory at 1.
  bool run(const std::function<void(int64_t micro)>& part);
  // Runs `part` once: work whose size no micro-batch changes (CLIP's scores over every validation pair). An
  // out-of-memory error there is this rank's failure as at micro-batch 1 (rethrown in one process).
  bool run_once(const std::function<void()>& part);
  int64_t value() const { return micro_; }
  bool failed() const { return failed_; }
  // Fully sharded weights, evaluated unit by unit: every forward is a collective. `begin` runs before each try,
  // `out_of_memory` when this rank ran out of memory in one: it tells the other ranks, which fail at their next
  // collective, so that every rank halves (or stops, at 1) together.
  void set_collective(std::function<void()> begin, std::function<void()> out_of_memory) {
    begin_ = std::move(begin);
    out_of_memory_ = std::move(out_of_memory);
  }
  // Every rank, after each evaluation: throws OutOfMemoryAtFloor on every rank when any ran out at micro-batch 1.
  void agree();

 private:
  int64_t micro_;
  distributed::Communicator* world_;
  bool failed_ = false;
  std::function<void()> begin_, out_of_memory_;
  std::string what_;
};

// What an evaluation measured. The engine reports it only once every rank evaluated.
struct Evaluated {
  std::optional<double> loss;              // what checkpoint.keep_best compares; none when nothing was evaluated
  std::function<void(Reporter&)> report;  // metrics, progress log, TensorBoard
  std::map<std::string, double> metrics;   // evaluation by generation ("rougeL", ...): checkpoint.best_metric
};

// A task has four roles beside what it is (Task below); the engine calls each at its moment. A method with a body
// is a default a task overrides only when it has something to say.

// The data: records, their fingerprint, the loader and its cursor.
class TaskData {
 public:
  virtual ~TaskData() = default;
  // Opens the training data (and what reading it needs: the tokenizer) and returns its fingerprint, stored in every
  // checkpoint as "data_fingerprint".
  virtual nlohmann::json open_data() = 0;
  // What differs between a checkpoint's fingerprint and this run's, one line each; `warnings`: changes that leave
  // the epoch order intact. Empty: the same data.
  virtual std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                                std::vector<std::string>& warnings) const = 0;
  // The loader (after the model is built; LoaderTask in loader_task.h writes the rest of this role once).
  virtual void open_loader() = 0;
  virtual uint64_t examples_per_epoch() const = 0;
  virtual std::unique_ptr<TaskBatch> next_batch() = 0;  // null when the data is done
  virtual LoaderCursor cursor() const = 0;
  virtual void restore_cursor(const LoaderCursor& cursor) = 0;
  virtual DataStats data_stats() const = 0;
};

// The model: built (or resumed), what trains, saved.
class TaskModel {
 public:
  virtual ~TaskModel() = default;
  // A checkpoint of another model or adapter shape cannot continue this run (the engine has checked its version and
  // task already).
  virtual void check_checkpoint(const std::filesystem::path& dir, const nlohmann::json& state) const {
    (void)dir;
    (void)state;
  }
  // Builds the model on `device`: weights (from `resume` when a full fine-tune resumes), LoRA (its adapters from
  // `resume`), frozen parts, activation checkpointing. An out-of-memory error here is the engine's to report.
  virtual void build_model(const std::optional<std::filesystem::path>& resume, const c10::Device& device) = 0;
  virtual Module& model() = 0;
  virtual std::string model_type() const = 0;
  // The model, for tasks whose weights can be fully sharded (distributed.shard_weights: its blocks are the units);
  // null otherwise.
  virtual ShardableModule* shardable_model() { return nullptr; }
  // With fully sharded weights: whether evaluate() runs its forwards unit by unit (the same number on every rank,
  // through the step's StepSync); otherwise the engine gathers the whole model for it.
  virtual bool evaluates_unit_by_unit() const { return false; }
  // Before build_model, with fully sharded weights: pretrained weights may stay unread (meta) until weight_reader()
  // reads each; an empty reader: the model holds its values.
  virtual void read_weights_on_demand() {}
  virtual std::function<at::Tensor(const std::string&)> weight_reader() { return {}; }
  // The LoRA adapters (they are not in the model's tree); null without LoRA.
  virtual Module* adapters() { return nullptr; }
  // What trains: the adapters with LoRA (plus what the task trains in full beside them), else the model.
  virtual Module& trainable() { return model(); }
  // The trained model (or adapter) with what loads it (tokenizer, preprocessing) into `dir`.
  virtual void save(const std::filesystem::path& dir) = 0;
  // Fully sharded weights (tasks with a shardable_model): save() from weights fetched one parameter at a time
  // (`parameter`, valid until written; every rank calls it, rank 0 with `write`), and what a checkpoint whose weights
  // are in the ranks' parts holds beside them (config.json, the tokenizer).
  virtual void save_streamed(const std::filesystem::path& dir,
                             const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
    (void)dir, (void)parameter, (void)write;
  }
  virtual void save_without_weights(const std::filesystem::path& dir) { (void)dir; }
  // What train_state.json holds beside the engine's keys (text with LoRA: the base model's config).
  virtual void add_train_state(nlohmann::json& state) const { (void)state; }
  // After the final save (rank 0): --merge.
  virtual void after_final_save(const std::filesystem::path& output_dir, const TrainOptions& options) {
    (void)output_dir;
    (void)options;
  }
};

// The step: the StepWork of its micro-batches in the engine's attempt loop (attempts.h), the probe's worst case,
// what to change when even the floor does not fit.
class TaskStep {
 public:
  virtual ~TaskStep() = default;
  virtual void build_step(const StepParts& parts) = 0;
  // One optimizer step over `batch` (run_attempts with the task's StepWork).
  virtual StepResult train_step(TaskBatch& batch, int64_t step, double lr) = 0;
  // micro_batch_size=auto: the largest micro-batch worth trying (with data parallelism, a rank's largest share),
  // and forward and backward of a worst-case step in micro-batches of `micro` (an out-of-memory error propagates).
  virtual int64_t probe_limit() const = 0;
  virtual void probe(int64_t micro) = 0;
  // What a probe of `micro` ran, for its log line ("4 at maximum lengths").
  virtual std::string probe_case(int64_t micro) const { return std::to_string(micro) + " at the worst case"; }
  // When not even one example fits: what did not fit, and what to change.
  virtual std::pair<std::string, std::string> probe_failure() const {
    return {"not even one example fits for micro_batch_size=auto",
            "turn on training.activation_checkpointing, or raise memory.limit"};
  }
  // What shrinks a step of this task, for the report when even the floor did not fit (most effective first).
  virtual std::vector<std::string> floor_suggestions() const { return {}; }
  // The run moved to another device (train/device_move.h): where the next batches run.
  virtual void set_device(const c10::Device& device) = 0;
};

// Evaluation: its metrics and the value checkpoint.keep_best compares.
class TaskEvaluation {
 public:
  virtual ~TaskEvaluation() = default;
  // evaluation.micro_batch_size=auto starts from this (default: training's micro-batch).
  virtual int64_t evaluation_micro_batch(const MemoryPolicy& policy) const;
  // Over the validation data (every rank its share; sums over the ranks inside). Nothing is reported here. The
  // default evaluates nothing (Evaluated::loss empty).
  virtual Evaluated evaluate(int64_t step, EvaluationMicroBatch& micro) {
    (void)step;
    (void)micro;
    return {};
  }
  // After an evaluation every rank agreed on: what rank 0 alone shows (text: sample generations).
  virtual void after_evaluation(int64_t step, Reporter& reporter) {
    (void)step;
    (void)reporter;
  }
};

// What the engine trains: what it counts, and the four roles. Its kind (task_kind.h) made it and names it.
class Task : public TaskData, public TaskModel, public TaskStep, public TaskEvaluation {
 public:
  explicit Task(const TaskContext& context) : context_(context) {}
  ~Task() override = default;

  virtual Counted counted() const = 0;
  // Settings and options this task refuses before anything loads (UsageError).
  virtual void check_settings(const TrainOptions& options) const { (void)options; }

 protected:
  const Config& config() const { return context_.config; }
  distributed::Communicator* world() const { return context_.world; }
  bool primary() const { return context_.primary; }
  std::filesystem::path output_dir() const { return context_.config.checkpoint.output_dir; }

 private:
  TaskContext context_;
};

}  // namespace trainer
