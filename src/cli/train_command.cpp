// The train command: everything is resolved and checked before any step runs, so a mistake in paths, device or
// data shows in the first second, not after the model has loaded.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <ostream>

#include <ATen/DeviceAccelerator.h>
#include <spdlog/spdlog.h>

#include "data/jsonl.h"
#include "distributed/process_group.h"
#include "trainer/device.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/run.h"
#include "trainer/version.h"
#include "train/run_lock.h"
#include "train/engine/engine.h"
#include "train/engine/task_kind.h"

namespace trainer {
namespace {

// PYTORCH_ALLOC_CONF must be in the environment before the first device allocation; the user's wins.
// Returns what applies, for the plan.
std::string export_allocator_conf(const MemoryConfig& memory) {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"})
    if (const char* value = std::getenv(name)) {
      if (!memory.allocator_conf.empty())
        spdlog::info("{} is set in the environment; memory.allocator_conf is not applied", name);
      return std::string(name) + "=" + value + " (from the environment)";
    }
  if (memory.allocator_conf.empty()) return "";
  setenv("PYTORCH_ALLOC_CONF", memory.allocator_conf.c_str(), 1);
  return "PYTORCH_ALLOC_CONF=" + memory.allocator_conf + " (memory.allocator_conf)";
}

// Data parallelism: the device of this rank (LOCAL_RANK's GPU when the config leaves the choice to trainer), its
// share of the CPU threads, and its log lines marked with the rank.
DeviceConfig prepare_rank(const Config& config, const distributed::Environment& environment) {
  // TRAINER_NUM_THREADS (applied in main) is the user's choice per process: the ranks do not divide it.
  const char* chosen = std::getenv("TRAINER_NUM_THREADS");
  const int threads = chosen && *chosen ? 0 : distributed::share_cpu_threads(environment.local_world_size);
  if (environment.rank != 0) {
    auto logger = spdlog::default_logger();
    logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(environment.rank) + "] [%l] %v");
    if (logger->level() < spdlog::level::warn) logger->set_level(spdlog::level::warn);
  }
  if (threads > 0)
    spdlog::info("rank {} of {}: {} intra-op threads ({} ranks on this machine)", environment.rank,
                 environment.world_size, threads, environment.local_world_size);
  DeviceConfig device = config.device;
  const auto accelerator = at::accelerator::getAccelerator(false);
  if ((device.type == "auto" || device.type == "cuda") && accelerator && *accelerator == c10::DeviceType::CUDA &&
      static_cast<int>(at::accelerator::deviceCount()) > environment.local_rank)
    device.type = "cuda:" + std::to_string(environment.local_rank);
  return device;
}

// The keys that may differ between ranks: what one machine has (its memory, its device).
const std::vector<std::string> kPerRankKeys = {"memory.limit", "device.*"};

// The plan's lines on how long the run is and what memory it adapts to (text and image runs alike).
void print_length_and_memory(const Config& config, const std::string& allocator_conf, std::ostream& out) {
  const auto& t = config.training;
  out << "  length       "
      << (t.max_steps > 0 ? std::to_string(t.max_steps) + " optimizer steps" : std::to_string(t.epochs) + " epoch(s)")
      << "\n";
  out << "  memory       "
      << (config.memory.limit.bytes ? "limit " + format_byte_size(config.memory.limit) : std::string("no limit"))
      << ", on out-of-memory: " << enum_name(config.memory.on_oom)
      << (allocator_conf.empty() ? "" : "; " + allocator_conf) << "\n";
}

// What a run holds from before the wait for a device (queued jobs started together) to its end: the output
// directory's lock (one run per directory; rank 0 holds it for all ranks; a dry run writes nothing and takes none),
// the device, and with data parallelism (`environment`) the ranks' group, joined and with the configs compared.
struct StartedRun {
  std::optional<RunLock> lock;
  ResolvedDevice device;
  std::unique_ptr<distributed::Communicator> world;
};

StartedRun start_run(const Config& config, const TrainOptions& options,
                   const std::optional<distributed::Environment>& environment, const DeviceConfig& device_config) {
  StartedRun started;
  if (!options.dry_run && (!environment || environment->rank == 0))
    started.lock.emplace(RunLock::acquire(config.checkpoint.output_dir));
  started.device = resolve_device(device_config);
  if (environment && !options.dry_run) {
    started.world = distributed::Communicator::connect(
        *environment, started.device.device,
        std::chrono::seconds(static_cast<int64_t>(std::ceil(config.distributed.timeout_s))));
    started.world->check_same_config(config_to_json(config, -1), kPerRankKeys);
  }
  return started;
}

// The plan's "ranks" line up to the share each rank takes (the caller says that part).
void print_ranks_line(const distributed::Environment& environment, const ResolvedDevice& device, std::ostream& out) {
  out << "  ranks        " << environment.world_size << " (this is rank " << environment.rank << ", local rank "
      << environment.local_rank << "; backend " << (device.device.is_cuda() ? "nccl" : "gloo") << ", rendezvous "
      << environment.master_addr << ":" << environment.master_port
      << (environment.agent_store ? " (torchrun's store)" : "") << "); ";
}

}  // namespace

int run_train(const Config& config, const TrainOptions& options, std::ostream& stdout_stream) {
  const auto environment = distributed::environment_from_variables();
  // Data parallelism: rank 0 alone prints the configuration, the plan and the run (errors go to stderr on every rank).
  std::ostream null_stream(nullptr);
  std::ostream& out = environment && environment->rank != 0 ? null_stream : stdout_stream;
  const DeviceConfig device_config = environment ? prepare_rank(config, *environment) : config.device;
  out << "trainer " << kVersion << " (LibTorch " << kTorchBuildVersion << ", " << kTorchBuild << ")\n\n";
  out << "Resolved configuration (the keys that differ from their defaults; --print-config shows every key):\n"
      << format_config_table(config, options.config_file, options.overrides) << "\n";

  const std::string allocator_conf = export_allocator_conf(config.memory);
  // The kind of task (train/engine/task_kind.h) decides the plan's lines; a model directory that is missing (or has
  // no config.json) gets the same error whatever the task.
  if (!std::filesystem::exists(std::filesystem::path(config.model.path) / "config.json"))
    inspect_model_dir(config.model.path, config.model.init == ModelInit::kPretrained);
  const TaskKind& kind = task_kind(config);
  const TrainPlanLines lines = kind.plan_lines(config, options, environment ? environment->world_size : 1);
  StartedRun started = start_run(config, options, environment, device_config);
  const ResolvedDevice& device = started.device;
  distributed::Communicator* world = started.world.get();

  auto row = [&out](const std::string& label, const std::string& text) {
    out << "  " << label << std::string(label.size() < 13 ? 13 - label.size() : 1, ' ') << text << "\n";
  };
  out << "Plan:\n";
  for (const auto& [label, text] : lines.before_device) row(label, text);
  row("device", device.description + "; accelerators built in: " + accelerator_summary());
  row("batch", lines.batch);
  if (environment) {
    print_ranks_line(*environment, device, out);
    out << lines.ranks << "\n";
  }
  print_length_and_memory(config, allocator_conf, out);
  for (const auto& [label, text] : lines.after_memory) row(label, text);
  out << "  output       " << config.checkpoint.output_dir << "\n\n";

  if (options.dry_run) {
    out << "Dry run: the configuration is valid and every path resolves. Nothing was trained.\n";
    return kExitOk;
  }
  return train(config, device, options, out, world);
}

}  // namespace trainer
