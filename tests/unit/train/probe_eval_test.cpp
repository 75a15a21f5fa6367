// micro_batch_size=auto and evaluation, against real out-of-memory errors from the CPU budget.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/engine/engine.h"
#include "train/optim/optimizer.h"
#include "train/tasks/text/text_step.h"
#include "train/tasks/text/text_task.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace {

struct BudgetScope {
  BudgetScope() { install_cpu_budget(); }
  ~BudgetScope() { set_cpu_budget_limit(0); }
};

Config tiny_qwen2_config() {
  Config c = load_config(test::source_path("configs/tiny-qwen2.json"));
  c.model.path = test::source_path("configs/models/tiny-qwen2");
  c.data.train_files = {test::source_path("data/demo/recipes-causal.jsonl")};
  c.data.validation_files = {test::source_path("data/demo/recipes-causal-val.jsonl")};
  c.data.max_length = 96;
  c.memory.auto_safety_margin = 0.0;
  return c;
}

struct TinyRun {
  Config config = tiny_qwen2_config();
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<TrainStep> step;
  TinyRun() {
    model = load_model(config.model.path, ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 3);
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    optimizer = std::make_unique<AdamW>(*model, config.optimizer);
    policy = std::make_unique<MemoryPolicy>(config.memory, config.training);
    step = std::make_unique<TrainStep>(*model, *optimizer, *policy, StepOptions{});
  }
  std::vector<Example> worst_case(int64_t n) const {
    Example e;
    e.input_ids.assign(static_cast<std::size_t>(config.data.max_length), 5);
    e.labels = e.input_ids;
    return std::vector<Example>(static_cast<std::size_t>(n), e);
  }
  bool fits(int64_t n) {
    try {
      step->forward_backward(worst_case(n), 1.0);
      optimizer->zero_grad();
      return true;
    } catch (const c10::OutOfMemoryError&) {
      optimizer->zero_grad();
      return false;
    }
  }
  // What one worst-case example's step adds to the live bytes at its peak (0 if it did not run).
  int64_t one_example_bytes() {
    const int64_t base = cpu_memory_stats().allocated;
    reset_cpu_peak();
    return fits(1) ? cpu_memory_stats().peak - base : 0;
  }
  // memory.limit and the CPU budget both at `bytes`.
  void cap(int64_t bytes) {
    config.memory.limit.bytes = static_cast<uint64_t>(bytes);
    set_cpu_budget_limit(bytes);
  }
  int64_t probe() {
    return probe_micro_batch(config, at::Device(at::kCPU), config.training.batch_size, *optimizer,
                             [&](int64_t n) { step->forward_backward(worst_case(n), 1.0); });
  }
};

}  // namespace

// The margin chooses between micro-batches; when even one example peaks inside it (but runs), the run goes ahead at
// micro-batch 1 instead of stopping (found on a card: Qwen2.5-7B LoRA at 2048 tokens, 22.65 GiB of 24 at 1). When one
// example runs out of memory, the probe still says none fits.
TEST(AutoMicroBatch, OneExampleInsideTheMarginStillTrainsAtOne) {
  BudgetScope budget;
  TinyRun s;
  const int64_t base = cpu_memory_stats().allocated;
  const int64_t one = s.one_example_bytes();
  ASSERT_GT(one, 0);
  // Capacity 1.5x of one example's step, a margin of 50%: one example fits the capacity but not capacity minus margin.
  s.config.memory.auto_safety_margin = 0.5;
  s.cap(base + one + one / 2);
  EXPECT_EQ(s.probe(), 1);
  // Under a budget smaller than one example's step, nothing runs: 0, and the task says what to change.
  s.cap(base + one / 2);
  EXPECT_EQ(s.probe(), 0);
}

TEST(AutoMicroBatch, PicksTheLargestThatFits) {
  BudgetScope budget;
  TinyRun s;
  const int64_t base = cpu_memory_stats().allocated;
  const int64_t one = s.one_example_bytes();
  ASSERT_GT(one, 0);
  // Room for a few examples but not for the whole batch of 16.
  s.cap(base + 5 * one);
  const int64_t chosen = s.probe();
  ASSERT_GT(chosen, 1);
  ASSERT_LT(chosen, s.config.training.batch_size);
  EXPECT_TRUE(s.fits(chosen));
  EXPECT_FALSE(s.fits(chosen + 1)) << "one above the probed size must not fit";
}

TEST(Evaluation, AnOutOfMemoryShrinksOnlyTheEvaluationMicroBatch) {
  BudgetScope budget;
  TinyRun s;
  auto tokenizer = load_tokenizer(s.config.model.path);
  const int32_t pad = 0;
  const c10::Device cpu(at::kCPU);
  EvaluationMicroBatch free_micro(16, nullptr);
  auto loader = make_validation_loader(s.config, *tokenizer, DataFamily::kCausal, 16);
  ASSERT_TRUE(loader);
  const int64_t base = cpu_memory_stats().allocated;
  reset_cpu_peak();
  const auto unconstrained = validation_loss(*s.model, *loader, free_micro, s.config, cpu, pad);
  const int64_t sixteen = cpu_memory_stats().peak - base;
  EXPECT_EQ(free_micro.value(), 16);

  const int64_t training_micro = s.policy->micro_batch();
  set_cpu_budget_limit(base + sixteen / 3);
  EvaluationMicroBatch micro(16, nullptr);
  loader = make_validation_loader(s.config, *tokenizer, DataFamily::kCausal, 16);
  const auto constrained = validation_loss(*s.model, *loader, micro, s.config, cpu, pad);
  set_cpu_budget_limit(0);
  EXPECT_LT(micro.value(), 16) << "the evaluation micro-batch shrank";
  EXPECT_EQ(s.policy->micro_batch(), training_micro) << "the training micro-batch did not";
  EXPECT_EQ(constrained.tokens, unconstrained.tokens);
  EXPECT_NEAR(constrained.loss, unconstrained.loss, 1e-5);
}

// With training's chunked loss on, evaluation runs the LM head over chunks of target tokens too: the same loss,
// and a lower peak than through the full logits.
TEST(Evaluation, ChunkedLossGivesTheSameLossWithLessMemory) {
  BudgetScope budget;
  TinyRun s;
  auto tokenizer = load_tokenizer(s.config.model.path);
  const c10::Device cpu(at::kCPU);
  auto measure = [&](int64_t chunk) {
    EvaluationMicroBatch micro(16, nullptr);
    auto loader = make_validation_loader(s.config, *tokenizer, DataFamily::kCausal, 16);
    const int64_t base = cpu_memory_stats().allocated;
    reset_cpu_peak();
    const auto result = validation_loss(*s.model, *loader, micro, s.config, cpu, 0, chunk);
    return std::make_pair(result, cpu_memory_stats().peak - base);
  };
  const auto [plain, plain_peak] = measure(0);
  const auto [chunked, chunked_peak] = measure(16);
  EXPECT_EQ(chunked.tokens, plain.tokens);
  EXPECT_NEAR(chunked.loss, plain.loss, 1e-5);
  EXPECT_LT(chunked_peak, plain_peak) << "one chunk of logits at a time";
}

}  // namespace trainer
