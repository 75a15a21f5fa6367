// The training loop (see trainer.h).
#include "train/trainer.h"

#include <chrono>
#include <csignal>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <ostream>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "log/reporter.h"
#include "memory/cpu_budget.h"
#include "memory/cuda_extras.h"
#include "memory/policy.h"
#include "models/lora.h"
#include "models/weights.h"
#include "train/checkpointing.h"
#include "train/device_move.h"
#include "train/fixed_memory.h"
#include "train/optimizer.h"
#include "train/resume_check.h"
#include "train/retention.h"
#include "train/rng.h"
#include "train/signals.h"
#include "train/step.h"
#include "trainer/data.h"
#include "trainer/model_dir.h"
#include "trainer/peft.h"
#include "trainer/safetensors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// The layout of checkpoint-N/ (train_state.json, optimizer.safetensors); a resume refuses any other.
constexpr int kCheckpointVersion = 1;

struct MemoryNow {
  int64_t allocated = 0, peak = 0;
};

MemoryNow memory_now(const c10::Device& device) {
  if (device.is_cpu()) {
    const auto stats = cpu_memory_stats();
    return {stats.allocated, stats.peak};
  }
  const auto stats = at::accelerator::getDeviceStats(device.index());
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};
}

// Examples of the longest lengths the config allows: the worst case micro_batch_size=auto must fit.
std::vector<Example> worst_case_examples(const Config& config, DataFamily family, int64_t count, int32_t token) {
  Example e;
  if (family == DataFamily::kSeq2Seq) {
    e.input_ids.assign(static_cast<std::size_t>(config.data.max_input_length), token);
    e.labels.assign(static_cast<std::size_t>(config.data.max_target_length), token);
  } else {
    e.input_ids.assign(static_cast<std::size_t>(config.data.max_length), token);
    e.labels = e.input_ids;
  }
  return std::vector<Example>(static_cast<std::size_t>(count), e);
}

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

void reset_peak(const c10::Device& device) {
  if (device.is_cpu()) reset_cpu_peak();
  else at::accelerator::resetPeakStats(device.index());
}

// What held the memory when a step did not fit even at the floor: the fixed part (weights, gradients, optimizer
// state), the rest of the run's peak (activations and workspace), and the allocator's own counters.
std::string memory_report(const Config& config, const c10::Device& device, Module& model, Module* lora,
                          const Optimizer& optimizer, const MemoryPolicy& policy) {
  const int64_t weights = parameter_bytes(model) + (lora ? parameter_bytes(*lora) : 0);
  const int64_t gradients = parameter_bytes(lora ? *lora : model);  // one per trainable parameter, its dtype
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

// The changes that shrink what did not fit, most effective first; only those this config has not made yet.
std::string floor_suggestions(const Config& config, const c10::Device& device, bool seq2seq) {
  std::vector<std::string> s;
  s.push_back(seq2seq
                  ? "shorter sequences: data.max_input_length / data.max_target_length (activations grow with length)"
                  : "shorter sequences: data.max_length (activations grow with length)");
  if (!config.training.activation_checkpointing) s.push_back("training.activation_checkpointing=true from the start");
  if (!config.lora.enabled) s.push_back("lora.enabled=true (no gradients or optimizer state for the base weights)");
  if (config.optimizer.name == OptimizerName::kAdamW)
    s.push_back("optimizer.name=adafactor (its state is a few bytes per matrix row and column, not 8 per parameter)");
  if (config.optimizer.name == OptimizerName::kAdamW && config.optimizer.state_dtype == StateDtype::kFp32)
    s.push_back("optimizer.state_dtype=bf16 (halves the AdamW state)");
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

}  // namespace

// The largest micro-batch whose forward and backward at maximum lengths fit and leave memory.auto_safety_margin
// of the capacity free: doubling, then bisecting between the last fit and the first failure.
int64_t probe_micro_batch(TrainStep& step, Optimizer& optimizer, const Config& config, DataFamily family,
                          const c10::Device& device) {
  const int64_t batch_size = config.training.batch_size;
  const int64_t capacity = memory_capacity(config, device);
  const double allowed = static_cast<double>(capacity) * (1.0 - config.memory.auto_safety_margin);
  auto fits = [&](int64_t n) {
    const auto examples = worst_case_examples(config, family, n, 5);
    reset_peak(device);
    try {
      step.forward_backward(examples, 1.0);
      optimizer.zero_grad();
    } catch (const c10::OutOfMemoryError&) {
      optimizer.zero_grad();
      release_cached_memory();
      spdlog::info("micro_batch_size=auto: {} does not fit (out of memory)", n);
      return false;
    }
    const auto peak = static_cast<double>(memory_now(device).peak);
    const bool ok = capacity == 0 || peak <= allowed;
    spdlog::info("micro_batch_size=auto: {} at maximum lengths peaks at {}{}", n, human_bytes(peak),
                 ok ? "" : " (inside the safety margin: too close)");
    return ok;
  };
  int64_t good = 0, bad = batch_size + 1;
  for (int64_t n = 1;; n = std::min(2 * n, batch_size)) {
    if (!fits(n)) {
      bad = n;
      break;
    }
    good = n;
    if (n == batch_size) break;
  }
  while (bad - good > 1) {
    const int64_t mid = (good + bad) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

// Validation loss with its own micro-batch: an out-of-memory error halves it and retries the same batch,
// and never touches the training policy.
namespace {

// The summed loss and target tokens of one collated micro-batch without autograd: through the full logits, or with
// `loss_chunk_size` > 0 through the LM head over that many trained positions at a time, so that with a large
// vocabulary evaluation never holds more logits than a training step's chunked loss does.
std::pair<double, int64_t> evaluation_loss(LanguageModel& model, const Batch& batch, int64_t loss_chunk_size) {
  if (loss_chunk_size <= 0) {
    const auto out = forward_loss(model, batch);
    return {out.loss_sum.item<double>(), out.target_tokens};
  }
  const auto [hidden, targets] = model.hidden_and_targets(batch);
  const at::Tensor flat_targets = targets.reshape({-1});
  const at::Tensor rows = (flat_targets != -100).nonzero().reshape({-1});
  const at::Tensor flat_hidden = hidden.reshape({-1, hidden.size(-1)});
  double sum = 0;
  for (int64_t begin = 0; begin < rows.numel(); begin += loss_chunk_size) {
    const at::Tensor index = rows.narrow(0, begin, std::min(loss_chunk_size, rows.numel() - begin));
    const at::Tensor logits = model.lm_head(flat_hidden.index_select(0, index));
    sum += at::cross_entropy_loss(logits.to(at::kFloat), flat_targets.index_select(0, index), {}, at::Reduction::Sum,
                                  -100)
               .item<double>();
  }
  return {sum, rows.numel()};
}

}  // namespace

EvalResult evaluate(LanguageModel& model, DataLoader& loader, int64_t& micro, const Config& config,
                    const c10::Device& device, int32_t pad_id, int64_t loss_chunk_size) {
  at::NoGradGuard no_grad;
  model.train(false);
  EvalResult result;
  double loss_sum = 0;
  int64_t batches = 0;
  while (auto batch = loader.next()) {
    for (;;) {
      try {
        double part_sum = 0;
        int64_t part_tokens = 0;
        const std::span<const Example> examples(batch->examples);
        for (const auto& [begin, count] : split_counts(static_cast<int64_t>(examples.size()), micro)) {
          const auto collated = collate(examples.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)),
                                        pad_id, device);
          const auto [sum, tokens] =
              evaluation_loss(model, {collated.input_ids, collated.attention_mask, collated.labels, {}}, loss_chunk_size);
          part_sum += sum;
          part_tokens += tokens;
        }
        loss_sum += part_sum;
        result.tokens += part_tokens;
        break;
      } catch (const c10::OutOfMemoryError&) {
        release_cached_memory();
        if (micro <= 1) throw;
        spdlog::warn("evaluation: out of memory; evaluation micro-batch {} -> {}", micro, micro / 2);
        micro /= 2;
      }
    }
    if (config.evaluation.max_batches > 0 && ++batches >= config.evaluation.max_batches) break;
  }
  model.train(true);
  result.loss = result.tokens ? loss_sum / static_cast<double>(result.tokens) : 0.0;
  return result;
}

namespace {

// The tokenizer files beside the saved weights, so a saved directory is complete for from_pretrained and for
// `trainer generate --prompt`.
void copy_tokenizer_files(const Config& config, const fs::path& to) {
  fs::path from(config.tokenizer.path.empty() ? config.model.path : config.tokenizer.path);
  if (!fs::is_directory(from)) from = from.parent_path();
  trainer::copy_tokenizer_files(from.string(), to.string());
}

// What checkpoints and the final save hold: the full model, or with LoRA the adapter alone, in PEFT's format.
struct TrainedWeights {
  LanguageModel& model;
  const LoraAdapters* lora = nullptr;
  std::string base_model;  // the adapter's base_model_name_or_path
};

void save_trained(const TrainedWeights& trained, const fs::path& dir, const Config& config) {
  if (trained.lora)
    write_peft_adapter(dir.string(), to_peft_adapter(*trained.lora, trained.model, trained.base_model));
  else
    save_model(trained.model, dir.string(), config.checkpoint.max_shard_size.bytes);
  copy_tokenizer_files(config, dir);
}

// LoRA on the frozen base, restored from `resume_dir` when resuming. The adapter's base is model.path; a randomly
// initialised base (the tiny demos) is saved to output_dir/base at the start of a run (a resumed run recreates
// the same one from training.seed), so the adapter has a base to be loaded onto.
std::unique_ptr<LoraAdapters> apply_lora_for_training(LanguageModel& model, const Config& config,
                                                      const std::optional<fs::path>& resume_dir, std::string& base) {
  base = fs::absolute(config.model.path).lexically_normal().string();
  if (config.model.init == ModelInit::kRandom) {
    const fs::path saved = fs::absolute(fs::path(config.checkpoint.output_dir) / "base").lexically_normal();
    if (!resume_dir || (!fs::exists(saved / kWeightsFileName) && !fs::exists(saved / kWeightsIndexName))) {
      save_model(model, saved.string(), config.checkpoint.max_shard_size.bytes);
      copy_tokenizer_files(config, saved);
    }
    base = saved.string();
  }
  auto adapters = apply_lora(model, config.lora, static_cast<uint64_t>(config.training.seed));
  if (resume_dir) load_lora_weights(*adapters, read_peft_adapter(resume_dir->string()), resume_dir->string());
  const auto& applied = adapters->config();
  std::string targets;
  for (const auto& t : applied.target_modules) targets += (targets.empty() ? "" : ",") + t;
  spdlog::info("LoRA r={} alpha={} (scale {:.4g}{}) dropout={} on {} layers ({}); base frozen{}; {} trainable parameters",
               applied.r, applied.alpha, lora_scaling(applied.alpha, applied.r, applied.rslora),
               applied.rslora ? ", rsLoRA" : "", applied.dropout, adapters->layers().size(), targets,
               applied.base_in_bf16 ? " in bf16" : "", adapters->trainable_parameters());
  return adapters;
}

// Generations from evaluation.sample_prompts, logged as text: what the model has learned, at a glance.
void log_samples(LanguageModel& model, const Tokenizer& tokenizer, const Config& config, const c10::Device& device,
                 int64_t step, Reporter& reporter) {
  for (std::size_t i = 0; i < config.evaluation.sample_prompts.size(); ++i) {
    const auto& prompt = config.evaluation.sample_prompts[i];
    const auto ids = prompt_ids(model, tokenizer, prompt, config.tokenizer.add_eos);
    if (ids.empty()) continue;
    GenerateOptions options;
    options.max_new_tokens = config.evaluation.max_new_tokens;
    const auto generated = generate(model, at::tensor(ids, at::kLong).unsqueeze(0).to(device), options);
    const std::vector<int32_t> out(generated.begin(), generated.end());
    reporter.on_sample(step, i, prompt, tokenizer.decode(out));
  }
}

void write_checkpoint_files(const fs::path& temp_dir, int64_t step, const c10::Device& device,
                            const TrainedWeights& trained, const Optimizer& optimizer,
                            const nlohmann::json& policy_state, const LoaderCursor& cursor, int64_t tokens_seen,
                            const Config& config, const nlohmann::json& data_fingerprint);
std::optional<fs::path> newest_checkpoint(const fs::path& dir);

// A checkpoint: the model in Hugging Face format, the optimizer state, and the train state with the resolved
// config, written to a temporary directory and renamed into place, so a crash leaves the previous one intact.
// CheckpointRetention removes old ones afterwards.
// `cursor` and `policy_state` are those of the moment after `step`: after an out-of-memory stop they are the ones
// from before the failed batch, so a resume trains that batch again.
// `on_disk`: this run's state at `step` is already checkpoint-N (a stop right after a periodic checkpoint, or right
// after resuming from it): it is kept as it is, never deleted and rewritten, so no moment exists without it.
// Another checkpoint-N (an earlier run's in the same output_dir) is replaced only once the new one is whole.
void write_checkpoint(const fs::path& output_dir, int64_t step, bool on_disk, const c10::Device& device,
                      const TrainedWeights& trained,
                      const Optimizer& optimizer, const nlohmann::json& policy_state, const LoaderCursor& cursor,
                      int64_t tokens_seen, const Config& config, const nlohmann::json& data_fingerprint) {
  const fs::path final_dir = output_dir / ("checkpoint-" + std::to_string(step));
  if (on_disk && fs::exists(final_dir / "COMPLETE")) {
    spdlog::info("checkpoint step {}: {} (already written)", step, final_dir.string());
    return;
  }
  const fs::path temp_dir = output_dir / (".checkpoint-" + std::to_string(step) + ".tmp");
  fs::remove_all(temp_dir);
  try {
    write_checkpoint_files(temp_dir, step, device, trained, optimizer, policy_state, cursor, tokens_seen, config,
                           data_fingerprint);
  } catch (const Error& e) {
    // A full disk (or any write error): the partial directory goes, the previous checkpoint stays the newest, and
    // the message says what the checkpoint needs against what is free.
    std::error_code ignored;
    fs::remove_all(temp_dir, ignored);
    int64_t needed = trained.lora ? 4 * trained.lora->trainable_parameters() : parameter_bytes(trained.model);
    for (const auto& [name, tensor] : optimizer.state_tensors()) needed += static_cast<int64_t>(tensor.nbytes());
    const auto space = fs::space(output_dir, ignored);
    const auto previous = newest_checkpoint(output_dir);
    throw DataError(fmt::format("checkpoint step {} could not be written: {}\n  the checkpoint needs about {} "
                                "(weights and optimizer state); {} {}\n  {}",
                                step, e.what(), human_bytes(static_cast<double>(needed)),
                                ignored ? std::string("free space unknown on")
                                        : human_bytes(static_cast<double>(space.available)) + " free on",
                                output_dir.string(),
                                previous ? "the newest complete checkpoint is still " + previous->string()
                                         : std::string("no earlier checkpoint of this run exists")),
                    "free space there (or set checkpoint.output_dir to a disk with room), then continue with "
                    "--resume");
  }
  const fs::path replaced = output_dir / (".checkpoint-" + std::to_string(step) + ".replaced");
  fs::remove_all(replaced);
  if (fs::exists(final_dir)) fs::rename(final_dir, replaced);
  fs::rename(temp_dir, final_dir);
  // Written last: a checkpoint without it is not trusted.
  write_text_file((final_dir / "COMPLETE").string(), std::to_string(step) + "\n");
  fs::remove_all(replaced);
  spdlog::info("checkpoint step {}: {}", step, final_dir.string());
}

// What checkpoint-N holds, written into `temp_dir` (see write_checkpoint).
void write_checkpoint_files(const fs::path& temp_dir, int64_t step, const c10::Device& device,
                            const TrainedWeights& trained, const Optimizer& optimizer,
                            const nlohmann::json& policy_state, const LoaderCursor& cursor, int64_t tokens_seen,
                            const Config& config, const nlohmann::json& data_fingerprint) {
  save_trained(trained, temp_dir, config);
  auto tensors = optimizer.state_tensors();
  // LibTorch's generator state. Dropout no longer draws from it (its masks are keyed by the step); kept for
  // anything else that does, and so that older and newer checkpoints read alike.
  tensors.emplace_back("rng.cpu", get_rng_state(at::Device(at::kCPU)));
  if (!device.is_cpu()) tensors.emplace_back("rng." + device.str(), get_rng_state(device));
  write_safetensors((temp_dir / "optimizer.safetensors").string(), tensors, {});
  nlohmann::json state = {{"version", kCheckpointVersion},
                                {"step", step},
                                {"optimizer_steps", optimizer.steps()},
                                {"tokens_seen", tokens_seen},
                                {"data_cursor", cursor_to_json(cursor)},
                                {"memory_policy", policy_state},
                                {"config", nlohmann::json::parse(config_to_json(config))},
                                {"data_fingerprint", data_fingerprint}};
  if (trained.lora) state["base_model_config"] = trained.model.hf_config();  // an adapter has no config.json
  write_text_file((temp_dir / "train_state.json").string(), state.dump(2) + "\n");
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

// The newest checkpoint-N in `dir` that was completely written.
std::optional<fs::path> newest_checkpoint(const fs::path& dir) {
  const auto all = checkpoint_dirs(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (fs::exists(it->second / "COMPLETE")) return it->second;
  return std::nullopt;
}


// A checkpoint of another architecture cannot continue this run: its config.json (a LoRA checkpoint's base
// model config) must equal model.path's, and a LoRA checkpoint needs the same adapter shape and scaling.
void check_same_architecture(const fs::path& checkpoint, const Config& config) {
  const auto state = read_json_file((checkpoint / "train_state.json").string());
  const auto version = state.value("version", 0);
  if (version != kCheckpointVersion)
    throw DataError("checkpoint " + checkpoint.string() + " has format version " + std::to_string(version) +
                        "; this trainer reads version " + std::to_string(kCheckpointVersion),
                    version > kCheckpointVersion ? "resume it with the trainer release that wrote it, or a newer one"
                                                 : "start a new run; its final model loads with model.path");
  const auto& saved_lora = state.at("config").at("lora");
  if (saved_lora.at("enabled").get<bool>() != config.lora.enabled)
    throw DataError("checkpoint " + checkpoint.string() + " holds " +
                        (config.lora.enabled ? "a full model, not a LoRA adapter" : "a LoRA adapter, not a full model"),
                    "resume with the lora.enabled setting the checkpoint was trained with");
  if (config.lora.enabled) {
    const auto current_lora = nlohmann::json::parse(config_to_json(config)).at("lora");
    std::string changed;
    for (const char* key : {"r", "alpha", "target_modules", "rslora"})
      if (saved_lora.at(key) != current_lora.at(key))
        changed += std::string("\n  lora.") + key + ": checkpoint " + saved_lora.at(key).dump() + ", config " +
                   current_lora.at(key).dump();
    if (!changed.empty())
      throw DataError("checkpoint " + checkpoint.string() + " was trained with other LoRA settings:" + changed,
                      "resume with the lora settings of the checkpoint");
  }
  auto saved = config.lora.enabled ? state.at("base_model_config")
                                   : read_json_file((checkpoint / "config.json").string());
  auto current = read_json_file((fs::path(config.model.path) / "config.json").string());
  std::string differences;
  for (const auto& [key, value] : current.items()) {
    if (key == "transformers_version") continue;
    if (!saved.contains(key) || saved[key] != value)
      differences += "\n  " + key + ": checkpoint " + (saved.contains(key) ? saved[key].dump() : "(missing)") +
                     ", model.path " + value.dump();
  }
  if (!differences.empty())
    throw DataError("checkpoint " + checkpoint.string() + " belongs to another model than model.path:" + differences,
                    "resume with the model.path the checkpoint was trained from");
}

int run_training(const Config& config, const ResolvedDevice& resolved, const TrainOptions& train_options,
                 Reporter& reporter) {
  c10::Device device = resolved.device;  // changes only when the run moves (train/device_move.h)
  install_stop_handlers();  // from here a signal stops at the next step boundary (with a checkpoint)
  if (config.memory.snapshot_on_oom) {
    if (cuda_extras_available() && device.is_cuda()) start_recording_allocations();
    else spdlog::warn("memory.snapshot_on_oom: allocator snapshots need a CUDA device and a CUDA build of trainer; "
                      "none will be written on {}", device.str());
  }
  if (train_options.merge && !config.lora.enabled)
    throw UsageError("--merge merges LoRA adapters, but lora.enabled=false", "add --set lora.enabled=true, or drop --merge");
  if (train_options.merge && !config.checkpoint.save_final)
    throw UsageError("--merge merges the final adapter, but checkpoint.save_final=false",
                     "drop --merge, or set checkpoint.save_final=true");
  if (config.memory.limit.bytes > 0) {
    if (device.is_cpu()) set_cpu_budget_limit(static_cast<int64_t>(config.memory.limit.bytes));
    else cap_device_memory(device, static_cast<int64_t>(config.memory.limit.bytes));
  }

  // Without tokenizer files in model.path: pre-tokenized records only (trainer/tokenizer.h).
  const auto tokenizer = load_run_tokenizer(config, /*samples=*/true);
  // A LoRA base held in bf16 is loaded in bf16: a 7B model never exists in fp32 on the device.
  const bool bf16_weights = config.precision.mode == PrecisionMode::kBf16 || (config.lora.enabled && config.lora.base_in_bf16);
  const auto dtype = bf16_weights ? at::kBFloat16 : at::kFloat;
  std::optional<fs::path> resume_dir;
  if (!train_options.resume_from.empty()) {
    resume_dir = fs::path(train_options.resume_from);
    if (!fs::exists(*resume_dir / "COMPLETE"))
      throw DataError(train_options.resume_from + " is not a complete checkpoint (no COMPLETE marker)",
                      "resume from a checkpoint-N directory that trainer finished writing");
  } else if (train_options.resume) {
    resume_dir = newest_checkpoint(config.checkpoint.output_dir);
    if (!resume_dir)
      throw DataError("--resume: no complete checkpoint in " + config.checkpoint.output_dir,
                      "start without --resume, or point checkpoint.output_dir at the run to continue");
  }
  // Before anything is loaded: the checkpoint's model, then the settings (one line with every difference; the
  // ones that would make it another run are refused unless --allow-config-change), then the data.
  nlohmann::json resume_state;
  bool data_changed = false;
  if (resume_dir) {
    check_same_architecture(*resume_dir, config);
    resume_state = read_json_file((*resume_dir / "train_state.json").string());
    check_resume_config(resume_state.at("config"), config, resume_dir->string(), train_options.allow_config_change);
  }
  const nlohmann::json fingerprint = data_fingerprint(config, *tokenizer);
  if (resume_dir)
    data_changed = check_resume_data(resume_state, fingerprint, resume_dir->string(), train_options.allow_data_change);
  // What must fit before the first example (weights, LoRA, optimizer state): an error says how much that is.
  auto fixed_part = [&](const char* what, auto&& build) {
    try {
      return build();
    } catch (const c10::OutOfMemoryError& e) {
      throw fixed_memory_error(config, device, what, e);
    }
  };
  // With LoRA the base always comes from model.path; the checkpoint holds only the adapter.
  auto model = fixed_part("the model's weights", [&] {
    return resume_dir && !config.lora.enabled
               ? load_model(resume_dir->string(), ModelInit::kPretrained,
                            at::TensorOptions().dtype(dtype).device(device))
               : load_model(config.model.path, config.model.init, at::TensorOptions().dtype(dtype).device(device),
                            static_cast<uint64_t>(config.training.seed));
  });
  model->train(true);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  std::unique_ptr<LoraAdapters> lora;
  std::string lora_base;
  if (config.lora.enabled)
    lora = fixed_part("the LoRA adapters", [&] { return apply_lora_for_training(*model, config, resume_dir, lora_base); });
  const TrainedWeights trained{*model, lora.get(), lora_base};
  if (config.training.activation_checkpointing) apply_activation_checkpointing(*model);
  const DataFamily family = model->family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  if (tokenizer->vocab_size() > model->vocab_size())
    throw DataError("the tokenizer " + tokenizer->source() + " has " + std::to_string(tokenizer->vocab_size()) +
                        " tokens but the model's vocabulary has " + std::to_string(model->vocab_size()),
                    "tokenizer.path must belong to model.path");
  const int32_t pad_id = tokenizer->pad_id().value_or(tokenizer->eos_id().value_or(0));

  auto loader = make_train_loader(config, *tokenizer, family);
  const int64_t per_epoch = static_cast<int64_t>(
      (loader->examples_per_epoch() + static_cast<uint64_t>(config.training.batch_size) - 1) /
      static_cast<uint64_t>(config.training.batch_size));
  const int64_t total_steps = config.training.max_steps > 0 ? config.training.max_steps : per_epoch * config.training.epochs;

  // Only trainable parameters get state: with LoRA, the adapters (the frozen base has no gradients).
  const char* state_name = config.optimizer.name == OptimizerName::kAdafactor
                               ? "the Adafactor state (row and column statistics)"
                               : "the AdamW state (two moments per trainable parameter)";
  std::unique_ptr<Optimizer> optimizer = fixed_part(state_name, [&] {
    return make_optimizer(lora ? static_cast<Module&>(*lora) : *model, config.optimizer,
                          static_cast<uint64_t>(config.training.seed));
  });
  MemoryPolicy policy(config.memory, config.training);
  StepOptions options;
  options.device = device;
  options.pad_id = pad_id;
  options.precision = config.precision.mode;
  options.max_grad_norm = config.training.max_grad_norm;
  options.max_retries = config.memory.max_retries;
  options.chunked_loss = config.training.chunked_loss;
  options.seed = static_cast<uint64_t>(config.training.seed);
  options.packing = config.data.packing;
  options.pack_capacity = pack_capacity(config.data, family);
  TrainStep step(*model, *optimizer, policy, options);
  DeviceLadder device_ladder(config, device);
  int64_t tokens_seen = 0;
  int64_t step_index = 0;
  if (resume_dir) {
    const auto& state = resume_state;
    const auto file = SafetensorsFile::open((*resume_dir / "optimizer.safetensors").string());
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& t : file.tensors())
      if (!t.name.starts_with("rng.")) tensors.emplace_back(t.name, file.load(t.name, at::kFloat));
    optimizer->load_state(tensors, state.at("optimizer_steps").get<int64_t>(),
                          (*resume_dir / "optimizer.safetensors").string());
    const LoaderCursor saved_cursor = cursor_from_json(state.at("data_cursor"));
    loader->restore(data_changed ? new_epoch_cursor(saved_cursor) : saved_cursor);
    policy.restore(state.at("memory_policy"));
    step_index = state.at("step").get<int64_t>();
    tokens_seen = state.at("tokens_seen").get<int64_t>();
    if (file.find("rng.cpu")) set_rng_state(at::Device(at::kCPU), file.load("rng.cpu"));
    if (!device.is_cpu()) {
      const std::string name = "rng." + device.str();
      if (file.find(name)) set_rng_state(device, file.load(name));  // dropout does not need it (keyed masks)
    }
    spdlog::info("resuming from {} at step {} (micro-batch {}){}", resume_dir->string(), step_index,
                 policy.micro_batch(),
                 data_changed ? fmt::format("; the data changed: epoch {} starts over it", loader->cursor().epoch + 1)
                              : std::string());
  } else if (config.training.micro_batch_size.is_auto && !policy.by_tokens()) {
    const int64_t probed = probe_micro_batch(step, *optimizer, config, family, device);
    if (probed == 0)
      throw OutOfMemoryAtFloor("not even one example of the maximum lengths fits for micro_batch_size=auto",
                               "lower data.max_length / max_input_length / max_target_length, turn on "
                               "training.activation_checkpointing and training.chunked_loss, or raise memory.limit");
    policy.set_micro_batch(probed, 0, "micro_batch_size=auto probe");
  }

  std::unique_ptr<DataLoader> validation;
  // Evaluation's own micro-batch (examples); "auto" starts from training's (in token mode: what its budget holds
  // at the maximum lengths).
  const int64_t longest = max_example_tokens(config.data, family == DataFamily::kSeq2Seq);
  int64_t eval_micro = !config.evaluation.micro_batch_size.is_auto ? config.evaluation.micro_batch_size.value
                       : policy.by_tokens() ? std::max<int64_t>(1, policy.micro_batch() / std::max<int64_t>(1, longest))
                                            : policy.micro_batch();
  const fs::path output_dir(config.checkpoint.output_dir);
  fs::create_directories(output_dir);
  if (!resume_dir)
    if (const auto earlier = newest_checkpoint(output_dir))
      spdlog::warn("{} already holds checkpoints of an earlier run (newest {}); this run starts from step 0 and "
                   "writes its own beside them. To continue that run instead, stop and add --resume",
                   output_dir.string(), earlier->filename().string());
  CheckpointRetention retention(output_dir, config.checkpoint.keep_last, config.checkpoint.keep_best);
  retention.start(resume_dir ? std::optional<int64_t>(step_index) : std::nullopt);
  double last_eval = std::nan("");
  int64_t last_eval_step = -1;
  // Checkpoint-N, then what stays (keep_last, keep_best: by the validation loss at this step), then the webhook.
  // The step whose state checkpoint-N in output_dir holds: the one resumed from, then each one written.
  std::optional<int64_t> on_disk_step;
  std::error_code same_error;
  if (resume_dir && fs::equivalent(*resume_dir, output_dir / ("checkpoint-" + std::to_string(step_index)), same_error))
    on_disk_step = step_index;
  auto checkpoint = [&](const LoaderCursor& cursor, const nlohmann::json& policy_state) {
    write_checkpoint(output_dir, step_index, on_disk_step == step_index, device, trained, *optimizer, policy_state,
                     cursor, tokens_seen, config, fingerprint);
    on_disk_step = step_index;
    retention.on_checkpoint(step_index, last_eval_step == step_index ? std::optional<double>(last_eval) : std::nullopt);
    const auto path = (output_dir / ("checkpoint-" + std::to_string(step_index))).string();
    reporter.on_checkpoint(step_index, path);
    return path;
  };

  reset_peak(device);  // the summary's peak is training's, not the micro-batch probe's
  const int64_t start_step = step_index, start_tokens = tokens_seen;
  reporter.on_start({model->model_type(), count_parameters(*model), optimizer->trainable_parameters(), total_steps,
                     policy.micro_batch(), start_step, start_tokens, resume_dir ? resume_dir->string() : ""});
  int64_t current_epoch = loader->cursor().epoch;
  while (step_index < total_steps) {
    if (const int signal = stop_requested()) {
      reporter.on_stopped(signal, step_index, checkpoint(loader->cursor(), policy.state()));
      return signal == SIGINT ? kExitInterrupted : kExitOk;
    }
    const auto step_start = Clock::now();
    const LoaderCursor cursor_before = loader->cursor();  // for a checkpoint of this state if the step cannot fit
    const nlohmann::json policy_before = policy.state();
    auto batch = loader->next();
    if (batch && batch->epoch != current_epoch) {
      const auto d = loader->stats();
      spdlog::info("epoch {} done (data so far: records {} read, bad records skipped {}, truncated {}, too long and "
                   "skipped {})", current_epoch + 1, d.records_read, d.bad_records_skipped, d.truncated,
                   d.overlength_skipped);
      current_epoch = batch->epoch;
    }
    if (!batch) break;
    const double lr = scheduled_lr(config.scheduler, config.optimizer.lr, step_index, total_steps);
    StepResult result;
    for (;;) try {
      result = step.run(*batch, step_index + 1, lr);
      break;
    } catch (const OutOfMemoryAtFloor& e) {
      // ---- the end of the memory ladder: move the run to a device with more room, run the same step there ----
      if (const auto moved = device_ladder.move(step_index + 1, device, {*model, lora.get(), *optimizer}, policy,
                                                e.what())) {
        device = *moved;
        step.set_device(device);
        continue;
      }
      // ---- no move left: stop with a report and a checkpoint of the last completed step ----
      dump_snapshot_once(output_dir, step_index + 1);
      std::string report = memory_report(config, device, *model, lora.get(), *optimizer, policy);
      if (const auto why_not = device_ladder.why_not_moved(); !why_not.empty()) report += "\n  device moves: " + why_not;
      const auto saved = checkpoint(cursor_before, policy_before);
      throw OutOfMemoryAtFloor(std::string(e.what()) + "\n" + report + "\nthe last completed step (" +
                                   std::to_string(step_index) + ") is saved in " + saved +
                                   "; after changing the config, continue with --resume-from " + saved,
                               floor_suggestions(config, device, family == DataFamily::kSeq2Seq));
    }
    ++step_index;
    if (result.retries > 0) dump_snapshot_once(output_dir, step_index);
    tokens_seen += result.target_tokens;
    const auto memory = memory_now(device);
    reporter.on_step({step_index, result.loss, lr, result.grad_norm, result.target_tokens, tokens_seen,
                      result.micro_batch, result.micro_steps, result.retries,
                      static_cast<int64_t>(policy.adaptations().size()), device_ladder.moves(), memory.allocated,
                      memory.peak,
                      std::chrono::duration<double>(Clock::now() - step_start).count()});
    const bool eval_now = config.evaluation.every_steps > 0 && step_index % config.evaluation.every_steps == 0;
    if (eval_now || step_index == total_steps) {
      validation = make_validation_loader(config, *tokenizer, family, config.training.batch_size);
      if (validation) {
        const auto eval = evaluate(*model, *validation, eval_micro, config, device, pad_id,
                                   step.chunked_loss() ? step.loss_chunk_size() : 0);
        last_eval = eval.loss;
        last_eval_step = step_index;
        reporter.on_eval(step_index, eval.loss, eval.tokens);
      }
      log_samples(*model, *tokenizer, config, device, step_index, reporter);
    }
    if (config.checkpoint.every_steps > 0 && step_index % config.checkpoint.every_steps == 0 && step_index < total_steps)
      checkpoint(loader->cursor(), policy.state());
    if (config.memory.empty_cache_every > 0 && step_index % config.memory.empty_cache_every == 0) release_cached_memory();
  }

  // The end of the run: a checkpoint to continue from (a longer max_steps, more epochs), then the model itself.
  checkpoint(loader->cursor(), policy.state());
  if (config.checkpoint.save_final) save_trained(trained, output_dir / "final", config);
  if (train_options.merge) {
    MergeOptions merge;
    merge.adapter_dir = (output_dir / "final").string();
    merge.output_dir = (output_dir / "final-merged").string();
    merge.max_shard_bytes = config.checkpoint.max_shard_size.bytes;
    merge_adapter(merge);
  }
  RunSummary summary;
  summary.steps = step_index;
  summary.tokens_seen = tokens_seen;
  summary.data = loader->stats();
  summary.memory_peak = memory_now(device).peak;
  summary.adaptations = policy.adaptations();
  summary.escalations = policy.escalations();
  if (config.checkpoint.save_final) summary.model_dir = (output_dir / "final").string();
  summary.model_is_adapter = lora != nullptr;
  if (train_options.merge) summary.merged_dir = (output_dir / "final-merged").string();
  if (const auto& best = retention.best()) {
    summary.best_checkpoint = best->path.string();
    summary.best_eval_loss = best->eval_loss;
  }
  reporter.on_finish(std::move(summary));
  return kExitOk;
}

}  // namespace

int train(const Config& config, const ResolvedDevice& resolved, const TrainOptions& train_options, std::ostream& out) {
  Reporter reporter(config, out);
  try {
    return run_training(config, resolved, train_options, reporter);
  } catch (const std::exception& error) {
    reporter.on_failure(error);  // the webhook hears of it; main reports it and picks the exit code
    throw;
  }
}

}  // namespace trainer
