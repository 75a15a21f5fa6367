// The end of the memory ladder (train/device_move.h): what a move re-creates, what it keeps, and when it is made.
// On the CPU build the move is CPU -> CPU: the same code as CUDA -> CPU (Tensor::set_data with a copy from
// .to(device)), so these tests prove that every tensor of the run is re-created and that everything holding one
// follows it; not the CUDA copy itself.
#include <algorithm>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/device_move.h"
#include "train/optim/optimizer.h"

namespace trainer {
namespace {

std::unique_ptr<LanguageModel> trainable_tiny(const char* name) {
  auto model = load_model(test::source_path(std::string("configs/models/") + name), ModelInit::kRandom,
                          at::TensorOptions().dtype(at::kFloat), 5);
  model->train(true);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  return model;
}

// A step of plain gradients (the sum of the logits of a few tokens), so the optimizer has state.
void one_step(LanguageModel& model, Optimizer& optimizer) {
  optimizer.zero_grad();
  Batch batch;
  batch.input_ids = at::arange(3, 19, at::kLong).reshape({2, 8});
  batch.attention_mask = at::ones({2, 8}, at::kLong);
  batch.labels = batch.input_ids.clone();
  forward_loss(model, batch).loss_sum.backward();
  optimizer.step(1e-2);
}

std::map<std::string, at::Tensor> snapshot(Module& model) {
  std::map<std::string, at::Tensor> out;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) { out[name] = p.detach().clone(); });
  return out;
}

// Every parameter and every optimizer state tensor is a new tensor after the move, with the same values; the tied
// LM head stays tied; and the next step from the moved run gives exactly the weights of a run that never moved,
// which it could not if the optimizer still updated the old tensors. AdamW and Adafactor (with its first moment).
TEST(DeviceMove, EveryTensorIsRecreatedAndTheNextStepIsTheSame) {
  for (const auto name : {OptimizerName::kAdamW, OptimizerName::kAdafactor}) {
    SCOPED_TRACE(enum_name(name));
    OptimizerConfig config;
    config.name = name;
    config.lr = 1e-2;
    config.adafactor_beta1 = name == OptimizerName::kAdafactor;  // its first moment moves too
    auto moved = trainable_tiny("tiny-qwen2");
    auto stayed = trainable_tiny("tiny-qwen2");
    auto moved_opt = make_optimizer(*moved, config, 1);
    auto stayed_opt = make_optimizer(*stayed, config, 1);
    one_step(*moved, *moved_opt);
    one_step(*stayed, *stayed_opt);

    std::map<std::string, const void*> before;
    moved->for_each_parameter([&](const std::string& n, at::Tensor& p) { before[n] = p.data_ptr(); });
    std::map<std::string, const void*> state_before;
    for (const auto& [n, t] : moved_opt->state_tensors()) state_before[n] = t.data_ptr();
    ASSERT_FALSE(state_before.empty());
    const auto values = snapshot(*moved);
    const auto state_values = moved_opt->state_tensors();
    EXPECT_TRUE(moved->lm_head_tied());
    EXPECT_EQ(moved->lm_head_weight().data_ptr(), before.at("model.embed_tokens.weight"));

    const int64_t bytes = move_parameters({moved.get()}, c10::Device(c10::kCPU));
    moved_opt->move_to(c10::Device(c10::kCPU));

    int64_t expected_bytes = 0;
    std::map<std::string, const void*> after;
    moved->for_each_parameter([&](const std::string& n, at::Tensor& p) {
      after[n] = p.data_ptr();
      EXPECT_NE(p.data_ptr(), before.at(n)) << n << " was not re-created";
      EXPECT_TRUE(p.requires_grad()) << n;
      EXPECT_TRUE(at::equal(p, values.at(n))) << n;
      expected_bytes += static_cast<int64_t>(p.nbytes());
    });
    EXPECT_EQ(bytes, expected_bytes);
    EXPECT_EQ(moved->lm_head_weight().data_ptr(), after.at("model.embed_tokens.weight")) << "still tied";
    const auto state_after = moved_opt->state_tensors();
    ASSERT_EQ(state_after.size(), state_values.size());
    for (std::size_t i = 0; i < state_after.size(); ++i) {
      EXPECT_NE(state_after[i].second.data_ptr(), state_before.at(state_after[i].first)) << state_after[i].first;
      EXPECT_TRUE(at::equal(state_after[i].second, state_values[i].second)) << state_after[i].first;
    }

    one_step(*moved, *moved_opt);
    one_step(*stayed, *stayed_opt);
    const auto after_moved = snapshot(*moved);
    const auto after_stayed = snapshot(*stayed);
    for (const auto& [n, t] : after_stayed) EXPECT_TRUE(at::equal(after_moved.at(n), t)) << n;
    EXPECT_FALSE(at::equal(after_moved.at("model.embed_tokens.weight"), values.at("model.embed_tokens.weight")))
        << "the step changed the weights";
  }
}

// bf16 weights with Kahan compensation: the compensation buffers move too (they are optimizer state).
TEST(DeviceMove, KahanCompensationMovesWithTheOptimizer) {
  auto model = load_model(test::source_path("configs/models/tiny-qwen2"), ModelInit::kRandom,
                          at::TensorOptions().dtype(at::kBFloat16), 5);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  OptimizerConfig config;
  config.bf16_update = Bf16Update::kKahan;
  auto optimizer = make_optimizer(*model, config, 1);
  one_step(*model, *optimizer);
  std::map<std::string, const void*> before;
  for (const auto& [n, t] : optimizer->state_tensors()) before[n] = t.data_ptr();
  ASSERT_TRUE(before.count("kahan_compensation.model.embed_tokens.weight"));
  move_parameters({model.get()}, c10::Device(c10::kCPU));
  optimizer->move_to(c10::Device(c10::kCPU));
  for (const auto& [n, t] : optimizer->state_tensors()) EXPECT_NE(t.data_ptr(), before.at(n)) << n;
  one_step(*model, *optimizer);  // the update runs on the moved state
}

// Which move is made: move_to_cpu needs device.allow_cpu_fallback (and, on the CPU, a memory.limit to lift);
// move_to_other_gpu needs device.type=auto and a GPU. The policy records a move, never offers one from
// next_escalation, and a restored policy may move again (a resume starts on the device its config picks).
TEST(DeviceMove, TheLadderMovesOnlyWhereTheConfigAllowsIt) {
  install_cpu_budget();
  auto model = trainable_tiny("tiny-qwen2");
  OptimizerConfig adam;
  auto optimizer = make_optimizer(*model, adam, 1);
  Config config;
  config.device.type = "cpu";
  MemoryPolicy policy(config.memory, config.training);
  const c10::Device cpu(c10::kCPU);
  {
    DeviceLadder ladder(config, cpu);
    set_cpu_budget_limit(1LL << 40);
    EXPECT_FALSE(ladder.move(3, cpu, {*model, nullptr, *optimizer}, policy, "out of memory"));
    EXPECT_NE(ladder.why_not_moved().find("move_to_other_gpu not made: device.type=cpu"), std::string::npos)
        << ladder.why_not_moved();
    EXPECT_NE(ladder.why_not_moved().find("move_to_cpu not made: device.allow_cpu_fallback=false"), std::string::npos)
        << ladder.why_not_moved();
  }
  config.device.allow_cpu_fallback = true;
  {
    DeviceLadder ladder(config, cpu);
    set_cpu_budget_limit(0);
    EXPECT_FALSE(ladder.move(3, cpu, {*model, nullptr, *optimizer}, policy, "out of memory"));
    EXPECT_NE(ladder.why_not_moved().find("no memory.limit to lift"), std::string::npos) << ladder.why_not_moved();
    set_cpu_budget_limit(1LL << 40);
    const auto moved = ladder.move(3, cpu, {*model, nullptr, *optimizer}, policy, "out of memory\nreport");
    ASSERT_TRUE(moved);
    EXPECT_TRUE(moved->is_cpu());
    EXPECT_EQ(cpu_memory_stats().limit, 0) << "the budget of the device left behind is lifted";
    EXPECT_EQ(ladder.moves(), 1);
    EXPECT_TRUE(policy.escalated("move_to_cpu"));
    EXPECT_EQ(policy.adaptations().back().reason, "escalate: move_to_cpu (cpu -> cpu)");
    set_cpu_budget_limit(1LL << 40);
    EXPECT_FALSE(ladder.move(4, cpu, {*model, nullptr, *optimizer}, policy, "out of memory")) << "once per process";
    set_cpu_budget_limit(0);
  }
  for (int i = 0; i < 6; ++i) EXPECT_FALSE(is_device_escalation(policy.next_escalation(5)));
  MemoryPolicy restored(config.memory, config.training);
  restored.restore(policy.state());
  EXPECT_FALSE(restored.escalated("move_to_cpu"));
  EXPECT_TRUE(std::any_of(restored.adaptations().begin(), restored.adaptations().end(),
                          [](const Adaptation& a) { return a.reason == "escalate: move_to_cpu (cpu -> cpu)"; }))
      << "the move stays in the record";
}

}  // namespace
}  // namespace trainer
