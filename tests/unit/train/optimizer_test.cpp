// The optimizers on free-standing tensors: bf16 updates that keep their value (stochastic rounding, Kahan
// compensation) against round-to-nearest, determinism and exact resume, the allocation-free update, and the state
// size the planner counts. Adafactor's numerics are compared with transformers in tests/parity/test_adafactor.py.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "train/optim/optimizer.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

// Tensors as a module's parameters.
class Bag : public Module {
 public:
  Bag(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
    tensors_.reserve(tensors.size());
    for (const auto& [name, t] : tensors) {
      tensors_.push_back(t.clone().requires_grad_(true));
      register_parameter(name, &tensors_.back());
    }
  }
  std::vector<at::Tensor>& tensors() { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

std::vector<std::pair<std::string, at::Tensor>> start_tensors(at::ScalarType dtype) {
  at::manual_seed(11);
  return {{"layer.weight", (at::randn({64, 48}) * 0.05 + 0.05).to(dtype)},
          {"layer.bias", (at::randn({48}) * 0.05).to(dtype)},
          {"block.w", (at::randn({2, 8, 16}) * 0.05).to(dtype)}};
}

// Gradient number `step` for each tensor, independent of the run: a steady direction (as a loss going down gives)
// plus as much noise.
void set_grads(Bag& bag, int64_t step) {
  at::manual_seed(77);
  std::vector<at::Tensor> direction;
  for (auto& t : bag.tensors()) direction.push_back(at::randn(t.sizes()));
  at::manual_seed(1000 + static_cast<uint64_t>(step));
  for (std::size_t i = 0; i < direction.size(); ++i) {
    auto& t = bag.tensors()[i];
    t.mutable_grad() = (direction[i] + at::randn(t.sizes())).to(t.scalar_type());
  }
}

OptimizerConfig adamw(Bf16Update update, StateDtype state = StateDtype::kFp32) {
  OptimizerConfig c;
  c.bf16_update = update;
  c.state_dtype = state;
  c.weight_decay = 0.01;
  return c;
}

OptimizerConfig adafactor(Bf16Update update) {
  OptimizerConfig c;
  c.name = OptimizerName::kAdafactor;
  c.bf16_update = update;
  c.adafactor_beta1 = true;
  c.weight_decay = 0.01;
  return c;
}

// The distance moved from the start, in fp32, summed over the tensors: |w - w0|.
double distance(Bag& bag, const std::vector<std::pair<std::string, at::Tensor>>& start) {
  double d2 = 0;
  for (std::size_t i = 0; i < start.size(); ++i)
    d2 += (bag.tensors()[i].detach().to(at::kFloat) - start[i].second.to(at::kFloat)).pow(2).sum().item<double>();
  return std::sqrt(d2);
}

double difference(Bag& a, Bag& b) {
  double d2 = 0;
  for (std::size_t i = 0; i < a.tensors().size(); ++i)
    d2 += (a.tensors()[i].detach().to(at::kFloat) - b.tensors()[i].detach().to(at::kFloat)).pow(2).sum().item<double>();
  return std::sqrt(d2);
}

void run_steps(Bag& bag, Optimizer& optimizer, int64_t from, int64_t to, double lr) {
  for (int64_t s = from; s < to; ++s) {
    set_grads(bag, s);
    optimizer.step(lr);
  }
}

TEST(Bf16Update, StochasticAndKahanFollowFp32WhereNearestLosesTheUpdates) {
  // lr 1e-4 on weights around 0.05: most updates are below half a bf16 step (~1.2e-4), as in configs/t5xl.json.
  // Each bf16 run against the fp32 run from the same (bf16-representable) start, relative to how far that moved.
  const auto start = start_tensors(at::kBFloat16);
  for (const bool use_adafactor : {false, true}) {
    SCOPED_TRACE(use_adafactor ? "Adafactor" : "AdamW");
    const auto config = [&](Bf16Update u) { return use_adafactor ? adafactor(u) : adamw(u); };
    Bag fp32(start);
    for (auto& t : fp32.tensors()) t = t.detach().to(at::kFloat).requires_grad_(true);
    auto reference = make_optimizer(fp32, config(Bf16Update::kStochastic), 5);
    run_steps(fp32, *reference, 0, 200, 1e-4);
    const double moved = distance(fp32, start);
    ASSERT_GT(moved, 0);
    std::map<Bf16Update, double> error;
    for (const auto update : {Bf16Update::kStochastic, Bf16Update::kKahan, Bf16Update::kNearest}) {
      Bag bf16(start);
      auto optimizer = make_optimizer(bf16, config(update), 5);
      run_steps(bf16, *optimizer, 0, 200, 1e-4);
      error[update] = difference(bf16, fp32) / moved;
    }
    EXPECT_GT(error[Bf16Update::kNearest], 0.5) << "round to nearest should lose most of the update";
    EXPECT_LT(error[Bf16Update::kStochastic], 0.25);
    EXPECT_LT(error[Bf16Update::kKahan], 0.05);
  }
}

TEST(Bf16Update, StochasticRoundingIsAFunctionOfSeedStepAndElement) {
  Bag a(start_tensors(at::kBFloat16)), b(start_tensors(at::kBFloat16)), c(start_tensors(at::kBFloat16));
  auto oa = make_optimizer(a, adamw(Bf16Update::kStochastic), 5);
  auto ob = make_optimizer(b, adamw(Bf16Update::kStochastic), 5);
  auto oc = make_optimizer(c, adamw(Bf16Update::kStochastic), 6);
  run_steps(a, *oa, 0, 5, 1e-4);
  run_steps(b, *ob, 0, 5, 1e-4);
  run_steps(c, *oc, 0, 5, 1e-4);
  EXPECT_EQ(difference(a, b), 0.0);
  EXPECT_GT(difference(a, c), 0.0) << "another training.seed draws other rounding";
}

// Steps 0..10 straight, against 0..4, the state through a checkpoint (as resume reads it: fp32), 4..10.
void expect_exact_resume(const OptimizerConfig& config, at::ScalarType dtype) {
  Bag straight(start_tensors(dtype));
  auto o1 = make_optimizer(straight, config, 9);
  run_steps(straight, *o1, 0, 10, 1e-3);

  Bag first(start_tensors(dtype));
  auto o2 = make_optimizer(first, config, 9);
  run_steps(first, *o2, 0, 4, 1e-3);
  std::vector<std::pair<std::string, at::Tensor>> saved, weights;
  for (const auto& [name, t] : o2->state_tensors()) saved.emplace_back(name, t.to(at::kFloat).clone());
  for (auto& t : first.tensors()) t.mutable_grad() = at::Tensor();
  for (std::size_t i = 0; i < first.tensors().size(); ++i)
    weights.emplace_back(start_tensors(dtype)[i].first, first.tensors()[i].detach());
  Bag resumed(weights);
  auto o3 = make_optimizer(resumed, config, 9);
  o3->load_state(saved, o2->steps(), "optimizer.safetensors");
  run_steps(resumed, *o3, 4, 10, 1e-3);
  EXPECT_EQ(difference(straight, resumed), 0.0);
  const auto a = o1->state_tensors(), b = o3->state_tensors();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
}

TEST(Bf16Update, ResumeIsExact) {
  {
    SCOPED_TRACE("AdamW stochastic, bf16 moments");
    expect_exact_resume(adamw(Bf16Update::kStochastic, StateDtype::kBf16), at::kBFloat16);
  }
  {
    SCOPED_TRACE("AdamW kahan");
    expect_exact_resume(adamw(Bf16Update::kKahan), at::kBFloat16);
  }
  {
    SCOPED_TRACE("Adafactor kahan");
    expect_exact_resume(adafactor(Bf16Update::kKahan), at::kBFloat16);
  }
  {
    SCOPED_TRACE("Adafactor fp32");
    expect_exact_resume(adafactor(Bf16Update::kStochastic), at::kFloat);
  }
}

TEST(Int8AdamW, MovesLikeFp32AdamWResumesExactlyAndKeepsAboutTwoBytesAParameter) {
  // 5120 elements: 8-bit moments (bitsandbytes' min_8bit_size is 4096); the others keep fp32 moments.
  at::manual_seed(5);
  const std::vector<std::pair<std::string, at::Tensor>> start = {{"big.weight", at::randn({80, 64}) * 0.05},
                                                                 {"layer.weight", at::randn({64, 48}) * 0.05},
                                                                 {"layer.bias", at::randn({48}) * 0.05}};
  const auto int8 = adamw(Bf16Update::kStochastic, StateDtype::kInt8);
  Bag a(start), b(start);
  auto o8 = make_optimizer(a, int8, 1);
  auto o32 = make_optimizer(b, adamw(Bf16Update::kStochastic), 1);
  run_steps(a, *o8, 0, 10, 1e-3);
  run_steps(b, *o32, 0, 10, 1e-3);
  // Same direction, nearly the same size: 8-bit moments are an approximation of the fp32 ones.
  double moved = 0;
  for (std::size_t i = 0; i < start.size(); ++i) moved += (b.tensors()[i].detach() - start[i].second).norm().item<double>();
  EXPECT_GT(moved, 1e-3);
  EXPECT_LT(difference(a, b), 0.05 * moved);
  EXPECT_GT(difference(a, b), 0.0);
  int64_t expected = 0;
  for (auto& t : a.tensors()) expected += optimizer_state_bytes(int8, t.sizes(), false);
  EXPECT_EQ(o8->state_bytes(), expected);
  EXPECT_LT(optimizer_state_bytes(int8, {80, 64}, false), 2.1 * 80 * 64 + 25);
  for (const auto& [name, t] : o8->state_tensors()) EXPECT_TRUE(name.starts_with("adamw8bit.")) << name;

  // Resume: state saved after 4 steps and loaded into a fresh optimizer continues bit for bit.
  Bag first(start);
  auto o2 = make_optimizer(first, int8, 1);
  run_steps(first, *o2, 0, 4, 1e-3);
  std::vector<std::pair<std::string, at::Tensor>> saved, weights;
  for (const auto& [name, t] : o2->state_tensors()) saved.emplace_back(name, t.clone());
  for (std::size_t i = 0; i < start.size(); ++i) weights.emplace_back(start[i].first, first.tensors()[i].detach());
  Bag resumed(weights);
  auto o3 = make_optimizer(resumed, int8, 1);
  o3->load_state(saved, o2->steps(), "optimizer.safetensors");
  run_steps(resumed, *o3, 4, 10, 1e-3);
  EXPECT_EQ(difference(a, resumed), 0.0);
  const auto x = o8->state_tensors(), y = o3->state_tensors();
  ASSERT_EQ(x.size(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(at::equal(x[i].second, y[i].second)) << x[i].first;

  // bf16 parameters are refused with the setting to change.
  Bag bf16(start_tensors(at::kBFloat16));
  EXPECT_THROW(make_optimizer(bf16, int8, 1), UsageError);
}

TEST(Bf16Update, KahanCompensationIsSavedAndCountedAtTwoBytesAParameter) {
  Bag bag(start_tensors(at::kBFloat16));
  auto stochastic = make_optimizer(bag, adamw(Bf16Update::kStochastic), 1);
  auto kahan = make_optimizer(bag, adamw(Bf16Update::kKahan), 1);
  EXPECT_EQ(kahan->state_bytes() - stochastic->state_bytes(), 2 * kahan->trainable_parameters());
  int64_t compensation = 0;
  for (const auto& [name, t] : kahan->state_tensors())
    if (name.starts_with("kahan_compensation.")) {
      EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
      ++compensation;
    }
  EXPECT_EQ(compensation, 3);
  // fp32 weights need no compensation.
  Bag fp32(start_tensors(at::kFloat));
  EXPECT_EQ(make_optimizer(fp32, adamw(Bf16Update::kKahan), 1)->state_bytes(),
            make_optimizer(fp32, adamw(Bf16Update::kStochastic), 1)->state_bytes());
}

TEST(Optimizer, StateBytesAreWhatThePlannerCounts) {
  for (const auto dtype : {at::kFloat, at::kBFloat16})
    for (const auto& config : {adamw(Bf16Update::kKahan), adamw(Bf16Update::kStochastic, StateDtype::kBf16),
                               adafactor(Bf16Update::kKahan), adafactor(Bf16Update::kStochastic)}) {
      Bag bag(start_tensors(dtype));
      int64_t expected = 0;
      for (auto& t : bag.tensors()) expected += optimizer_state_bytes(config, t.sizes(), dtype == at::kBFloat16);
      EXPECT_EQ(make_optimizer(bag, config, 0)->state_bytes(), expected);
    }
  // Adafactor without a first moment: rows + columns of each matrix, the vector whole, in fp32.
  OptimizerConfig factored;
  factored.name = OptimizerName::kAdafactor;
  EXPECT_EQ(optimizer_state_bytes(factored, {64, 48}, false), 4 * (64 + 48));
  EXPECT_EQ(optimizer_state_bytes(factored, {2, 8, 16}, false), 4 * 2 * (8 + 16));
  EXPECT_EQ(optimizer_state_bytes(factored, {48}, false), 4 * 48);
}

TEST(Optimizer, TheUpdateAllocatesNothing) {
  // As AdamW's fp32 update (tests/unit/train/step_test.cpp): bf16 weights with either rounding, and Adafactor.
  install_cpu_budget();
  for (const auto& config : {adamw(Bf16Update::kStochastic, StateDtype::kBf16), adamw(Bf16Update::kKahan),
                             adafactor(Bf16Update::kStochastic), adafactor(Bf16Update::kKahan)}) {
    Bag bag(start_tensors(at::kBFloat16));
    auto optimizer = make_optimizer(bag, config, 3);
    set_grads(bag, 0);
    set_cpu_budget_limit(cpu_memory_stats().allocated + 1);  // not one more byte
    EXPECT_NO_THROW(optimizer->step(1e-3)) << optimizer->name();
    set_cpu_budget_limit(0);
    EXPECT_EQ(optimizer->steps(), 1);
  }
}

TEST(Optimizer, FusedAdamWAllocatesNothingEither) {
  install_cpu_budget();
  Bag bag(start_tensors(at::kFloat));
  AdamW optimizer(bag, adamw(Bf16Update::kStochastic), 3);
  ASSERT_TRUE(optimizer.fused());
  for (int64_t step = 0; step < 2; ++step) {  // the first step too: nothing is allocated lazily
    set_grads(bag, step);
    set_cpu_budget_limit(cpu_memory_stats().allocated + 1);
    EXPECT_NO_THROW(optimizer.step(1e-3));
    set_cpu_budget_limit(0);
  }
  EXPECT_EQ(optimizer.steps(), 2);
}

// ATen's fused kernel where every parameter and moment is fp32, the chunked update otherwise: the same weights and
// moments (to float rounding: the two order the bias corrections differently) over steps with a changing
// learning rate, weight decay on the matrices and none on the bias; and a resumed fused optimizer continues the same.
TEST(Optimizer, FusedAdamWGivesTheChunkedUpdatesWeights) {
  const auto start = start_tensors(at::kFloat);
  Bag fused_bag(start), chunked_bag(start);
  AdamW fused(fused_bag, adamw(Bf16Update::kStochastic), 3);
  AdamW chunked(chunked_bag, adamw(Bf16Update::kStochastic), 3, /*allow_fused=*/false);
  ASSERT_TRUE(fused.fused());
  ASSERT_FALSE(chunked.fused());
  EXPECT_FALSE(AdamW(fused_bag, adamw(Bf16Update::kStochastic, StateDtype::kBf16), 3).fused()) << "bf16 moments";
  Bag bf16_bag(start_tensors(at::kBFloat16));
  EXPECT_FALSE(AdamW(bf16_bag, adamw(Bf16Update::kStochastic), 3).fused()) << "bf16 weights";
  for (int64_t step = 0; step < 12; ++step) {
    set_grads(fused_bag, step);
    set_grads(chunked_bag, step);
    const double lr = 1e-3 * (1.0 - 0.05 * static_cast<double>(step));
    fused.step(lr);
    chunked.step(lr);
  }
  EXPECT_GT(distance(fused_bag, start), 1e-3) << "the weights moved";
  EXPECT_LT(difference(fused_bag, chunked_bag), 1e-6);
  const auto a = fused.state_tensors(), b = chunked.state_tensors();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(at::allclose(a[i].second, b[i].second, 1e-5, 1e-9)) << a[i].first;
  }
  // Resume: a new fused optimizer loaded with the state continues exactly as the one that ran on.
  Bag resumed_bag(start);
  for (std::size_t i = 0; i < start.size(); ++i) resumed_bag.tensors()[i].detach().copy_(fused_bag.tensors()[i].detach());
  AdamW resumed(resumed_bag, adamw(Bf16Update::kStochastic), 3);
  resumed.load_state(fused.state_tensors(), fused.steps(), "test");
  set_grads(fused_bag, 12);
  set_grads(resumed_bag, 12);
  fused.step(1e-3);
  resumed.step(1e-3);
  EXPECT_EQ(difference(fused_bag, resumed_bag), 0.0);
}

TEST(Optimizer, LoadStateNamesTheMissingTensor) {
  Bag bag(start_tensors(at::kFloat));
  auto optimizer = make_optimizer(bag, adafactor(Bf16Update::kStochastic), 0);
  auto state = optimizer->state_tensors();
  const std::string missing = state[1].first;
  state.erase(state.begin() + 1);
  try {
    optimizer->load_state(state, 3, "ckpt/optimizer.safetensors");
    FAIL() << "a missing state tensor was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt/optimizer.safetensors: no tensor " + missing), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(optimizer->steps(), 0);
}

TEST(OptimizerConfig, AdafactorAndRoundingKeysAreValidated) {
  const char* minimal = R"({"model": {"path": "m"}, "data": {"train_files": ["d.jsonl"]}})";
  const auto problems = [&](const std::vector<std::string>& overrides) {
    try {
      parse_config(minimal, "test.json", overrides);
    } catch (const ConfigError& e) {
      std::string where;
      for (const auto& p : e.problems()) where += p.where + ";";
      return where;
    }
    return std::string();
  };
  EXPECT_EQ(problems({"optimizer.name=adafactor", "optimizer.bf16_update=kahan", "optimizer.relative_step=true",
                      "optimizer.warmup_init=true"}),
            "");
  EXPECT_NE(problems({"optimizer.bf16_update=round"}).find("optimizer.bf16_update"), std::string::npos);
  EXPECT_NE(problems({"optimizer.name=adafactor", "optimizer.warmup_init=true"}).find("optimizer.warmup_init"),
            std::string::npos);
  EXPECT_NE(problems({"optimizer.relative_step=true"}).find("optimizer.name"), std::string::npos)
      << "relative_step is Adafactor's";
  EXPECT_NE(problems({"optimizer.name=adafactor", "optimizer.decay_rate=0.8"}).find("optimizer.decay_rate"),
            std::string::npos);
  const Config config = parse_config(minimal, "test.json");
  EXPECT_EQ(config.optimizer.bf16_update, Bf16Update::kStochastic);
  EXPECT_FALSE(config.optimizer.scale_parameter);  // as transformers' Trainer passes for optim="adafactor"
}

// ZeRO-1's shares: whole parameters, every one owned by exactly one rank, the elements spread evenly (no rank over
// 1/N by more than the largest parameter), the same answer on every call (every rank computes it alone).
TEST(ShardedOptimizer, OwnersShareTheElementsEvenly) {
  const std::vector<int64_t> numels = {1000, 10, 500, 500, 300, 200, 7, 400, 90, 90, 650};
  int64_t total = 0, largest = 0;
  for (const auto n : numels) total += n, largest = std::max(largest, n);
  EXPECT_EQ(shard_owners(numels, 1), std::vector<int>(numels.size(), 0));
  for (int world = 2; world <= 4; ++world) {
    SCOPED_TRACE(world);
    const auto owners = shard_owners(numels, world);
    ASSERT_EQ(owners.size(), numels.size());
    EXPECT_EQ(owners, shard_owners(numels, world));
    std::vector<int64_t> load(static_cast<std::size_t>(world), 0);
    for (std::size_t i = 0; i < owners.size(); ++i) {
      ASSERT_GE(owners[i], 0);
      ASSERT_LT(owners[i], world);
      load[static_cast<std::size_t>(owners[i])] += numels[i];
    }
    for (const auto l : load) {
      EXPECT_GT(l, 0);
      EXPECT_LE(l, total / world + largest);
    }
  }
}

// Ranks that each update only their own parameters reach the unsharded optimizer's weights, for the fused AdamW
// kernel, the chunked AdamW update (bf16 moments: stochastic rounding keyed by the parameter's index, which sharding
// keeps) and Adafactor (per-parameter statistics and update RMS); their state together is the unsharded state, in
// disjoint halves; and a 3-way shard resumed from the unsharded state continues exactly (resume on another world
// size, as the trainer's checkpoint parts do).
TEST(ShardedOptimizer, ShardsTogetherUpdateAsTheUnshardedOptimizerAndResumeFromIt) {
  const auto start = start_tensors(at::kFloat);
  struct Variant {
    const char* name;
    OptimizerConfig config;
    bool fused;
  };
  const std::vector<Variant> variants = {{"AdamW fused", adamw(Bf16Update::kStochastic), true},
                                         {"AdamW chunked", adamw(Bf16Update::kStochastic), false},
                                         {"AdamW bf16 moments", adamw(Bf16Update::kStochastic, StateDtype::kBf16), false},
                                         {"Adafactor", adafactor(Bf16Update::kStochastic), false}};
  auto make = [](Bag& bag, const Variant& v, OptimizerShard shard) -> std::unique_ptr<Optimizer> {
    if (v.config.name == OptimizerName::kAdamW) return std::make_unique<AdamW>(bag, v.config, 5, v.fused, shard);
    return std::make_unique<Adafactor>(bag, v.config, 5, shard);
  };
  for (const auto& v : variants) {
    SCOPED_TRACE(v.name);
    Bag whole(start), sharded(start);
    auto unsharded = make(whole, v, {});
    auto rank0 = make(sharded, v, {0, 2});
    auto rank1 = make(sharded, v, {1, 2});
    if (v.config.name == OptimizerName::kAdamW) {
      EXPECT_EQ(dynamic_cast<AdamW&>(*rank0).fused(), v.fused);
      EXPECT_EQ(dynamic_cast<AdamW&>(*unsharded).fused(), v.fused);
    }
    EXPECT_GT(rank0->state_bytes(), 0);
    EXPECT_GT(rank1->state_bytes(), 0);
    EXPECT_EQ(rank0->state_bytes() + rank1->state_bytes(), unsharded->state_bytes());
    std::map<std::string, int> names;
    for (const auto& [name, t] : rank0->state_tensors()) ++names[name];
    for (const auto& [name, t] : rank1->state_tensors()) ++names[name];
    const auto all = unsharded->state_tensors();
    EXPECT_EQ(names.size(), all.size());
    for (const auto& [name, t] : all) EXPECT_EQ(names[name], 1) << name;
    for (int64_t s = 0; s < 3; ++s) {
      set_grads(whole, s);
      unsharded->step(1e-2);
      set_grads(sharded, s);
      rank0->step(1e-2);
      rank1->step(1e-2);
    }
    EXPECT_LE(difference(whole, sharded), 1e-7);
    EXPECT_GT(distance(whole, start), 1e-3);
    // Three ranks resume the unsharded state (each takes its own tensors from the whole set) and go on alike.
    Bag resumed(start);
    for (std::size_t i = 0; i < start.size(); ++i) {
      at::NoGradGuard no_grad;
      resumed.tensors()[i].copy_(whole.tensors()[i]);
    }
    std::vector<std::unique_ptr<Optimizer>> three;
    for (int r = 0; r < 3; ++r) {
      three.push_back(make(resumed, v, {r, 3}));
      three.back()->load_state(all, unsharded->steps(), "test");
    }
    for (int64_t s = 3; s < 5; ++s) {
      set_grads(whole, s);
      unsharded->step(1e-2);
      set_grads(resumed, s);
      for (auto& o : three) o->step(1e-2);
    }
    EXPECT_LE(difference(whole, resumed), 1e-7);
  }
}

}  // namespace
}  // namespace trainer
