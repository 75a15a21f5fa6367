// The preference task: DPO (training.objective=dpo) on a causal language model, as TRL's DPOTrainer trains it.
// Data: preference pairs (preference_data.h) through the text loader, one pair per example, so the effective batch,
// the shuffle, the cursor and the ranks' shares count pairs and a pair is never split. The step: per micro-batch of
// pairs, both sequences of every pair in one forward (rows chosen, rejected, chosen, ... so that dropout masks follow
// the pair's place in the effective batch), the reference's log-probabilities without autograd (with LoRA the same
// model with its adapters off, as PEFT + TRL do; else a frozen copy of the starting weights), the policy's through
// the fused chunked LM head (no full logits), and the gradient of the loss (dpo_loss.h) back through the same fused
// head with each token weighted by its sequence's share of the loss. Evaluation: the validation pairs' loss and
// TRL's reward metrics. The model is the text task's (TextModel: LoRA, 4-bit bases, saving, --merge).
// dpo.precompute_reference: before the first step, one pass computes the reference's log-probabilities of every train
// and validation pair into checkpoint.output_dir/dpo-reference (reference_store.h), resumed after the last finished
// chunk, reused whole by a resumed run; training then reads them and runs no reference at all (a full fine-tune holds
// no frozen copy).
#include "train/tasks/preference/preference_task.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/autograd.h>

#include "data/record.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/policy.h"
#include "models/dropout.h"
#include "models/lora.h"
#include "models/weights.h"
#include "train/activation_checkpointing.h"
#include "train/device_move.h"
#include "train/engine/attempts.h"
#include "train/fused_loss.h"
#include "train/precision.h"
#include "train/resume_check.h"
#include "train/tasks/preference/dpo_loss.h"
#include "train/tasks/preference/preference_data.h"
#include "train/tasks/preference/reference_store.h"
#include "train/tasks/text/language_model_task.h"
#include "train/tasks/text/text_model.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

// The chosen completions' tokens of `pairs` (what the sft loss is a mean over), at least 1.
double chosen_tokens(std::span<const Example> pairs) {
  int64_t n = 0;
  for (const Example& pair : pairs) n += target_tokens(pair, DataFamily::kCausal);
  return static_cast<double>(std::max<int64_t>(1, n));
}

class PreferenceTask final : public LanguageModelTask {
 public:
  explicit PreferenceTask(const TaskContext& context)
      : LanguageModelTask(context, preference_example_shape(context.config)) {}
  ~PreferenceTask() override { loader_.reset(); }  // the loader's workers read mapper_, destroyed before the base's

  Counted counted() const override { return {"pairs_seen", "preference pairs", "pairs", false}; }

  void check_settings(const TrainOptions& options) const override {
    LanguageModelTask::check_settings(options);
    // Fully sharded weights: the reference is the base under the adapters, run unit by unit as the policy is, or
    // the reference pass's table (its forwards unit by unit); a frozen copy beside the sharded model during training
    // would be whole on every rank.
    if (world() && config().distributed.shard_weights && !config().dpo.precompute_reference &&
        (!config().lora.enabled || !config().dpo.reference_model.empty()))
      throw UsageError(std::string("distributed.shard_weights=true with DPO ") +
                           (config().lora.enabled ? "and dpo.reference_model" : "as a full fine-tune") +
                           " needs dpo.precompute_reference=true: a frozen reference copy kept beside the sharded "
                           "model for the whole run would be whole on every rank",
                       "set dpo.precompute_reference=true (one pass before training computes the reference's "
                       "log-probabilities, unit by unit over the sharded model), or train LoRA adapters "
                       "(lora.enabled=true: the reference is the base under them)");
  }
  // Fully sharded weights (LoRA): the base is sharded, the adapters whole on every rank.
  ShardableModule* shardable_model() override { return model_; }

  nlohmann::json open_data() override {
    tokenizer_ = load_run_tokenizer(config(), /*samples=*/false);
    if (is_ids_only(*tokenizer_))
      throw UsageError("DPO renders and tokenizes preference records, but " + config().model.path +
                           " has no tokenizer files",
                       "set tokenizer.path to the model's tokenizer");
    mapper_ = preference_mapper(config(), *tokenizer_);  // the template parsed once, for training and evaluation
    fingerprint_ = data_fingerprint(config(), *tokenizer_);
    return fingerprint_;
  }

  void build_model(const std::optional<fs::path>& resume, const c10::Device& device) override;

  void open_loader() override {
    loader_ = make_train_loader(config(), *tokenizer_, DataFamily::kCausal, distributed::record_share(world()),
                                mapper_);
  }

  void build_step(const StepParts& parts) override {
    optimizer_ = &parts.optimizer;
    policy_ = &parts.policy;
    sync_ = parts.sync;
    scaler_ = parts.scaler;
    device_ = parts.device;
    evaluate_unit_by_unit_ = parts.evaluate_unit_by_unit;
    if (config().dpo.precompute_reference) prepare_reference();
  }
  StepResult train_step(TaskBatch& batch, int64_t step, double lr) override;
  int64_t probe_limit() const override { return config().training.batch_size; }
  void probe(int64_t micro) override {
    std::vector<Example> pairs(static_cast<std::size_t>(micro), worst_case_pair());
    PreferenceSums sums;
    // A precomputed reference has no value for the made-up pair: zeros stand in while probing_ is set, and it is
    // cleared however the probe ends (an out-of-memory error is the probe's answer).
    struct Probing {
      bool& flag;
      explicit Probing(bool& f) : flag(f) { flag = true; }
      ~Probing() { flag = false; }
    } probing(probing_);
    forward_backward(pairs, 0, {static_cast<double>(micro), 1.0}, /*step=*/0, sums);
  }
  std::string probe_case(int64_t micro) const override {
    return std::to_string(micro) + " pairs of two sequences at data.max_length";
  }
  std::pair<std::string, std::string> probe_failure() const override {
    return {"not even one preference pair (two sequences of data.max_length) fits for micro_batch_size=auto",
            "lower data.max_length, turn on training.activation_checkpointing, train LoRA adapters (no reference "
            "copy), or raise memory.limit"};
  }
  std::vector<std::string> floor_suggestions() const override {
    return {"shorter sequences: data.max_length (a pair is two of them)",
            "LoRA (lora.enabled=true): the reference is the base under the adapters, no second copy of the weights"};
  }
  void set_device(const c10::Device& device) override {
    device_ = device;
    if (reference_) move_parameters({reference_.get()}, device);
  }

  Evaluated evaluate(int64_t step, EvaluationMicroBatch& micro) override;
  // Fully sharded weights: the validation pairs' scores unit by unit, as the text task's loss.
  bool evaluates_unit_by_unit() const override { return true; }

  // One attempt's forward and backward of `pairs` (the effective batch's pairs from `first_pair` on) in
  // micro-batches; the loss's part of them. Public for the step's work.
  double forward_backward(std::span<const Example> pairs, int64_t first_pair, const PairTotals& totals, int64_t step,
                          PreferenceSums& sums, bool last_part = false);
  // Fully sharded weights: as many passes as the rank with the most (agreed), the others empty ones.
  std::size_t agreed_passes(std::size_t mine) {
    if (!sync_ || !sync_->shards_weights()) return mine;
    return static_cast<std::size_t>(sync_->agree_passes(static_cast<int64_t>(mine)));
  }
  void empty_pass(int64_t step);
  // The forwards of an empty pass outside training (an evaluation, the reference pass): the reference's (when it
  // runs) then, with `policy`, the policy's, on one padding token, without gradients.
  void empty_forwards(bool policy);
  bool escalate(int64_t step);
  bool may_overlap() const { return !model_->has_block_runner(); }
  MemoryPolicy& policy() { return *policy_; }

 private:
  Example worst_case_pair() const {
    Example pair;
    pair.input_ids.assign(static_cast<std::size_t>(config().data.max_length), 5);
    pair.labels = pair.input_ids;
    pair.labels[0] = -100;
    pair.rejected_ids = pair.input_ids;
    pair.rejected_labels = pair.labels;
    return pair;
  }
  // Scores of `pairs` (`batch` is them collated as rows chosen, rejected, ...): the reference's without autograd
  // (or from `precomputed`, dpo.precompute_reference's table of these pairs), the policy's with `hidden` kept for
  // the backward when `hidden_out` is given.
  PairScores score(const Batch& batch, std::span<const Example> pairs, const ReferenceTable* precomputed,
                   at::Tensor* hidden_out, at::Tensor* targets_out);
  // The reference's summed log-probabilities of the chosen (even rows) and rejected (odd rows) sequences, fp64 (k).
  std::pair<at::Tensor, at::Tensor> reference_logps(const Batch& batch, int64_t pairs);
  std::pair<at::Tensor, at::Tensor> precomputed_logps(std::span<const Example> pairs, const ReferenceTable& table,
                                                      const char* split) const;
  // A frozen copy of the reference (model.path's starting weights or dpo.reference_model's) in reference_.
  void load_reference();
  // dpo.precompute_reference: the pass (or what is left of it) and the tables.
  void prepare_reference();
  nlohmann::json reference_identity() const;
  // One split's pass from `chunks` finished chunks on (the loader at `position`); returns the pairs computed.
  // `micro`: over fully sharded weights, the pass runs unit by unit (reference_by_units).
  int64_t reference_pass(const ReferenceStore& store, const std::string& split, int64_t chunks, uint64_t position,
                         EvaluationMicroBatch* micro);
  // The reference of `pairs` into out[2i], out[2i + 1], in pieces of pass_fit_ pairs, halved at each out-of-memory.
  void reference_of(std::span<const Example> pairs, double* out);
  // The same over fully sharded weights for this rank's `pieces` of a chunk's `pairs` (each forward a collective):
  // every rank runs as many forwards as the rank with the most, and an out-of-memory error halves every rank's
  // forwards together (`micro`).
  void reference_by_units(std::span<const Example> pairs, const std::vector<std::pair<int64_t, int64_t>>& pieces,
                          double* out, EvaluationMicroBatch& micro);
  Batch collate_pairs(std::span<const Example> pairs) const;
  std::optional<at::ScalarType> autocast() const { return autocast_dtype(config().precision.mode); }
  bool dropout_on() const { return !config().dpo.disable_dropout; }
  // Trained positions per chunk of the fused head: the policy's (the smaller_loss_chunks escalation halves it).
  int64_t loss_chunk() const { return policy_ ? policy_->loss_chunk_size() : config().training.loss_chunk_size; }

  RecordMapper mapper_;  // preference records -> pairs (reads tokenizer_)
  std::unique_ptr<LanguageModel> reference_;  // full fine-tune: the frozen starting weights
  nlohmann::json fingerprint_;                 // open_data's
  bool resumed_ = false;
  bool probing_ = false;
  std::optional<ReferenceTable> train_reference_, validation_reference_;  // dpo.precompute_reference's values
  int64_t pass_fit_ = 1;  // pairs per forward of the reference pass
  Optimizer* optimizer_ = nullptr;
  MemoryPolicy* policy_ = nullptr;
  StepSync* sync_ = nullptr;
  GradScaler* scaler_ = nullptr;
  std::function<void(EvaluationMicroBatch&, const std::function<void()>&)> evaluate_unit_by_unit_;
  c10::Device device_{c10::kCPU};
  int32_t pad_id_ = 0;
};

void PreferenceTask::build_model(const std::optional<fs::path>& resume, const c10::Device& device) {
  device_ = device;
  build_text_model(resume, device);
  if (model_->family() != ModelFamily::kCausal)
    throw UsageError("training.objective=dpo trains causal language models; " + config().model.path + " is a " +
                         model_->model_type() + " (seq2seq) model",
                     "use a Llama, Qwen2 or Mistral model, or drop training.objective");
  if (model_->has_routing_loss())
    throw UsageError(config().model.path + "/config.json: \"output_router_logits\" is true: DPO with the mixture of "
                         "experts' load-balancing loss is not supported yet",
                     "set it to false in config.json: DPO then trains without the auxiliary loss, as TRL does with it "
                     "false");
  pad_id_ = text_model_.pad_id();
  model_->train(dropout_on());
  resumed_ = resume.has_value();
  if (config().dpo.precompute_reference) {
    spdlog::info("DPO reference: precomputed before training into {} (no reference copy or forward while training)",
                 (fs::path(config().checkpoint.output_dir) / ReferenceStore::kDirName).string());
    return;
  }
  if (text_model_.lora() && config().dpo.reference_model.empty()) {
    spdlog::info("DPO reference: the base model with the LoRA adapters off (no second copy)");
    return;
  }
  load_reference();
}

void PreferenceTask::load_reference() {
  const c10::Device device = device_;
  const std::string& other = config().dpo.reference_model;
  // The reference is the starting weights (also when a full fine-tune resumes from its checkpoint), or
  // dpo.reference_model's. Held as the base is: bf16 where the trained model's frozen weights are.
  const bool bf16 = config().precision.mode == PrecisionMode::kBf16 ||
                    (config().lora.enabled && config().lora.base_in_bf16);
  const auto options = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat).device(device);
  if (other.empty()) {
    reference_ = load_model(config().model.path, config().model.init, options,
                            static_cast<uint64_t>(config().training.seed), quantize_options(config().model));
  } else {
    reference_ = load_model(other, ModelInit::kPretrained, options, 0, quantize_options(config().model));
    if (reference_->vocab_size() != model_->vocab_size() || reference_->family() != model_->family())
      throw DataError("dpo.reference_model " + other + " is a " + reference_->model_type() + " with a vocabulary of " +
                          std::to_string(reference_->vocab_size()) + ", model.path a " + model_->model_type() +
                          " with " + std::to_string(model_->vocab_size()),
                      "the reference must share model.path's tokenizer: name a model of the same family");
  }
  reference_->train(false);
  reference_->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(false); });
  spdlog::info("DPO reference: a frozen copy of {} ({} parameters)", other.empty() ? config().model.path : other,
               count_parameters(*reference_));
}

Batch PreferenceTask::collate_pairs(std::span<const Example> pairs) const {
  std::vector<Example> rows;
  rows.reserve(2 * pairs.size());
  for (const Example& pair : pairs) {
    rows.push_back(Example{pair.input_ids, pair.labels, pair.source_index, {}, {}});
    rows.push_back(Example{pair.rejected_ids, pair.rejected_labels, pair.source_index, {}, {}});
  }
  const CollatedBatch collated = collate(rows, pad_id_, device_);
  return Batch{collated.input_ids, collated.attention_mask, collated.labels, {}};
}

std::pair<at::Tensor, at::Tensor> PreferenceTask::reference_logps(const Batch& batch, int64_t pairs) {
  const auto dtype = autocast();
  // without autograd and without dropout
  at::NoGradGuard no_grad;
  LanguageModel& reference = reference_ ? *reference_ : *model_;
  AdaptersOff off(reference_ ? nullptr : text_model_.lora());
  const bool was_training = reference.is_training();
  reference.train(false);
  at::Tensor hidden, targets;
  {
    AutocastScope scope(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
    std::tie(hidden, targets) = reference.hidden_and_targets(batch);
  }
  const TokenLosses losses =
      token_losses(hidden, targets, reference.lm_head_weight(), reference.lm_head_scale(), loss_chunk(), dtype,
                   reference.final_logit_softcap());
  reference.train(was_training);
  const at::Tensor logps = -losses.loss.reshape(targets.sizes()).to(at::kDouble).sum(1);  // (2k)
  return {logps.slice(0, 0, 2 * pairs, 2), logps.slice(0, 1, 2 * pairs, 2)};
}

std::pair<at::Tensor, at::Tensor> PreferenceTask::precomputed_logps(std::span<const Example> pairs,
                                                                    const ReferenceTable& table,
                                                                    const char* split) const {
  std::vector<double> chosen, rejected;
  for (const Example& pair : pairs) {
    const auto found = table.find(pair_key(pair));
    if (found == table.end()) {
      const fs::path dir = fs::path(config().checkpoint.output_dir) / ReferenceStore::kDirName;
      throw DataError("a " + std::string(split) + " preference pair (" + std::to_string(pair.input_ids.size()) +
                          " and " + std::to_string(pair.rejected_ids.size()) +
                          " tokens) has no precomputed reference log-probabilities in " + dir.string() +
                          ": its record changed after the pass (edited in place, with the same size)",
                      "delete " + dir.string() + " and they are computed again");
    }
    chosen.push_back(found->second.chosen);
    rejected.push_back(found->second.rejected);
  }
  const auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::tensor(chosen, options).to(device_), at::tensor(rejected, options).to(device_)};
}

PairScores PreferenceTask::score(const Batch& batch, std::span<const Example> pair_list,
                                 const ReferenceTable* precomputed, at::Tensor* hidden_out, at::Tensor* targets_out) {
  const auto pairs = static_cast<int64_t>(pair_list.size());
  const auto dtype = autocast();
  const int64_t chunk = loss_chunk();
  auto sequence_sums = [&](const at::Tensor& per_token, const at::Tensor& targets) {
    return per_token.reshape(targets.sizes()).to(at::kDouble).sum(1);  // (2k)
  };
  PairScores out;
  // Fully sharded weights: an untied head is a unit of its own, gathered from the reference's scores to the policy's
  // fused loss (forward_backward releases it; outside an attempt, in an evaluation, the hooks do nothing).
  if (sync_ && hidden_out) sync_->before_head(model_->lm_head_weight());
  if (!config().dpo.precompute_reference) {
    std::tie(out.ref_chosen, out.ref_rejected) = reference_logps(batch, pairs);
  } else if (probing_) {
    out.ref_chosen = out.ref_rejected = at::zeros({pairs}, at::TensorOptions().dtype(at::kDouble).device(device_));
  } else {
    const bool validation = validation_reference_ && precomputed == &*validation_reference_;
    std::tie(out.ref_chosen, out.ref_rejected) =
        precomputed_logps(pair_list, *precomputed, validation ? "validation" : "train");
  }
  at::Tensor hidden, targets;
  {
    AutocastScope scope(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
    std::tie(hidden, targets) = model_->hidden_and_targets(batch);
  }
  const TokenLosses losses = token_losses(hidden.detach(), targets, model_->lm_head_weight().detach(),
                                          model_->lm_head_scale(), chunk, dtype, model_->final_logit_softcap());
  const at::Tensor logps = -sequence_sums(losses.loss, targets);
  const at::Tensor trained = (targets != -100);
  const at::Tensor tokens = trained.to(at::kDouble).sum(1);
  const at::Tensor mean_logits = sequence_sums(losses.mean_logit, targets);
  out.chosen = logps.slice(0, 0, 2 * pairs, 2);
  out.rejected = logps.slice(0, 1, 2 * pairs, 2);
  out.chosen_tokens = tokens.slice(0, 0, 2 * pairs, 2);
  out.rejected_tokens = tokens.slice(0, 1, 2 * pairs, 2);
  out.logits_chosen = mean_logits.slice(0, 0, 2 * pairs, 2).sum().item<double>();
  out.logits_rejected = mean_logits.slice(0, 1, 2 * pairs, 2).sum().item<double>();
  if (hidden_out) *hidden_out = hidden;
  if (targets_out) *targets_out = targets;
  return out;
}

double PreferenceTask::forward_backward(std::span<const Example> pairs, int64_t first_pair, const PairTotals& totals,
                                        int64_t step, PreferenceSums& sums, bool last_part) {
  const auto k = static_cast<int64_t>(pairs.size());
  model_->train(dropout_on());
  const Batch batch = collate_pairs(pairs);
  // Rows 2i and 2i + 1 are pair first_pair + i's two sequences: dropout keys them by that place.
  std::optional<DropoutScope> dropout;
  if (dropout_on()) dropout.emplace(config().training.seed, step, 2 * first_pair, 2 * k, device_);
  at::Tensor hidden, targets;
  PairScores s = score(batch, pairs, train_reference_ ? &*train_reference_ : nullptr, &hidden, &targets);
  // The loss as a function of the sequences' log-probabilities; its gradient per sequence, then per token.
  s.chosen = s.chosen.detach().requires_grad_(true);
  s.rejected = s.rejected.detach().requires_grad_(true);
  const at::Tensor loss = dpo_loss(config().dpo, s, totals);
  const auto grads = torch::autograd::grad({loss}, {s.chosen, s.rejected});
  // logp = -sum(token losses): d loss / d token loss = -d loss / d logp of its sequence (rows interleaved).
  const at::Tensor row_grad = at::stack({grads[0], grads[1]}, 1).reshape({-1});  // (2k)
  const at::Tensor row_weights =
      (-row_grad).to(at::kFloat).unsqueeze(1).expand(targets.sizes()).reshape({-1}).contiguous();

  at::Tensor weight = model_->lm_head_weight();
  at::Tensor weight_grad;
  if (weight.requires_grad()) {
    if (!weight.grad().defined()) weight.mutable_grad() = at::zeros_like(weight);
    weight_grad = weight.grad();
  }
  if (sync_ && last_part) sync_->before_last_backward();
  const double grad_scale = scaler_ ? scaler_->scale() : 1.0;
  const auto fused = fused_linear_cross_entropy(hidden.detach().reshape({-1, hidden.size(-1)}), targets,
                                                weight.detach(), model_->lm_head_scale(), grad_scale,
                                                loss_chunk(),
                                                autocast(), weight_grad, row_weights, model_->final_logit_softcap());
  if (sync_ && weight_grad.defined() && !model_->lm_head_tied()) sync_->gradient_ready(weight);
  if (sync_) sync_->after_head(weight);
  if (hidden.requires_grad()) hidden.backward(fused.grad_hidden.reshape(hidden.sizes()));

  const double value = loss.item<double>();
  s.chosen = s.chosen.detach();
  s.rejected = s.rejected.detach();
  sums.add(config().dpo, s);
  sums.loss += value;
  return value;
}

// A pass that trains nothing, for a rank with fewer micro-batches than another under fully sharded weights: the same
// units' collectives in the same order as forward_backward (the head gathered, the reference's forward, the policy's,
// the head released, the backward), on one padding token, with a gradient of zero.
void PreferenceTask::empty_pass(int64_t step) {
  const at::Tensor one = at::full({1, 1}, pad_id_, at::TensorOptions().dtype(at::kLong).device(device_));
  const Batch batch{one, at::ones_like(one), at::full_like(one, -100), {}};
  const at::Tensor weight = model_->lm_head_weight();
  sync_->before_head(weight);
  const auto dtype = autocast();
  if (!config().dpo.precompute_reference) {  // as score(): a precomputed reference runs no forward
    at::NoGradGuard no_grad;
    AdaptersOff off(text_model_.lora());
    AutocastScope scope(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
    (void)model_->hidden_and_targets(batch);
  }
  const DropoutScope dropout(config().training.seed, step, 0, 1, device_);
  at::Tensor hidden;
  {
    AutocastScope scope(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
    hidden = model_->hidden_and_targets(batch).first;
  }
  sync_->after_head(weight);
  if (hidden.requires_grad()) (hidden.sum() * 0.0).backward();
}

void PreferenceTask::empty_forwards(bool policy) {
  const at::Tensor one = at::full({1, 1}, pad_id_, at::TensorOptions().dtype(at::kLong).device(device_));
  const Batch batch{one, at::ones_like(one), at::full_like(one, -100), {}};
  const auto dtype = autocast();
  at::NoGradGuard no_grad;
  const bool was_training = model_->is_training();
  model_->train(false);
  AutocastScope scope(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
  if (!config().dpo.precompute_reference || !policy) {  // the reference pass, or the reference as score() runs it
    AdaptersOff off(text_model_.lora());
    (void)model_->hidden_and_targets(batch);
  }
  if (policy) (void)model_->hidden_and_targets(batch);
  model_->train(was_training);
}

// ---- dpo.precompute_reference ------------------------------------------------------------------------------------

// Pairs per chunk file of the pass: what a kill -9 can cost to recompute.
constexpr int64_t kReferenceChunkPairs = 512;

// What the values depend on: the data (the engine's fingerprint of the train files and the tokenizer, the validation
// files' alike) and the settings that decide the pairs' tokens or the reference's weights and precision. Settings
// that change neither (workers, logging, the learning rate, ...) are left out, so changing them reuses the values.
nlohmann::json PreferenceTask::reference_identity() const {
  const nlohmann::json resolved = nlohmann::json::parse(config_to_json(config()));
  nlohmann::json settings = nlohmann::json::object();
  for (const char* section : {"model", "tokenizer"})
    for (const auto& [key, value] : resolved.at(section).items()) settings[std::string(section) + "." + key] = value;
  const std::vector<std::pair<std::string, std::string>> keys = {
      {"data", "validation_files"}, {"data", "validation_fraction"}, {"data", "chat_template"},
      {"data", "max_length"},       {"data", "on_overlength"},       {"dpo", "reference_model"},
      {"lora", "enabled"},          {"lora", "base_in_bf16"},        {"precision", "mode"},
      {"training", "seed"}};  // the seed: the held-out split and model.init=random
  for (const auto& [section, key] : keys) settings[section + "." + key] = resolved.at(section).at(key);
  nlohmann::json validation;  // null: none, or the held-out part of the train files (their fingerprint and the seed)
  if (!config().data.validation_files.empty()) {
    Config files = config();
    files.data.train_files = config().data.validation_files;
    files.data.validation_fraction = 0;
    validation = data_fingerprint(files, *tokenizer_);
  }
  return {{"version", 1}, {"train_data", fingerprint_}, {"validation_data", validation}, {"settings", settings}};
}

void PreferenceTask::prepare_reference() {
  const ReferenceStore store(fs::path(config().checkpoint.output_dir) / ReferenceStore::kDirName);
  const nlohmann::json identity = reference_identity();
  // Rank 0 reads the directory (and starts it over when it belongs to other data or another reference); every rank
  // goes on from its answer: complete, then the finished chunks and positions of train and validation.
  constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
  std::vector<int64_t> state(5, kNone);
  if (primary()) {
    const auto changes = store.identity_changes(identity);
    if (!changes.empty()) {
      std::string listed;
      for (const auto& change : changes) listed += "\n  " + change;
      spdlog::warn("DPO reference: {} was computed for other data or another reference:{}\ncomputing it again",
                   store.dir().string(), listed);
    }
    if (!store.has_identity() || !changes.empty()) store.start(identity);
    const auto train = store.progress("train");
    const auto validation = store.progress("validation");
    state = {store.complete() ? 1 : 0, train.chunks, static_cast<int64_t>(train.position), validation.chunks,
             static_cast<int64_t>(validation.position)};
  }
  if (world()) state = world()->all_reduce_max(state);
  if (state[0] == 1) {
    spdlog::info("DPO reference: reusing {} (complete; not computed again)", store.dir().string());
  } else {
    // The reference for the pass: the base under the adapters (LoRA), the trained model itself before its first
    // step (a full fine-tune that starts now), else a frozen copy (dpo.reference_model, or model.path's starting
    // weights beside a resumed full fine-tune) loaded for the pass and freed after it.
    const bool copy = !config().dpo.reference_model.empty() || (!text_model_.lora() && resumed_);
    if (copy) load_reference();
    const auto start = std::chrono::steady_clock::now();
    if (state[1] > 0 || state[3] > 0)
      spdlog::info("DPO reference: going on with the pass in {} after {} train and {} validation chunks",
                   store.dir().string(), state[1], state[3]);
    pass_fit_ = std::max<int64_t>(1, config().training.batch_size);
    int64_t pairs = 0;
    auto pass = [&](EvaluationMicroBatch* micro) {
      pairs = reference_pass(store, "train", state[1], static_cast<uint64_t>(state[2]), micro) +
              reference_pass(store, "validation", state[3], static_cast<uint64_t>(state[4]), micro);
    };
    if (evaluate_unit_by_unit_ && !reference_) {
      // Fully sharded weights: the reference is the sharded model itself (the base under the adapters, or the
      // weights before the first step), run unit by unit.
      EvaluationMicroBatch micro(pass_fit_, world(), "DPO reference pass");
      evaluate_unit_by_unit_(micro, [&] { pass(&micro); });
    } else {
      pass(nullptr);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (primary()) store.mark_complete({{"pairs_computed", pairs}, {"seconds", seconds}});
    spdlog::info("DPO reference: {} pairs computed in {:.1f} s into {}", pairs, seconds, store.dir().string());
    reference_.reset();  // freed before training
  }
  if (world()) world()->barrier();  // rank 0's files are written before any rank reads them
  train_reference_ = store.load("train");
  validation_reference_ = store.load("validation");
}

int64_t PreferenceTask::reference_pass(const ReferenceStore& store, const std::string& split, int64_t chunks,
                                       uint64_t position, EvaluationMicroBatch* micro) {
  // The records in file order, one pass, a chunk per batch; each rank maps its share of the records and gets the
  // others' (RecordShare), so every rank sees every chunk whole.
  Config pass = config();
  pass.data.shuffle = false;
  pass.data.group_by_length = false;
  pass.training.max_steps = 0;
  pass.training.epochs = 1;
  pass.training.batch_size = kReferenceChunkPairs;
  const bool train = split == "train";
  std::unique_ptr<DataLoader> loader =
      train ? make_train_loader(pass, *tokenizer_, DataFamily::kCausal, distributed::record_share(world()), mapper_)
            : make_validation_loader(pass, *tokenizer_, DataFamily::kCausal, kReferenceChunkPairs,
                                     distributed::record_share(world()), mapper_);
  if (!loader) return 0;
  LoaderCursor cursor = loader->cursor();
  cursor.position = position;
  loader->restore(cursor);
  const uint64_t records = loader->examples_per_epoch();
  const int rank = world() ? world()->rank() : 0;
  const int ranks = world() ? world()->world_size() : 1;
  const int64_t piece = std::max<int64_t>(1, config().training.batch_size);
  int64_t computed = 0;
  auto last_log = std::chrono::steady_clock::now();
  while (auto batch = loader->next()) {
    const std::span<const Example> pairs(batch->examples);
    // The chunk in pieces of training.batch_size pairs, piece i on rank i % ranks: each piece is padded and
    // computed as in one process, and the sum over the ranks (zeros elsewhere) is exact.
    std::vector<double> values(2 * pairs.size(), 0.0);
    const auto pieces = split_counts(static_cast<int64_t>(pairs.size()), piece);
    std::vector<std::pair<int64_t, int64_t>> mine;
    for (std::size_t i = 0; i < pieces.size(); ++i)
      if (static_cast<int>(i % static_cast<std::size_t>(ranks)) == rank) mine.push_back(pieces[i]);
    if (micro) {
      reference_by_units(pairs, mine, values.data(), *micro);
    } else {
      for (const auto& [begin, count] : mine)
        reference_of(pairs.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)),
                     values.data() + 2 * begin);
    }
    if (world()) values = world()->all_reduce_sum(values, "exchanging DPO's reference log-probabilities");
    std::vector<ReferenceEntry> entries(pairs.size());
    for (std::size_t i = 0; i < pairs.size(); ++i)
      entries[i] = {pair_key(pairs[i]), {values[2 * i], values[2 * i + 1]}};
    if (primary()) store.write_chunk(split, chunks, loader->cursor().position, entries);
    ++chunks;
    computed += static_cast<int64_t>(pairs.size());
    const auto now = std::chrono::steady_clock::now();
    if (now - last_log > std::chrono::seconds(10)) {
      const auto at = loader->cursor().position;
      spdlog::info("DPO reference: {} records {}/{} ({:.0f}%)", split, at, records,
                   records ? 100.0 * static_cast<double>(at) / static_cast<double>(records) : 100.0);
      last_log = now;
    }
  }
  spdlog::info("DPO reference: {} done: {} pairs computed now, {} chunks in all", split, computed, chunks);
  return computed;
}

void PreferenceTask::reference_of(std::span<const Example> pairs, double* out) {
  std::size_t begin = 0;
  while (begin < pairs.size()) {
    const std::size_t n = std::min(static_cast<std::size_t>(pass_fit_), pairs.size() - begin);
    const auto some = pairs.subspan(begin, n);
    try {
      const auto [chosen, rejected] = reference_logps(collate_pairs(some), static_cast<int64_t>(n));
      const at::Tensor both = at::stack({chosen, rejected}, 1).to(at::kCPU).contiguous();  // (n, 2)
      std::copy_n(both.data_ptr<double>(), 2 * n, out + 2 * begin);
      begin += n;
    } catch (const c10::OutOfMemoryError& e) {
      if (n <= 1)
        throw OutOfMemoryAtFloor(std::string("out of memory in DPO's reference pass with one pair (two sequences of "
                                             "up to data.max_length): ") + e.what_without_backtrace(),
                                 "lower data.max_length, or raise memory.limit");
      release_cached_memory();
      pass_fit_ = static_cast<int64_t>(n / 2);
      spdlog::warn("DPO reference: out of memory with {} pairs in a forward; going on with {}", n, pass_fit_);
    }
  }
}

void PreferenceTask::reference_by_units(std::span<const Example> pairs,
                                        const std::vector<std::pair<int64_t, int64_t>>& pieces, double* out,
                                        EvaluationMicroBatch& micro) {
  const bool fit = micro.run([&](int64_t size) {
    std::vector<std::pair<int64_t, int64_t>> forwards;
    for (const auto& [begin, count] : pieces)
      for (const auto& [first, n] : split_counts(count, size)) forwards.emplace_back(begin + first, n);
    const std::size_t passes = agreed_passes(forwards.size());
    for (const auto& [begin, n] : forwards) {
      const auto some = pairs.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(n));
      const auto [chosen, rejected] = reference_logps(collate_pairs(some), n);
      const at::Tensor both = at::stack({chosen, rejected}, 1).to(at::kCPU).contiguous();  // (n, 2)
      std::copy_n(both.data_ptr<double>(), 2 * n, out + 2 * begin);
    }
    for (std::size_t i = forwards.size(); i < passes; ++i) empty_forwards(/*policy=*/false);
  });
  // An out-of-memory error is agreed: at one pair per forward every rank fails this chunk together.
  if (!fit)
    throw OutOfMemoryAtFloor("out of memory in DPO's reference pass (fully sharded, unit by unit) with one pair (two "
                             "sequences of up to data.max_length) in a forward",
                             "lower data.max_length, or raise memory.limit");
  pass_fit_ = micro.value();
}

bool PreferenceTask::escalate(int64_t step) {
  for (std::string escalation = policy_->next_escalation(step); !escalation.empty();
       escalation = policy_->next_escalation(step)) {
    if (escalation == "activation_checkpointing" && !model_->has_block_runner()) {
      apply_activation_checkpointing(*model_);
      return true;
    }
    if (escalation == "smaller_loss_chunks") return true;  // the policy has halved its loss_chunk_size
    // chunked_loss: a DPO step always runs the fused chunked head.
  }
  return false;
}

// The preference task's part of an attempt (StepWork for run_attempts): this rank's pairs in the policy's
// micro-batches.
class PreferenceStepWork final : public StepWork {
 public:
  PreferenceStepWork(PreferenceTask& task, std::span<const Example> pairs, int64_t first_pair, PairTotals totals)
      : task_(task), pairs_(pairs), first_pair_(first_pair), totals_(totals) {}
  void forward_backward(int64_t step, AttemptOutcome& outcome) override {
    sums = PreferenceSums{};
    const auto parts = task_.policy().split(pairs_, /*seq2seq=*/false);
    outcome.largest_part = 0;
    for (const auto& [begin, count] : parts) outcome.largest_part = std::max(outcome.largest_part, count);
    outcome.micro_steps = static_cast<int64_t>(parts.size());
    outcome.at_floor = outcome.largest_part <= 1;
    const std::size_t passes = task_.agreed_passes(parts.size());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto& [begin, count] = parts[i];
      outcome.loss_sum += task_.forward_backward(
          pairs_.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)), first_pair_ + begin,
          totals_, step, sums, i + 1 == parts.size());
    }
    for (std::size_t i = parts.size(); i < passes; ++i) task_.empty_pass(step);
  }
  bool escalate(int64_t step) override { return task_.escalate(step); }
  bool may_overlap() const override { return task_.may_overlap(); }
  std::string floor_hint() const override { return "lower data.max_length (a pair is two sequences of it)"; }

  PreferenceSums sums;  // of the successful attempt

 private:
  PreferenceTask& task_;
  std::span<const Example> pairs_;
  int64_t first_pair_;
  PairTotals totals_;
};

StepResult PreferenceTask::train_step(TaskBatch& task_batch, int64_t step, double lr) {
  const EffectiveBatch& batch = batch_of(task_batch);
  const std::span<const Example> all(batch.examples);
  PairTotals totals;
  totals.pairs = static_cast<double>(all.size());
  totals.chosen_tokens = chosen_tokens(all);
  const auto [first, count] =
      sync_ ? sync_->share(all, /*by_tokens=*/false, /*seq2seq=*/false)
            : std::pair<int64_t, int64_t>{0, static_cast<int64_t>(all.size())};
  PreferenceStepWork work(*this, all.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(count)), first,
                          totals);
  StepResult result = run_attempts(work, {*optimizer_, *policy_, scaler_, sync_, config().training.max_grad_norm,
                                          config().memory.max_retries, step, lr, static_cast<int64_t>(all.size()),
                                          1.0, static_cast<int64_t>(all.size())});
  PreferenceSums sums = work.sums;
  if (world()) sums = PreferenceSums::from_vector(world()->all_reduce_sum(sums.to_vector(), "summing DPO's metrics"));
  result.metrics = sums.metrics();
  return result;
}

Evaluated PreferenceTask::evaluate(int64_t step, EvaluationMicroBatch& micro) {
  auto validation = make_validation_loader(config(), *tokenizer_, DataFamily::kCausal, config().training.batch_size,
                                           distributed::record_share(world()), mapper_);
  if (!validation) return {};
  at::NoGradGuard no_grad;
  const bool was_training = model_->is_training();
  model_->train(false);
  PreferenceSums sums;
  int64_t batches = 0;
  while (auto batch = validation->next()) {
    std::span<const Example> pairs(batch->examples);
    PairTotals totals;  // each batch's loss is its pairs' mean: summed here per pair, divided by all pairs below
    totals.pairs = 1;
    totals.chosen_tokens = chosen_tokens(pairs) / static_cast<double>(pairs.size());
    if (world()) {
      const auto [first, count] = distributed::share_of(pairs, world()->rank(), world()->world_size(), false);
      pairs = pairs.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(count));
    }
    PreferenceSums part;
    const bool fit = micro.run([&](int64_t size) {
      part = PreferenceSums{};
      const auto parts = split_counts(static_cast<int64_t>(pairs.size()), size);
      // Fully sharded weights: as many forwards as the rank with the most, agreed first (the others run empty ones).
      for (std::size_t i = parts.size(), passes = agreed_passes(parts.size()); i < passes; ++i)
        empty_forwards(/*policy=*/true);
      for (const auto& [begin, n] : parts) {
        const auto some = pairs.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(n));
        const PairScores scores = score(collate_pairs(some), some,
                                        validation_reference_ ? &*validation_reference_ : nullptr, nullptr, nullptr);
        part.add(config().dpo, scores);
        part.loss += dpo_loss(config().dpo, scores, totals).item<double>();
      }
    });
    if (fit) sums += part;
    if (config().evaluation.max_batches > 0 && ++batches >= config().evaluation.max_batches) break;
  }
  model_->train(was_training);
  if (world())
    sums = PreferenceSums::from_vector(world()->all_reduce_sum(sums.to_vector(), "summing DPO's evaluation"));
  if (sums.pairs == 0) return {};
  const double loss = sums.loss / sums.pairs;
  const auto metrics = sums.metrics();
  const auto pairs = static_cast<int64_t>(sums.pairs);
  return {loss, [step, loss, metrics, pairs](Reporter& reporter) {
            reporter.on_eval_values(step, loss, metrics, pairs, "pairs");
          },
          {}};
}

}  // namespace

std::unique_ptr<Task> make_preference_task(const TaskContext& context) {
  return std::make_unique<PreferenceTask>(context);
}

}  // namespace trainer
