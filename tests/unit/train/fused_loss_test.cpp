// The fused linear cross-entropy against the plain loss (LM head over every position, cross-entropy through
// autograd): the same loss and gradients, on its own and inside the training step for T5 and Qwen2 (tied and
// untied heads, T5's tied-embedding rescale, LoRA, bf16-mixed), and the memory it promises: one chunk of fp32
// logits, never the full logits or a logit gradient beside them.
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/lora.h"
#include "models/model.h"
#include "support/paths.h"
#include "train/fused_loss.h"
#include "train/optim/optimizer.h"
#include "train/precision.h"
#include "train/tasks/text/text_step.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

struct Reference {
  double loss = 0;
  at::Tensor grad_hidden, grad_weight;
};

// The plain loss through autograd: logits of every row, fp32 cross-entropy summed, times grad_scale.
Reference plain_loss(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& weight, double scale,
                     double grad_scale, bool bf16_autocast) {
  const at::Tensor h = hidden.detach().clone().requires_grad_(true);
  const at::Tensor w = weight.detach().clone().requires_grad_(true);
  at::Tensor loss;
  {
    AutocastScope autocast(bf16_autocast, at::kCPU);
    const at::Tensor logits = at::linear(h * scale, w);
    loss = at::cross_entropy_loss(logits.to(at::kFloat), targets, {}, at::Reduction::Sum, -100);
  }
  (loss * grad_scale).backward();
  return {loss.item<double>(), h.grad(), w.grad()};
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double tol, const std::string& what) {
  EXPECT_TRUE(at::allclose(a.to(at::kFloat), b.to(at::kFloat), tol, tol))
      << what << ": max difference " << (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

struct Inputs {
  at::Tensor hidden, targets, weight;
};

Inputs random_inputs(int64_t n, int64_t d, int64_t v) {
  at::manual_seed(5);
  Inputs in{at::randn({n, d}), at::randint(0, v, {n}, at::kLong), at::randn({v, d}) * 0.3};
  in.targets.narrow(0, 0, n / 5).fill_(-100);  // some positions are not trained on
  in.targets[n - 1] = -100;
  return in;
}

}  // namespace

TEST(FusedLinearCrossEntropy, GivesThePlainLossAndGradientsInFp32) {
  const Inputs in = random_inputs(37, 16, 97);
  for (const double scale : {1.0, 0.25}) {  // 0.25: T5's d_model^-0.5 rescale of a tied head
    const Reference ref = plain_loss(in.hidden, in.targets, in.weight, scale, 1.0 / 29, false);
    for (const int64_t chunk : {1, 4, 7, 1000}) {
      at::Tensor weight_grad = at::zeros_like(in.weight);
      const auto fused = fused_linear_cross_entropy(in.hidden, in.targets, in.weight, scale, 1.0 / 29, chunk,
                                                    std::nullopt, weight_grad);
      EXPECT_NEAR(fused.loss_sum.item<double>(), ref.loss, 1e-5 * std::abs(ref.loss)) << "chunk " << chunk;
      expect_close(fused.grad_hidden, ref.grad_hidden, 1e-5, "hidden gradient, chunk " + std::to_string(chunk));
      expect_close(weight_grad, ref.grad_weight, 1e-5, "weight gradient, chunk " + std::to_string(chunk));
      EXPECT_TRUE(fused.grad_hidden.narrow(0, 0, 37 / 5).eq(0).all().item<bool>()) << "ignored rows get no gradient";
    }
  }
}

// DPO's backward: each position's loss weighted by its own factor (its sequence's share of the loss) gives the
// gradients of sum(w_i * loss_i) through autograd; token_losses gives the per-position losses of the same logits and
// the logits' mean over the vocabulary, 0 where not trained.
TEST(FusedLinearCrossEntropy, RowWeightsGiveTheWeightedLossGradientsAndTokenLossesThePerPositionLosses) {
  const Inputs in = random_inputs(40, 16, 50);
  at::manual_seed(7);
  const at::Tensor row_weights = at::randn({40});
  const at::Tensor h = in.hidden.clone().requires_grad_(true);
  const at::Tensor w = in.weight.clone().requires_grad_(true);
  const at::Tensor logits = at::linear(h * 0.5, w);
  const at::Tensor per_position = at::cross_entropy_loss(logits, in.targets, {}, at::Reduction::None, -100);
  (per_position * row_weights * 3.0).sum().backward();

  at::Tensor weight_grad = at::zeros_like(in.weight);
  const auto fused = fused_linear_cross_entropy(in.hidden, in.targets, in.weight, 0.5, 3.0, 7, std::nullopt,
                                                weight_grad, row_weights);
  expect_close(fused.grad_hidden, h.grad(), 1e-5, "hidden gradient");
  expect_close(weight_grad, w.grad(), 1e-5, "weight gradient");
  EXPECT_NEAR(fused.loss_sum.item<double>(), per_position.sum().item<double>(), 1e-4);

  const TokenLosses losses = token_losses(in.hidden, in.targets, in.weight, 0.5, 7, std::nullopt);
  expect_close(losses.loss, per_position.detach(), 1e-5, "per-position losses");
  const at::Tensor trained = in.targets != -100;
  expect_close(losses.mean_logit, at::where(trained, logits.detach().mean(1), at::zeros({40})), 1e-5, "mean logits");
}

TEST(FusedLinearCrossEntropy, AccumulatesIntoAnExistingWeightGradientAndHandlesNoTrainedRows) {
  const Inputs in = random_inputs(20, 8, 31);
  const Reference ref = plain_loss(in.hidden, in.targets, in.weight, 1.0, 1.0, false);
  at::Tensor weight_grad = at::ones_like(in.weight);
  fused_linear_cross_entropy(in.hidden, in.targets, in.weight, 1.0, 1.0, 3, std::nullopt, weight_grad);
  expect_close(weight_grad, ref.grad_weight + 1, 1e-5, "accumulated weight gradient");
  const auto none = fused_linear_cross_entropy(in.hidden, at::full_like(in.targets, -100), in.weight, 1.0, 1.0, 3,
                                               std::nullopt);
  EXPECT_EQ(none.loss_sum.item<double>(), 0.0);
  EXPECT_TRUE(none.grad_hidden.eq(0).all().item<bool>());
}

TEST(FusedLinearCrossEntropy, Bf16ComputeMatchesTheAutocastLoss) {
  const Inputs in = random_inputs(64, 32, 300);
  const Reference ref = plain_loss(in.hidden, in.targets, in.weight, 1.0, 1.0 / 50, true);
  at::Tensor weight_grad = at::zeros_like(in.weight);
  const auto fused = fused_linear_cross_entropy(in.hidden, in.targets, in.weight, 1.0, 1.0 / 50, 16, at::kBFloat16,
                                                weight_grad);
  EXPECT_NEAR(fused.loss_sum.item<double>(), ref.loss, 1e-3 * std::abs(ref.loss));
  // Both round the logits and their gradient to bf16 the same way; what differs is summation order.
  auto relative = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.to(at::kFloat) - b.to(at::kFloat)).norm() / b.to(at::kFloat).norm()).item<double>();
  };
  EXPECT_LT(relative(fused.grad_hidden, ref.grad_hidden), 1e-2);
  EXPECT_LT(relative(weight_grad, ref.grad_weight), 1e-2);
}

namespace {

struct ModelCase {
  std::string name;      // configs/models/<name>
  nlohmann::json patch;  // merged into its config.json
  bool lora = false;
  PrecisionMode precision = PrecisionMode::kFp32;
};

std::map<std::string, at::Tensor> step_grads(const ModelCase& c, bool chunked) {
  auto hf = read_json_file(test::source_path("configs/models/" + c.name + "/config.json"));
  if (c.patch.is_object()) hf.merge_patch(c.patch);
  auto model = build_model(hf, at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(3);
  model->init_weights();
  model->train(false);  // no dropout: both sides see the same network
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  std::unique_ptr<LoraAdapters> lora;
  if (c.lora) {
    LoraConfig config;
    config.r = 4;
    config.dropout = 0.0;
    lora = apply_lora(*model, config, 0);
    at::NoGradGuard no_grad;  // B non-zero, so A's gradient is not zero either
    for (const auto& [path, layer] : lora->layers()) layer->lora_B.normal_(0, 0.1);
  }
  Module& trained = lora ? static_cast<Module&>(*lora) : *model;
  AdamW optimizer(trained, OptimizerConfig{});
  TrainingConfig training;
  training.batch_size = 3;
  training.loss_chunk_size = 5;
  MemoryPolicy policy({}, training);
  StepOptions options;
  options.precision = c.precision;
  options.chunked_loss = chunked;
  TrainStep step(*model, optimizer, policy, options);
  const bool seq2seq = model->family() == ModelFamily::kSeq2Seq;
  at::manual_seed(9);
  std::vector<Example> examples(3);
  int64_t tokens = 0;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const int64_t length = 6 + 5 * static_cast<int64_t>(i);
    const at::Tensor ids = at::randint(3, 200, {length}, at::kInt);
    examples[i].input_ids.assign(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + length);
    examples[i].labels = seq2seq ? std::vector<int32_t>(examples[i].input_ids.begin() + 1, examples[i].input_ids.end())
                                 : examples[i].input_ids;
    examples[i].labels[0] = -100;
    tokens += target_tokens(examples[i], seq2seq ? DataFamily::kSeq2Seq : DataFamily::kCausal);
  }
  const double loss = step.forward_backward(examples, static_cast<double>(tokens));
  std::map<std::string, at::Tensor> grads;
  grads["loss"] = at::tensor(loss, at::kDouble);
  trained.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) grads[name] = p.grad().clone();
  });
  return grads;
}

class FusedLossInTheStep : public ::testing::TestWithParam<ModelCase> {};

}  // namespace

TEST_P(FusedLossInTheStep, GivesThePlainLossAndGradients) {
  const ModelCase c = GetParam();
  const auto plain = step_grads(c, false), fused = step_grads(c, true);
  ASSERT_EQ(plain.size(), fused.size());
  ASSERT_GT(plain.size(), 1u);
  const bool bf16 = c.precision != PrecisionMode::kFp32;
  for (const auto& [name, a] : plain) {
    ASSERT_TRUE(fused.contains(name)) << name;
    const at::Tensor b = fused.at(name);
    if (!bf16) {
      EXPECT_TRUE(at::allclose(a, b, 1e-5, 1e-5)) << name << ": max difference " << (a - b).abs().max().item<double>();
    } else {  // bf16 logits and gradients: close relative to the gradient's size
      const double error = ((a - b).norm() / a.norm().clamp_min(1e-12)).item<double>();
      EXPECT_LT(error, 2e-2) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    TinyModels, FusedLossInTheStep,
    ::testing::Values(ModelCase{"tiny-qwen2", {}, false, PrecisionMode::kFp32},                        // tied head
                      ModelCase{"tiny-qwen2", {{"tie_word_embeddings", false}}, false, PrecisionMode::kFp32},
                      ModelCase{"tiny-qwen2", {}, true, PrecisionMode::kFp32},
                      ModelCase{"tiny-qwen2", {}, false, PrecisionMode::kBf16Mixed},
                      ModelCase{"tiny-t5", {{"scale_decoder_outputs", true}}, false, PrecisionMode::kFp32},  // rescale
                      ModelCase{"tiny-t5", {{"tie_word_embeddings", false}}, false, PrecisionMode::kFp32},
                      ModelCase{"tiny-t5", {}, true, PrecisionMode::kFp32},
                      ModelCase{"tiny-t5", {{"tie_word_embeddings", false}}, false, PrecisionMode::kBf16Mixed}),
    [](const auto& test_info) {
      const auto& c = test_info.param;
      std::string name = c.name == "tiny-t5" ? "T5" : "Qwen2";
      if (c.patch.contains("tie_word_embeddings")) name += "Untied";
      if (c.patch.contains("scale_decoder_outputs")) name += "TiedRescaled";
      if (c.lora) name += "Lora";
      if (c.precision == PrecisionMode::kBf16Mixed) name += "Bf16Mixed";
      return name;
    });

TEST(FusedLinearCrossEntropy, HoldsOneChunkOfFp32LogitsAtATime) {
  // A large vocabulary against a small hidden size: the logits dominate. The peak above the inputs is one chunk of
  // fp32 logits (the gradient is made in place) plus the row-sized buffers, where the plain loss holds every row's
  // logits, log-probabilities and their gradients.
  install_cpu_budget();
  const int64_t n = 256, d = 16, v = 20000, chunk = 32;
  const Inputs in = random_inputs(n, d, v);
  at::Tensor weight_grad = at::zeros_like(in.weight);
  reset_cpu_peak();
  const int64_t base = cpu_memory_stats().allocated;
  const auto fused =
      fused_linear_cross_entropy(in.hidden, in.targets, in.weight, 1.0, 1.0, chunk, std::nullopt, weight_grad);
  const double peak = static_cast<double>(cpu_memory_stats().peak - base);
  const double one_chunk = static_cast<double>(chunk * v * 4);
  const double rows = static_cast<double>(n * d * 4 * 2);  // the hidden gradient, and a copy of the index/rows
  EXPECT_LT(peak, 1.15 * one_chunk + rows + 64 * 1024) << "peak " << peak << ", one chunk " << one_chunk;
  EXPECT_GT(peak, one_chunk) << "the chunk's logits were not where the peak is";
  reset_cpu_peak();
  const int64_t base_plain = cpu_memory_stats().allocated;
  plain_loss(in.hidden, in.targets, in.weight, 1.0, 1.0, false);
  EXPECT_GT(static_cast<double>(cpu_memory_stats().peak - base_plain), 2.0 * n * v * 4);
}

}  // namespace trainer
