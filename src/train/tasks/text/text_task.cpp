// The text task: seq2seq (T5) and causal (Llama, Qwen2, Mistral) language models on JSONL records through the
// tokenizer and the streaming loader (packing, token-budget micro-batches), trained by TrainStep (train/tasks/text/text_step.h: the
// loss per target token of the effective batch, the fused chunked loss), evaluated by the validation loss and sample
// generations, saved as a Hugging Face directory or with LoRA as a PEFT adapter (--merge writes the merged model too).
#include "train/tasks/text/text_task.h"

#include <cmath>
#include <filesystem>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/packing.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/planner.h"
#include "memory/policy.h"
#include "models/lora.h"
#include "train/resume_check.h"
#include "train/tasks/text/generation_eval.h"
#include "train/tasks/text/language_model_task.h"
#include "train/tasks/text/text_model.h"
#include "train/tasks/text/text_step.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

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

class TextTask final : public LanguageModelTask {
 public:
  using LanguageModelTask::LanguageModelTask;

  Counted counted() const override { return {"tokens_seen", "target tokens", "tokens", true}; }
  LanguageModel* shardable_model() override { return model_; }
  // Fully sharded weights: the validation loss, evaluation by generation and the samples unit by unit (every decoding
  // step agreed; every rank generates the samples, rank 0 reports them).
  bool evaluates_unit_by_unit() const override { return true; }

  nlohmann::json open_data() override {
    // Without tokenizer files in model.path: pre-tokenized records only (trainer/tokenizer.h).
    tokenizer_ = load_run_tokenizer(config(), /*samples=*/true);
    return data_fingerprint(config(), *tokenizer_);
  }

  void build_model(const std::optional<fs::path>& resume, const c10::Device& device) override {
    device_ = device;
    build_text_model(resume, device);
    family_ = text_model_.family();
    pad_id_ = text_model_.pad_id();
  }

  void open_loader() override {
    // Data parallelism: each rank tokenizes only its share of the records and gets the rest from the others.
    loader_ = make_train_loader(config(), *tokenizer_, family_, distributed::record_share(world()));
  }

  void build_step(const StepParts& parts) override {
    StepOptions options;
    options.device = parts.device;
    options.pad_id = pad_id_;
    options.precision = config().precision.mode;
    options.max_grad_norm = config().training.max_grad_norm;
    options.max_retries = config().memory.max_retries;
    options.chunked_loss = config().training.chunked_loss;
    options.seed = static_cast<uint64_t>(config().training.seed);
    options.packing = config().data.packing;
    options.pack_capacity = pack_capacity(config().data, family_);
    options.sync = parts.sync;
    sync_ = parts.sync;
    options.scaler = parts.scaler;
    device_ = parts.device;
    step_ = std::make_unique<TrainStep>(*model_, parts.optimizer, parts.policy, options);
  }
  StepResult train_step(TaskBatch& batch, int64_t step, double lr) override {
    return step_->run(batch_of(batch), step, lr);
  }
  int64_t probe_limit() const override { return config().training.batch_size; }
  void probe(int64_t micro) override {
    step_->forward_backward(worst_case_examples(config(), family_, micro, 5), 1.0);
  }
  std::string probe_case(int64_t micro) const override { return std::to_string(micro) + " at maximum lengths"; }
  std::pair<std::string, std::string> probe_failure() const override {
    return {"not even one example of the maximum lengths fits for micro_batch_size=auto",
            "lower data.max_length / max_input_length / max_target_length, turn on "
            "training.activation_checkpointing and training.chunked_loss, or raise memory.limit"};
  }
  std::vector<std::string> floor_suggestions() const override {
    return {family_ == DataFamily::kSeq2Seq
                ? "shorter sequences: data.max_input_length / data.max_target_length (activations grow with length)"
                : "shorter sequences: data.max_length (activations grow with length)"};
  }
  void set_device(const c10::Device& device) override {
    device_ = device;
    step_->set_device(device);
  }

  // "auto" starts from training's micro-batch (in token mode: what its budget holds at the maximum lengths).
  int64_t evaluation_micro_batch(const MemoryPolicy& policy) const override {
    if (!policy.by_tokens()) return policy.micro_batch();
    const int64_t longest = max_example_tokens(config().data, family_ == DataFamily::kSeq2Seq);
    return std::max<int64_t>(1, policy.micro_batch() / std::max<int64_t>(1, longest));
  }
  Evaluated evaluate(int64_t step, EvaluationMicroBatch& micro) override;
  void after_evaluation(int64_t step, Reporter& reporter) override;

 private:
  DataFamily family_ = DataFamily::kCausal;
  int32_t pad_id_ = 0;
  std::unique_ptr<TrainStep> step_;
  StepSync* sync_ = nullptr;
  c10::Device device_{c10::kCPU};
};

Evaluated TextTask::evaluate(int64_t step, EvaluationMicroBatch& micro) {
  auto validation = make_validation_loader(config(), *tokenizer_, family_, config().training.batch_size,
                                           distributed::record_share(world()));
  if (!validation) return {};
  const auto result = validation_loss(*model_, *validation, micro, config(), device_, pad_id_,
                                      step_->chunked_loss() ? step_->loss_chunk_size() : 0, world(), sync_);
  if (!config().evaluation.generate)
    return {result.loss, [step, result](Reporter& reporter) { reporter.on_eval(step, result.loss, result.tokens); }};
  // Evaluation by generation over the validation examples, read again from the start.
  auto examples = make_validation_loader(config(), *tokenizer_, family_, config().training.batch_size,
                                         distributed::record_share(world()));
  const auto options = evaluation_generate_options(config(), model_->family(), config().model.path);
  const fs::path predictions = primary() ? predictions_path(output_dir(), step) : fs::path();
  const auto scores = evaluate_by_generation(*model_, *tokenizer_, *examples, config(), options, micro, world(),
                                             predictions, sync_);
  if (scores.skipped > 0 && primary())
    spdlog::warn("evaluation.generate: {} validation examples have no prompt (plain text records) and were not "
                 "generated for; prompt/completion records give a prompt and a reference", scores.skipped);
  return {result.loss,
          [step, result, scores, predictions](Reporter& reporter) {
            reporter.on_eval(step, result.loss, result.tokens);
            reporter.on_eval_generation(step, scores.metrics, scores.examples, predictions.string());
          },
          scores.metrics};
}

// Generations from evaluation.sample_prompts, logged as text: what the model has learned, at a glance.
void TextTask::after_evaluation(int64_t step, Reporter& reporter) {
  for (std::size_t i = 0; i < config().evaluation.sample_prompts.size(); ++i) {
    const auto& prompt = config().evaluation.sample_prompts[i];
    const auto ids = prompt_ids(*model_, *tokenizer_, prompt, config().tokenizer.add_eos);
    if (ids.empty()) continue;
    GenerateOptions options;
    options.max_new_tokens = config().evaluation.max_new_tokens;
    if (sync_ && sync_->shards_weights())  // every rank generates it in step: each forward is a collective
      options.pace = [sync = sync_](bool mine) { return sync->agree_passes(mine ? 1 : 0) > 0; };
    const auto generated = generate(*model_, at::tensor(ids, at::kLong).unsqueeze(0).to(device_), options);
    const std::vector<int32_t> out(generated.begin(), generated.end());
    reporter.on_sample(step, i, prompt, tokenizer_->decode(out));
  }
}

}  // namespace

ValidationLoss validation_loss(LanguageModel& model, DataLoader& loader, EvaluationMicroBatch& micro,
                               const Config& config, const c10::Device& device, int32_t pad_id,
                               int64_t loss_chunk_size, distributed::Communicator* world, StepSync* sync) {
  at::NoGradGuard no_grad;
  model.train(false);
  double loss_sum = 0;
  int64_t tokens = 0, batches = 0, local_examples = 0;
  // A rank out of memory at micro-batch 1 still reads the batches the others read: each rank tokenizes a share of
  // the records for all (RecordShare), so its exchanges must go on.
  while (auto batch = loader.next()) {
    std::span<const Example> examples(batch->examples);
    if (world) {  // this rank's share: disjoint, and together the whole batch
      const auto [first, count] = distributed::share_of(examples, world->rank(), world->world_size(), false);
      examples = examples.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(count));
    }
    double part_sum = 0;
    int64_t part_tokens = 0;
    const bool fit = micro.run([&](int64_t size) {
      part_sum = 0;
      part_tokens = 0;
      const auto parts = split_counts(static_cast<int64_t>(examples.size()), size);
      // Fully sharded weights: every forward is a collective; as many as the rank with the most, agreed first (the
      // others then run forwards of one padding token that count nothing).
      const auto mine = static_cast<int64_t>(parts.size());
      const int64_t passes = sync && sync->shards_weights() ? sync->agree_passes(mine) : mine;
      for (const auto& [begin, count] : parts) {
        const auto collated = collate(
            examples.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)), pad_id, device);
        const auto [sum, n] =
            evaluation_loss(model, {collated.input_ids, collated.attention_mask, collated.labels, {}}, loss_chunk_size);
        part_sum += sum;
        part_tokens += n;
      }
      const at::Tensor one = at::full({1, 1}, pad_id, at::TensorOptions().dtype(at::kLong).device(device));
      for (int64_t i = mine; i < passes; ++i)
        evaluation_loss(model, {one, at::ones_like(one), at::full_like(one, -100), {}}, loss_chunk_size);
    });
    if (fit) {
      loss_sum += part_sum;
      tokens += part_tokens;
      local_examples += static_cast<int64_t>(examples.size());
    }
    if (config.evaluation.max_batches > 0 && ++batches >= config.evaluation.max_batches) break;
  }
  model.train(true);
  if (world) {  // the whole validation set's sum and count (exact in doubles up to 2^53 tokens)
    spdlog::debug("evaluation: rank {} of {} evaluated its share: {} examples, {} target tokens", world->rank(),
                  world->world_size(), local_examples, tokens);
    const auto sums = world->all_reduce_sum({loss_sum, static_cast<double>(tokens)}, "summing the validation loss");
    loss_sum = sums[0];
    tokens = static_cast<int64_t>(std::llround(sums[1]));
  }
  return {tokens ? loss_sum / static_cast<double>(tokens) : 0.0, tokens};
}

std::unique_ptr<Task> make_text_task(const TaskContext& context) { return std::make_unique<TextTask>(context); }

}  // namespace trainer
