// The training loop (see trainer.h).
#include "train/trainer.h"

#include <chrono>
#include <csignal>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
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
#include "distributed/checkpoint_parts.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "models/lora.h"
#include "models/weights.h"
#include "train/checkpoint_dir.h"
#include "train/checkpointing.h"
#include "train/device_move.h"
#include "train/fixed_memory.h"
#include "train/grad_scaler.h"
#include "train/optimizer.h"
#include "train/resume_check.h"
#include "train/retention.h"
#include "train/rng.h"
#include "train/signals.h"
#include "train/step.h"
#include "trainer/data.h"
#include "trainer/device.h"
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
  return largest_that_fits(batch_size, fits);
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
                    const c10::Device& device, int32_t pad_id, int64_t loss_chunk_size,
                    distributed::Communicator* world) {
  at::NoGradGuard no_grad;
  model.train(false);
  EvalResult result;
  double loss_sum = 0;
  int64_t batches = 0, local_examples = 0;
  // Data parallelism: out of memory at evaluation micro-batch 1 on this rank. It stops evaluating and says so in the
  // final sum, so every rank stops with the same error instead of waiting for a rank that left. It still reads the
  // batches the others read: each rank tokenizes a share of the records for all (RecordShare), so its exchanges
  // must go on.
  bool failed = false;
  for (;;) {
    auto batch = loader.next();
    if (!batch) break;
    while (!failed) {
      try {
        double part_sum = 0;
        int64_t part_tokens = 0;
        std::span<const Example> examples(batch->examples);
        if (world) {  // this rank's share: disjoint, and together the whole batch
          const auto [first, count] = distributed::share_of(examples, world->rank(), world->world_size(), false);
          examples = examples.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(count));
        }
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
        local_examples += static_cast<int64_t>(examples.size());
        break;
      } catch (const c10::OutOfMemoryError& e) {
        release_cached_memory();
        if (micro <= 1 && !world) throw;
        if (micro <= 1) {
          spdlog::warn("evaluation: rank {}: out of memory at evaluation micro-batch 1: {}", world->rank(),
                       std::string(e.what_without_backtrace()).substr(0, 200));
          failed = true;
          break;
        }
        spdlog::warn("evaluation: out of memory; evaluation micro-batch {} -> {}", micro, micro / 2);
        micro /= 2;
      }
    }
    if (config.evaluation.max_batches > 0 && ++batches >= config.evaluation.max_batches) break;
  }
  model.train(true);
  if (world) {  // the whole validation set's sum and count (exact in doubles up to 2^53 tokens)
    spdlog::debug("evaluation: rank {} of {} evaluated its share: {} examples, {} target tokens", world->rank(),
                  world->world_size(), local_examples, result.tokens);
    // The sums, then one 0/1 per rank: which ranks ran out of memory at the floor.
    std::vector<double> values(2 + static_cast<std::size_t>(world->world_size()), 0.0);
    values[0] = loss_sum;
    values[1] = static_cast<double>(result.tokens);
    values[2 + static_cast<std::size_t>(world->rank())] = failed ? 1.0 : 0.0;
    const auto sums = world->all_reduce_sum(values, "summing the validation loss");
    std::string failed_ranks;
    for (int r = 0; r < world->world_size(); ++r)
      if (sums[2 + static_cast<std::size_t>(r)] > 0) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
    if (!failed_ranks.empty()) {
      model.train(true);
      throw OutOfMemoryAtFloor("evaluation ran out of memory on rank(s) " + failed_ranks +
                                   " with one example per evaluation micro-batch",
                               "raise memory.limit on those ranks, or lower data.max_length / max_input_length "
                               "(validation examples as long as training's), or set evaluation.every_steps=0");
    }
    loss_sum = sums[0];
    result.tokens = static_cast<int64_t>(std::llround(sums[1]));
  }
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
                                                      const std::optional<fs::path>& resume_dir, std::string& base,
                                                      bool write_base) {
  base = fs::absolute(config.model.path).lexically_normal().string();
  if (config.model.init == ModelInit::kRandom) {
    const fs::path saved = fs::absolute(fs::path(config.checkpoint.output_dir) / "base").lexically_normal();
    if (write_base &&
        (!resume_dir || (!fs::exists(saved / kWeightsFileName) && !fs::exists(saved / kWeightsIndexName)))) {
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

// Sharded optimizer state (distributed.shard_optimizer): every rank writes its part of the optimizer state.
// `files`: the part file of each rank (rank 0's is optimizer.safetensors, with the RNG state). `agree(failed)`:
// every rank's outcome of writing its part (this one failed or not), once all have tried; returns the files that
// failed ("" when none), so COMPLETE is written only once every part is on disk.
struct OptimizerParts {
  std::vector<std::string> files;
  std::function<std::string(bool failed)> agree;
};

void write_checkpoint_files(const fs::path& temp_dir, int64_t step, const c10::Device& device,
                            const TrainedWeights& trained, const Optimizer& optimizer,
                            const nlohmann::json& policy_state, const LoaderCursor& cursor, int64_t tokens_seen,
                            const Config& config, const nlohmann::json& data_fingerprint,
                            const nlohmann::json& scaler_state, const OptimizerParts* parts);

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
                      int64_t tokens_seen, const Config& config, const nlohmann::json& data_fingerprint,
                      const nlohmann::json& scaler_state, const OptimizerParts* parts = nullptr) {
  CheckpointWrite write;
  bool agreed = false;
  write.write_files = [&](const fs::path& temp_dir) {
    write_checkpoint_files(temp_dir, step, device, trained, optimizer, policy_state, cursor, tokens_seen, config,
                           data_fingerprint, scaler_state, parts);
    // COMPLETE only once every rank's part is on disk.
    if (parts) {
      agreed = true;
      if (const std::string missing = parts->agree(false); !missing.empty())
        throw DataError("the optimizer state part(s) " + missing + " could not be written by their ranks",
                        "see those ranks' errors");
    }
  };
  write.on_failure = [&] {
    if (parts && !agreed) parts->agree(true);  // the other ranks learn that this checkpoint failed
  };
  write.needed_bytes = trained.lora ? 4 * trained.lora->trainable_parameters() : parameter_bytes(trained.model);
  for (const auto& [name, tensor] : optimizer.state_tensors())
    write.needed_bytes += static_cast<int64_t>(tensor.nbytes());
  write.prepared = parts != nullptr;  // with parts the caller prepared it, and the other ranks write into it
  write_checkpoint_dir(output_dir, step, on_disk, write);
}

// What checkpoint-N holds, written into `temp_dir` (see write_checkpoint).
void write_checkpoint_files(const fs::path& temp_dir, int64_t step, const c10::Device& device,
                            const TrainedWeights& trained, const Optimizer& optimizer,
                            const nlohmann::json& policy_state, const LoaderCursor& cursor, int64_t tokens_seen,
                            const Config& config, const nlohmann::json& data_fingerprint,
                            const nlohmann::json& scaler_state, const OptimizerParts* parts) {
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
  // Sharded: the optimizer state is the union of these files (each rank's parameters); any world size reads it.
  if (parts) state["optimizer_files"] = parts->files;
  if (trained.lora) state["base_model_config"] = trained.model.hf_config();  // an adapter has no config.json
  // fp16-mixed: the loss scale and its growth tracker, so a resume scales and skips as the uninterrupted run would
  // (absent in other modes and in older checkpoints, which load as before).
  if (!scaler_state.is_null()) state["loss_scaler"] = scaler_state;
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

// ---- the run, in phases -------------------------------------------------------------------------------------

// What a resume continues from: the checkpoint, its train state, and whether the data changed since.
struct ResumePoint {
  std::optional<fs::path> dir;
  nlohmann::json state;
  bool data_changed = false;
};

// The checkpoint --resume / --resume-from names, if any (checked to be complete).
std::optional<fs::path> find_resume_dir(const Config& config, const TrainOptions& train_options) {
  if (!train_options.resume_from.empty()) {
    fs::path dir(train_options.resume_from);
    if (!fs::exists(dir / "COMPLETE"))
      throw DataError(train_options.resume_from + " is not a complete checkpoint (no COMPLETE marker)",
                      "resume from a checkpoint-N directory that trainer finished writing");
    return dir;
  }
  if (!train_options.resume && !train_options.resume_if_present) return std::nullopt;
  auto dir = newest_complete_checkpoint(config.checkpoint.output_dir);
  if (!dir && train_options.resume_if_present) {
    spdlog::info("--resume-if-present: no complete checkpoint in {} yet; starting from the beginning",
                 config.checkpoint.output_dir);
    return std::nullopt;
  }
  if (!dir)
    throw DataError("--resume: no complete checkpoint in " + config.checkpoint.output_dir,
                    "start without --resume, or point checkpoint.output_dir at the run to continue");
  return dir;
}

// Options that contradict each other, the memory budget, allocator recording: before anything is loaded.
void prepare_run(const Config& config, const c10::Device& device, const TrainOptions& train_options) {
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
}

// One training run over explicit state: set_up() loads everything (model, LoRA, optimizer, data, the resumed
// state), loop() runs the optimizer steps, finish() saves and summarises. With a communicator (data parallelism)
// every rank runs the same phases; rank 0 alone writes files and reports.
class TrainingRun {
 public:
  TrainingRun(const Config& config, const c10::Device& device, const TrainOptions& train_options, Reporter& reporter,
              distributed::Communicator* world)
      : config_(config), device_(device), train_options_(train_options), reporter_(reporter), world_(world),
        primary_(!world || world->rank() == 0), output_dir_(config.checkpoint.output_dir) {}

  void set_up();
  int loop();  // the exit code when a signal stopped the run; -1 when it ran to its end
  int finish();

 private:
  void check_resume();
  void build_model();
  void build_optimizer_and_step();
  void restore_or_probe();
  void start_retention();
  std::string checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state);
  std::string checkpoint_sharded(const LoaderCursor& cursor, const nlohmann::json& policy_state);
  bool train_one_step();
  void evaluate_and_sample();
  int agreed_stop_signal();

  const Config& config_;
  c10::Device device_;  // changes only when the run moves (train/device_move.h)
  const TrainOptions& train_options_;
  Reporter& reporter_;
  distributed::Communicator* world_;
  const bool primary_;  // writes checkpoints, metrics, the final model
  const fs::path output_dir_;

  std::unique_ptr<Tokenizer> tokenizer_;
  ResumePoint resume_;
  nlohmann::json fingerprint_;
  std::unique_ptr<LanguageModel> model_;
  std::unique_ptr<LoraAdapters> lora_;
  std::string lora_base_;
  std::optional<TrainedWeights> trained_;
  DataFamily family_ = DataFamily::kCausal;
  int32_t pad_id_ = 0;
  std::unique_ptr<DataLoader> loader_;
  int64_t total_steps_ = 0;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<MemoryPolicy> policy_;
  std::unique_ptr<distributed::DataParallel> data_parallel_;
  std::unique_ptr<TrainStep> step_;
  std::unique_ptr<GradScaler> scaler_;  // precision.mode=fp16-mixed
  int64_t skipped_at_start_ = 0;        // the scaler's skipped steps when this process started (resume)
  std::unique_ptr<DeviceLadder> device_ladder_;
  int64_t tokens_seen_ = 0;
  int64_t step_index_ = 0;
  int64_t eval_micro_ = 0;
  std::unique_ptr<CheckpointRetention> retention_;
  double last_eval_ = std::nan("");
  int64_t last_eval_step_ = -1;
  // The step whose state checkpoint-N in output_dir holds: the one resumed from, then each one written.
  std::optional<int64_t> on_disk_step_;
  int64_t current_epoch_ = 0;
};

// What must fit before the first example (weights, LoRA, optimizer state): an error says how much that is.
template <class Build>
auto fixed_part(const Config& config, const c10::Device& device, const char* what, Build&& build) {
  try {
    return build();
  } catch (const c10::OutOfMemoryError& e) {
    throw fixed_memory_error(config, device, what, e);
  }
}

void TrainingRun::set_up() {
  // Without tokenizer files in model.path: pre-tokenized records only (trainer/tokenizer.h).
  tokenizer_ = load_run_tokenizer(config_, /*samples=*/true);
  resume_.dir = find_resume_dir(config_, train_options_);
  check_resume();
  build_model();
  // Data parallelism: each rank tokenizes only its share of the records and gets the rest from the others.
  loader_ = make_train_loader(config_, *tokenizer_, family_, distributed::record_share(world_));
  const int64_t per_epoch = static_cast<int64_t>(
      (loader_->examples_per_epoch() + static_cast<uint64_t>(config_.training.batch_size) - 1) /
      static_cast<uint64_t>(config_.training.batch_size));
  total_steps_ = config_.training.max_steps > 0 ? config_.training.max_steps : per_epoch * config_.training.epochs;
  build_optimizer_and_step();
  restore_or_probe();
  // Evaluation's own micro-batch (examples); "auto" starts from training's (in token mode: what its budget holds
  // at the maximum lengths).
  const int64_t longest = max_example_tokens(config_.data, family_ == DataFamily::kSeq2Seq);
  eval_micro_ = !config_.evaluation.micro_batch_size.is_auto ? config_.evaluation.micro_batch_size.value
                : policy_->by_tokens() ? std::max<int64_t>(1, policy_->micro_batch() / std::max<int64_t>(1, longest))
                                       : policy_->micro_batch();
  start_retention();
}

// Before anything is loaded: the checkpoint's model, then the settings (one line with every difference; the ones
// that would make it another run are refused unless --allow-config-change), then the data.
void TrainingRun::check_resume() {
  if (resume_.dir) {
    check_same_architecture(*resume_.dir, config_);
    resume_.state = read_json_file((*resume_.dir / "train_state.json").string());
    check_resume_config(resume_.state.at("config"), config_, resume_.dir->string(), train_options_.allow_config_change);
  }
  fingerprint_ = data_fingerprint(config_, *tokenizer_);
  if (resume_.dir)
    resume_.data_changed =
        check_resume_data(resume_.state, fingerprint_, resume_.dir->string(), train_options_.allow_data_change);
}

// The model (from model.path, or from the checkpoint when resuming a full fine-tune), LoRA, activation
// checkpointing; with data parallelism rank 0's values on every rank.
void TrainingRun::build_model() {
  // A LoRA base held in bf16 is loaded in bf16: a 7B model never exists in fp32 on the device.
  const bool bf16_weights =
      config_.precision.mode == PrecisionMode::kBf16 || (config_.lora.enabled && config_.lora.base_in_bf16);
  const auto options = at::TensorOptions().dtype(bf16_weights ? at::kBFloat16 : at::kFloat).device(device_);
  // fp16-mixed is refused for the T5 family, known from model.path's config.json: before any weight is read.
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) {
    const fs::path config_json = fs::path(config_.model.path) / "config.json";
    if (fs::exists(config_json))
      check_fp16_supported(read_json_file(config_json.string()).value("model_type", std::string()),
                           config_json.string());
  }
  // With LoRA the base always comes from model.path; the checkpoint holds only the adapter.
  model_ = fixed_part(config_, device_, "the model's weights", [&] {
    return resume_.dir && !config_.lora.enabled
               ? load_model(resume_.dir->string(), ModelInit::kPretrained, options)
               : load_model(config_.model.path, config_.model.init, options,
                            static_cast<uint64_t>(config_.training.seed));
  });
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) check_fp16_supported(model_->model_type(), config_.model.path);
  model_->train(true);
  model_->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  if (config_.lora.enabled)
    lora_ = fixed_part(config_, device_, "the LoRA adapters", [&] {
      return apply_lora_for_training(*model_, config_, resume_.dir, lora_base_, primary_);
    });
  trained_.emplace(TrainedWeights{*model_, lora_.get(), lora_base_});
  if (config_.training.activation_checkpointing) apply_activation_checkpointing(*model_);
  family_ = model_->family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  if (tokenizer_->vocab_size() > model_->vocab_size())
    throw DataError("the tokenizer " + tokenizer_->source() + " has " + std::to_string(tokenizer_->vocab_size()) +
                        " tokens but the model's vocabulary has " + std::to_string(model_->vocab_size()),
                    "tokenizer.path must belong to model.path");
  pad_id_ = tokenizer_->pad_id().value_or(tokenizer_->eos_id().value_or(0));
  if (world_) {
    std::vector<at::Tensor> all;
    model_->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    if (lora_) lora_->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    world_->broadcast(all);
  }
}

void TrainingRun::build_optimizer_and_step() {
  // Only trainable parameters get state: with LoRA, the adapters (the frozen base has no gradients).
  const char* state_name = config_.optimizer.name == OptimizerName::kAdafactor
                               ? "the Adafactor state (row and column statistics)"
                               : "the AdamW state (two moments per trainable parameter)";
  Module& trainable = lora_ ? static_cast<Module&>(*lora_) : *model_;
  // distributed.shard_optimizer (ZeRO-1): this rank's state covers its share of the parameters only.
  OptimizerShard shard;
  if (world_ && config_.distributed.shard_optimizer) shard = {world_->rank(), world_->world_size()};
  optimizer_ = fixed_part(config_, device_, state_name, [&] {
    return make_optimizer(trainable, config_.optimizer, static_cast<uint64_t>(config_.training.seed), shard);
  });
  policy_ = std::make_unique<MemoryPolicy>(config_.memory, config_.training);
  StepOptions options;
  options.device = device_;
  options.pad_id = pad_id_;
  options.precision = config_.precision.mode;
  options.max_grad_norm = config_.training.max_grad_norm;
  options.max_retries = config_.memory.max_retries;
  options.chunked_loss = config_.training.chunked_loss;
  options.seed = static_cast<uint64_t>(config_.training.seed);
  options.packing = config_.data.packing;
  options.pack_capacity = pack_capacity(config_.data, family_);
  if (world_) {
    data_parallel_ = distributed::make_data_parallel(
        *world_, trainable, static_cast<int64_t>(config_.distributed.bucket_size.bytes),
        shard.world > 1 ? optimizer_->owners() : std::vector<int>{});
    data_parallel_->set_overlap(config_.distributed.overlap_grad_reduce);
    options.sync = data_parallel_.get();
  }
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) {
    GradScalerOptions scaling;
    scaling.init_scale = config_.precision.initial_loss_scale;
    scaling.growth_interval = config_.precision.loss_scale_growth_interval;
    scaler_ = std::make_unique<GradScaler>(scaling);
    options.scaler = scaler_.get();
  }
  step_ = std::make_unique<TrainStep>(*model_, *optimizer_, *policy_, options);
  device_ladder_ = std::make_unique<DeviceLadder>(config_, device_);
}

// A resume restores the optimizer, the data position, the policy, the step and the RNG; a fresh run with
// micro_batch_size=auto probes the largest micro-batch that fits (the smallest of any rank's).
void TrainingRun::restore_or_probe() {
  if (resume_.dir) {
    const auto& state = resume_.state;
    distributed::load_optimizer_parts(*resume_.dir, state, *optimizer_);
    const auto file = SafetensorsFile::open((*resume_.dir / "optimizer.safetensors").string());
    const LoaderCursor saved_cursor = cursor_from_json(state.at("data_cursor"));
    loader_->restore(resume_.data_changed ? new_epoch_cursor(saved_cursor) : saved_cursor);
    policy_->restore(state.at("memory_policy"));
    if (scaler_ && state.contains("loss_scaler")) {
      scaler_->restore(state.at("loss_scaler"), (*resume_.dir / "train_state.json").string());
      skipped_at_start_ = scaler_->skipped_steps();
    } else if (scaler_) {
      spdlog::info("fp16-mixed: {} holds no loss scale (another precision mode); starting at {}",
                   resume_.dir->string(), scaler_->scale());
    }
    step_index_ = state.at("step").get<int64_t>();
    tokens_seen_ = state.at("tokens_seen").get<int64_t>();
    if (file.find("rng.cpu")) set_rng_state(at::Device(at::kCPU), file.load("rng.cpu"));
    if (!device_.is_cpu()) {
      const std::string name = "rng." + device_.str();
      if (file.find(name)) set_rng_state(device_, file.load(name));  // dropout does not need it (keyed masks)
    }
    spdlog::info("resuming from {} at step {} (micro-batch {}){}", resume_.dir->string(), step_index_,
                 policy_->micro_batch(),
                 resume_.data_changed
                     ? fmt::format("; the data changed: epoch {} starts over it", loader_->cursor().epoch + 1)
                     : std::string());
  } else if (config_.training.micro_batch_size.is_auto && !policy_->by_tokens()) {
    int64_t probed = probe_micro_batch(*step_, *optimizer_, config_, family_, device_);
    if (world_) probed = -world_->all_reduce_max({-probed})[0];  // what fits on every rank
    if (probed == 0)
      throw OutOfMemoryAtFloor("not even one example of the maximum lengths fits for micro_batch_size=auto",
                               "lower data.max_length / max_input_length / max_target_length, turn on "
                               "training.activation_checkpointing and training.chunked_loss, or raise memory.limit");
    policy_->set_micro_batch(probed, 0, "micro_batch_size=auto probe");
  }
}

void TrainingRun::start_retention() {
  fs::create_directories(output_dir_);
  if (!resume_.dir && primary_)
    if (const auto earlier = newest_complete_checkpoint(output_dir_))
      spdlog::warn("{} already holds checkpoints of an earlier run (newest {}); this run starts from step 0 and "
                   "writes its own beside them. To continue that run instead, stop and add --resume",
                   output_dir_.string(), earlier->filename().string());
  retention_ = std::make_unique<CheckpointRetention>(output_dir_, config_.checkpoint.keep_last,
                                                     config_.checkpoint.keep_best);
  if (primary_) retention_->start(resume_.dir ? std::optional<int64_t>(step_index_) : std::nullopt);
  std::error_code same_error;
  if (resume_.dir &&
      fs::equivalent(*resume_.dir, output_dir_ / ("checkpoint-" + std::to_string(step_index_)), same_error))
    on_disk_step_ = step_index_;
}

// Checkpoint-N, then what stays (keep_last, keep_best: by the validation loss at this step), then the webhook.
// Rank 0 alone writes it (every rank holds the same weights and optimizer state).
std::string TrainingRun::checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state) {
  const auto path = (output_dir_ / ("checkpoint-" + std::to_string(step_index_))).string();
  if (world_ && optimizer_->shard().world > 1) return checkpoint_sharded(cursor, policy_state);
  if (!primary_) return path;
  write_checkpoint(output_dir_, step_index_, on_disk_step_ == step_index_, device_, *trained_, *optimizer_,
                   policy_state, cursor, tokens_seen_, config_, fingerprint_,
                   scaler_ ? scaler_->state() : nlohmann::json());
  on_disk_step_ = step_index_;
  retention_->on_checkpoint(step_index_,
                            last_eval_step_ == step_index_ ? std::optional<double>(last_eval_) : std::nullopt);
  reporter_.on_checkpoint(step_index_, path);
  return path;
}

// With sharded optimizer state every rank writes its part (no rank ever holds the whole state): rank 0 prepares
// the temporary directory, each rank writes optimizer-rank-R-of-N.safetensors into it, and rank 0 writes the model,
// its own part and train_state.json (listing the parts), then renames it into place and writes COMPLETE once every
// part is on disk. The output directory must be one directory for all ranks (a shared file system across nodes).
std::string TrainingRun::checkpoint_sharded(const LoaderCursor& cursor, const nlohmann::json& policy_state) {
  const auto final_dir = output_dir_ / ("checkpoint-" + std::to_string(step_index_));
  const int world = world_->world_size();
  const bool on_disk = on_disk_step_ == step_index_;
  // The same answer on every rank (one directory): either all write or none does.
  const bool skip = on_disk && static_cast<bool>(world_->all_reduce_max({fs::exists(final_dir / "COMPLETE") ? 1 : 0})[0]);
  on_disk_step_ = step_index_;
  if (skip) {
    if (primary_) spdlog::info("checkpoint step {}: {} (already written)", step_index_, final_dir.string());
    return final_dir.string();
  }
  const fs::path temp_dir = output_dir_ / (".checkpoint-" + std::to_string(step_index_) + ".tmp");
  if (primary_) {
    fs::remove_all(temp_dir);
    fs::create_directories(temp_dir);
  }
  world_->barrier();
  OptimizerParts parts;
  for (int r = 0; r < world; ++r) parts.files.push_back(distributed::optimizer_part_file(r, world));
  // Every rank's outcome: 1 where its part could not be written.
  auto agree_on_parts = [&](bool failed) {
    std::vector<int64_t> flags(static_cast<std::size_t>(world), 0);
    flags[static_cast<std::size_t>(world_->rank())] = failed ? 1 : 0;
    const auto all = world_->all_reduce_max(flags);
    std::string missing;
    for (int r = 0; r < world; ++r)
      if (all[static_cast<std::size_t>(r)]) missing += (missing.empty() ? "" : ", ") + parts.files[static_cast<std::size_t>(r)];
    return missing;
  };
  if (!primary_) {
    std::string failure;
    try {
      write_safetensors((temp_dir / parts.files[static_cast<std::size_t>(world_->rank())]).string(),
                        optimizer_->state_tensors(), {});
    } catch (const Error& e) {
      failure = e.what();
      spdlog::error("checkpoint step {}: this rank's optimizer state could not be written: {}", step_index_, failure);
    }
    const std::string missing = agree_on_parts(!failure.empty());
    if (!missing.empty())
      throw DataError("checkpoint step " + std::to_string(step_index_) + " could not be written: the optimizer state "
                          "part(s) " + missing + " failed" + (failure.empty() ? "" : ": " + failure),
                      "free space in checkpoint.output_dir, then continue with --resume");
    world_->barrier();  // rank 0 has renamed it and written COMPLETE
    return final_dir.string();
  }
  parts.agree = agree_on_parts;
  write_checkpoint(output_dir_, step_index_, on_disk, device_, *trained_, *optimizer_, policy_state, cursor,
                   tokens_seen_, config_, fingerprint_, scaler_ ? scaler_->state() : nlohmann::json(), &parts);
  world_->barrier();
  retention_->on_checkpoint(step_index_,
                            last_eval_step_ == step_index_ ? std::optional<double>(last_eval_) : std::nullopt);
  reporter_.on_checkpoint(step_index_, final_dir.string());
  return final_dir.string();
}

// A signal on any rank stops every rank after the same step.
int TrainingRun::agreed_stop_signal() {
  const int signal = stop_requested();
  if (!world_) return signal;
  return static_cast<int>(world_->all_reduce_max({signal})[0]);
}

int TrainingRun::loop() {
  reset_peak(device_);  // the summary's peak is training's, not the micro-batch probe's
  reporter_.on_start({model_->model_type(), count_parameters(*model_), optimizer_->trainable_parameters(),
                      total_steps_, policy_->micro_batch(), step_index_, tokens_seen_,
                      resume_.dir ? resume_.dir->string() : ""});
  current_epoch_ = loader_->cursor().epoch;
  while (step_index_ < total_steps_) {
    if (const int signal = agreed_stop_signal()) {
      reporter_.on_stopped(signal, step_index_, checkpoint(loader_->cursor(), policy_->state()));
      return signal == SIGINT ? kExitInterrupted : kExitOk;
    }
    if (!train_one_step()) break;
  }
  return -1;
}

// One optimizer step: the next effective batch, the memory-adaptive step, metrics, then evaluation and a periodic
// checkpoint when due. False when the data is done.
bool TrainingRun::train_one_step() {
  const auto step_start = Clock::now();
  const LoaderCursor cursor_before = loader_->cursor();  // for a checkpoint of this state if the step cannot fit
  const nlohmann::json policy_before = policy_->state();
  auto batch = loader_->next();
  if (batch && batch->epoch != current_epoch_) {
    const auto d = loader_->stats();
    spdlog::info("epoch {} done (data so far: records {} read, bad records skipped {}, truncated {}, too long and "
                 "skipped {})", current_epoch_ + 1, d.records_read, d.bad_records_skipped, d.truncated,
                 d.overlength_skipped);
    current_epoch_ = batch->epoch;
  }
  if (!batch) return false;
  const double lr = scheduled_lr(config_.scheduler, config_.optimizer.lr, step_index_, total_steps_);
  StepResult result;
  for (;;) try {
    result = step_->run(*batch, step_index_ + 1, lr);
    break;
  } catch (const OutOfMemoryAtFloor& e) {
    // ---- the end of the memory ladder: move the run to a device with more room, run the same step there ----
    // (one process only: ranks would have to agree on a move, which data parallelism does not do yet)
    if (!world_) {
      if (const auto moved = device_ladder_->move(step_index_ + 1, device_, {*model_, lora_.get(), *optimizer_},
                                                  *policy_, e.what())) {
        device_ = *moved;
        step_->set_device(device_);
        continue;
      }
    }
    // ---- no move left: stop with a report and a checkpoint of the last completed step ----
    dump_snapshot_once(output_dir_, step_index_ + 1);
    std::string report = memory_report(config_, device_, *model_, lora_.get(), *optimizer_, *policy_);
    if (world_) report += "\n  device moves: not made in data-parallel runs (the ranks stop together)";
    else if (const auto why_not = device_ladder_->why_not_moved(); !why_not.empty())
      report += "\n  device moves: " + why_not;
    const auto saved = checkpoint(cursor_before, policy_before);
    throw OutOfMemoryAtFloor(std::string(e.what()) + "\n" + report + "\nthe last completed step (" +
                                 std::to_string(step_index_) + ") is saved in " + saved +
                                 "; after changing the config, continue with --resume-from " + saved,
                             floor_suggestions(config_, device_, family_ == DataFamily::kSeq2Seq));
  }
  ++step_index_;
  if (result.retries > 0) dump_snapshot_once(output_dir_, step_index_);
  tokens_seen_ += result.target_tokens;
  const auto memory = memory_now(device_);
  reporter_.on_step({step_index_, result.loss, lr, result.grad_norm, result.target_tokens, tokens_seen_,
                     result.micro_batch, result.micro_steps, result.retries,
                     static_cast<int64_t>(policy_->adaptations().size()), device_ladder_->moves(), memory.allocated,
                     memory.peak, std::chrono::duration<double>(Clock::now() - step_start).count(),
                     scaler_ ? std::optional(LossScaling{result.loss_scale, result.skipped, scaler_->skipped_steps()})
                             : std::nullopt});
  const bool eval_now = config_.evaluation.every_steps > 0 && step_index_ % config_.evaluation.every_steps == 0;
  if (eval_now || step_index_ == total_steps_) evaluate_and_sample();
  if (config_.checkpoint.every_steps > 0 && step_index_ % config_.checkpoint.every_steps == 0 &&
      step_index_ < total_steps_)
    checkpoint(loader_->cursor(), policy_->state());
  if (config_.memory.empty_cache_every > 0 && step_index_ % config_.memory.empty_cache_every == 0)
    release_cached_memory();
  return true;
}

// Validation loss, sharded over the ranks (each evaluates its share of every validation batch; the sums are
// summed), and sample generations (rank 0 alone: the other ranks hold the same weights and go on to the next step,
// where they wait for it).
void TrainingRun::evaluate_and_sample() {
  auto validation = make_validation_loader(config_, *tokenizer_, family_, config_.training.batch_size,
                                           distributed::record_share(world_));
  if (validation) {
    const auto eval = evaluate(*model_, *validation, eval_micro_, config_, device_, pad_id_,
                               step_->chunked_loss() ? step_->loss_chunk_size() : 0, world_);
    last_eval_ = eval.loss;
    last_eval_step_ = step_index_;
    reporter_.on_eval(step_index_, eval.loss, eval.tokens);
  }
  if (!primary_) return;
  log_samples(*model_, *tokenizer_, config_, device_, step_index_, reporter_);
}

// The end of the run: a checkpoint to continue from (a longer max_steps, more epochs), then the model itself.
int TrainingRun::finish() {
  checkpoint(loader_->cursor(), policy_->state());
  if (primary_ && config_.checkpoint.save_final) save_trained(*trained_, output_dir_ / "final", config_);
  if (primary_ && train_options_.merge) {
    MergeOptions merge;
    merge.adapter_dir = (output_dir_ / "final").string();
    merge.output_dir = (output_dir_ / "final-merged").string();
    merge.max_shard_bytes = config_.checkpoint.max_shard_size.bytes;
    merge_adapter(merge);
  }
  RunSummary summary;
  summary.steps = step_index_;
  summary.tokens_seen = tokens_seen_;
  summary.data = loader_->stats();
  summary.memory_peak = memory_now(device_).peak;
  summary.adaptations = policy_->adaptations();
  summary.escalations = policy_->escalations();
  if (scaler_)
    summary.loss_scaling = RunSummary::LossScalingSummary{scaler_->skipped_steps(),
                                                          scaler_->skipped_steps() - skipped_at_start_, scaler_->scale()};
  if (config_.checkpoint.save_final) summary.model_dir = (output_dir_ / "final").string();
  summary.model_is_adapter = lora_ != nullptr;
  if (train_options_.merge) summary.merged_dir = (output_dir_ / "final-merged").string();
  if (const auto& best = retention_->best()) {
    summary.best_checkpoint = best->path.string();
    summary.best_eval_loss = best->eval_loss;
  }
  distributed::add_rank_figures(world_, summary);
  reporter_.on_finish(std::move(summary));
  return kExitOk;
}

int run_training(const Config& config, const ResolvedDevice& resolved, const TrainOptions& train_options,
                 Reporter& reporter, distributed::Communicator* world) {
  prepare_run(config, resolved.device, train_options);
  TrainingRun run(config, resolved.device, train_options, reporter, world);
  run.set_up();
  if (const int stopped = run.loop(); stopped >= 0) return stopped;
  return run.finish();
}

}  // namespace

int train(const Config& config, const ResolvedDevice& resolved, const TrainOptions& train_options, std::ostream& out,
          distributed::Communicator* world) {
  // Rank 0 alone prints the progress and writes metrics, TensorBoard and the webhook; the others log warnings.
  std::ostream null_stream(nullptr);
  const bool primary = !world || world->rank() == 0;
  Reporter reporter(config, primary ? out : null_stream, primary);
  try {
    const int code = run_training(config, resolved, train_options, reporter, world);
    if (world) world->barrier();  // rank 0, which hosts the rendezvous, leaves last
    return code;
  } catch (const std::exception& error) {
    reporter.on_failure(error);  // the webhook hears of it; main reports it and picks the exit code
    throw;
  }
}

}  // namespace trainer
