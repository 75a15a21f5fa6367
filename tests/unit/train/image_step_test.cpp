// The image-classification step against real out-of-memory errors from the CPU budget allocator: any split gives
// the same gradient (the loss is normalised by the effective batch's image count), an adaptation mid-run reaches
// the weights of an unconstrained run with dropout on, and a linear probe trains the head alone.
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/image/image_lora.h"
#include "models/image/image_model.h"
#include "support/paths.h"
#include "support/temp_dir.h"
#include "train/activation_checkpointing.h"
#include "train/tasks/image/image_step.h"
#include "train/optim/optimizer.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

struct BudgetScope {
  BudgetScope() { install_cpu_budget(); }
  ~BudgetScope() { set_cpu_budget_limit(0); }
};

// Random pixels and labels of 5 classes at the tiny ViT's 32 x 32.
ImageBatch make_images(int64_t count, uint64_t seed) {
  at::manual_seed(seed);
  ImageBatch batch;
  batch.height = batch.width = 32;
  const at::Tensor pixels = at::randn({count, 3, 32, 32});
  const at::Tensor labels = at::randint(0, 5, {count}, at::kLong);
  batch.pixels.assign(pixels.data_ptr<float>(), pixels.data_ptr<float>() + pixels.numel());
  batch.labels.assign(labels.data_ptr<int64_t>(), labels.data_ptr<int64_t>() + count);
  return batch;
}

struct Trainee {
  std::unique_ptr<ImageClassifier> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<ImageTrainStep> step;

  explicit Trainee(int64_t micro, bool linear_probe = false) {
    // configs/models/tiny-vit has dropout 0.1 on hidden states and attention: its masks must follow the images.
    model = load_image_classifier(test::source_path("configs/models/tiny-vit"), ModelInit::kRandom,
                                  at::TensorOptions().dtype(at::kFloat), 7, {"a", "b", "c", "d", "e"});
    model->train(true);
    const std::string head = model->head_prefix();
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      p.requires_grad_(!linear_probe || name.starts_with(head));
    });
    OptimizerConfig adam;
    adam.lr = 1e-3;
    adam.weight_decay = 0.01;
    optimizer = make_optimizer(*model, adam, 0);
    TrainingConfig training;
    training.batch_size = 16;
    training.micro_batch_size = MicroBatchSize::fixed(micro);
    policy = std::make_unique<MemoryPolicy>(MemoryConfig{}, training);
    ImageStepOptions options;
    options.seed = 3;
    options.linear_probe = linear_probe;
    step = std::make_unique<ImageTrainStep>(*model, *optimizer, *policy, options);
  }

  std::map<std::string, at::Tensor> grads_of(const ImageBatch& batch) {
    optimizer->zero_grad();
    const at::Tensor pixels = at::from_blob(const_cast<float*>(batch.pixels.data()), {batch.size(), 3, 32, 32});
    const at::Tensor labels = at::from_blob(const_cast<int64_t*>(batch.labels.data()), {batch.size()}, at::kLong);
    for (const auto& [begin, count] : split_counts(batch.size(), policy->micro_batch()))
      step->forward_backward(pixels.narrow(0, begin, count), labels.narrow(0, begin, count), begin, 1,
                             static_cast<double>(batch.size()));
    std::map<std::string, at::Tensor> grads;
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (p.grad().defined()) grads[name] = p.grad().clone();
    });
    return grads;
  }

  int64_t peak_above(int64_t base, const ImageBatch& batch, int64_t n) {
    reset_cpu_peak();
    const at::Tensor pixels = at::from_blob(const_cast<float*>(batch.pixels.data()), {n, 3, 32, 32});
    const at::Tensor labels = at::from_blob(const_cast<int64_t*>(batch.labels.data()), {n}, at::kLong);
    step->forward_backward(pixels, labels, 0, 1, 1.0);
    optimizer->zero_grad();
    return cpu_memory_stats().peak - base;
  }
};

void expect_close(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a)
    EXPECT_TRUE(at::allclose(t, b.at(name), tol, tol))
        << name << ": max difference " << (t - b.at(name)).abs().max().item<double>();
}

std::map<std::string, at::Tensor> weights_of(Module& model) {
  std::map<std::string, at::Tensor> out;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) { out[name] = p.detach().clone(); });
  return out;
}

}  // namespace

TEST(ImageTrainStep, AnySplitGivesTheSameGradientWithDropoutOn) {
  const auto batch = make_images(16, 1);
  const auto whole = Trainee(16).grads_of(batch);
  EXPECT_EQ(whole.size(), weights_of(*Trainee(16).model).size());
  expect_close(whole, Trainee(4).grads_of(batch), 1e-5);
  expect_close(whole, Trainee(1).grads_of(batch), 1e-5);
}

// Six steps; after two, a budget arrives that fits micro-batches of 4 images but not 8: the micro-batch goes
// 16 -> 8 -> 4 at step 3, and the run reaches the weights of six unconstrained steps (fp32, dropout on).
TEST(ImageTrainStep, OutOfMemoryMidRunReachesTheSameWeights) {
  BudgetScope budget;
  std::vector<ImageBatch> batches;
  for (uint64_t i = 0; i < 6; ++i) batches.push_back(make_images(16, 10 + i));
  Trainee free_run(16);
  for (int64_t s = 0; s < 6; ++s) free_run.step->run(batches[static_cast<std::size_t>(s)], s + 1, 1e-3);

  Trainee constrained(16);
  for (int64_t s = 0; s < 2; ++s) constrained.step->run(batches[static_cast<std::size_t>(s)], s + 1, 1e-3);
  ASSERT_TRUE(constrained.policy->adaptations().empty());
  const int64_t base = cpu_memory_stats().allocated;
  const int64_t four = constrained.peak_above(base, batches[2], 4);
  const int64_t eight = constrained.peak_above(base, batches[2], 8);
  ASSERT_LT(four, eight);
  set_cpu_budget_limit(base + (four + eight) / 2);
  StepResult last;
  for (std::size_t b = 2; b < batches.size(); ++b)
    last = constrained.step->run(batches[b], static_cast<int64_t>(b) + 1, 1e-3);
  set_cpu_budget_limit(0);

  const auto& a = constrained.policy->adaptations();
  ASSERT_EQ(a.size(), 2u) << "the budget must force 16 -> 8 -> 4 at step 3 and nothing after";
  EXPECT_EQ(a[0].step, 3);
  EXPECT_EQ(a[0].new_micro_batch, 8);
  EXPECT_EQ(a[1].new_micro_batch, 4);
  EXPECT_EQ(last.micro_batch, 4);
  EXPECT_EQ(last.micro_steps, 4);
  EXPECT_EQ(last.counted, 16);  // images
  expect_close(weights_of(*free_run.model), weights_of(*constrained.model), 1e-5);
}

TEST(ImageTrainStep, ActivationCheckpointingGivesTheSameGradient) {
  const auto batch = make_images(8, 2);
  const auto plain = Trainee(8).grads_of(batch);
  Trainee checkpointed(4);
  checkpointed.model->set_block_runner(activation_checkpointing_runner());
  expect_close(plain, checkpointed.grads_of(batch), 1e-5);
}

TEST(ImageTrainStep, LinearProbeTrainsTheHeadAlone) {
  const auto batch = make_images(8, 3);
  Trainee probe(8, /*linear_probe=*/true);
  const auto before = weights_of(*probe.model);
  const auto grads = probe.grads_of(batch);
  for (const auto& [name, grad] : grads) EXPECT_TRUE(name.starts_with(probe.model->head_prefix())) << name;
  EXPECT_FALSE(grads.empty());
  probe.step->run(batch, 1, 1e-2);
  for (const auto& [name, after] : weights_of(*probe.model))
    EXPECT_EQ(name.starts_with(probe.model->head_prefix()), !at::equal(before.at(name), after)) << name;
  // The probe's gradient equals a full model's head gradient on the same images.
  const auto full = Trainee(8).grads_of(batch);
  for (const auto& [name, grad] : grads) EXPECT_TRUE(at::allclose(grad, full.at(name), 1e-5, 1e-5)) << name;
}

// LoRA on an image classifier: the adapters start as the identity (B = 0), only they and the head train, and a
// saved adapter loads back into a fresh model with the same logits.
TEST(ImageLora, AdaptersAndHeadTrainAndRoundTripThroughTheAdapterFiles) {
  const auto batch = make_images(8, 4);
  const at::Tensor pixels = at::from_blob(const_cast<float*>(batch.pixels.data()), {8, 3, 32, 32});
  Trainee t(8);
  t.model->train(false);
  const at::Tensor before = image_logits(*t.model, pixels, c10::kCPU, PrecisionMode::kFp32);
  LoraConfig config;
  config.r = 4;
  config.target_modules = {"query", "value", "intermediate.dense"};
  auto lora = apply_image_lora(*t.model, config, 1);
  EXPECT_EQ(lora->layers().size(), 6u);  // 2 layers x 3 targets
  EXPECT_TRUE(at::allclose(before, image_logits(*t.model, pixels, c10::kCPU, PrecisionMode::kFp32), 1e-6, 1e-6));
  std::vector<std::string> trainable;
  lora->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.requires_grad()) trainable.push_back(name);
  });
  EXPECT_EQ(trainable.size(), 6u * 2 + 2);  // A and B per layer, the head's weight and bias
  t.model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    EXPECT_EQ(p.requires_grad(), name.starts_with("classifier.")) << name;
  });
  t.model->train(true);
  OptimizerConfig adam;
  adam.lr = 1e-2;
  auto optimizer = make_optimizer(*lora, adam, 0);
  ImageTrainStep step(*t.model, *optimizer, *t.policy, ImageStepOptions{});
  step.run(batch, 1, 1e-2);
  step.run(batch, 2, 1e-2);
  t.model->train(false);
  const at::Tensor after = image_logits(*t.model, pixels, c10::kCPU, PrecisionMode::kFp32);
  EXPECT_FALSE(at::allclose(before, after, 1e-4, 1e-4));

  test::TempDir dir;
  write_image_adapter(dir.path().string(), *lora, *t.model, "base");
  Trainee fresh(8);
  auto loaded = apply_image_lora(*fresh.model, config, 99);
  load_image_adapter(dir.path().string(), *loaded, *fresh.model);
  fresh.model->train(false);
  EXPECT_TRUE(at::allclose(after, image_logits(*fresh.model, pixels, c10::kCPU, PrecisionMode::kFp32), 1e-6, 1e-6));
  LoraConfig wrong;
  wrong.target_modules = {"nonexistent"};
  EXPECT_THROW(apply_image_lora(*Trainee(8).model, wrong, 0), UsageError);
}

}  // namespace trainer
