// Activation checkpointing recomputes blocks in backward with the forward's dropout context: the gradients equal
// those of a run without it, dropout included (T5's dropout_rate 0.1, Qwen2 with attention_dropout 0.1).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/dropout.h"
#include "models/model.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/activation_checkpointing.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

std::map<std::string, at::Tensor> gradients(LanguageModel& model, const Batch& batch, uint64_t seed) {
  model.for_each_parameter([](const std::string&, at::Tensor& p) { p.mutable_grad() = at::Tensor(); });
  const DropoutScope dropout(seed, 1, 0, batch.input_ids.size(0), at::kCPU);
  at::manual_seed(static_cast<uint64_t>(seed) * 7 + 1);  // LibTorch's generator plays no part
  forward_loss(model, batch).loss_sum.backward();
  std::map<std::string, at::Tensor> grads;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) { grads[name] = p.grad().clone(); });
  return grads;
}

}  // namespace

TEST(ActivationCheckpointing, SameGradientsWithDropoutOn) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto config = read_json_file(test::source_path(std::string("configs/models/") + name + "/config.json"));
    if (std::string(name) == "tiny-qwen2") config["attention_dropout"] = 0.1;
    auto model = build_model(config, at::TensorOptions().dtype(at::kFloat));
    at::manual_seed(2);
    model->init_weights();
    model->train(true);  // T5's dropout_rate 0.1 and Qwen2's attention dropout are active
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    at::manual_seed(4);
    Batch batch;
    batch.input_ids = at::randint(3, 200, {2, 12}, at::kLong);
    batch.attention_mask = at::ones_like(batch.input_ids);
    batch.attention_mask[1].narrow(0, 8, 4).zero_();
    batch.labels = model->family() == ModelFamily::kSeq2Seq ? at::randint(3, 200, {2, 6}, at::kLong)
                                                            : batch.input_ids.masked_fill(batch.attention_mask == 0, -100);

    const auto plain = gradients(*model, batch, 99);
    apply_activation_checkpointing(*model);
    const auto checkpointed = gradients(*model, batch, 99);
    remove_activation_checkpointing(*model);
    const auto other_seed = gradients(*model, batch, 100);

    ASSERT_EQ(plain.size(), checkpointed.size());
    bool dropout_matters = false;
    for (const auto& [param, grad] : plain) {
      ASSERT_TRUE(checkpointed.at(param).defined()) << param;
      EXPECT_TRUE(at::allclose(grad, checkpointed.at(param), 1e-5, 1e-5))
          << param << ": max difference " << (grad - checkpointed.at(param)).abs().max().item<double>() << " of "
          << grad.abs().max().item<double>();
      dropout_matters = dropout_matters || !at::allclose(grad, other_seed.at(param), 1e-5, 1e-6);
    }
    EXPECT_TRUE(dropout_matters) << "the test must exercise dropout";
  }
}

}  // namespace trainer
