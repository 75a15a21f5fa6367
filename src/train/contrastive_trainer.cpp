// CLIP contrastive training (see contrastive_trainer.h).
#include "train/contrastive_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <optional>
#include <ostream>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/image_loader.h"
#include "distributed/checkpoint_parts.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "data/permutation.h"
#include "log/reporter.h"
#include "memory/cpu_budget.h"
#include "memory/cuda_extras.h"
#include "memory/policy.h"
#include "models/clip.h"
#include "models/clip_lora.h"
#include "models/clip_zero_shot.h"
#include "train/checkpoint_dir.h"
#include "train/checkpointing_runner.h"
#include "train/contrastive.h"
#include "train/grad_scaler.h"
#include "train/optimizer.h"
#include "train/precision.h"
#include "train/resume_check.h"
#include "train/retention.h"
#include "train/signals.h"
#include "train/step.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

bool is_clip_model_config(const nlohmann::json& config) {
  return config.is_object() && config.value("model_type", "") == "clip" && config.contains("text_config");
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kContrastiveCheckpointVersion = 1;
constexpr uint64_t kMicroBatchSeedSalt = 0xC11B5EEDC0FFEE01ull;

// Captions as CLIP's tokenizer gives them: <|startoftext|> ids <|endoftext|>, at most max_length ids (a longer
// caption is cut before its end token, which stays: transformers' truncation=True), padded to the longest caption.
class CaptionTokenizer {
 public:
  CaptionTokenizer(const Config& config, int64_t model_max_length) {
    const std::string source = config.tokenizer.path.empty() ? config.model.path : config.tokenizer.path;
    tokenizer_ = load_tokenizer(source, config.tokenizer.kind);
    source_dir_ = fs::is_directory(source) ? fs::path(source) : fs::path(source).parent_path();
    special_ = tokenizer_->special_token_template();
    max_length_ = std::min<int64_t>(model_max_length, config.data.max_length);
    pad_ = tokenizer_->pad_id().value_or(tokenizer_->eos_id().value_or(0));
  }

  // (N, T) ids and (N, T) attention mask of 0/1, T the longest caption's length.
  std::pair<at::Tensor, at::Tensor> operator()(const std::vector<std::string>& texts) const {
    std::vector<std::vector<int64_t>> rows;
    std::size_t longest = 1;
    for (const auto& text : texts) {
      std::vector<int64_t> ids(special_.prefix.begin(), special_.prefix.end());
      for (const int32_t id : tokenizer_->encode(text)) ids.push_back(id);
      const auto limit = static_cast<std::size_t>(max_length_);
      if (ids.size() + special_.suffix.size() > limit) ids.resize(limit - std::min(limit, special_.suffix.size()));
      ids.insert(ids.end(), special_.suffix.begin(), special_.suffix.end());
      longest = std::max(longest, ids.size());
      rows.push_back(std::move(ids));
    }
    const auto n = static_cast<int64_t>(rows.size()), t = static_cast<int64_t>(longest);
    at::Tensor ids = at::full({n, t}, pad_, at::kLong), mask = at::zeros({n, t}, at::kLong);
    auto* id_data = ids.data_ptr<int64_t>();
    auto* mask_data = mask.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < rows[static_cast<std::size_t>(i)].size(); ++j) {
        id_data[i * t + static_cast<int64_t>(j)] = rows[static_cast<std::size_t>(i)][j];
        mask_data[i * t + static_cast<int64_t>(j)] = 1;
      }
    return {ids, mask};
  }

  int64_t max_length() const { return max_length_; }
  int64_t pad_id() const { return pad_; }
  // The tokenizer files, copied beside the saved model so that CLIPProcessor loads from the same directory.
  void copy_files_to(const fs::path& dir) const {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                             "merges.txt"})
      if (fs::exists(source_dir_ / name))
        fs::copy_file(source_dir_ / name, dir / name, fs::copy_options::overwrite_existing);
  }

 private:
  std::unique_ptr<Tokenizer> tokenizer_;
  fs::path source_dir_;
  SpecialTokenTemplate special_;
  int64_t max_length_ = 77;
  int64_t pad_ = 0;
};

std::vector<std::string> captions_of(const data::ImageDataset& dataset, const ImageBatch& batch) {
  std::vector<std::string> out;
  out.reserve(batch.records.size());
  for (const std::size_t r : batch.records) out.push_back(dataset.captions.at(r));
  return out;
}

at::Tensor pixels_of(const ImageBatch& batch) {
  if (batch.pixels.empty()) return at::zeros({0, 3, batch.height, batch.width}, at::kFloat);  // a rank's empty share
  return at::from_blob(const_cast<float*>(batch.pixels.data()), {batch.size(), 3, batch.height, batch.width},
                       at::kFloat);
}

// ---- evaluation --------------------------------------------------------------------------------------------------

// Fraction of queries whose own pair is among the k best-scored candidates. Pairs whose captions are the same text
// are interchangeable (a caption cannot tell their images apart), so a candidate counts when its caption is the
// query's: `group[i]` numbers the distinct captions.
double recall_at(const at::Tensor& scores, const std::vector<int64_t>& group, int64_t k) {
  const int64_t n = scores.size(0);
  k = std::min<int64_t>(k, scores.size(1));
  const at::Tensor best = std::get<1>(scores.topk(k, 1)).contiguous();  // (n, k)
  const auto* b = best.data_ptr<int64_t>();
  int64_t hits = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j)
      if (group[static_cast<std::size_t>(b[i * k + j])] == group[static_cast<std::size_t>(i)]) {
        ++hits;
        break;
      }
  return n > 0 ? static_cast<double>(hits) / static_cast<double>(n) : 0.0;
}

// ---- the run -----------------------------------------------------------------------------------------------------

class ContrastiveRun {
 public:
  ContrastiveRun(const Config& config, const c10::Device& device, const TrainOptions& options, Reporter& reporter,
                 distributed::Communicator* world)
      : config_(config), device_(device), options_(options), reporter_(reporter), world_(world),
        primary_(!world || world->rank() == 0), output_dir_(config.checkpoint.output_dir) {}

  void set_up();
  int loop();
  int finish();

 private:
  void open_resume();
  void build_model();
  int64_t apply_lora_to_model();
  void restore_or_probe();
  bool train_one_step();
  StepResult run_step(const ImageBatch& batch, int64_t step, double lr);
  // The pairs [first, first + count) of the effective batch (this rank's share), split into micro-batches of
  // `micro`; `ranks`: data parallelism's part of the step (none in the probe and in a single process).
  ContrastiveResult forward_backward(const at::Tensor& pixels, const at::Tensor& ids, const at::Tensor& mask,
                                     int64_t step, int64_t micro, int64_t first, int64_t count,
                                     const ContrastiveRanks* ranks);
  // Data parallelism: the loader decodes (and the run tokenizes) only this rank's share of each effective batch.
  ImageShard shard() const;
  // This rank's captions of `batch` as ids and mask, padded to the longest caption of the whole effective batch (every
  // rank's), so each pair's text is what one process feeds the text tower.
  std::pair<at::Tensor, at::Tensor> tokenize(const std::vector<std::string>& texts);
  // Rows of every rank's share put together: `rows` (this rank's, `width` columns) into a (pairs, width) matrix on
  // every rank (zeros elsewhere, summed over the ranks).
  at::Tensor gather_rows(const at::Tensor& rows, int64_t pairs, int64_t begin);
  int agreed_stop_signal();
  bool escalate(int64_t step);
  void evaluate();
  at::Tensor embed(const at::Tensor& pixels, const at::Tensor& ids, const at::Tensor& mask, bool images);
  void save_model(const fs::path& dir);
  std::string checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state);

  const Config& config_;
  c10::Device device_;
  const TrainOptions& options_;
  Reporter& reporter_;
  distributed::Communicator* world_;
  const bool primary_;  // rank 0 (or a single process): reports, writes checkpoints
  const fs::path output_dir_;
  std::unique_ptr<distributed::DataParallel> data_parallel_;

  std::optional<fs::path> resume_dir_;
  nlohmann::json resume_state_;
  std::shared_ptr<const data::ImageDataset> dataset_;
  nlohmann::json fingerprint_;
  std::unique_ptr<ClipModel> model_;
  std::unique_ptr<ClipLoraAdapters> lora_;  // lora.enabled
  std::string lora_base_;                   // the adapter's base_model_name_or_path
  std::unique_ptr<CaptionTokenizer> tokenizer_;
  data::ImageProcessorSpec spec_;
  std::unique_ptr<ImageLoader> loader_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<MemoryPolicy> policy_;
  std::unique_ptr<CheckpointRetention> retention_;
  std::unique_ptr<GradScaler> scaler_;  // precision.mode=fp16-mixed
  int64_t skipped_at_start_ = 0;        // the scaler's skipped steps when this process started (resume)
  bool checkpointing_on_ = false;
  int64_t total_steps_ = 0, step_index_ = 0, pairs_seen_ = 0, eval_micro_ = 1;
  double last_eval_ = std::nan("");
  int64_t last_eval_step_ = -1;
  std::optional<int64_t> on_disk_step_;
};

void ContrastiveRun::open_resume() {
  if (!options_.resume_from.empty()) {
    resume_dir_ = fs::path(options_.resume_from);
    if (!fs::exists(*resume_dir_ / "COMPLETE"))
      throw DataError(options_.resume_from + " is not a complete checkpoint (no COMPLETE marker)",
                      "resume from a checkpoint-N directory that trainer finished writing");
  } else if (options_.resume) {
    resume_dir_ = newest_complete_checkpoint(output_dir_);
    if (!resume_dir_)
      throw DataError("--resume: no complete checkpoint in " + config_.checkpoint.output_dir,
                      "start without --resume, or point checkpoint.output_dir at the run to continue");
  }
  if (!resume_dir_) return;
  resume_state_ = read_json_file((*resume_dir_ / "train_state.json").string());
  if (resume_state_.value("version", 0) != kContrastiveCheckpointVersion ||
      resume_state_.value("task", "") != "contrastive")
    throw DataError(resume_dir_->string() + " is not a contrastive (CLIP) checkpoint of this trainer",
                    "resume from a checkpoint this contrastive run wrote");
  check_resume_config(resume_state_.at("config"), config_, resume_dir_->string(), options_.allow_config_change);
}

void ContrastiveRun::set_up() {
  if (config_.precision.mode == PrecisionMode::kBf16)
    throw UsageError("precision.mode=bf16 (bf16 weights) is not implemented for training.objective=contrastive yet",
                     "use precision.mode=bf16-mixed (fp32 weights, bf16 autocast), fp16-mixed or fp32");
  if (options_.merge)
    throw UsageError("--merge is not implemented for CLIP (training.objective=contrastive)",
                     "drop --merge; PEFT merges the adapter in final/: PeftModel.from_pretrained(CLIPModel."
                     "from_pretrained(base), \"final\").merge_and_unload()");
  open_resume();
  build_model();
  if (world_) {  // every rank starts from rank 0's weights
    std::vector<at::Tensor> all;
    model_->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    if (lora_) lora_->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    at::NoGradGuard no_grad;
    world_->broadcast(all);
  }
  loader_ = make_caption_loader(config_, dataset_, spec_, true, config_.training.batch_size, shard());
  const auto batch = static_cast<uint64_t>(config_.training.batch_size);
  const auto per_epoch = static_cast<int64_t>((loader_->examples_per_epoch() + batch - 1) / batch);
  total_steps_ = config_.training.max_steps > 0 ? config_.training.max_steps : per_epoch * config_.training.epochs;
  Module& trainable = lora_ ? static_cast<Module&>(*lora_) : *model_;
  // distributed.shard_optimizer (ZeRO-1): this rank's state covers its share of the parameters only.
  OptimizerShard optimizer_shard;
  if (world_ && config_.distributed.shard_optimizer) optimizer_shard = {world_->rank(), world_->world_size()};
  optimizer_ = make_optimizer(trainable, config_.optimizer, static_cast<uint64_t>(config_.training.seed),
                              optimizer_shard);
  policy_ = std::make_unique<MemoryPolicy>(config_.memory, config_.training);
  if (world_) {
    data_parallel_ = distributed::make_data_parallel(
        *world_, trainable, static_cast<int64_t>(config_.distributed.bucket_size.bytes),
        optimizer_shard.world > 1 ? optimizer_->owners() : std::vector<int>{});
  }
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) {
    GradScalerOptions scaling;
    scaling.init_scale = config_.precision.initial_loss_scale;
    scaling.growth_interval = config_.precision.loss_scale_growth_interval;
    scaler_ = std::make_unique<GradScaler>(scaling);
  }
  restore_or_probe();
  eval_micro_ = config_.evaluation.micro_batch_size.is_auto ? policy_->micro_batch()
                                                            : config_.evaluation.micro_batch_size.value;
  fs::create_directories(output_dir_);
  retention_ = std::make_unique<CheckpointRetention>(output_dir_, config_.checkpoint.keep_last,
                                                     config_.checkpoint.keep_best);
  if (primary_) retention_->start(resume_dir_ ? std::optional<int64_t>(step_index_) : std::nullopt);
  std::error_code same_error;
  if (resume_dir_ &&
      fs::equivalent(*resume_dir_, output_dir_ / ("checkpoint-" + std::to_string(step_index_)), same_error))
    on_disk_step_ = step_index_;
}

void ContrastiveRun::build_model() {
  const nlohmann::json hf = read_json_file((fs::path(config_.model.path) / "config.json").string());
  if (!is_clip_model_config(hf))
    throw UsageError(config_.model.path + "/config.json is not a CLIPModel (model_type \"clip\" with a text_config); "
                                          "training.objective=contrastive trains both towers of a CLIP",
                     "point model.path at a CLIPModel directory (e.g. openai/clip-vit-base-patch32), or use "
                     "training.objective=classification for an image classifier");
  dataset_ = std::make_shared<const data::ImageDataset>(data::open_caption_dataset(
      config_.data.train_files, {}, config_.data.on_bad_record == BadRecordPolicy::kSkip));
  if (dataset_->records.size() < 2)
    throw DataError("data.train_files: " + std::to_string(dataset_->records.size()) +
                        " image-caption pair(s); contrastive training needs at least 2",
                    "list {\"image\": \"path\", \"caption\": \"...\"} records in the JSONL files");
  fingerprint_ = image_data_fingerprint(*dataset_);
  if (resume_dir_ && resume_state_.contains("data_fingerprint") && resume_state_.at("data_fingerprint") != fingerprint_) {
    const std::string what = "the training pairs differ from those " + resume_dir_->string() + " was trained on (" +
                             resume_state_.at("data_fingerprint").at("records").dump() + " records then, " +
                             std::to_string(dataset_->records.size()) + " now)";
    if (!options_.allow_data_change)
      throw DataError(what, "restore the data, or pass --allow-data-change to continue on the new pairs (the rest of "
                            "this epoch follows the new order)");
    spdlog::warn("{}: continuing (--allow-data-change)", what);
  }
  const auto tensor_options = at::TensorOptions().dtype(at::kFloat).device(device_);
  const auto seed = static_cast<uint64_t>(config_.training.seed);
  // A LoRA checkpoint holds the adapters alone: the base is model.path's again (a random one from the same seed).
  model_ = resume_dir_ && !config_.lora.enabled
               ? load_clip(resume_dir_->string(), ModelInit::kPretrained, tensor_options, seed)
               : load_clip(config_.model.path, config_.model.init, tensor_options, seed);
  tokenizer_ = std::make_unique<CaptionTokenizer>(config_, model_->max_text_length());
  spec_ = data::read_image_processor(config_.model.path, "CLIPImageProcessor");
  model_->train(true);
  int64_t trainable = 0;
  model_->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    bool train = true;
    if (config_.contrastive.freeze_image_tower)
      for (const char* prefix : ClipModel::kVisionPrefixes) train = train && !name.starts_with(prefix);
    p.requires_grad_(train);
    if (train) trainable += p.numel();
  });
  if (config_.lora.enabled) trainable = apply_lora_to_model();
  if (config_.training.activation_checkpointing) {
    model_->set_block_runner(activation_checkpointing_runner());
    checkpointing_on_ = true;
  }
  spdlog::info("{} image-caption pairs for training, images {} x {} pixels, captions up to {} tokens; negatives: {}; "
               "{} trainable parameters{}",
               dataset_->records.size(), spec_.output_size().second, spec_.output_size().first,
               tokenizer_->max_length(), enum_name(config_.contrastive.negatives), trainable,
               config_.contrastive.freeze_image_tower ? " (image tower locked)" : "");
}

ContrastiveResult ContrastiveRun::forward_backward(const at::Tensor& pixels, const at::Tensor& ids,
                                                   const at::Tensor& mask, int64_t step, int64_t micro, int64_t first,
                                                   int64_t count, const ContrastiveRanks* ranks) {
  std::vector<ContrastiveMicroBatch> parts;
  if (count > 0)
    for (const auto& [offset, size] : split_counts(count, micro)) {
      // Keyed by the pair's place in the effective batch: neither the split nor the ranks change a dropout mask.
      // `pixels`, `ids` and `mask` hold this rank's pairs alone (row 0 is pair `first`).
      const int64_t begin = first + offset;
      ContrastiveMicroBatch mb;
      mb.pixel_values = pixels.narrow(0, offset, size).to(device_);
      mb.input_ids = ids.narrow(0, offset, size).to(device_);
      mb.attention_mask = mask.narrow(0, offset, size).to(device_);
      mb.first_example = begin;
      mb.rng_seed = data::mix_seed(static_cast<uint64_t>(config_.training.seed) ^ kMicroBatchSeedSalt,
                                   static_cast<uint64_t>(step), static_cast<uint64_t>(begin));
      parts.push_back(std::move(mb));
    }
  ContrastiveOptions options;
  options.negatives = config_.contrastive.negatives == ContrastiveNegativesMode::kBatch
                          ? ContrastiveNegatives::kBatch
                          : ContrastiveNegatives::kMicroBatch;
  options.dropout_seed = static_cast<uint64_t>(config_.training.seed);
  options.step = step;
  options.image_tower_trainable = !config_.contrastive.freeze_image_tower;
  options.ranks = ranks;
  // fp16-mixed: gradients of the scaled loss (apply_update divides them by the scale again).
  if (scaler_) options.loss_scale = scaler_->scale();
  // Mixed precision: both passes under the same autocast, so the second pass re-creates the first's embeddings.
  const auto dtype = autocast_dtype(config_.precision.mode);
  AutocastScope autocast(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
  return contrastive_forward_backward(*model_, parts, options);
}

// By records (equal counts, the first ranks one more: distributed::share_of's split by examples): a pair's cost does
// not depend on its caption's length enough to balance by tokens. Every rank learns how many pairs each kept, so the
// pairs are numbered as in one process (bad images skipped in one rank's share included).
ImageShard ContrastiveRun::shard() const {
  if (!world_) return {};
  return {world_->rank(), world_->world_size(),
          distributed::kept_counts_exchange(world_, "counting the decoded image-caption pairs of the effective batch")};
}

std::pair<at::Tensor, at::Tensor> ContrastiveRun::tokenize(const std::vector<std::string>& texts) {
  auto [ids, mask] = (*tokenizer_)(texts);
  if (!world_) return {ids, mask};
  const int64_t longest = world_->all_reduce_max({ids.size(1)})[0];
  if (longest == ids.size(1)) return {ids, mask};
  return {at::constant_pad_nd(ids, {0, longest - ids.size(1)}, static_cast<double>(tokenizer_->pad_id())),
          at::constant_pad_nd(mask, {0, longest - mask.size(1)}, 0)};
}

at::Tensor ContrastiveRun::gather_rows(const at::Tensor& rows, int64_t pairs, int64_t begin) {
  at::Tensor all = at::zeros({pairs, rows.size(1)}, at::TensorOptions().dtype(at::kFloat).device(device_));
  all.narrow(0, begin, rows.size(0)).copy_(rows);
  world_->all_reduce_sum({all}, static_cast<int64_t>(config_.distributed.bucket_size.bytes));
  return all;
}

// A signal on any rank stops every rank after the same step.
int ContrastiveRun::agreed_stop_signal() {
  const int signal = stop_requested();
  if (!world_) return signal;
  return static_cast<int>(world_->all_reduce_max({signal})[0]);
}

bool ContrastiveRun::escalate(int64_t step) {
  for (std::string escalation = policy_->next_escalation(step); !escalation.empty();
       escalation = policy_->next_escalation(step)) {
    if (escalation == "activation_checkpointing" && !checkpointing_on_) {
      model_->set_block_runner(activation_checkpointing_runner());
      checkpointing_on_ = true;
      return true;
    }
  }
  return false;
}

// One optimizer step over the effective batch: split by the policy, gradients of the whole batch's loss (or the
// micro-batch mode's objective), then clipping, the update and CLIP's cap on the logit scale. On out-of-memory the
// attempt's gradients are dropped (each attempt starts from none), the policy shrinks, and the same batch runs again.
StepResult ContrastiveRun::run_step(const ImageBatch& batch, int64_t step, double lr) {
  // Data parallelism: `batch` is this rank's share (pairs [first, first + count) of the effective batch's `pairs`);
  // the negatives (batch mode) are still every pair's, gathered.
  const at::Tensor pixels = pixels_of(batch);
  const auto [ids, mask] = tokenize(captions_of(*dataset_, batch));
  const int64_t pairs = world_ ? batch.total : batch.size();
  const int64_t first = world_ ? batch.first : 0, count = batch.size();
  const bool batch_negatives = config_.contrastive.negatives == ContrastiveNegativesMode::kBatch;
  ContrastiveRanks ranks;
  if (world_) {
    ranks.batch = pairs;
    ranks.offset = first;
    ranks.width = model_->projection_dim();
    ranks.logit_scale_gradient = primary_;
    ranks.agree = [this](bool fit) { return data_parallel_->agree(fit, 0).all_fit; };
    ranks.sum = [this](at::Tensor& rows) {
      world_->all_reduce_sum({rows}, static_cast<int64_t>(config_.distributed.bucket_size.bytes));
    };
  }
  StepResult result;
  bool optimizer_retried = false;
  for (int64_t attempt = 0;; ++attempt) {
    optimizer_->zero_grad();
    const int64_t micro = std::min(pairs, std::max<int64_t>(1, policy_->micro_batch()));
    ContrastiveResult outcome;
    std::optional<std::string> out_of_memory;
    try {
      outcome = forward_backward(pixels, ids, mask, step, micro, first, count, world_ ? &ranks : nullptr);
      if (outcome.dropped) out_of_memory = "another rank ran out of memory";
      else if (data_parallel_) data_parallel_->prepare();
    } catch (const c10::OutOfMemoryError& e) {
      out_of_memory = e.what_without_backtrace();
    }
    if (data_parallel_) {
      // Every rank learns whether every rank fit (both passes) before any gradient is summed; all decide alike.
      const auto agreed = data_parallel_->agree(!out_of_memory, micro);
      if (!agreed.all_fit)
        out_of_memory = "rank(s) " + agreed.failed_ranks + ": " + out_of_memory.value_or("out of memory");
    }
    if (out_of_memory) {
      adapt_to_out_of_memory(*optimizer_, *policy_, step, attempt, config_.memory.max_retries, micro <= 1,
                             [&] { return escalate(step); }, *out_of_memory,
                             "a smaller image size, training.activation_checkpointing=true, "
                             "contrastive.freeze_image_tower=true, or a larger memory.limit");
      continue;
    }
    // The summed gradients; the loss: batch mode's is the same on every rank (counted once), micro-batch mode's is
    // each rank's weighted part.
    if (data_parallel_)
      outcome.loss = data_parallel_->reduce(batch_negatives && !primary_ ? 0.0 : outcome.loss);
    result.loss = outcome.loss;
    result.micro_batch = micro;
    result.micro_steps = (pairs + micro - 1) / micro;
    result.retries = attempt;
    result.target_tokens = pairs;
    const UpdatePhase phase{*optimizer_, *policy_, scaler_.get(), data_parallel_.get(),
                            config_.training.max_grad_norm, step, lr, pairs};
    if (!apply_update(phase, result, optimizer_retried)) continue;
    if (!result.skipped) model_->clamp_logit_scale();
    return result;
  }
}

void ContrastiveRun::restore_or_probe() {
  if (resume_dir_) {
    // optimizer.safetensors, or the parts a sharded run wrote (any world size then and now).
    distributed::load_optimizer_parts(*resume_dir_, resume_state_, *optimizer_);
    loader_->restore(cursor_from_json(resume_state_.at("data_cursor")));
    policy_->restore(resume_state_.at("memory_policy"));
    // fp16-mixed: the loss scale and its growth tracker, so the resumed run scales and skips as the uninterrupted one.
    if (scaler_ && resume_state_.contains("loss_scaler")) {
      scaler_->restore(resume_state_.at("loss_scaler"), (*resume_dir_ / "train_state.json").string());
      skipped_at_start_ = scaler_->skipped_steps();
    }
    step_index_ = resume_state_.at("step").get<int64_t>();
    pairs_seen_ = resume_state_.at("pairs_seen").get<int64_t>();
    spdlog::info("resuming from {} at step {} (micro-batch {})", resume_dir_->string(), step_index_,
                 policy_->micro_batch());
    return;
  }
  if (!config_.training.micro_batch_size.is_auto) return;
  // micro_batch_size=auto: the largest micro-batch at which a whole step fits, measured as the step runs it: an
  // effective batch (under data parallelism this rank's largest share) of captions at the longest length, split at
  // the candidate, through both passes of gradient caching and the batch's loss (or micro-batch negatives), then
  // the optimizer phase's gradient norm. Measuring one micro-batch's passes alone misses the batch's embeddings and
  // loss and misjudges gradient caching's second pass (one tower at a time).
  const auto [height, width] = spec_.output_size();
  const int64_t capacity = config_.memory.limit.bytes > 0 ? static_cast<int64_t>(config_.memory.limit.bytes)
                           : device_.is_cpu()           ? 0
                                                        : static_cast<int64_t>(at::accelerator::getMemoryInfo(device_.index()).second);
  const double allowed = static_cast<double>(capacity) * (1.0 - config_.memory.auto_safety_margin);
  const int64_t length = tokenizer_->max_length();
  const int64_t world = world_ ? world_->world_size() : 1;
  const int64_t largest_share = (config_.training.batch_size + world - 1) / world;
  const int64_t pairs = std::max<int64_t>(largest_share, 2);
  // Pixels outside LibTorch's allocator, as the loader's are (pixels_of), so the probe counts what a step counts.
  std::vector<float> pixel_buffer(static_cast<std::size_t>(pairs * 3 * height * width), 0.0f);
  const at::Tensor pixels = at::from_blob(pixel_buffer.data(), {pairs, 3, height, width}, at::kFloat);
  const at::Tensor ids = at::zeros({pairs, length}, at::kLong), mask = at::ones({pairs, length}, at::kLong);
  auto fits = [&](int64_t n) {
    reset_peak(device_);
    try {
      forward_backward(pixels, ids, mask, 0, n, 0, pairs, nullptr);
      optimizer_->squared_grad_norm();
      optimizer_->zero_grad();
    } catch (const c10::OutOfMemoryError&) {
      optimizer_->zero_grad();
      release_cached_memory();
      spdlog::info("micro_batch_size=auto: {} does not fit (out of memory)", n);
      return false;
    }
    const auto peak = static_cast<double>(memory_now(device_).peak);
    const bool ok = capacity == 0 || peak <= allowed;
    spdlog::info("micro_batch_size=auto: a step of {} pairs in micro-batches of {} peaks at {}{}", pairs, n,
                 human_bytes(peak), ok ? "" : " (inside the safety margin: too close)");
    return ok;
  };
  // Data parallelism: each rank probes up to its largest share; the ranks take what fits on every rank.
  int64_t good = largest_that_fits(largest_share, fits);
  if (world_) good = -world_->all_reduce_max({-good})[0];
  if (good == 0)
    throw OutOfMemoryAtFloor("not even one image-caption pair fits for micro_batch_size=auto",
                             "turn on training.activation_checkpointing, lock the image tower, or raise memory.limit");
  policy_->set_micro_batch(good, 0, "micro_batch_size=auto probe");
}

int ContrastiveRun::loop() {
  reset_peak(device_);
  reporter_.on_start({"clip", count_parameters(*model_), optimizer_->trainable_parameters(), total_steps_,
                      policy_->micro_batch(), step_index_, pairs_seen_, resume_dir_ ? resume_dir_->string() : ""});
  while (step_index_ < total_steps_) {
    if (const int signal = agreed_stop_signal()) {
      reporter_.on_stopped(signal, step_index_, checkpoint(loader_->cursor(), policy_->state()));
      return signal == SIGINT ? kExitInterrupted : kExitOk;
    }
    if (!train_one_step()) break;
  }
  return -1;
}

bool ContrastiveRun::train_one_step() {
  const auto start = Clock::now();
  const LoaderCursor cursor_before = loader_->cursor();
  const nlohmann::json policy_before = policy_->state();
  auto batch = loader_->next();
  if (!batch) return false;
  const double lr = scheduled_lr(config_.scheduler, config_.optimizer.lr, step_index_, total_steps_);
  StepResult result;
  try {
    result = run_step(*batch, step_index_ + 1, lr);
  } catch (const OutOfMemoryAtFloor& e) {
    const auto saved = checkpoint(cursor_before, policy_before);
    throw OutOfMemoryAtFloor(std::string(e.what()) + "\nthe last completed step (" + std::to_string(step_index_) +
                                 ") is saved in " + saved + "; after changing the config, continue with --resume-from " +
                                 saved,
                             e.hint());
  }
  ++step_index_;
  pairs_seen_ += result.target_tokens;
  const auto memory = memory_now(device_);
  reporter_.on_step({step_index_, result.loss, lr, result.grad_norm, result.target_tokens, pairs_seen_,
                     result.micro_batch, result.micro_steps, result.retries,
                     static_cast<int64_t>(policy_->adaptations().size()), 0, memory.allocated, memory.peak,
                     std::chrono::duration<double>(Clock::now() - start).count(),
                     scaler_ ? std::optional(LossScaling{result.loss_scale, result.skipped, scaler_->skipped_steps()})
                             : std::nullopt});
  const bool eval_now = config_.evaluation.every_steps > 0 && step_index_ % config_.evaluation.every_steps == 0;
  if (eval_now || step_index_ == total_steps_) evaluate();
  if (config_.checkpoint.every_steps > 0 && step_index_ % config_.checkpoint.every_steps == 0 &&
      step_index_ < total_steps_)
    checkpoint(loader_->cursor(), policy_->state());
  return true;
}

// Normalised embeddings (fp32, on the host) of images or captions, without autograd, in evaluation micro-batches
// (halved on out-of-memory; training's policy is never touched).
at::Tensor ContrastiveRun::embed(const at::Tensor& pixels, const at::Tensor& ids, const at::Tensor& mask,
                                 bool images) {
  const int64_t n = images ? pixels.size(0) : ids.size(0);
  const auto dtype = autocast_dtype(config_.precision.mode);  // evaluate in the precision training runs in
  AutocastScope autocast(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
  for (;;) {
    try {
      std::vector<at::Tensor> parts;
      for (const auto& [begin, count] : split_counts(n, std::max<int64_t>(1, eval_micro_))) {
        const at::Tensor features =
            images ? model_->image_features(pixels.narrow(0, begin, count).to(device_))
                   : model_->text_features(ids.narrow(0, begin, count).to(device_),
                                           mask.narrow(0, begin, count).to(device_));
        parts.push_back(features.to(at::kFloat).cpu());
      }
      const at::Tensor all = at::cat(parts);
      return all / all.norm(2, {1}, true);
    } catch (const c10::OutOfMemoryError&) {
      release_cached_memory();
      if (eval_micro_ <= 1) throw;
      spdlog::warn("evaluation: out of memory; evaluation micro-batch {} -> {}", eval_micro_, eval_micro_ / 2);
      eval_micro_ /= 2;
    }
  }
}

// Over the validation pairs: the contrastive loss (mean over consecutive chunks of training.batch_size pairs, the
// training objective's batch), recall@1/5/10 both ways, and zero-shot top-1 accuracy when the records have labels
// and evaluation.class_prompts is set.
void ContrastiveRun::evaluate() {
  if (config_.data.validation_files.empty()) return;
  const bool skip = config_.data.on_bad_record == BadRecordPolicy::kSkip;
  auto dataset = std::make_shared<const data::ImageDataset>(
      data::open_caption_dataset(config_.data.validation_files, {}, skip));
  auto loader = make_caption_loader(config_, dataset, spec_, false, config_.training.batch_size, shard());
  at::NoGradGuard no_grad;
  model_->train(false);
  std::vector<at::Tensor> image_parts, text_parts;
  std::vector<std::string> captions;
  std::vector<int64_t> labels;
  int64_t batches = 0;
  while (auto batch = loader->next()) {
    const auto texts = captions_of(*dataset, *batch);
    if (world_) {
      // Each rank decodes and embeds its share of the batch; the embeddings and the pairs' records are gathered, so
      // every rank scores them all.
      const auto [ids, mask] = (*tokenizer_)(texts);
      const int64_t pairs = batch->total, first = batch->first, count = batch->size();
      const int64_t width = model_->projection_dim();
      at::Tensor mine = at::zeros({count, 2 * width});
      if (count > 0) mine = at::cat({embed(pixels_of(*batch), {}, {}, true), embed({}, ids, mask, false)}, 1);
      const at::Tensor all = gather_rows(mine.to(device_), pairs, first).cpu();
      image_parts.push_back(all.narrow(1, 0, width));
      text_parts.push_back(all.narrow(1, width, width));
      std::vector<double> records(static_cast<std::size_t>(pairs), 0.0);
      for (int64_t i = 0; i < count; ++i)
        records[static_cast<std::size_t>(first + i)] = static_cast<double>(batch->records[static_cast<std::size_t>(i)]);
      records = world_->all_reduce_sum(records, "gathering the evaluation pairs' records");
      for (const double r : records) {
        const auto record = static_cast<std::size_t>(std::llround(r));
        captions.push_back(dataset->captions.at(record));
        labels.push_back(dataset->records.at(record).label);
      }
    } else {
      const auto [ids, mask] = (*tokenizer_)(texts);
      image_parts.push_back(embed(pixels_of(*batch), {}, {}, true));
      text_parts.push_back(embed({}, ids, mask, false));
      captions.insert(captions.end(), texts.begin(), texts.end());
      labels.insert(labels.end(), batch->labels.begin(), batch->labels.end());
    }
    if (config_.evaluation.max_batches > 0 && ++batches >= config_.evaluation.max_batches) break;
  }
  if (image_parts.empty()) {
    model_->train(true);
    return;
  }
  const at::Tensor images = at::cat(image_parts), texts = at::cat(text_parts);
  const int64_t n = images.size(0);
  Reporter::Retrieval eval;
  eval.pairs = n;
  const at::Tensor scale = model_->logit_scale().detach().to(at::kFloat).cpu();
  double loss_sum = 0;
  for (const auto& [begin, count] : split_counts(n, config_.training.batch_size))
    loss_sum += clip_contrastive_loss(images.narrow(0, begin, count), texts.narrow(0, begin, count), scale)
                    .item<double>() *
                static_cast<double>(count);
  eval.loss = loss_sum / static_cast<double>(n);
  std::map<std::string, int64_t> first;
  std::vector<int64_t> group;
  for (const auto& caption : captions) group.push_back(first.emplace(caption, static_cast<int64_t>(first.size())).first->second);
  const at::Tensor similarity = images.matmul(texts.t());  // (images, texts)
  const int64_t ks[3] = {1, 5, 10};
  for (int i = 0; i < 3; ++i) {
    eval.image_to_text[i] = recall_at(similarity, group, ks[i]);
    eval.text_to_image[i] = recall_at(similarity.t(), group, ks[i]);
  }
  // Zero-shot: each class's text embedding is the mean of its normalised prompt embeddings, normalised again.
  const auto labelled = std::count_if(labels.begin(), labels.end(), [](int64_t l) { return l >= 0; });
  if (!config_.evaluation.class_prompts.empty() && labelled > 0 && dataset->classes.size() >= 2) {
    std::vector<at::Tensor> classes;
    for (const auto& name : dataset->classes) {
      std::vector<std::string> prompts;
      for (const auto& prompt : config_.evaluation.class_prompts)
        prompts.push_back(zero_shot_class_texts({name}, prompt).front());
      const auto [ids, mask] = (*tokenizer_)(prompts);
      const at::Tensor mean = embed({}, ids, mask, false).mean(0);
      classes.push_back(mean / mean.norm());
    }
    const at::Tensor predicted = std::get<1>(images.matmul(at::stack(classes).t()).max(1)).contiguous();
    const auto* p = predicted.data_ptr<int64_t>();
    int64_t correct = 0;
    for (int64_t i = 0; i < n; ++i) correct += labels[static_cast<std::size_t>(i)] >= 0 && p[i] == labels[static_cast<std::size_t>(i)];
    eval.zero_shot_top1 = static_cast<double>(correct) / static_cast<double>(labelled);
  }
  model_->train(true);
  last_eval_ = eval.loss;
  last_eval_step_ = step_index_;
  if (primary_) reporter_.on_eval_retrieval(step_index_, eval);
}

// A directory transformers loads with CLIPModel and CLIPProcessor: the model, its preprocessing and tokenizer.
// LoRA (lora.enabled): adapters on the towers that train (the text tower alone with contrastive.freeze_image_tower),
// everything else frozen (projections and logit scale too, as PEFT leaves them). A random base (the demo) is saved to
// output_dir/base first, so the adapter has a base that transformers loads. Returns the trainable parameters.
int64_t ContrastiveRun::apply_lora_to_model() {
  lora_base_ = fs::absolute(config_.model.path).lexically_normal().string();
  if (config_.model.init == ModelInit::kRandom) {
    const fs::path base = fs::absolute(output_dir_ / "base").lexically_normal();
    if (primary_ && !fs::exists(base / "model.safetensors")) {  // every rank's random base is the same
      fs::create_directories(base);
      save_clip(*model_, base.string());
      write_text_file((base / "preprocessor_config.json").string(), data::image_processor_json(spec_));
      tokenizer_->copy_files_to(base);
    }
    lora_base_ = base.string();
  }
  lora_ = apply_clip_lora(*model_, config_.lora, static_cast<uint64_t>(config_.training.seed),
                          /*vision=*/!config_.contrastive.freeze_image_tower, /*text=*/true);
  if (resume_dir_) load_clip_adapter(resume_dir_->string(), *lora_);
  int64_t trainable = 0;
  lora_->for_each_parameter([&](const std::string&, at::Tensor& p) { trainable += p.numel(); });
  spdlog::info("LoRA r={} alpha={} on {} layers of the {}; the base frozen", lora_->config().r, lora_->config().alpha,
               lora_->layers().size(), lora_->vision() ? "image and text towers" : "text tower");
  return trainable;
}

// What checkpoints and the final save hold: a CLIPModel directory, or with LoRA the PEFT adapter; both with the
// preprocessing and the tokenizer, so either is a directory `trainer predict --text` and transformers read.
void ContrastiveRun::save_model(const fs::path& dir) {
  if (lora_) {
    write_clip_adapter(dir.string(), *lora_, lora_base_);
    write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
    tokenizer_->copy_files_to(dir);
    return;
  }
  save_clip(*model_, dir.string());
  write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  tokenizer_->copy_files_to(dir);
}

// Rank 0 writes it (every rank holds the same weights); with sharded optimizer state every rank writes its part
// (distributed/checkpoint_parts.h). Every rank calls it at the same step.
std::string ContrastiveRun::checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state) {
  nlohmann::json state = {{"version", kContrastiveCheckpointVersion},
                          {"task", "contrastive"},
                          {"step", step_index_},
                          {"optimizer_steps", optimizer_->steps()},
                          {"pairs_seen", pairs_seen_},
                          {"data_cursor", cursor_to_json(cursor)},
                          {"memory_policy", policy_state},
                          {"config", nlohmann::json::parse(config_to_json(config_))},
                          {"data_fingerprint", fingerprint_}};
  if (scaler_) state["loss_scaler"] = scaler_->state();
  Module& trained = lora_ ? static_cast<Module&>(*lora_) : *model_;
  const fs::path final_dir = distributed::write_checkpoint_on_ranks(
      output_dir_, step_index_, on_disk_step_ == step_index_, [&](const fs::path& dir) { save_model(dir); }, trained,
      *optimizer_, std::move(state), world_);
  on_disk_step_ = step_index_;
  if (!primary_) return final_dir.string();
  retention_->on_checkpoint(step_index_,
                            last_eval_step_ == step_index_ ? std::optional<double>(last_eval_) : std::nullopt);
  reporter_.on_checkpoint(step_index_, final_dir.string());
  return final_dir.string();
}

int ContrastiveRun::finish() {
  checkpoint(loader_->cursor(), policy_->state());
  if (config_.checkpoint.save_final && primary_) save_model(output_dir_ / "final");
  RunSummary summary;
  summary.counted = "image-caption pairs";
  summary.counted_rate = "pairs";
  summary.eval_perplexity = false;  // a contrastive loss is no per-token loss
  summary.steps = step_index_;
  summary.tokens_seen = pairs_seen_;
  summary.data = loader_->stats();
  summary.memory_peak = memory_now(device_).peak;
  summary.adaptations = policy_->adaptations();
  summary.escalations = policy_->escalations();
  if (scaler_)
    summary.loss_scaling = RunSummary::LossScalingSummary{scaler_->skipped_steps(),
                                                          scaler_->skipped_steps() - skipped_at_start_, scaler_->scale()};
  if (config_.checkpoint.save_final) summary.model_dir = (output_dir_ / "final").string();
  summary.model_is_adapter = lora_ != nullptr;
  if (const auto& best = retention_->best()) {
    summary.best_checkpoint = best->path.string();
    summary.best_eval_loss = best->eval_loss;
  }
  distributed::add_rank_figures(world_, summary);
  reporter_.on_finish(std::move(summary));
  return kExitOk;
}

}  // namespace

int train_contrastive(const Config& config, const ResolvedDevice& resolved, const TrainOptions& options,
                      std::ostream& out, distributed::Communicator* world) {
  install_stop_handlers();
  if (config.memory.limit.bytes > 0) {
    if (resolved.device.is_cpu()) set_cpu_budget_limit(static_cast<int64_t>(config.memory.limit.bytes));
    else cap_device_memory(resolved.device, static_cast<int64_t>(config.memory.limit.bytes));
  }
  // Data parallelism: rank 0 alone prints the progress and writes metrics; the others log warnings.
  std::ostream null_stream(nullptr);
  const bool primary = !world || world->rank() == 0;
  Reporter reporter(config, primary ? out : null_stream, primary);
  try {
    ContrastiveRun run(config, resolved.device, options, reporter, world);
    run.set_up();
    int code = run.loop();
    if (code < 0) code = run.finish();
    if (world) world->barrier();  // rank 0, which hosts the rendezvous, leaves last
    return code;
  } catch (const std::exception& error) {
    reporter.on_failure(error);
    throw;
  }
}

}  // namespace trainer
