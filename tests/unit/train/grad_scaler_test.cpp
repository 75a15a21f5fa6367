// fp16-mixed's dynamic loss scaling: GradScaler's arithmetic (torch.amp.GradScaler's rules), and the training step
// with it on a tiny Qwen2 under CPU fp16 autocast, with real overflows from a loss scale fp16 cannot hold.
#include <iomanip>
#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/policy.h"
#include "models/model.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/optim/grad_scaler.h"
#include "train/optim/optimizer.h"
#include "train/tasks/text/text_step.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

GradScalerOptions scaling(double init_scale, int64_t growth_interval = 2000) {
  GradScalerOptions options;
  options.init_scale = init_scale;
  options.growth_interval = growth_interval;
  return options;
}

TEST(GradScaler, StartsAtTwoToTheSixteenAndUnscalesFiniteGradients) {
  GradScaler scaler;
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  at::Tensor a = at::full({3}, 65536.0, at::kFloat), b = at::full({2, 2}, 32768.0, at::kFloat);
  EXPECT_FALSE(scaler.unscale_and_check({a, b, at::Tensor()}));  // an undefined gradient is no gradient
  EXPECT_TRUE(at::equal(a, at::ones({3})));
  EXPECT_TRUE(at::equal(b, at::full({2, 2}, 0.5)));
}

TEST(GradScaler, FindsInfAndNanInAnyGradientOfAnyDtype) {
  GradScaler scaler(scaling(4.0));
  for (const double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()}) {
    at::Tensor fine = at::ones({4}, at::kFloat), half = at::ones({5}, at::kHalf);
    half[3] = bad;
    EXPECT_TRUE(scaler.unscale_and_check({fine, half})) << bad;
    at::Tensor other = at::ones({4}, at::kFloat);
    other[0] = bad;
    EXPECT_TRUE(scaler.unscale_and_check({other, at::ones({5}, at::kHalf)})) << bad;
  }
  EXPECT_FALSE(scaler.unscale_and_check({at::full({2}, 1e30, at::kFloat), at::full({2}, 60000.0, at::kHalf)}));
}

// GradScaler.update's rules: backoff by 0.5 and a reset tracker on an overflow, growth by 2 after growth_interval
// clean steps in a row; the state round-trips through a checkpoint's JSON.
TEST(GradScaler, BacksOffOnOverflowAndGrowsAfterTheInterval) {
  GradScaler scaler(scaling(1024.0, 3));
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  scaler.update(false);  // the third clean step in a row
  EXPECT_EQ(scaler.scale(), 1024.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  scaler.update(false);
  scaler.update(true);  // an overflow resets the count of clean steps
  EXPECT_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(scaler.consecutive_skips(), 1);
  scaler.update(true);
  EXPECT_EQ(scaler.consecutive_skips(), 2);
  scaler.update(false);
  EXPECT_EQ(scaler.consecutive_skips(), 0);
  EXPECT_EQ(scaler.skipped_steps(), 3);

  const auto state = scaler.state();
  GradScaler restored(scaling(1.0, 3));
  restored.restore(state, "train_state.json");
  EXPECT_EQ(restored.scale(), 256.0);
  EXPECT_EQ(restored.growth_tracker(), 1);
  EXPECT_EQ(restored.skipped_steps(), 3);
  for (auto* s : {&scaler, &restored}) {
    s->update(false);
    s->update(false);
  }
  EXPECT_EQ(restored.scale(), scaler.scale());
  EXPECT_EQ(restored.scale(), 512.0);

  EXPECT_THROW(restored.restore(nlohmann::json{{"scale", -1.0}, {"growth_tracker", 0}}, "x"), DataError);
  EXPECT_THROW(restored.restore(nlohmann::json{{"growth_tracker", 0}}, "x"), DataError);
  EXPECT_EQ(restored.scale(), 512.0);  // a refused state changes nothing
}

TEST(GradScaler, Fp16MixedIsRefusedForTheT5FamilyOnly) {
  for (const char* type : {"t5", "mt5", "umt5", "longt5"}) {
    try {
      check_fp16_supported(type, "m/config.json");
      ADD_FAILURE() << type << " was not refused";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("overflow fp16"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("m/config.json"), std::string::npos) << e.what();
      EXPECT_NE(e.hint().find("bf16-mixed"), std::string::npos) << e.hint();
    }
  }
  for (const char* type : {"qwen2", "llama", "mistral", "vit", "clip_vision_model"})
    EXPECT_NO_THROW(check_fp16_supported(type, "m/config.json")) << type;
}

// ---- the training step with loss scaling -----------------------------------------------------------------------

EffectiveBatch make_batch(int64_t count, uint64_t seed) {
  at::manual_seed(seed);
  EffectiveBatch batch;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t length = 20 + at::randint(0, 30, {1}).item<int64_t>();
    Example e;
    const at::Tensor ids = at::randint(3, 500, {length}, at::kInt);
    e.input_ids.assign(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + length);
    e.labels = e.input_ids;
    batch.target_tokens += target_tokens(e, DataFamily::kCausal);
    batch.examples.push_back(std::move(e));
  }
  return batch;
}

struct Trainee {
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<GradScaler> scaler;
  std::unique_ptr<TrainStep> step;

  Trainee(PrecisionMode precision, std::optional<double> init_scale, bool chunked_loss = false) {
    model = load_model(test::source_path("configs/models/tiny-qwen2"), ModelInit::kRandom,
                       at::TensorOptions().dtype(at::kFloat), 7);
    model->train(true);
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    OptimizerConfig adam;
    adam.lr = 1e-3;
    optimizer = std::make_unique<AdamW>(*model, adam);
    TrainingConfig training;
    training.batch_size = 4;
    training.micro_batch_size = MicroBatchSize::fixed(2);
    policy = std::make_unique<MemoryPolicy>(MemoryConfig{}, training);
    StepOptions options;
    options.precision = precision;
    options.max_grad_norm = 0;  // no clipping: the gradients themselves are compared
    options.chunked_loss = chunked_loss;
    if (init_scale) {
      scaler = std::make_unique<GradScaler>(scaling(*init_scale));
      options.scaler = scaler.get();
    }
    step = std::make_unique<TrainStep>(*model, *optimizer, *policy, options);
  }

  std::map<std::string, at::Tensor> weights() {
    std::map<std::string, at::Tensor> out;
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) { out[name] = p.detach().clone(); });
    return out;
  }
};

double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double largest = 0;
  for (const auto& [name, t] : a) largest = std::max(largest, (t - b.at(name)).abs().max().item<double>());
  return largest;
}

// One step with fp16 autocast and the default scale: the update is fp32's within fp16's rounding, and the step is
// not fp32's exactly (autocast really ran the matmuls in fp16 on the CPU).
void fp16_mixed_step_follows_fp32(bool chunked_loss) {
  const auto batch = make_batch(4, 3);
  Trainee fp32(PrecisionMode::kFp32, std::nullopt, chunked_loss), fp16(PrecisionMode::kFp16Mixed, 65536.0, chunked_loss);
  const auto before = fp32.weights();
  const auto a = fp32.step->run(batch, 1, 1e-3), b = fp16.step->run(batch, 1, 1e-3);
  EXPECT_FALSE(b.skipped);
  EXPECT_EQ(b.loss_scale, 65536.0);
  EXPECT_EQ(a.loss_scale, 0.0);
  EXPECT_NEAR(a.loss, b.loss, 1e-2);
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-2 * a.grad_norm);  // unscaled before the norm
  // fp16 really ran: the loss or the gradients are not fp32's. Which of them shows it depends on the CPU's kernels:
  // on an AVX2 machine both differ; on an AVX-512/AMX machine (Xeon, torch 2.13) the loss was fp32's to 12 digits
  // (6.24975697316 on both sides) while the gradient norms differed (1.18164 vs 1.18169).
  EXPECT_TRUE(a.loss != b.loss || a.grad_norm != b.grad_norm)
      << std::setprecision(12) << "loss " << a.loss << " vs " << b.loss << ", gradient norm " << a.grad_norm << " vs "
      << b.grad_norm;
  // AdamW's first step moves each weight by about lr * sign(gradient): equal signs give equal weights.
  const auto wa = fp32.weights(), wb = fp16.weights();
  EXPECT_GT(max_difference(wa, before), 5e-4);
  int64_t differing = 0, total = 0;
  for (const auto& [name, t] : wa) {
    differing += ((t - wb.at(name)).abs() > 1e-4).sum().item<int64_t>();
    total += t.numel();
  }
  EXPECT_LT(differing, total / 50) << differing << " of " << total << " weights moved differently";
  EXPECT_EQ(fp16.optimizer->steps(), 1);
}

TEST(Fp16MixedStep, UpdatesAsFp32WithinFp16Rounding) { fp16_mixed_step_follows_fp32(false); }
TEST(Fp16MixedStep, UpdatesAsFp32WithinFp16RoundingWithChunkedLoss) { fp16_mixed_step_follows_fp32(true); }

// A loss scale of 2^60 overflows fp16 in backward (a real inf, nothing injected): the step is skipped (weights,
// optimizer state and step count untouched), the scale halves, the memory policy keeps its micro-batch, and no
// attempt counts as an out-of-memory retry. Each further overflow halves it again; once it fits, steps train.
TEST(Fp16MixedStep, AnOverflowSkipsTheUpdateAndBacksOffWithoutTouchingTheMemoryPolicy) {
  const auto batch = make_batch(4, 5);
  Trainee t(PrecisionMode::kFp16Mixed, std::ldexp(1.0, 60));
  const auto before = t.weights();
  const auto result = t.step->run(batch, 1, 1e-3);
  EXPECT_TRUE(result.skipped);
  EXPECT_EQ(result.loss_scale, std::ldexp(1.0, 60));
  EXPECT_TRUE(std::isnan(result.grad_norm));
  EXPECT_TRUE(std::isfinite(result.loss));  // the forward pass was fine: only the scaled backward overflowed
  EXPECT_EQ(result.retries, 0);
  EXPECT_EQ(result.micro_batch, 2);
  EXPECT_EQ(t.policy->micro_batch(), 2);
  EXPECT_TRUE(t.policy->adaptations().empty());
  EXPECT_EQ(t.scaler->scale(), std::ldexp(1.0, 59));
  EXPECT_EQ(t.optimizer->steps(), 0);
  EXPECT_TRUE(t.optimizer->gradients().empty());
  EXPECT_EQ(max_difference(before, t.weights()), 0.0);

  // Halving until the gradients fit, then training.
  int64_t step = 1, skipped = 1;
  for (StepResult r = result; r.skipped && step < 100; ++step) {
    r = t.step->run(batch, step + 1, 1e-3);
    if (r.skipped) ++skipped;
  }
  EXPECT_GT(skipped, 30);  // from 2^60 down below 2^30 at least (about 2^19 fits)
  EXPECT_EQ(t.scaler->skipped_steps(), skipped);
  EXPECT_EQ(t.optimizer->steps(), 1);
  EXPECT_GT(max_difference(before, t.weights()), 0.0);
  EXPECT_TRUE(t.policy->adaptations().empty());
}

}  // namespace
}  // namespace trainer
