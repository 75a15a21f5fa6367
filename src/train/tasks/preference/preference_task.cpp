// The preference task: DPO (training.objective=dpo) on a causal language model, as TRL's DPOTrainer trains it.
// Data: preference pairs (preference_data.h) through the text loader, one pair per example, so the effective batch,
// the shuffle, the cursor and the ranks' shares count pairs and a pair is never split. The step: per micro-batch of
// pairs, both sequences of every pair in one forward (rows chosen, rejected, chosen, ... so that dropout masks follow
// the pair's place in the effective batch), the reference's log-probabilities without autograd (with LoRA the same
// model with its adapters off, as PEFT + TRL do; else a frozen copy of the starting weights), the policy's through
// the fused chunked LM head (no full logits), and the gradient of the loss (dpo_loss.h) back through the same fused
// head with each token weighted by its sequence's share of the loss. Evaluation: the validation pairs' loss and
// TRL's reward metrics. The model is the text task's (TextModel: LoRA, 4-bit bases, saving, --merge).
#include "train/tasks/preference/preference_task.h"

#include <algorithm>
#include <filesystem>

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
#include "train/engine/loader_task.h"
#include "train/fused_loss.h"
#include "train/precision.h"
#include "train/resume_check.h"
#include "train/tasks/preference/dpo_loss.h"
#include "train/tasks/preference/preference_data.h"
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

class PreferenceTask final : public LoaderTask<DataLoader, EffectiveBatch> {
 public:
  using LoaderTask::LoaderTask;
  ~PreferenceTask() override { loader_.reset(); }  // the loader's workers read tokenizer_ (as the text task)

  std::string name() const override { return "dpo"; }
  Counted counted() const override { return {"pairs_seen", "preference pairs", "pairs", false}; }
  std::string model_type() const override { return model_->model_type(); }

  void check_settings(const TrainOptions& options) const override { text_model_.check_settings(options); }
  void check_checkpoint(const fs::path& checkpoint, const nlohmann::json& state) const override {
    text_model_.check_checkpoint(checkpoint, state);
  }

  nlohmann::json open_data() override {
    tokenizer_ = load_run_tokenizer(config(), /*samples=*/false);
    if (is_ids_only(*tokenizer_))
      throw UsageError("DPO renders and tokenizes preference records, but " + config().model.path +
                           " has no tokenizer files",
                       "set tokenizer.path to the model's tokenizer");
    mapper_ = preference_mapper(config(), *tokenizer_);  // the template parsed once, for training and evaluation
    return data_fingerprint(config(), *tokenizer_);
  }
  std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                        std::vector<std::string>& warnings) const override {
    return trainer::data_changes(saved, current, warnings);
  }

  void build_model(const std::optional<fs::path>& resume, const c10::Device& device) override;
  Module& model() override { return *model_; }
  Module* adapters() override { return text_model_.lora(); }
  Module& trainable() override { return text_model_.trainable(); }

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
  }
  StepResult train_step(TaskBatch& batch, int64_t step, double lr) override;
  int64_t probe_limit() const override { return config().training.batch_size; }
  void probe(int64_t micro) override {
    std::vector<Example> pairs(static_cast<std::size_t>(micro), worst_case_pair());
    PreferenceSums sums;
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

  void save(const fs::path& dir) override { text_model_.save(dir); }
  void add_train_state(nlohmann::json& state) const override { text_model_.add_train_state(state); }
  void after_final_save(const fs::path& output_dir, const TrainOptions& options) override {
    text_model_.after_final_save(output_dir, options);
  }

  // One attempt's forward and backward of `pairs` (the effective batch's pairs from `first_pair` on) in
  // micro-batches; the loss's part of them. Public for the step's work.
  double forward_backward(std::span<const Example> pairs, int64_t first_pair, const PairTotals& totals, int64_t step,
                          PreferenceSums& sums, bool last_part = false);
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
  // Scores of `pairs` (collated as rows chosen, rejected, ...): the reference's without autograd, the policy's
  // with `hidden` kept for the backward when `with_grad`.
  PairScores score(const Batch& batch, int64_t pairs, at::Tensor* hidden_out, at::Tensor* targets_out);
  Batch collate_pairs(std::span<const Example> pairs) const;
  std::optional<at::ScalarType> autocast() const { return autocast_dtype(config().precision.mode); }
  bool dropout_on() const { return !config().dpo.disable_dropout; }
  // Trained positions per chunk of the fused head: the policy's (the smaller_loss_chunks escalation halves it).
  int64_t loss_chunk() const { return policy_ ? policy_->loss_chunk_size() : config().training.loss_chunk_size; }

  std::unique_ptr<Tokenizer> tokenizer_;
  RecordMapper mapper_;  // preference records -> pairs (reads tokenizer_)
  TextModel text_model_{config(), primary(), preference_example_shape(config())};
  LanguageModel* model_ = nullptr;
  std::unique_ptr<LanguageModel> reference_;  // full fine-tune: the frozen starting weights
  Optimizer* optimizer_ = nullptr;
  MemoryPolicy* policy_ = nullptr;
  StepSync* sync_ = nullptr;
  GradScaler* scaler_ = nullptr;
  c10::Device device_{c10::kCPU};
  int32_t pad_id_ = 0;
};

void PreferenceTask::build_model(const std::optional<fs::path>& resume, const c10::Device& device) {
  device_ = device;
  text_model_.build(resume, device, *tokenizer_);
  model_ = &text_model_.model();
  if (model_->family() != ModelFamily::kCausal)
    throw UsageError("training.objective=dpo trains causal language models; " + config().model.path + " is a " +
                         model_->model_type() + " (seq2seq) model",
                     "use a Llama, Qwen2 or Mistral model, or drop training.objective");
  pad_id_ = text_model_.pad_id();
  model_->train(dropout_on());
  const std::string& other = config().dpo.reference_model;
  if (text_model_.lora() && other.empty()) {
    spdlog::info("DPO reference: the base model with the LoRA adapters off (no second copy)");
    return;
  }
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

PairScores PreferenceTask::score(const Batch& batch, int64_t pairs, at::Tensor* hidden_out, at::Tensor* targets_out) {
  const auto dtype = autocast();
  const int64_t chunk = loss_chunk();
  auto sequence_sums = [&](const at::Tensor& per_token, const at::Tensor& targets) {
    return per_token.reshape(targets.sizes()).to(at::kDouble).sum(1);  // (2k)
  };
  PairScores out;
  {  // the reference, without autograd and without dropout
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
        token_losses(hidden, targets, reference.lm_head_weight(), reference.lm_head_scale(), chunk, dtype);
    reference.train(was_training);
    const at::Tensor logps = -sequence_sums(losses.loss, targets);
    out.ref_chosen = logps.slice(0, 0, 2 * pairs, 2);
    out.ref_rejected = logps.slice(0, 1, 2 * pairs, 2);
  }
  at::Tensor hidden, targets;
  {
    AutocastScope scope(dtype.has_value(), device_.type(), dtype.value_or(at::kBFloat16));
    std::tie(hidden, targets) = model_->hidden_and_targets(batch);
  }
  const TokenLosses losses = token_losses(hidden.detach(), targets, model_->lm_head_weight().detach(),
                                          model_->lm_head_scale(), chunk, dtype);
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
  PairScores s = score(batch, k, &hidden, &targets);
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
                                                autocast(), weight_grad, row_weights);
  if (sync_ && weight_grad.defined() && !model_->lm_head_tied()) sync_->gradient_ready(weight);
  if (hidden.requires_grad()) hidden.backward(fused.grad_hidden.reshape(hidden.sizes()));

  const double value = loss.item<double>();
  s.chosen = s.chosen.detach();
  s.rejected = s.rejected.detach();
  sums.add(config().dpo, s);
  sums.loss += value;
  return value;
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
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto& [begin, count] = parts[i];
      outcome.loss_sum += task_.forward_backward(
          pairs_.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)), first_pair_ + begin,
          totals_, step, sums, i + 1 == parts.size());
    }
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
      for (const auto& [begin, n] : split_counts(static_cast<int64_t>(pairs.size()), size)) {
        const auto some = pairs.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(n));
        const PairScores scores = score(collate_pairs(some), n, nullptr, nullptr);
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
