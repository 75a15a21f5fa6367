// The train command: everything is resolved and checked before any step runs, so a mistake in paths, device or
// data shows in the first second, not after the model has loaded.
#include <cstdlib>
#include <optional>
#include <ostream>

#include <spdlog/spdlog.h>

#include "data/jsonl.h"
#include "trainer/device.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/run.h"
#include "trainer/version.h"
#include "train/run_lock.h"
#include "train/trainer.h"

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

}  // namespace

int run_train(const Config& config, const TrainOptions& options, std::ostream& out) {
  out << "trainer " << kVersion << " (LibTorch " << kTorchBuildVersion << ", " << kTorchBuild << ")\n\n";
  out << "Resolved configuration (the keys that differ from their defaults; --print-config shows every key):\n"
      << format_config_table(config, options.config_file, options.overrides) << "\n";

  const std::string allocator_conf = export_allocator_conf(config.memory);
  const auto model = inspect_model_dir(config.model.path, config.model.init == ModelInit::kPretrained);
  const auto train_files = data::expand_globs(config.data.train_files, "data.train_files");
  const auto validation_files = data::expand_globs(config.data.validation_files, "data.validation_files");
  // One run per output directory, held from before the wait for a device (queued jobs started together) to the
  // end; a dry run writes nothing and takes no lock.
  std::optional<RunLock> lock;
  if (!options.dry_run) lock.emplace(RunLock::acquire(config.checkpoint.output_dir));
  const auto device = resolve_device(config.device);

  const auto& t = config.training;
  out << "Plan:\n";
  out << "  model        " << model.dir << " (" << model.model_type << ", " << model.family << "; "
      << (config.model.init == ModelInit::kRandom ? std::string("random initialisation from config.json")
                                                  : human_bytes(static_cast<double>(model.weight_bytes)) +
                                                        " of weights in " +
                                                        std::to_string(model.weight_files.size()) + " file(s)")
      << ")\n";
  out << "  tokenizer    "
      << (config.tokenizer.path.empty() ? (model.tokenizer_file.empty() ? "(none in model.path: pre-tokenized records only)"
                                                                         : model.tokenizer_file)
                                        : config.tokenizer.path)
      << "\n";
  out << "  data         " << train_files.size() << " training file(s), " << validation_files.size()
      << " validation file(s)\n";
  out << "  device       " << device.description << "; accelerators built in: " << accelerator_summary() << "\n";
  out << "  batch        " << t.batch_size << " examples per optimizer step; "
      << (t.micro_batch_tokens > 0 ? "micro-batches of at most " + std::to_string(t.micro_batch_tokens) +
                                         " padded tokens"
          : t.micro_batch_size.is_auto ? std::string("micro-batch auto (probed against memory)")
                                       : "micro-batch " + std::to_string(t.micro_batch_size.value))
      << "\n";
  out << "  length       "
      << (t.max_steps > 0 ? std::to_string(t.max_steps) + " optimizer steps" : std::to_string(t.epochs) + " epoch(s)")
      << "\n";
  out << "  memory       "
      << (config.memory.limit.bytes ? "limit " + format_byte_size(config.memory.limit) : std::string("no limit"))
      << ", on out-of-memory: " << enum_name(config.memory.on_oom)
      << (allocator_conf.empty() ? "" : "; " + allocator_conf) << "\n";
  if (config.lora.enabled) {
    const auto& l = config.lora;
    std::string targets;
    for (const auto& target : l.target_modules) targets += (targets.empty() ? "" : ",") + target;
    if (targets.empty()) targets = model.family == "seq2seq" ? "q,v" : "q_proj,v_proj";
    out << "  lora         r=" << l.r << ", alpha " << l.alpha << (l.rslora ? " (rsLoRA)" : "") << ", on "
        << targets
        << (l.base_in_bf16 ? "; frozen base in bf16" : "; frozen base") << "; saved as a PEFT adapter"
        << (options.merge ? " and merged" : "") << "\n";
  }
  out << "  output       " << config.checkpoint.output_dir << "\n\n";

  if (options.dry_run) {
    out << "Dry run: the configuration is valid and every path resolves. Nothing was trained.\n";
    return kExitOk;
  }
  return train(config, device, options, out);
}

}  // namespace trainer
