// The contrastive task (training.objective = contrastive): image-caption JSONL pairs through the threaded image
// loader, captions through the model directory's tokenizer, each effective batch trained by
// contrastive_forward_backward (train/tasks/contrastive/contrastive.h: gradient caching with contrastive.negatives = batch, so any
// split, and any out-of-memory retry, trains the full batch's loss), then CLIP's cap on the logit scale; evaluation by
// image->text and text->image recall@1/5/10, the validation loss and zero-shot accuracy; the result a CLIPModel
// directory transformers loads (or a PEFT adapter). With data parallelism each rank embeds its share of the pairs and
// the embeddings are gathered, so the negatives are the global batch's (docs/clip.md).
#include "train/tasks/contrastive/contrastive_task.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/image_loader.h"
#include "data/jsonl.h"
#include "data/permutation.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/policy.h"
#include "models/image/clip.h"
#include "models/image/clip_lora.h"
#include "models/image/clip_zero_shot.h"
#include "train/activation_checkpointing.h"
#include "train/tasks/contrastive/contrastive.h"
#include "train/engine/loader_task.h"
#include "train/optim/grad_scaler.h"
#include "train/optim/optimizer.h"
#include "train/precision.h"
#include "trainer/hf_weights.h"
#include "trainer/model_dir.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

bool is_clip_model_config(const nlohmann::json& config) {
  return config.is_object() && config.value("model_type", "") == "clip" && config.contains("text_config");
}

namespace {

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

class ContrastiveTask final : public LoaderTask<ImageLoader, ImageBatch> {
 public:
  using LoaderTask::LoaderTask;

  Counted counted() const override { return {"pairs_seen", "image-caption pairs", "pairs", false}; }
  std::string model_type() const override { return "clip"; }

  void check_settings(const TrainOptions& options) const override {
    if (config().precision.mode == PrecisionMode::kBf16)
      throw UsageError("precision.mode=bf16 (bf16 weights) is not implemented for training.objective=contrastive yet",
                       "use precision.mode=bf16-mixed (fp32 weights, bf16 autocast), fp16-mixed or fp32");
    if (options.merge)
      throw UsageError("--merge is not implemented for CLIP (training.objective=contrastive)",
                       "drop --merge; PEFT merges the adapter in final/: PeftModel.from_pretrained(CLIPModel."
                       "from_pretrained(base), \"final\").merge_and_unload()");
  }

  nlohmann::json open_data() override {
    dataset_ = std::make_shared<const data::ImageDataset>(data::open_caption_dataset(
        data::expand_globs(config().data.train_files, "data.train_files"), {}, config().data.on_bad_record == BadRecordPolicy::kSkip));
    if (dataset_->records.size() < 2)
      throw DataError("data.train_files: " + std::to_string(dataset_->records.size()) +
                          " image-caption pair(s); contrastive training needs at least 2",
                      "list {\"image\": \"path\", \"caption\": \"...\"} records in the JSONL files");
    return image_data_fingerprint(*dataset_);
  }
  std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                        std::vector<std::string>& warnings) const override {
    (void)warnings;
    if (saved == current) return {};
    return {"the training pairs differ from those the checkpoint was trained on (" + saved.at("records").dump() +
            " records then, " + current.at("records").dump() + " now, or other images or captions)"};
  }

  void build_model(const std::optional<fs::path>& resume, const c10::Device& device) override;
  Module& model() override { return *model_; }
  ShardableModule* shardable_model() override { return model_.get(); }
  // Fully sharded weights: the root (embeddings, projections, logit scale) gathered for an evaluation, each encoder
  // layer of either tower for its forward, as in training.
  bool evaluates_unit_by_unit() const override { return true; }
  Module* adapters() override { return lora_.get(); }
  Module& trainable() override { return lora_ ? static_cast<Module&>(*lora_) : *model_; }

  void open_loader() override {
    loader_ = make_caption_loader(config(), dataset_, spec_, true, config().training.batch_size, shard());
  }

  void build_step(const StepParts& parts) override {
    optimizer_ = &parts.optimizer;
    policy_ = &parts.policy;
    sync_ = parts.sync;
    scaler_ = parts.scaler;
    device_ = parts.device;
    sharded_pieces_ = sync_ && sync_->shards_weights() ? parts.optimized : nullptr;
  }
  StepResult train_step(TaskBatch& batch, int64_t step, double lr) override;
  int64_t probe_limit() const override {
    const int64_t ranks = world() ? world()->world_size() : 1;
    return (config().training.batch_size + ranks - 1) / ranks;
  }
  void probe(int64_t micro) override;
  std::string probe_case(int64_t micro) const override {
    return "a step of " + std::to_string(std::max<int64_t>(probe_limit(), 2)) + " pairs in micro-batches of " +
           std::to_string(micro);
  }
  std::pair<std::string, std::string> probe_failure() const override {
    return {"not even one image-caption pair fits for micro_batch_size=auto",
            "turn on training.activation_checkpointing, lock the image tower, or raise memory.limit"};
  }
  std::vector<std::string> floor_suggestions() const override {
    std::vector<std::string> s = {"a smaller image size or shorter captions (data.max_length)"};
    if (!config().contrastive.freeze_image_tower)
      s.push_back("contrastive.freeze_image_tower=true (the image tower keeps no gradients or optimizer state)");
    return s;
  }
  void set_device(const c10::Device& device) override { device_ = device; }

  Evaluated evaluate(int64_t step, EvaluationMicroBatch& micro) override;
  void save(const fs::path& dir) override;
  // Fully sharded weights: save() with each weight fetched as its file is written, and the files beside the weights
  // of a checkpoint whose weights are in the ranks' parts.
  void save_streamed(const fs::path& dir, const std::function<at::Tensor(const std::string&)>& parameter,
                     bool write) override;
  void save_without_weights(const fs::path& dir) override;

  // The pairs [first, first + count) of the effective batch (this rank's share), split into micro-batches of
  // `micro`; `ranks`: data parallelism's part of the step (none in the probe and in a single process).
  ContrastiveResult forward_backward(const at::Tensor& pixels, const at::Tensor& ids, const at::Tensor& mask,
                                     int64_t step, int64_t micro, int64_t first, int64_t count,
                                     const ContrastiveRanks* ranks);
  bool escalate(int64_t step);
  void clamp_logit_scale();
  int64_t micro_batch() const { return policy_->micro_batch(); }

 private:
  int64_t apply_lora_to_model(const std::optional<fs::path>& resume);
  // By records (equal counts, the first ranks one more: distributed::share_of's split by examples): a pair's cost
  // does not depend on its caption's length enough to balance by tokens. Every rank learns how many pairs each kept,
  // so the pairs are numbered as in one process (bad images skipped in one rank's share included).
  ImageShard shard() const {
    if (!world()) return {};
    return {world()->rank(), world()->world_size(),
            distributed::kept_counts_exchange(world(), "counting the decoded image-caption pairs of the effective batch")};
  }
  // This rank's captions as ids and mask, padded to the longest caption of the whole effective batch (every rank's),
  // so each pair's text is what one process feeds the text tower.
  std::pair<at::Tensor, at::Tensor> tokenize(const std::vector<std::string>& texts) {
    auto [ids, mask] = (*tokenizer_)(texts);
    if (!world()) return {ids, mask};
    const int64_t longest = world()->all_reduce_max({ids.size(1)})[0];
    if (longest == ids.size(1)) return {ids, mask};
    return {at::constant_pad_nd(ids, {0, longest - ids.size(1)}, static_cast<double>(tokenizer_->pad_id())),
            at::constant_pad_nd(mask, {0, longest - mask.size(1)}, 0)};
  }
  // Rows of every rank's share put together: `rows` (this rank's, `width` columns) into a (pairs, width) matrix on
  // every rank (zeros elsewhere, summed over the ranks).
  at::Tensor gather_rows(const at::Tensor& rows, int64_t pairs, int64_t begin) {
    at::Tensor all = at::zeros({pairs, rows.size(1)}, at::TensorOptions().dtype(at::kFloat).device(device_));
    all.narrow(0, begin, rows.size(0)).copy_(rows);
    world()->all_reduce_sum({all}, static_cast<int64_t>(config().distributed.bucket_size.bytes));
    return all;
  }
  // Normalised embeddings (fp32, on the host) of images or captions, without autograd, in micro-batches of `micro`.
  at::Tensor embed(const at::Tensor& pixels, const at::Tensor& ids, const at::Tensor& mask, bool images,
                   int64_t micro);

  std::shared_ptr<const data::ImageDataset> dataset_;
  std::unique_ptr<ClipModel> model_;
  std::unique_ptr<ClipLoraAdapters> lora_;  // lora.enabled
  std::string lora_base_;                   // the adapter's base_model_name_or_path
  std::unique_ptr<CaptionTokenizer> tokenizer_;
  data::ImageProcessorSpec spec_;
  Optimizer* optimizer_ = nullptr;
  MemoryPolicy* policy_ = nullptr;
  StepSync* sync_ = nullptr;
  GradScaler* scaler_ = nullptr;
  Module* sharded_pieces_ = nullptr;  // fully sharded weights: what the optimizer steps on (this rank's pieces)
  bool checkpointing_on_ = false;
  c10::Device device_{c10::kCPU};
};

// The contrastive task's part of an attempt (StepWork for run_attempts): both passes of gradient caching (or the
// micro-batch negatives' one) over this rank's share at the policy's micro-batch.
class ContrastiveStepWork final : public StepWork {
 public:
  ContrastiveStepWork(ContrastiveTask& task, at::Tensor pixels, at::Tensor ids, at::Tensor mask, int64_t pairs,
                      int64_t first, int64_t count, const ContrastiveRanks* ranks, bool count_loss)
      : task_(task), pixels_(std::move(pixels)), ids_(std::move(ids)), mask_(std::move(mask)), pairs_(pairs),
        first_(first), count_(count), ranks_(ranks), count_loss_(count_loss) {}

  void forward_backward(int64_t step, AttemptOutcome& outcome) override {
    const int64_t micro = std::min(pairs_, std::max<int64_t>(1, task_.micro_batch()));
    outcome.largest_part = micro;
    outcome.micro_steps = (pairs_ + micro - 1) / micro;
    outcome.at_floor = micro <= 1;
    const ContrastiveResult result = task_.forward_backward(pixels_, ids_, mask_, step, micro, first_, count_, ranks_);
    if (result.dropped) outcome.dropped = "another rank ran out of memory";
    // Batch negatives: the loss is the same on every rank (counted once); micro-batch negatives: each rank's part.
    outcome.loss_sum = count_loss_ ? result.loss : 0.0;
  }
  bool escalate(int64_t step) override { return task_.escalate(step); }
  std::string floor_hint() const override {
    return "a smaller image size, training.activation_checkpointing=true, contrastive.freeze_image_tower=true, or a "
           "larger memory.limit";
  }
  void after_update() override { task_.clamp_logit_scale(); }

 private:
  ContrastiveTask& task_;
  at::Tensor pixels_, ids_, mask_;
  int64_t pairs_, first_, count_;
  const ContrastiveRanks* ranks_;
  bool count_loss_;
};

void ContrastiveTask::build_model(const std::optional<fs::path>& resume, const c10::Device& device) {
  if (config().model.quantize != QuantizeMode::kNone)
    throw UsageError("model.quantize: 4-bit layers are built for the text models (T5, Llama, Qwen2, Mistral), not for "
                     "the image models (ViT, CLIP)",
                     "set model.quantize=none (LoRA on ViT and CLIP trains on the full-precision base)");
  device_ = device;
  const nlohmann::json hf = read_json_file((fs::path(config().model.path) / "config.json").string());
  if (!is_clip_model_config(hf))
    throw UsageError(config().model.path + "/config.json is not a CLIPModel (model_type \"clip\" with a text_config); "
                                           "training.objective=contrastive trains both towers of a CLIP",
                     "point model.path at a CLIPModel directory, or use training.objective=classification for an "
                     "image classifier");
  const auto tensor_options = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto seed = static_cast<uint64_t>(config().training.seed);
  // A LoRA checkpoint holds the adapters alone: the base is model.path's again (a random one from the same seed).
  model_ = resume && !config().lora.enabled ? load_clip(resume->string(), ModelInit::kPretrained, tensor_options, seed)
                                            : load_clip(config().model.path, config().model.init, tensor_options, seed);
  tokenizer_ = std::make_unique<CaptionTokenizer>(config(), model_->max_text_length());
  spec_ = data::read_image_processor(config().model.path, "CLIPImageProcessor");
  model_->train(true);
  int64_t trainable = 0;
  model_->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    bool train = true;
    if (config().contrastive.freeze_image_tower)
      for (const char* prefix : ClipModel::kVisionPrefixes) train = train && !name.starts_with(prefix);
    p.requires_grad_(train);
    if (train) trainable += p.numel();
  });
  if (config().lora.enabled) trainable = apply_lora_to_model(resume);
  if (config().training.activation_checkpointing) {
    model_->set_block_runner(activation_checkpointing_runner());
    checkpointing_on_ = true;
  }
  spdlog::info("{} image-caption pairs for training, images {} x {} pixels, captions up to {} tokens; negatives: {}; "
               "{} trainable parameters{}",
               dataset_->records.size(), spec_.output_size().second, spec_.output_size().first,
               tokenizer_->max_length(), enum_name(config().contrastive.negatives), trainable,
               config().contrastive.freeze_image_tower ? " (image tower locked)" : "");
}

// LoRA (lora.enabled): adapters on the towers that train (the text tower alone with contrastive.freeze_image_tower),
// everything else frozen (projections and logit scale too, as PEFT leaves them). A random base (the demo) is saved to
// output_dir/base first, so the adapter has a base that transformers loads. Returns the trainable parameters.
int64_t ContrastiveTask::apply_lora_to_model(const std::optional<fs::path>& resume) {
  lora_base_ = fs::absolute(config().model.path).lexically_normal().string();
  if (config().model.init == ModelInit::kRandom) {
    const fs::path base = fs::absolute(output_dir() / "base").lexically_normal();
    if (primary() && !fs::exists(base / "model.safetensors")) {  // every rank's random base is the same
      fs::create_directories(base);
      save_clip(*model_, base.string());
      write_text_file((base / "preprocessor_config.json").string(), data::image_processor_json(spec_));
      tokenizer_->copy_files_to(base);
    }
    lora_base_ = base.string();
  }
  lora_ = apply_clip_lora(*model_, config().lora, static_cast<uint64_t>(config().training.seed),
                          /*vision=*/!config().contrastive.freeze_image_tower, /*text=*/true);
  if (resume) load_clip_adapter(resume->string(), *lora_);
  int64_t trainable = 0;
  lora_->for_each_parameter([&](const std::string&, at::Tensor& p) { trainable += p.numel(); });
  spdlog::info("LoRA r={} alpha={} on {} layers of the {}; the base frozen", lora_->config().r, lora_->config().alpha,
               lora_->layers().size(), lora_->vision() ? "image and text towers" : "text tower");
  return trainable;
}

ContrastiveResult ContrastiveTask::forward_backward(const at::Tensor& pixels, const at::Tensor& ids,
                                                    const at::Tensor& mask, int64_t step, int64_t micro,
                                                    int64_t first, int64_t count, const ContrastiveRanks* ranks) {
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
      mb.rng_seed = data::mix_seed(static_cast<uint64_t>(config().training.seed) ^ kMicroBatchSeedSalt,
                                   static_cast<uint64_t>(step), static_cast<uint64_t>(begin));
      parts.push_back(std::move(mb));
    }
  ContrastiveOptions options;
  options.negatives = config().contrastive.negatives == ContrastiveNegativesMode::kBatch
                          ? ContrastiveNegatives::kBatch
                          : ContrastiveNegatives::kMicroBatch;
  options.dropout_seed = static_cast<uint64_t>(config().training.seed);
  options.step = step;
  options.image_tower_trainable = !config().contrastive.freeze_image_tower;
  options.ranks = ranks;
  if (ranks && sync_ && sync_->shards_weights()) {
    // Fully sharded weights: as many micro-batches on every rank (the blocks' gathers and reductions pair up); the
    // others' extra ones are empty here: one black image and a caption of one padding token.
    const auto mine = static_cast<int64_t>(parts.size());
    options.empty_passes = sync_->agree_passes(mine) - mine;
    const auto on_device = at::TensorOptions().device(device_);
    options.empty.pixel_values = at::zeros({1, 3, pixels.size(2), pixels.size(3)}, on_device);
    options.empty.input_ids = at::full({1, 1}, tokenizer_->pad_id(), on_device.dtype(at::kLong));
    options.empty.attention_mask = at::ones_like(options.empty.input_ids);
  }
  // fp16-mixed: gradients of the scaled loss (the update divides them by the scale again).
  if (scaler_) options.loss_scale = scaler_->scale();
  // Mixed precision: both passes under the same autocast, so the second pass re-creates the first's embeddings.
  const auto dtype = autocast_dtype(config().precision.mode);
  AutocastScope autocast(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
  return contrastive_forward_backward(*model_, parts, options);
}

void ContrastiveTask::clamp_logit_scale() {
  if (!sharded_pieces_) return model_->clamp_logit_scale();
  // Fully sharded weights: the master value is the piece one rank keeps (the model's own is not gathered now); the
  // next gather brings the clamped value.
  at::NoGradGuard no_grad;
  sharded_pieces_->for_each_parameter([](const std::string& name, at::Tensor& piece) {
    if (name == "logit_scale") piece.clamp_(0.0, kClipMaxLogitScale);
  });
}

bool ContrastiveTask::escalate(int64_t step) {
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
// micro-batch mode's objective), then clipping, the update and CLIP's cap on the logit scale.
StepResult ContrastiveTask::train_step(TaskBatch& task_batch, int64_t step, double lr) {
  const ImageBatch& batch = batch_of(task_batch);
  // Data parallelism: `batch` is this rank's share (pairs [first, first + count) of the effective batch's `pairs`);
  // the negatives (batch mode) are still every pair's, gathered.
  const at::Tensor pixels = pixels_of(batch);
  const auto [ids, mask] = tokenize(captions_of(*dataset_, batch));
  const int64_t pairs = world() ? batch.total : batch.size();
  const int64_t first = world() ? batch.first : 0, count = batch.size();
  const bool batch_negatives = config().contrastive.negatives == ContrastiveNegativesMode::kBatch;
  ContrastiveRanks ranks;
  if (world()) {
    ranks.batch = pairs;
    ranks.offset = first;
    ranks.width = model_->projection_dim();
    ranks.logit_scale_gradient = primary();
    ranks.agree = [this](bool fit) { return sync_->agree(fit, 0).all_fit; };
    if (sync_->shards_weights())
      // Fully sharded weights: the attempt's agreement must wait for its end (StepSync::agree closes the attempt).
      // A rank out of memory in pass (a) rethrows at once and tells the others at the attempt's end
      // (StepSync::announce_failure), which they learn at the status all-reduce here or at a block's gather before it.
      ranks.agree = [this](bool fit) {
        if (fit) sync_->sum({0.0}, "agreeing that every rank embedded its share of the pairs");
        return fit;
      };
    ranks.sum = [this](at::Tensor& rows) {
      world()->all_reduce_sum({rows}, static_cast<int64_t>(config().distributed.bucket_size.bytes));
    };
  }
  ContrastiveStepWork work(*this, pixels, ids, mask, pairs, first, count, world() ? &ranks : nullptr,
                           !(batch_negatives && world() && !primary()));
  return run_attempts(work, {*optimizer_, *policy_, scaler_, sync_, config().training.max_grad_norm,
                             config().memory.max_retries, step, lr, pairs, 1.0, pairs});
}

// micro_batch_size=auto: the largest micro-batch at which a whole step fits, measured as the step runs it: an
// effective batch (under data parallelism this rank's largest share) of captions at the longest length, split at the
// candidate, through both passes of gradient caching and the batch's loss (or micro-batch negatives), then the
// optimizer phase's gradient norm. Measuring one micro-batch's passes alone misses the batch's embeddings and loss
// and misjudges gradient caching's second pass (one tower at a time).
void ContrastiveTask::probe(int64_t micro) {
  const auto [height, width] = spec_.output_size();
  const int64_t pairs = std::max<int64_t>(probe_limit(), 2);
  // Pixels outside LibTorch's allocator, as the loader's are (pixels_of), so the probe counts what a step counts.
  std::vector<float> pixel_buffer(static_cast<std::size_t>(pairs * 3 * height * width), 0.0f);
  const at::Tensor pixels = at::from_blob(pixel_buffer.data(), {pairs, 3, height, width}, at::kFloat);
  const int64_t length = tokenizer_->max_length();
  const at::Tensor ids = at::zeros({pairs, length}, at::kLong), mask = at::ones({pairs, length}, at::kLong);
  forward_backward(pixels, ids, mask, 0, micro, 0, pairs, nullptr);
  optimizer_->squared_grad_norm();
}

at::Tensor ContrastiveTask::embed(const at::Tensor& pixels, const at::Tensor& ids, const at::Tensor& mask,
                                  bool images, int64_t micro) {
  const int64_t n = images ? pixels.size(0) : ids.size(0);
  const auto dtype = autocast_dtype(config().precision.mode);  // evaluate in the precision training runs in
  AutocastScope autocast(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
  std::vector<at::Tensor> parts;
  const auto pieces = split_counts(n, micro);
  // Fully sharded weights: every forward is a collective; as many as the rank with the most (agreed first), the others
  // one black image or a caption of one padding token that counts nothing.
  const auto mine = static_cast<int64_t>(pieces.size());
  const int64_t passes = sync_ && sync_->shards_weights() ? sync_->agree_passes(mine) : mine;
  for (const auto& [begin, count] : pieces) {
    const at::Tensor features = images ? model_->image_features(pixels.narrow(0, begin, count).to(device_))
                                       : model_->text_features(ids.narrow(0, begin, count).to(device_),
                                                               mask.narrow(0, begin, count).to(device_));
    parts.push_back(features.to(at::kFloat).cpu());
  }
  const auto [height, width] = spec_.output_size();
  for (int64_t i = mine; i < passes; ++i) {
    const at::Tensor one = at::full({1, 1}, tokenizer_->pad_id(), at::TensorOptions().dtype(at::kLong).device(device_));
    (void)(images ? model_->image_features(at::zeros({1, 3, height, width}, at::TensorOptions().device(device_)))
                  : model_->text_features(one, at::ones_like(one)));
  }
  if (parts.empty()) return at::zeros({0, model_->projection_dim()});  // a rank's empty share
  const at::Tensor all = at::cat(parts);
  return all / all.norm(2, {1}, true);
}

// Over the validation pairs: the contrastive loss (mean over consecutive chunks of training.batch_size pairs, the
// training objective's batch), recall@1/5/10 both ways, and zero-shot top-1 accuracy when the records have labels
// and evaluation.class_prompts is set. With data parallelism each rank decodes and embeds its share of every batch;
// the embeddings and the pairs' records are gathered, so every rank scores them all.
Evaluated ContrastiveTask::evaluate(int64_t step, EvaluationMicroBatch& micro) {
  if (config().data.validation_files.empty()) return {};
  const bool skip = config().data.on_bad_record == BadRecordPolicy::kSkip;
  auto dataset = std::make_shared<const data::ImageDataset>(
      data::open_caption_dataset(data::expand_globs(config().data.validation_files, "data.validation_files"), {}, skip));
  auto loader = make_caption_loader(config(), dataset, spec_, false, config().training.batch_size, shard());
  at::NoGradGuard no_grad;
  model_->train(false);
  std::vector<at::Tensor> image_parts, text_parts;
  std::vector<std::string> captions;
  std::vector<int64_t> labels;
  int64_t batches = 0;
  const int64_t width = model_->projection_dim();
  while (auto batch = loader->next()) {
    const auto texts = captions_of(*dataset, *batch);
    const auto [ids, mask] = (*tokenizer_)(texts);
    // (pairs, 2 x width): images, then texts. A rank out of memory at micro-batch 1 contributes zeros and goes on
    // with the exchanges; the engine then stops every rank.
    at::Tensor mine = at::zeros({batch->size(), 2 * width});
    // Fully sharded weights: a rank with an empty share still takes part in the forwards (empty ones).
    if (batch->size() > 0 || (sync_ && sync_->shards_weights()))
      micro.run([&](int64_t size) {
        mine = at::cat({embed(pixels_of(*batch), {}, {}, true, size), embed({}, ids, mask, false, size)}, 1);
      });
    if (world()) {
      const int64_t pairs = batch->total, first = batch->first, count = batch->size();
      const at::Tensor all = gather_rows(mine.to(device_), pairs, first).cpu();
      image_parts.push_back(all.narrow(1, 0, width));
      text_parts.push_back(all.narrow(1, width, width));
      std::vector<double> records(static_cast<std::size_t>(pairs), 0.0);
      for (int64_t i = 0; i < count; ++i)
        records[static_cast<std::size_t>(first + i)] = static_cast<double>(batch->records[static_cast<std::size_t>(i)]);
      records = world()->all_reduce_sum(records, "gathering the evaluation pairs' records");
      for (const double r : records) {
        const auto record = static_cast<std::size_t>(std::llround(r));
        captions.push_back(dataset->captions.at(record));
        labels.push_back(dataset->records.at(record).label);
      }
    } else {
      image_parts.push_back(mine.narrow(1, 0, width));
      text_parts.push_back(mine.narrow(1, width, width));
      captions.insert(captions.end(), texts.begin(), texts.end());
      labels.insert(labels.end(), batch->labels.begin(), batch->labels.end());
    }
    if (config().evaluation.max_batches > 0 && ++batches >= config().evaluation.max_batches) break;
  }
  if (image_parts.empty() || micro.failed()) {
    model_->train(true);
    return {};
  }
  // The scores over every validation pair: no micro-batch makes them smaller.
  Reporter::Retrieval eval;
  const bool scored = micro.run_once([&] {
    const at::Tensor images = at::cat(image_parts), texts = at::cat(text_parts);
    const int64_t n = images.size(0);
    eval.pairs = n;
    const at::Tensor scale = model_->logit_scale().detach().to(at::kFloat).cpu();
    double loss_sum = 0;
    for (const auto& [begin, count] : split_counts(n, config().training.batch_size))
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
    if (!config().evaluation.class_prompts.empty() && labelled > 0 && dataset->classes.size() >= 2) {
      std::vector<at::Tensor> classes;
      for (const auto& name : dataset->classes) {
        std::vector<std::string> prompts;
        for (const auto& prompt : config().evaluation.class_prompts)
          prompts.push_back(zero_shot_class_texts({name}, prompt).front());
        const auto [ids, mask] = (*tokenizer_)(prompts);
        at::Tensor mean;
        if (!micro.run([&](int64_t size) { mean = embed({}, ids, mask, false, size).mean(0); })) break;
        classes.push_back(mean / mean.norm());
      }
      if (classes.size() == dataset->classes.size()) {
        const at::Tensor predicted = std::get<1>(images.matmul(at::stack(classes).t()).max(1)).contiguous();
        const auto* p = predicted.data_ptr<int64_t>();
        int64_t correct = 0;
        for (int64_t i = 0; i < n; ++i)
          correct += labels[static_cast<std::size_t>(i)] >= 0 && p[i] == labels[static_cast<std::size_t>(i)];
        eval.zero_shot_top1 = static_cast<double>(correct) / static_cast<double>(labelled);
      }
    }
  });
  model_->train(true);
  if (!scored) return {};
  return {eval.loss, [step, eval](Reporter& reporter) { reporter.on_eval_retrieval(step, eval); }};
}

// A directory transformers loads with CLIPModel and CLIPProcessor: the model (or with LoRA the PEFT adapter), its
// preprocessing and tokenizer, so either is a directory `trainer predict --text` and transformers read.
void ContrastiveTask::save(const fs::path& dir) {
  if (lora_) write_clip_adapter(dir.string(), *lora_, lora_base_);
  else save_clip(*model_, dir.string());
  write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  tokenizer_->copy_files_to(dir);
}

void ContrastiveTask::save_streamed(const fs::path& dir, const std::function<at::Tensor(const std::string&)>& parameter,
                                    bool write) {
  save_clip(*model_, dir.string(), kDefaultMaxShardBytes, parameter, write);
  if (!write) return;
  write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  tokenizer_->copy_files_to(dir);
}

void ContrastiveTask::save_without_weights(const fs::path& dir) {
  save_clip_config(*model_, dir.string());
  write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  tokenizer_->copy_files_to(dir);
}

}  // namespace

std::unique_ptr<Task> make_contrastive_task(const TaskContext& context) {
  return std::make_unique<ContrastiveTask>(context);
}

}  // namespace trainer
