// `trainer plan`'s estimate against the peak the CPU budget allocator measures in a real training step.
#include <algorithm>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "memory/planner.h"
#include "memory/policy.h"
#include "models/weights.h"
#include "support/paths.h"
#include "support/temp_dir.h"
#include "train/activation_checkpointing.h"
#include "train/tasks/text/text_step.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

struct Case {
  std::string config_file;
  int64_t micro;
  bool checkpointing;
  bool chunked_loss;
};

Config case_config(const Case& c) {
  Config config = load_config(test::source_path(c.config_file));
  config.model.path = test::source_path(config.model.path);
  config.data.max_length = 128;
  config.data.max_input_length = 128;
  config.data.max_target_length = 64;
  config.training.batch_size = 2 * c.micro;
  config.training.activation_checkpointing = c.checkpointing;
  config.training.chunked_loss = c.chunked_loss;
  config.training.loss_chunk_size = 64;
  return config;
}

// Peak bytes of one optimizer step over two micro-batches of `micro` worst-case examples, counted from before the
// model existed: weights, optimizer state, gradients, activations, everything.
double measured_peak(const Config& config, int64_t micro) {
  install_cpu_budget();
  reset_cpu_peak();
  const int64_t before = cpu_memory_stats().allocated;
  auto model = load_model(config.model.path, ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 1);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  if (config.training.activation_checkpointing) apply_activation_checkpointing(*model);
  AdamW optimizer(*model, config.optimizer);
  Config fixed = config;
  fixed.training.micro_batch_size = MicroBatchSize::fixed(micro);
  MemoryPolicy policy(fixed.memory, fixed.training);
  StepOptions options;
  options.chunked_loss = config.training.chunked_loss;
  TrainStep step(*model, optimizer, policy, options);
  Example e;
  const bool seq2seq = model->family() == ModelFamily::kSeq2Seq;
  e.input_ids.assign(static_cast<std::size_t>(seq2seq ? config.data.max_input_length : config.data.max_length), 5);
  e.labels.assign(static_cast<std::size_t>(seq2seq ? config.data.max_target_length : config.data.max_length), 7);
  EffectiveBatch batch;
  batch.examples.assign(static_cast<std::size_t>(2 * micro), e);
  batch.target_tokens = 2 * micro * static_cast<int64_t>(e.labels.size());
  step.run(batch, 1, 1e-3);
  return static_cast<double>(cpu_memory_stats().peak - before);
}

class PlanEstimate : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(PlanEstimate, IsWithinTwentyPercentOfTheMeasuredPeak) {
  const Case c = GetParam();
  const Config config = case_config(c);
  const auto hf = read_json_file(config.model.path + "/config.json");
  const MemoryPlan plan = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
  const double estimate = plan.peak(c.micro, c.checkpointing, c.chunked_loss);
  const double measured = measured_peak(config, c.micro);
  EXPECT_NEAR(estimate / measured, 1.0, 0.2) << "estimate " << human_bytes(estimate) << ", measured "
                                             << human_bytes(measured);
  // The activations are a large part of the peak here, so the test says something about their model.
  EXPECT_GT(c.micro * (c.checkpointing ? plan.activations_per_example_checkpointed : plan.activations_per_example),
            0.3 * measured);
}

INSTANTIATE_TEST_SUITE_P(
    TinyModels, PlanEstimate,
    ::testing::Values(Case{"configs/tiny-qwen2.json", 4, false, false}, Case{"configs/tiny-qwen2.json", 2, true, true},
                      Case{"configs/tiny-t5.json", 4, false, false}, Case{"configs/tiny-t5.json", 2, true, true},
                      Case{"configs/tiny-t5.json", 1, false, true}),
    [](const auto& param_info) {
      const auto& c = param_info.param;
      return std::string(c.config_file.find("t5") != std::string::npos ? "T5" : "Qwen2") + "Micro" +
             std::to_string(c.micro) + (c.checkpointing ? "Checkpointing" : "") + (c.chunked_loss ? "ChunkedLoss" : "");
    });

TEST(Plan, RecommendsTheLargestMicroBatchUnderTheCapacity) {
  Config config = case_config({"configs/tiny-qwen2.json", 4, false, false});
  config.training.batch_size = 64;
  const auto hf = read_json_file(config.model.path + "/config.json");
  const MemoryPlan unlimited = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
  const double capacity = unlimited.peak(5, false, false) / (1.0 - config.memory.auto_safety_margin) + 1;
  const MemoryPlan plan = plan_memory(config, hf, at::Device(at::kCPU), capacity, "test");
  EXPECT_EQ(plan.largest_micro_batch(false, false), 5);
  EXPECT_GT(plan.largest_micro_batch(true, true), 5);
  std::ostringstream out;
  print_plan(plan, config, out);
  EXPECT_NE(out.str().find("recommendation: micro_batch_size 5 (13 accumulation steps"), std::string::npos) << out.str();
}

// The chunked loss is on by default and no longer a rung of the default ladder; the plan's table and
// recommendation take it as configured and suggest turning on only what the config leaves off.
TEST(Plan, TakesTheDefaultChunkedLossAsConfiguredAndSuggestsOnlyWhatIsOff) {
  EXPECT_TRUE(TrainingConfig{}.chunked_loss);
  const auto ladder = MemoryConfig{}.escalation;
  EXPECT_EQ(std::find(ladder.begin(), ladder.end(), "chunked_loss"), ladder.end());
  EXPECT_NE(std::find(ladder.begin(), ladder.end(), "smaller_loss_chunks"), ladder.end());

  Config config = case_config({"configs/tiny-qwen2.json", 4, false, true});
  config.training.batch_size = 64;
  const auto hf = read_json_file(config.model.path + "/config.json");
  const MemoryPlan unlimited = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
  const double capacity = unlimited.peak(5, false, true) / (1.0 - config.memory.auto_safety_margin) + 1;
  const MemoryPlan plan = plan_memory(config, hf, at::Device(at::kCPU), capacity, "test");
  ASSERT_EQ(plan.largest_micro_batch(false, true), 5);
  ASSERT_GT(plan.largest_micro_batch(true, true), 5);
  std::ostringstream out;
  print_plan(plan, config, out);
  const std::string text = out.str();
  EXPECT_NE(text.find("peak (as configured)"), std::string::npos) << text;
  EXPECT_NE(text.find("recommendation: micro_batch_size 5 (13 accumulation steps"), std::string::npos) << text;
  EXPECT_NE(text.find("chunked_loss=true\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  with training.activation_checkpointing=true: "), std::string::npos) << text;
  EXPECT_EQ(text.find("training.chunked_loss=true"), std::string::npos) << "it is on already\n" << text;
}

// QLoRA's dequantized copies (memory.dequantized_base): auto keeps them when the configured micro-batch still fits
// with them, and counts them in the weights; a memory.limit between the two peaks turns them off, and the plan says
// so; keep and per_use are taken as they are.
TEST(Plan, KeepsTheDequantizedBaseOnlyWhenTheMicroBatchStillFitsWithIt) {
  Config config = case_config({"configs/tiny-qwen2.json", 4, false, true});
  config.lora.enabled = true;
  config.lora.r = 4;
  config.model.quantize = QuantizeMode::kNf4;
  config.training.micro_batch_size = MicroBatchSize::fixed(4);
  const auto hf = read_json_file(config.model.path + "/config.json");
  config.memory.dequantized_base = DequantizedBase::kPerUse;
  const MemoryPlan per_use = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
  EXPECT_FALSE(per_use.keeps_dequantized_base);
  // Every linear layer of the 2 blocks, fp32: q 64x64, k and v 64x32, o 64x64, gate and up 64x128 and down 128x64.
  EXPECT_DOUBLE_EQ(per_use.dequantized_base, 4.0 * 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3));
  const double peak = per_use.peak(4, false, true);
  const double margin = config.memory.auto_safety_margin;

  config.memory.dequantized_base = DequantizedBase::kAuto;
  const double roomy = (peak + per_use.dequantized_base) / (1.0 - margin) + 1;
  const MemoryPlan kept = plan_memory(config, hf, at::Device(at::kCPU), roomy, "test");
  EXPECT_TRUE(kept.keeps_dequantized_base) << kept.dequantized_base_reason;
  EXPECT_DOUBLE_EQ(kept.weights, per_use.weights + per_use.dequantized_base);
  std::ostringstream out;
  print_plan(kept, config, out);
  EXPECT_NE(out.str().find("of which dequantized 4-bit weights"), std::string::npos) << out.str();

  const double tight = (peak + per_use.dequantized_base / 2) / (1.0 - margin);
  const MemoryPlan not_kept = plan_memory(config, hf, at::Device(at::kCPU), tight, "test");
  EXPECT_FALSE(not_kept.keeps_dequantized_base);
  EXPECT_DOUBLE_EQ(not_kept.weights, per_use.weights);
  EXPECT_NE(not_kept.dequantized_base_reason.find("dequantized on every use (memory.dequantized_base=auto"),
            std::string::npos)
      << not_kept.dequantized_base_reason;
  // The run's own choice: the same under memory.limit.
  std::string reason;
  const double copies = per_use.dequantized_base;
  config.memory.limit.bytes = static_cast<uint64_t>(tight);
  EXPECT_FALSE(choose_dequantized_base(config, at::Device(at::kCPU), copies, reason)) << reason;
  config.memory.limit.bytes = static_cast<uint64_t>(roomy);
  EXPECT_TRUE(choose_dequantized_base(config, at::Device(at::kCPU), copies, reason)) << reason;
  // micro_batch_size=auto: kept only when the copies leave the largest micro-batch as it is.
  config.training.micro_batch_size = MicroBatchSize::automatic();
  config.training.batch_size = 64;
  const MemoryPlan auto_plan = plan_memory(config, hf, at::Device(at::kCPU), tight, "test");
  MemoryPlan without = auto_plan;
  without.weights -= auto_plan.keeps_dequantized_base ? copies : 0;
  MemoryPlan with = without;
  with.weights += copies;
  EXPECT_EQ(auto_plan.keeps_dequantized_base,
            with.largest_micro_batch(false, true) >= std::max<int64_t>(1, without.largest_micro_batch(false, true)));

  config.memory.dequantized_base = DequantizedBase::kKeep;
  EXPECT_TRUE(choose_dequantized_base(config, at::Device(at::kCPU), copies, reason));
  config.memory.dequantized_base = DequantizedBase::kPerUse;
  config.memory.limit.bytes = 0;
  EXPECT_FALSE(choose_dequantized_base(config, at::Device(at::kCPU), copies, reason));
  EXPECT_NE(reason.find("per_use"), std::string::npos) << reason;
}

TEST(Plan, LoraCountsOnlyTheAdaptersAsTrainable) {
  Config config = case_config({"configs/tiny-qwen2.json", 1, false, false});
  config.lora.enabled = true;
  config.lora.r = 4;
  const auto hf = read_json_file(config.model.path + "/config.json");
  const MemoryPlan plan = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
  // q_proj 64 -> 64 and v_proj 64 -> 32 in each of the 2 layers: r * (in + out).
  EXPECT_EQ(plan.trainable_parameters, 2 * 4 * ((64 + 64) + (64 + 32)));
  EXPECT_DOUBLE_EQ(plan.optimizer_state, 8.0 * static_cast<double>(plan.trainable_parameters));
}

// Fully sharded weights: per rank, 1/N of the weights, gradients and AdamW state, plus the gathered root (the
// embeddings and head, with their gradient) and the largest block (with its gradient) and, prefetched, the next
// block's weights; kept gathered, every block.
TEST(Plan, FullyShardedWeightsKeepOneNthPlusTheGatheredUnits) {
  Config config = case_config({"configs/tiny-qwen2.json", 1, false, false});
  config.distributed.shard_weights = true;
  const auto hf = read_json_file(config.model.path + "/config.json");
  const MemoryPlan whole = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
  // The units as the model has them (meta: no weights): the root and the blocks.
  auto model = build_model(hf, at::TensorOptions().device(at::kMeta));
  const auto units = parameter_units(*model);
  std::vector<int64_t> numel(model->blocks().size() + 1, 0);
  std::size_t i = 0;
  model->for_each_parameter([&](const std::string&, at::Tensor& p) { numel[units[i++]] += p.numel(); });
  ASSERT_GT(numel[0], 0);
  const int64_t block = *std::max_element(numel.begin() + 1, numel.end());
  MemoryPlan sharded = whole;
  const std::string line = plan_fully_sharded(sharded, config, hf, 4);
  EXPECT_NE(line.find("over 4 ranks"), std::string::npos) << line;
  EXPECT_DOUBLE_EQ(sharded.optimizer_state, whole.optimizer_state / 4);
  EXPECT_DOUBLE_EQ(sharded.weights, whole.weights / 4 + 4.0 * static_cast<double>(numel[0] + 2 * block));
  EXPECT_DOUBLE_EQ(sharded.gradients, whole.gradients / 4 + 4.0 * static_cast<double>(numel[0] + block));
  config.distributed.prefetch = false;
  MemoryPlan unprefetched = whole;
  plan_fully_sharded(unprefetched, config, hf, 4);
  EXPECT_DOUBLE_EQ(unprefetched.weights, whole.weights / 4 + 4.0 * static_cast<double>(numel[0] + block));
  config.distributed.reshard_after_forward = false;
  MemoryPlan kept = whole;
  plan_fully_sharded(kept, config, hf, 4);
  EXPECT_DOUBLE_EQ(kept.weights, whole.weights / 4 + whole.weights);  // the root and every block gathered
}

TEST(Plan, LossTermsAtA152kVocabularyMatchTheMeasuredPeak) {
  // Qwen2's 152,064-token vocabulary on a model whose layers are tiny (hidden 16, tied head), so the loss is most
  // of the peak: the plain loss (full logits, log-probabilities and their gradients) and the fused chunked loss
  // (one chunk of fp32 logits) are each checked against a real step under the CPU budget allocator.
  test::TempDir dir;
  auto hf = read_json_file(test::source_path("configs/models/tiny-qwen2/config.json"));
  hf["vocab_size"] = 152064;
  hf["hidden_size"] = 16;
  hf["intermediate_size"] = 32;
  std::ofstream(dir.file("config.json")) << hf.dump();
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "fused chunked loss" : "plain loss");
    Config config = case_config({"configs/tiny-qwen2.json", 1, false, chunked});
    config.model.path = dir.path().string();
    config.training.loss_chunk_size = 96;
    const MemoryPlan plan = plan_memory(config, hf, at::Device(at::kCPU), 0, "test");
    const double estimate = plan.peak(1, false, chunked);
    const double measured = measured_peak(config, 1);
    EXPECT_NEAR(estimate / measured, 1.0, 0.2) << "estimate " << human_bytes(estimate) << ", measured "
                                               << human_bytes(measured);
    const double loss = chunked ? plan.loss_chunked(1) : plan.loss_per_example;
    EXPECT_GT(loss, 0.4 * measured) << "the loss is a large part of the peak, so the test says something about it";
  }
}

}  // namespace trainer
