// The training engine (see engine.h): every phase of a run, written once for every task.
#include "train/engine/engine.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <optional>
#include <ostream>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "distributed/data_parallel.h"
#include "distributed/fully_sharded.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/cpu_budget.h"
#include "memory/cuda_extras.h"
#include "memory/policy.h"
#include "models/linear4bit.h"
#include "models/module.h"
#include "train/checkpoint_dir.h"
#include "train/checkpoint_parts.h"
#include "train/device_move.h"
#include "train/engine/task.h"
#include "train/engine/task_kind.h"
#include "train/fixed_memory.h"
#include "train/optim/grad_scaler.h"
#include "train/optim/optimizer.h"
#include "train/precision.h"
#include "train/resume_check.h"
#include "train/retention.h"
#include "train/rng.h"
#include "train/signals.h"
#include "train/engine/attempts.h"
#include "trainer/device.h"
#include "trainer/hub.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace fs = std::filesystem;

// ---- evaluation's micro-batch --------------------------------------------------------------------------------------

bool EvaluationMicroBatch::run(const std::function<void(int64_t micro)>& part) {
  while (!failed_) {
    try {
      if (begin_) begin_();
      part(std::max<int64_t>(1, micro_));
      return true;
    } catch (const c10::OutOfMemoryError& e) {
      if (out_of_memory_) out_of_memory_();
      release_cached_memory();
      if (micro_ <= 1 && !world_) throw;
      if (micro_ <= 1) {
        spdlog::warn("{}: rank {}: out of memory at {} micro-batch 1: {}", what_, world_->rank(), what_,
                     std::string(e.what_without_backtrace()).substr(0, 200));
        failed_ = true;
        break;
      }
      spdlog::warn("{}: out of memory; {} micro-batch {} -> {}", what_, what_, micro_, micro_ / 2);
      micro_ /= 2;
    }
  }
  return false;
}

bool EvaluationMicroBatch::run_once(const std::function<void()>& part) {
  if (failed_) return false;
  try {
    if (begin_) begin_();
    part();
    return true;
  } catch (const c10::OutOfMemoryError& e) {
    if (out_of_memory_) out_of_memory_();
    release_cached_memory();
    if (!world_) throw;
    spdlog::warn("evaluation: rank {}: out of memory: {}", world_->rank(),
                 std::string(e.what_without_backtrace()).substr(0, 200));
    failed_ = true;
    return false;
  }
}

void EvaluationMicroBatch::agree() {
  const bool failed = failed_;
  failed_ = false;  // the next evaluation starts afresh
  std::string failed_ranks;
  if (world_) {
    std::vector<int64_t> flags(static_cast<std::size_t>(world_->world_size()), 0);
    flags[static_cast<std::size_t>(world_->rank())] = failed ? 1 : 0;
    const auto all = world_->all_reduce_max(flags);
    for (int r = 0; r < world_->world_size(); ++r)
      if (all[static_cast<std::size_t>(r)]) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (failed_ranks.empty()) return;
  throw OutOfMemoryAtFloor("evaluation ran out of memory on rank(s) " + failed_ranks +
                               " with one example per evaluation micro-batch",
                           "raise memory.limit on those ranks, or make validation examples smaller (lengths, image "
                           "size), or set evaluation.every_steps=0");
}

int64_t TaskEvaluation::evaluation_micro_batch(const MemoryPolicy& policy) const { return policy.micro_batch(); }

namespace {

using Clock = std::chrono::steady_clock;

// The layout of checkpoint-N/ (train_state.json, optimizer.safetensors); a resume refuses any other.
constexpr int kCheckpointVersion = 1;

// Memory the run may use on `device`: memory.limit, else the device's total; 0 when unknown (CPU, no limit).
int64_t memory_capacity(const Config& config, const c10::Device& device) {
  if (config.memory.limit.bytes > 0) return static_cast<int64_t>(config.memory.limit.bytes);
  if (device.is_cpu()) return 0;
  return static_cast<int64_t>(at::accelerator::getMemoryInfo(device.index()).second);
}

int64_t parameter_bytes(Module& module) {
  int64_t bytes = 0;
  module.for_each_parameter([&](const std::string&, at::Tensor& p) { bytes += static_cast<int64_t>(p.nbytes()); });
  return bytes;
}

// What held the memory when a step did not fit even at the floor: the fixed part (weights, gradients, optimizer
// state), the rest of the run's peak (activations and workspace), and the allocator's own counters.
std::string memory_report(const Config& config, const c10::Device& device, Module& model, Module* adapters,
                          const Optimizer& optimizer, const MemoryPolicy& policy) {
  const int64_t weights = parameter_bytes(model) + (adapters ? parameter_bytes(*adapters) : 0);
  int64_t gradients = 0;
  for (const auto& g : optimizer.gradients()) gradients += static_cast<int64_t>(g.numel() * g.element_size());
  const int64_t state = optimizer.state_bytes();
  const auto now = memory_now(device);
  const int64_t fixed = weights + gradients + state;
  auto line = [](const char* name, double bytes) { return fmt::format("\n  {:<30}{}", name, human_bytes(bytes)); };
  std::string out = "memory report:";
  out += line("weights", static_cast<double>(weights));
  out += line("gradients (during backward)", static_cast<double>(gradients));
  out += line(fmt::format("optimizer state ({})", optimizer.name()).c_str(), static_cast<double>(state));
  out += line("peak of the run", static_cast<double>(now.peak));
  out += line("activations + workspace at it", static_cast<double>(std::max<int64_t>(0, now.peak - fixed)));
  out += line("in use now", static_cast<double>(now.allocated));
  if (device.is_cpu()) {
    const auto cpu = cpu_memory_stats();
    out += fmt::format("\n  {:<30}{}, {} allocations refused", "CPU budget (memory.limit)",
                       format_byte_size(config.memory.limit), cpu.num_ooms);
  } else {
    const auto stats = at::accelerator::getDeviceStats(device.index());
    const auto [free, total] = at::accelerator::getMemoryInfo(device.index());
    out += line("reserved by the allocator", static_cast<double>(stats.reserved_bytes[0].current));
    out += fmt::format("\n  {:<30}{} free of {}; {} out-of-memory errors, {} allocation retries", device.str(),
                       human_bytes(static_cast<double>(free)), human_bytes(static_cast<double>(total)),
                       stats.num_ooms, stats.num_alloc_retries);
  }
  std::string used;
  for (const auto& e : policy.escalations()) used += (used.empty() ? "" : ", ") + e;
  out += fmt::format("\n  {:<30}{}{} (floor {}); escalations used: {} of {}{}", "micro-batch", policy.micro_batch(),
                     policy.by_tokens() ? " tokens" : "", policy.by_tokens() ? 1 : config.memory.min_micro_batch_size,
                     policy.escalations().size(), config.memory.escalation.size(), used.empty() ? "" : " (" + used + ")");
  return out;
}

// The changes that shrink what did not fit, most effective first (the task's own first); only those this config has
// not made yet.
std::string floor_suggestions(const Config& config, const c10::Device& device, const Task& task) {
  std::vector<std::string> s = task.floor_suggestions();
  if (!config.training.activation_checkpointing) s.push_back("training.activation_checkpointing=true from the start");
  if (!config.lora.enabled) s.push_back("lora.enabled=true (no gradients or optimizer state for the base weights)");
  if (config.optimizer.name == OptimizerName::kAdamW)
    s.push_back("optimizer.name=adafactor (its state is a few bytes per matrix row and column, not 8 per parameter)");
  if (config.optimizer.name == OptimizerName::kAdamW && config.optimizer.state_dtype == StateDtype::kFp32)
    s.push_back("optimizer.state_dtype=bf16 or int8 (halves, or quarters, the AdamW state)");
  if (config.precision.mode == PrecisionMode::kFp32)
    s.push_back("precision.mode=bf16-mixed (bf16 activations) or bf16 (bf16 weights and gradients too)");
  if (!config.device.allow_cpu_fallback)
    s.push_back("device.allow_cpu_fallback=true (the run moves to the CPU and goes on, slowly, instead of stopping)");
  s.push_back(device.is_cpu() ? "a larger memory.limit" : "a larger memory.limit or a device with more memory");
  s.push_back("`trainer plan` with the same config shows the budget");
  std::string out;
  for (const auto& item : s) out += (out.empty() ? "" : "; ") + item;
  return out;
}

// With memory.snapshot_on_oom on a CUDA device: the allocator's history up to the run's first out-of-memory error,
// for pytorch.org/memory_viz. Later errors add nothing new to look at.
void dump_snapshot_once(const fs::path& output_dir, int64_t step) {
  static bool dumped = false;
  if (dumped) return;
  const auto path = output_dir / ("memory-snapshot-step-" + std::to_string(step) + ".pickle");
  if (dump_allocator_snapshot(path.string())) {
    dumped = true;
    spdlog::warn("out of memory at step {}: allocator snapshot written to {} (open it in pytorch.org/memory_viz)",
                 step, path.string());
  }
}

// What a resume continues from: the checkpoint, its train state, and whether the data changed since.
struct ResumePoint {
  std::optional<fs::path> dir;
  nlohmann::json state;
  bool data_changed = false;
};

// The checkpoint --resume / --resume-from / --resume-if-present names, if any (checked to be complete).
std::optional<fs::path> find_resume_dir(const Config& config, const TrainOptions& options) {
  if (!options.resume_from.empty()) {
    fs::path dir(options.resume_from);
    if (!fs::exists(dir / "COMPLETE"))
      throw DataError(options.resume_from + " is not a complete checkpoint (no COMPLETE marker)",
                      "resume from a checkpoint-N directory that trainer finished writing");
    return dir;
  }
  if (!options.resume && !options.resume_if_present) return std::nullopt;
  auto dir = newest_complete_checkpoint(config.checkpoint.output_dir);
  if (!dir && options.resume_if_present) {
    spdlog::info("--resume-if-present: no complete checkpoint in {} yet; starting from the beginning",
                 config.checkpoint.output_dir);
    return std::nullopt;
  }
  if (!dir)
    throw DataError("--resume: no complete checkpoint in " + config.checkpoint.output_dir,
                    "start without --resume, or point checkpoint.output_dir at the run to continue");
  return dir;
}

// What a task's name means to a user, for the message when a checkpoint belongs to another kind of run.
std::string describe_task(const std::string& name) {
  const TaskKind* kind = task_kind_named(name);
  return kind ? kind->description : "\"" + name + "\"";
}

// The memory budget and allocator recording: before anything is loaded.
void prepare_run(const Config& config, const c10::Device& device) {
  install_stop_handlers();  // from here a signal stops at the next step boundary (with a checkpoint)
  if (config.memory.snapshot_on_oom) {
    if (cuda_extras_available() && device.is_cuda()) start_recording_allocations();
    else spdlog::warn("memory.snapshot_on_oom: allocator snapshots need a CUDA device and a CUDA build of trainer; "
                      "none will be written on {}", device.str());
  }
  if (config.memory.limit.bytes > 0) {
    if (device.is_cpu()) set_cpu_budget_limit(static_cast<int64_t>(config.memory.limit.bytes));
    else cap_device_memory(device, static_cast<int64_t>(config.memory.limit.bytes));
  }
}

// What must fit before the first example (weights, LoRA, optimizer state): an error says how much that is.
template <class Build>
auto fixed_part(const Config& config, const c10::Device& device, const char* what, Build&& build) {
  try {
    return build();
  } catch (const c10::OutOfMemoryError& e) {
    throw fixed_memory_error(config, device, what, e);
  }
}

// One run of one task over explicit state. With a communicator (data parallelism) every rank runs the same phases;
// rank 0 alone writes files and reports.
class Engine {
 public:
  Engine(const TaskKind& kind, Task& task, const Config& config, const c10::Device& device,
         const TrainOptions& options, Reporter& reporter, distributed::Communicator* world)
      : kind_(kind), task_(task), config_(config), device_(device), options_(options), reporter_(reporter), world_(world),
        primary_(!world || world->rank() == 0), output_dir_(config.checkpoint.output_dir), counted_(task.counted()) {}

  void set_up();
  int loop();  // the exit code when a signal stopped the run; -1 when it ran to its end
  int finish();

 private:
  void check_resume();
  void build_model();
  void build_optimizer_and_step();
  void restore();
  void probe_micro_batch();
  void start_retention();
  std::string checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state);
  bool train_one_step();
  StepResult run_step(TaskBatch& batch, const LoaderCursor& cursor_before, const nlohmann::json& policy_before,
                      double lr);
  void evaluate();
  int agreed_stop_signal();
  void shard_weights();
  void read_weights_from_parts();
  // In the ranks' checkpoint parts, a sharded run's pieces of the weights are named by this prefix and the parameter.
  inline static const std::string kWeightsPrefix = "weights.";
  // With sharded weights: where each of this rank's optimizer state tensors and pieces of the weights (not with LoRA:
  // the frozen base is not written) lie in their parameter (checkpoints); empty when nothing of them is sharded.
  std::map<std::string, int64_t> piece_offsets();
  // With sharded weights, the whole model gathered on every rank while `f` runs (every rank calls it).
  template <class F>
  auto with_whole_model(F&& f) {
    struct Release {
      distributed::FullySharded* sharded;
      ~Release() {
        if (sharded) sharded->release_all();
      }
    } release{sharded_.get()};
    if (sharded_) sharded_->gather_all();
    return f();
  }

  // With sharded weights, the validation loss computed unit by unit while `f` runs (every rank calls it).
  template <class F>
  auto with_evaluation_units(F&& f) {
    struct End {
      distributed::FullySharded* sharded;
      ~End() { sharded->end_evaluation(); }
    } end{sharded_.get()};
    sharded_->begin_evaluation();
    return f();
  }

  const TaskKind& kind_;  // its name is train_state.json's "task"
  Task& task_;
  const Config& config_;
  c10::Device device_;  // changes only when the run moves (train/device_move.h)
  const TrainOptions& options_;
  Reporter& reporter_;
  distributed::Communicator* world_;
  const bool primary_;  // writes checkpoints, metrics, the final model
  const fs::path output_dir_;
  const Counted counted_;

  ResumePoint resume_;
  nlohmann::json fingerprint_;
  int64_t total_steps_ = 0;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<MemoryPolicy> policy_;
  std::unique_ptr<distributed::DataParallel> data_parallel_;
  std::shared_ptr<distributed::FullySharded> sharded_;  // distributed.shard_weights over more than one rank
  std::unique_ptr<GradScaler> scaler_;  // precision.mode=fp16-mixed
  int64_t skipped_at_start_ = 0;        // the scaler's skipped steps when this process started (resume)
  std::unique_ptr<DeviceLadder> device_ladder_;
  std::optional<EvaluationMicroBatch> eval_micro_;
  std::unique_ptr<CheckpointRetention> retention_;
  int64_t seen_ = 0;  // what the task counts (counted_), since step 0
  int64_t step_index_ = 0;
  double last_eval_ = std::nan("");
  std::map<std::string, double> last_eval_metrics_;  // the last evaluation's generation metrics (rougeL, ...)
  int64_t last_eval_step_ = -1;
  // The step whose state checkpoint-N in output_dir holds: the one resumed from, then each one written.
  std::optional<int64_t> on_disk_step_;
  int64_t current_epoch_ = 0;
};

void Engine::set_up() {
  resume_.dir = find_resume_dir(config_, options_);
  check_resume();
  build_model();
  task_.open_loader();
  const auto batch = static_cast<uint64_t>(config_.training.batch_size);
  const auto per_epoch = static_cast<int64_t>((task_.examples_per_epoch() + batch - 1) / batch);
  total_steps_ = config_.training.max_steps > 0 ? config_.training.max_steps : per_epoch * config_.training.epochs;
  build_optimizer_and_step();
  if (resume_.dir) restore();
  else if (config_.training.micro_batch_size.is_auto && !policy_->by_tokens()) probe_micro_batch();
  const auto& evaluation_micro = config_.evaluation.micro_batch_size;
  eval_micro_.emplace(evaluation_micro.is_auto ? task_.evaluation_micro_batch(*policy_) : evaluation_micro.value, world_);
  if (sharded_)
    eval_micro_->set_collective([this] { sharded_->begin_evaluation_try(); }, [this] { sharded_->announce_failure(); });
  start_retention();
}

// Before anything is loaded: the checkpoint's format and task, its model (the task's check), then the settings (one
// line with every difference; the ones that would make it another run are refused unless --allow-config-change),
// then the data (refused unless --allow-data-change, which starts a new epoch over the data as it is now).
void Engine::check_resume() {
  if (resume_.dir) {
    const fs::path& dir = *resume_.dir;
    resume_.state = read_json_file((dir / "train_state.json").string());
    const auto version = resume_.state.value("version", 0);
    if (version != kCheckpointVersion)
      throw DataError("checkpoint " + dir.string() + " has format version " + std::to_string(version) +
                          "; this trainer reads version " + std::to_string(kCheckpointVersion),
                      version > kCheckpointVersion ? "resume it with the trainer release that wrote it, or a newer one"
                                                   : "start a new run; its final model loads with model.path");
    // Checkpoints written before tasks had names are text checkpoints.
    const std::string task = resume_.state.value("task", std::string("text"));
    if (task != kind_.name)
      throw DataError("checkpoint " + dir.string() + " was written by a " + describe_task(task) + " run; this is a " +
                          describe_task(kind_.name) + " run",
                      "resume from a checkpoint of this kind of run, or point checkpoint.output_dir at another "
                      "directory");
    task_.check_checkpoint(dir, resume_.state);
    check_resume_config(resume_.state.at("config"), config_, dir.string(), options_.allow_config_change);
  }
  fingerprint_ = task_.open_data();
  if (resume_.dir)
    resume_.data_changed = check_resume_data(
        resume_.state, fingerprint_, resume_.dir->string(), options_.allow_data_change,
        [this](const nlohmann::json& saved, const nlohmann::json& current, std::vector<std::string>& warnings) {
          return task_.data_changes(saved, current, warnings);
        });
}

// The task's model (weights, LoRA, frozen parts, activation checkpointing); with data parallelism rank 0's values on
// every rank. A checkpoint of fully sharded weights holds them in the ranks' parts: the model is built as at the
// start, then each rank reads what it keeps (its pieces, or whole parameters when it does not shard them).
void Engine::build_model() {
  const bool weights_in_parts = resume_.dir && resume_.state.value("weights_in_parts", false);
  const bool shard = world_ && config_.distributed.shard_weights;
  if (shard) task_.read_weights_on_demand();  // each rank reads its pieces when it shards
  fixed_part(config_, device_, config_.lora.enabled ? "the model's weights and the LoRA adapters" : "the model's weights",
             [&] {
               task_.build_model(weights_in_parts ? std::nullopt : resume_.dir, device_);
               return 0;
             });
  if (world_) {
    std::vector<at::Tensor> all;
    // (Weights read on demand are on the meta device: every rank reads the same files.)
    task_.model().for_each_parameter([&](const std::string&, at::Tensor& p) {
      if (!p.is_meta()) all.push_back(p);
    });
    if (Module* adapters = task_.adapters())
      adapters->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    at::NoGradGuard no_grad;
    world_->broadcast(all);
  }
  if (shard) shard_weights();
  if (weights_in_parts) read_weights_from_parts();
}

void Engine::read_weights_from_parts() {
  const fs::path& dir = *resume_.dir;
  std::map<std::string, at::Tensor> into;
  std::map<std::string, int64_t> offsets;
  if (sharded_) {
    for (auto& piece : sharded_->pieces()) {
      into[kWeightsPrefix + piece.name] = piece.values;
      offsets[kWeightsPrefix + piece.name] = piece.offset;
    }
  } else {
    task_.model().for_each_parameter([&](const std::string& name, at::Tensor& p) { into[kWeightsPrefix + name] = p; });
  }
  const auto incomplete = distributed::read_ranges(dir, distributed::part_files(resume_.state), into, offsets);
  if (!incomplete.empty())
    throw DataError("checkpoint " + dir.string() + " holds its weights in the ranks' parts, but not all of " +
                        incomplete.front().substr(kWeightsPrefix.size()) +
                        (incomplete.size() > 1 ? " (and " + std::to_string(incomplete.size() - 1) + " more)" : ""),
                    "resume from an earlier complete checkpoint, with the model.path it was trained from");
}

// distributed.shard_weights: what it covers so far is refused otherwise with the key to change, before any work.
void Engine::shard_weights() {
  const std::string fix = "set distributed.shard_weights=false (distributed.shard_optimizer=true shards the optimizer "
                          "state alone)";
  auto refuse = [&](const std::string& what) {
    throw UsageError("distributed.shard_weights=true does not support " + what + " yet", fix);
  };
  ShardableModule* model = task_.shardable_model();
  if (!model)
    refuse("the " + describe_task(kind_.name) + " task (the text, image-classification and contrastive tasks only)");
  // QLoRA: the 4-bit base is sharded as it is stored (packed codes, block scales), dequantized at each use: a kept
  // dequantized copy would be the whole layer on every rank.
  if (auto* language = dynamic_cast<LanguageModel*>(model); language && has_quantized_layers(*language)) {
    if (config_.memory.dequantized_base == DequantizedBase::kKeep)
      throw UsageError("distributed.shard_weights=true with memory.dequantized_base=keep: a kept dequantized copy "
                       "of a 4-bit layer would be the whole layer on every rank",
                       "set memory.dequantized_base=auto (each use dequantizes the gathered 4-bit weights)");
    if (keep_dequantized_weights(*language, false) > 0)
      spdlog::info("4-bit base weights: sharded in their 4-bit layout and dequantized at each use (fully sharded: "
                   "no kept copy)");
  }
  if (config_.optimizer.name == OptimizerName::kAdamW && config_.optimizer.state_dtype == StateDtype::kInt8)
    refuse("optimizer.state_dtype=int8 (its blocks of 256 elements would straddle the ranks' pieces; use fp32 or "
           "bf16 state, or Adafactor)");
  // LoRA: the frozen base is sharded, the adapters stay whole on every rank (their gradients summed).
  distributed::FullyShardedOptions options;
  options.reshard_after_forward = config_.distributed.reshard_after_forward;
  options.prefetch = config_.distributed.prefetch;
  // FSDP2's mixed precision: auto gathers in the compute dtype of precision.mode, reduces in param_dtype's.
  const auto compute = autocast_dtype(config_.precision.mode).value_or(at::kFloat);
  auto dtype_of = [&](ShardDtype d, at::ScalarType automatic) {
    switch (d) {
      case ShardDtype::kAuto: return automatic;
      case ShardDtype::kFp32: return at::kFloat;
      case ShardDtype::kBf16: return at::kBFloat16;
      case ShardDtype::kFp16: return at::kHalf;
    }
    return automatic;
  };
  options.param_dtype = dtype_of(config_.distributed.param_dtype, compute);
  options.reduce_dtype = dtype_of(config_.distributed.reduce_dtype, options.param_dtype);
  sharded_ = distributed::FullySharded::shard(*world_, *model, options, device_, task_.weight_reader(),
                                              task_.adapters());
}

std::map<std::string, int64_t> Engine::piece_offsets() {
  std::map<std::string, int64_t> by_parameter, out;
  for (const auto& piece : sharded_->pieces()) {
    by_parameter[piece.name] = piece.offset;
    if (!task_.adapters()) out[kWeightsPrefix + piece.name] = piece.offset;  // LoRA: the base is not written
  }
  for (const auto& [name, tensor] : optimizer_->state_tensors()) {
    if (optimizer_->whole_state(name)) continue;  // Adafactor's row and column statistics: whole in every part
    const auto dot = name.find('.');  // "exp_avg.<parameter>"; parameters kept whole (LoRA's adapters) have none
    if (const auto it = by_parameter.find(name.substr(dot + 1)); it != by_parameter.end()) out[name] = it->second;
  }
  return out;
}

void Engine::build_optimizer_and_step() {
  // Only trainable parameters get state: with LoRA, the adapters (the frozen base has no gradients).
  const char* state_name = config_.optimizer.name == OptimizerName::kAdafactor
                               ? "the Adafactor state (row and column statistics)"
                               : "the AdamW state (two moments per trainable parameter)";
  // Sharded weights: the optimizer steps on this rank's pieces of the parameters.
  Module& trainable = sharded_ ? sharded_->trainable_pieces() : task_.trainable();
  // distributed.shard_optimizer (ZeRO-1): this rank's state covers its share of the parameters only.
  OptimizerShard shard;
  if (world_ && config_.distributed.shard_optimizer && !sharded_) {
    shard.rank = world_->rank();
    shard.world = world_->world_size();
  }
  if (sharded_) {
    // Adafactor sums its statistics and RMS values over whole parameters: over the ranks' pieces.
    // bf16 weights round stochastically as in one process: keyed by the parameter's index among the trainable ones.
    std::map<std::string, int64_t> index;
    task_.trainable().for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (p.requires_grad()) index.emplace(name, static_cast<int64_t>(index.size()));
    });
    for (const auto& piece : sharded_->trainable_layout()) {
      const auto it = index.find(piece.name);
      shard.pieced.push_back({piece.name, piece.shape, piece.offset, it == index.end() ? -1 : it->second});
    }
    shard.sum_floats = [this](at::Tensor& values) {
      world_->all_reduce_sum({values}, static_cast<int64_t>(values.nbytes()));
    };
    shard.sum_doubles = [this](std::vector<double>& values) {
      values = world_->all_reduce_sum(values, "summing Adafactor's squares over the ranks");
    };
  }
  optimizer_ = fixed_part(config_, device_, state_name, [&] {
    return make_optimizer(trainable, config_.optimizer, static_cast<uint64_t>(config_.training.seed), shard);
  });
  policy_ = std::make_unique<MemoryPolicy>(config_.memory, config_.training);
  if (world_ && !sharded_) {
    // Their gradients are summed once per optimizer step.
    data_parallel_ = distributed::make_data_parallel(
        *world_, trainable, static_cast<int64_t>(config_.distributed.bucket_size.bytes),
        shard.world > 1 ? optimizer_->owners() : std::vector<int>{});
    data_parallel_->set_overlap(config_.distributed.overlap_grad_reduce);
  }
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) {
    GradScalerOptions scaling;
    scaling.init_scale = config_.precision.initial_loss_scale;
    scaling.growth_interval = config_.precision.loss_scale_growth_interval;
    scaler_ = std::make_unique<GradScaler>(scaling);
  }
  StepSync* sync = sharded_ ? static_cast<StepSync*>(sharded_.get()) : data_parallel_.get();
  StepParts parts{*optimizer_, *policy_, sync, scaler_.get(), device_, &trainable, {}};
  if (sharded_)
    parts.evaluate_unit_by_unit = [this](EvaluationMicroBatch& micro, const std::function<void()>& f) {
      micro.set_collective([this] { sharded_->begin_evaluation_try(); }, [this] { sharded_->announce_failure(); });
      with_evaluation_units([&] {
        f();
        return 0;
      });
    };
  task_.build_step(parts);
  device_ladder_ = std::make_unique<DeviceLadder>(config_, device_);
}

// A resume restores the optimizer, the data position (a new epoch when the data changed), the policy, the loss
// scale, the step, the running count and the RNG.
void Engine::restore() {
  const auto& state = resume_.state;
  const fs::path& dir = *resume_.dir;
  // optimizer.safetensors, or the parts a sharded run wrote (any world size then and now).
  distributed::load_optimizer_parts(dir, state, *optimizer_, sharded_ ? piece_offsets() : std::map<std::string, int64_t>{});
  const LoaderCursor saved_cursor = cursor_from_json(state.at("data_cursor"));
  task_.restore_cursor(resume_.data_changed ? new_epoch_cursor(saved_cursor) : saved_cursor);
  policy_->restore(state.at("memory_policy"));
  // fp16-mixed: the loss scale and its growth tracker, so the resumed run scales and skips as the uninterrupted one.
  if (scaler_ && state.contains("loss_scaler")) {
    scaler_->restore(state.at("loss_scaler"), (dir / "train_state.json").string());
    skipped_at_start_ = scaler_->skipped_steps();
  } else if (scaler_) {
    spdlog::info("fp16-mixed: {} holds no loss scale (another precision mode); starting at {}", dir.string(),
                 scaler_->scale());
  }
  step_index_ = state.at("step").get<int64_t>();
  seen_ = state.at(counted_.state_key).get<int64_t>();
  // LibTorch's generators (dropout masks are keyed by the step and need none of it; anything else that draws does).
  const auto file = SafetensorsFile::open((dir / "optimizer.safetensors").string());
  if (file.find("rng.cpu")) set_rng_state(at::Device(at::kCPU), file.load("rng.cpu"));
  if (!device_.is_cpu()) {
    const std::string name = "rng." + device_.str();
    if (file.find(name)) set_rng_state(device_, file.load(name));
  }
  spdlog::info("resuming from {} at step {} (micro-batch {}){}", dir.string(), step_index_, policy_->micro_batch(),
               resume_.data_changed
                   ? fmt::format("; the data changed: epoch {} starts over it", task_.cursor().epoch + 1)
                   : std::string());
}

// micro_batch_size=auto: the largest micro-batch whose worst-case step fits and leaves memory.auto_safety_margin of
// the capacity (memory.limit, or the device's total) free: doubling, then bisecting between the last fit and the
// first failure; with data parallelism what fits on every rank.
void Engine::probe_micro_batch() {
  // Fully sharded weights: each try is a collective attempt whose outcome every rank shares (its out-of-memory
  // errors do not turn prefetch off: the probe looks for them).
  if (sharded_) sharded_->set_probing(true);
  int64_t probed = trainer::probe_micro_batch(config_, device_, task_.probe_limit(), *optimizer_,
                                              [this](int64_t n) { task_.probe(n); },
                                              [this](int64_t n) { return task_.probe_case(n); }, sharded_.get());
  if (sharded_) sharded_->set_probing(false);
  if (world_) probed = -world_->all_reduce_max({-probed})[0];  // what fits on every rank
  if (probed == 0) {
    const auto [what, hint] = task_.probe_failure();
    throw OutOfMemoryAtFloor(what, hint);
  }
  policy_->set_micro_batch(probed, 0, "micro_batch_size=auto probe");
}

void Engine::start_retention() {
  fs::create_directories(output_dir_);
  if (!resume_.dir && primary_)
    if (const auto earlier = newest_complete_checkpoint(output_dir_))
      spdlog::warn("{} already holds checkpoints of an earlier run (newest {}); this run starts from step 0 and "
                   "writes its own beside them. To continue that run instead, stop and add --resume",
                   output_dir_.string(), earlier->filename().string());
  const auto& ck = config_.checkpoint;
  const bool maximize = ck.best_mode == BestMode::kMax || (ck.best_mode == BestMode::kAuto && ck.best_metric != "loss");
  retention_ = std::make_unique<CheckpointRetention>(output_dir_, ck.keep_last, ck.keep_best, ck.best_metric, maximize);
  if (primary_) retention_->start(resume_.dir ? std::optional<int64_t>(step_index_) : std::nullopt);
  std::error_code same_error;
  if (resume_.dir &&
      fs::equivalent(*resume_.dir, output_dir_ / ("checkpoint-" + std::to_string(step_index_)), same_error))
    on_disk_step_ = step_index_;
}

// checkpoint-N: the task's model (or adapter) files, the optimizer state with the RNG state, and train_state.json,
// written to a temporary directory and renamed into place (a crash leaves the previous one whole); COMPLETE last.
// Rank 0 writes it; with sharded optimizer state every rank writes its part (train/checkpoint_parts.h). Then
// what stays (keep_last, keep_best by the validation loss at this step) and the webhook. Every rank calls it at the
// same step. `cursor` and `policy_state` are those of the moment after `step`: after an out-of-memory stop they are
// the ones from before the failed batch, so a resume trains that batch again.
std::string Engine::checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state) {
  nlohmann::json state = {{"version", kCheckpointVersion},
                          {"task", kind_.name},
                          {"step", step_index_},
                          {"optimizer_steps", optimizer_->steps()},
                          {counted_.state_key, seen_},
                          {"data_cursor", cursor_to_json(cursor)},
                          {"memory_policy", policy_state},
                          {"config", nlohmann::json::parse(config_to_json(config_))},
                          {"data_fingerprint", fingerprint_}};
  // A model named by its Hub id: the repo and the commit its snapshot holds (model.path is that snapshot).
  if (const auto origin = hub::snapshot_origin(config_.model.path))
    state["model_source"] = {{"hub_id", origin->repo_id}, {"commit", origin->commit}};
  // fp16-mixed: the loss scale and its growth tracker (absent in other modes).
  if (scaler_) state["loss_scaler"] = scaler_->state();
  task_.add_train_state(state);
  NamedTensors rng = {{"rng.cpu", get_rng_state(at::Device(at::kCPU))}};
  if (!device_.is_cpu()) rng.emplace_back("rng." + device_.str(), get_rng_state(device_));
  // Sharded weights: each rank writes its pieces of the weights with its optimizer state; rank 0 the model's
  // config and tokenizer beside them. No rank gathers anything.
  // With LoRA the base is frozen and comes from model.path: the checkpoint holds the adapter alone, as unsharded.
  const bool weights_in_parts = sharded_ && !task_.adapters();
  NamedTensors pieces;
  if (weights_in_parts) {
    state["weights_in_parts"] = true;
    for (auto& piece : sharded_->pieces()) pieces.emplace_back(kWeightsPrefix + piece.name, piece.values);
  }
  const fs::path final_dir = distributed::write_checkpoint_on_ranks(
      output_dir_, step_index_, on_disk_step_ == step_index_,
      [&](const fs::path& dir) { weights_in_parts ? task_.save_without_weights(dir) : task_.save(dir); },
      sharded_ ? sharded_->trainable_pieces() : task_.trainable(), *optimizer_, std::move(state), world_, rng,
      sharded_ ? piece_offsets() : std::map<std::string, int64_t>{}, pieces);
  on_disk_step_ = step_index_;
  if (!primary_) return final_dir.string();
  std::optional<double> best_value;  // checkpoint.best_metric at this step, when it was evaluated at this step
  if (last_eval_step_ == step_index_) {
    if (retention_->metric() == "loss") best_value = last_eval_;
    else if (const auto it = last_eval_metrics_.find(retention_->metric()); it != last_eval_metrics_.end())
      best_value = it->second;
  }
  retention_->on_checkpoint(step_index_, best_value);
  reporter_.on_checkpoint(step_index_, final_dir.string());
  return final_dir.string();
}

// A signal on any rank stops every rank after the same step.
int Engine::agreed_stop_signal() {
  const int signal = stop_requested();
  if (!world_) return signal;
  return static_cast<int>(world_->all_reduce_max({signal})[0]);
}

int Engine::loop() {
  reset_peak(device_);  // the summary's peak is training's, not the micro-batch probe's
  reporter_.on_start({task_.model_type(), count_parameters(task_.model()), optimizer_->trainable_parameters(),
                      total_steps_, policy_->micro_batch(), step_index_, seen_,
                      resume_.dir ? resume_.dir->string() : "", counted_.unit});
  current_epoch_ = task_.cursor().epoch;
  while (step_index_ < total_steps_) {
    if (const int signal = agreed_stop_signal()) {
      reporter_.on_stopped(signal, step_index_, checkpoint(task_.cursor(), policy_->state()));
      return signal == SIGINT ? kExitInterrupted : kExitOk;
    }
    if (!train_one_step()) break;
  }
  return -1;
}

// The task's step, with the end of the memory ladder: when it does not fit at the floor with every escalation used,
// the run moves to a device with more room (one process only: ranks would have to agree on a move, which data
// parallelism does not do yet) and runs the same step there; with no move left it stops with a report and a
// checkpoint of the last completed step.
StepResult Engine::run_step(TaskBatch& batch, const LoaderCursor& cursor_before, const nlohmann::json& policy_before,
                            double lr) {
  for (;;) try {
      return task_.train_step(batch, step_index_ + 1, lr);
    } catch (const OutOfMemoryAtFloor& e) {
      if (!world_) {
        if (const auto moved = device_ladder_->move(step_index_ + 1, device_,
                                                    {task_.model(), task_.adapters(), *optimizer_}, *policy_, e.what())) {
          device_ = *moved;
          task_.set_device(device_);
          continue;
        }
      }
      dump_snapshot_once(output_dir_, step_index_ + 1);
      std::string report = memory_report(config_, device_, task_.model(), task_.adapters(), *optimizer_, *policy_);
      if (world_) report += "\n  device moves: not made in data-parallel runs (the ranks stop together)";
      else if (const auto why_not = device_ladder_->why_not_moved(); !why_not.empty())
        report += "\n  device moves: " + why_not;
      const auto saved = checkpoint(cursor_before, policy_before);
      throw OutOfMemoryAtFloor(std::string(e.what()) + "\n" + report + "\nthe last completed step (" +
                                   std::to_string(step_index_) + ") is saved in " + saved +
                                   "; after changing the config, continue with --resume-from " + saved,
                               floor_suggestions(config_, device_, task_));
    }
}

// One optimizer step: the next effective batch, the memory-adaptive step, metrics, then evaluation and a periodic
// checkpoint when due. False when the data is done.
bool Engine::train_one_step() {
  const auto step_start = Clock::now();
  const LoaderCursor cursor_before = task_.cursor();  // for a checkpoint of this state if the step cannot fit
  const nlohmann::json policy_before = policy_->state();
  auto batch = task_.next_batch();
  if (batch && batch->epoch != current_epoch_) {
    const auto d = task_.data_stats();
    spdlog::info("epoch {} done (data so far: records {} read, bad records skipped {}, truncated {}, too long and "
                 "skipped {})", current_epoch_ + 1, d.records_read, d.bad_records_skipped, d.truncated,
                 d.overlength_skipped);
    current_epoch_ = batch->epoch;
  }
  if (!batch) return false;
  const double lr = scheduled_lr(config_.scheduler, config_.optimizer.lr, step_index_, total_steps_);
  const StepResult result = run_step(*batch, cursor_before, policy_before, lr);
  ++step_index_;
  if (result.retries > 0) dump_snapshot_once(output_dir_, step_index_);
  seen_ += result.counted;
  const auto memory = memory_now(device_);
  reporter_.on_step({step_index_, result.loss, lr, result.grad_norm, result.counted, seen_,
                     result.micro_batch, result.micro_steps, result.retries,
                     static_cast<int64_t>(policy_->adaptations().size()), device_ladder_->moves(), memory.allocated,
                     memory.peak, std::chrono::duration<double>(Clock::now() - step_start).count(),
                     scaler_ ? std::optional(LossScaling{result.loss_scale, result.skipped, scaler_->skipped_steps()})
                             : std::nullopt,
                     result.metrics});
  const bool eval_now = config_.evaluation.every_steps > 0 && step_index_ % config_.evaluation.every_steps == 0;
  if (eval_now || step_index_ == total_steps_) evaluate();
  if (config_.checkpoint.every_steps > 0 && step_index_ % config_.checkpoint.every_steps == 0 &&
      step_index_ < total_steps_)
    checkpoint(task_.cursor(), policy_->state());
  if (config_.memory.empty_cache_every > 0 && step_index_ % config_.memory.empty_cache_every == 0)
    release_cached_memory();
  return true;
}

// The task's evaluation (every rank its share), the ranks' agreement on its out-of-memory outcome, then the report
// and what rank 0 alone shows afterwards.
void Engine::evaluate() {
  // Sharded weights: the validation loss and metrics run unit by unit (the root and the head gathered for them, the
  // blocks as they come, as in training: text with evaluation by generation and its samples, DPO, image
  // classification, CLIP).
  const auto run = [&] { return task_.evaluate(step_index_, *eval_micro_); };
  const Evaluated evaluated = !sharded_                         ? run()
                              : task_.evaluates_unit_by_unit() ? with_evaluation_units(run)
                                                               : with_whole_model(run);
  eval_micro_->agree();
  if (evaluated.loss) {
    last_eval_ = *evaluated.loss;
    last_eval_metrics_ = evaluated.metrics;
    last_eval_step_ = step_index_;
    if (evaluated.report) evaluated.report(reporter_);
  }
  const auto samples = [&] {
    if (primary_) task_.after_evaluation(step_index_, reporter_);
    return 0;
  };
  // Sharded weights: a task that evaluates unit by unit generates its samples so on every rank, in step (rank 0
  // reports them; the others' lines are below their log level); otherwise the whole model is gathered for rank 0.
  if (sharded_ && !config_.evaluation.sample_prompts.empty() && task_.evaluates_unit_by_unit())
    with_evaluation_units([&] {
      task_.after_evaluation(step_index_, reporter_);
      return 0;
    });
  else if (sharded_ && !config_.evaluation.sample_prompts.empty())
    with_whole_model(samples);
  else
    samples();
}

// The end of the run: a checkpoint to continue from (a longer max_steps, more epochs), then the model itself.
int Engine::finish() {
  checkpoint(task_.cursor(), policy_->state());
  if (config_.checkpoint.save_final && sharded_ && !task_.adapters()) {
    // One unit gathered at a time; rank 0 writes each file as its units arrive.
    task_.save_streamed(output_dir_ / "final", [&](const std::string& name) {
      const at::Tensor values = sharded_->gathered(name);
      return primary_ ? values.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : values;
    }, primary_);
    sharded_->release_exported();
  } else if (config_.checkpoint.save_final && primary_) {
    task_.save(output_dir_ / "final");
  }
  if (primary_) task_.after_final_save(output_dir_, options_);
  RunSummary summary;
  summary.counted = counted_.name;
  summary.counted_rate = counted_.unit;
  summary.eval_perplexity = counted_.eval_perplexity;
  summary.steps = step_index_;
  summary.seen = seen_;
  summary.data = task_.data_stats();
  summary.memory_peak = memory_now(device_).peak;
  summary.adaptations = policy_->adaptations();
  summary.escalations = policy_->escalations();
  if (scaler_)
    summary.loss_scaling = RunSummary::LossScalingSummary{scaler_->skipped_steps(),
                                                          scaler_->skipped_steps() - skipped_at_start_, scaler_->scale()};
  if (config_.checkpoint.save_final) summary.model_dir = (output_dir_ / "final").string();
  summary.model_is_adapter = task_.adapters() != nullptr;
  if (options_.merge) summary.merged_dir = (output_dir_ / "final-merged").string();
  if (const auto& best = retention_->best()) {
    summary.best_checkpoint = best->path.string();
    summary.best_eval_loss = best->value;
    summary.best_metric = retention_->metric();
  }
  distributed::add_rank_figures(world_, summary);
  reporter_.on_finish(std::move(summary));
  return kExitOk;
}

}  // namespace

int64_t probe_micro_batch(const Config& config, const c10::Device& device, int64_t limit, Optimizer& optimizer,
                          const std::function<void(int64_t)>& run,
                          const std::function<std::string(int64_t)>& describe, StepSync* sync) {
  const int64_t capacity = memory_capacity(config, device);
  const double allowed = static_cast<double>(capacity) * (1.0 - config.memory.auto_safety_margin);
  std::optional<double> peak_of_one;  // set when one example ran without running out of memory
  auto fits = [&](int64_t n) {
    reset_peak(device);
    bool fit = true, failed_here = false;
    try {
      if (sync) sync->begin_attempt(false);
      run(n);
      if (sync) sync->prepare();
    } catch (const AgreedOutOfMemory&) {
      fit = false;  // another rank's, learnt inside a collective
    } catch (const c10::OutOfMemoryError&) {
      fit = false;
      failed_here = true;
    }
    if (failed_here && sync) sync->announce_failure();
    if (sync) fit = sync->agree(fit, n).all_fit;
    optimizer.zero_grad();
    if (!fit) {
      release_cached_memory();
      spdlog::info("micro_batch_size=auto: {} does not fit (out of memory{})", n,
                   sync && !failed_here ? " on another rank" : "");
      return false;
    }
    const auto peak = static_cast<double>(memory_now(device).peak);
    if (n == 1) peak_of_one = peak;
    bool ok = capacity == 0 || peak <= allowed;
    if (sync) ok = sync->sum({ok ? 0.0 : 1.0}, "agreeing on the micro_batch_size=auto probe")[0] == 0.0;
    spdlog::info("micro_batch_size=auto: {} peaks at {}{}", describe ? describe(n) : std::to_string(n), human_bytes(peak),
                 ok ? "" : sync ? " (inside the safety margin on some rank: too close)" : " (inside the safety margin: too close)");
    return ok;
  };
  const int64_t chosen = largest_that_fits(limit, fits);
  // The margin is there to choose between micro-batches; with none smaller to choose, a run whose one example ran is
  // better started than refused (an out-of-memory error later still adapts what it can, and loses nothing).
  if (chosen == 0 && peak_of_one) {
    spdlog::warn("micro_batch_size=auto: 1 peaks at {}, inside memory.auto_safety_margin (at most {} of the {} "
                 "capacity): training at micro-batch 1 with less than the margin left; shorter maximum lengths or a "
                 "higher memory.limit would restore it",
                 human_bytes(*peak_of_one), human_bytes(allowed), human_bytes(static_cast<double>(capacity)));
    return 1;
  }
  return chosen;
}

int train(const Config& config, const ResolvedDevice& resolved, const TrainOptions& options, std::ostream& out,
          distributed::Communicator* world) {
  // Rank 0 alone prints the progress and writes metrics, TensorBoard and the webhook; the others log warnings.
  std::ostream null_stream(nullptr);
  const bool primary = !world || world->rank() == 0;
  Reporter reporter(config, primary ? out : null_stream, primary);
  try {
    const TaskKind& kind = task_kind(config);
    const auto task = kind.make({config, world, primary});
    task->check_settings(options);
    prepare_run(config, resolved.device);
    Engine engine(kind, *task, config, resolved.device, options, reporter, world);
    engine.set_up();
    int code = engine.loop();
    if (code < 0) code = engine.finish();
    if (world) world->barrier();  // rank 0, which hosts the rendezvous, leaves last
    return code;
  } catch (const std::exception& error) {
    reporter.on_failure(error);  // the webhook hears of it; main reports it and picks the exit code
    throw;
  }
}

}  // namespace trainer
