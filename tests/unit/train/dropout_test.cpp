// Dropout is a function of the example, not of the split: keyed masks (models/dropout.h) give the same weights for
// any micro-batch split, an out-of-memory shrink mid-run, activation checkpointing and a resume, dropout on, for
// T5 as FLAN-T5 ships it (dropout_rate 0.1) and for a Qwen2-shaped model with attention dropout and LoRA dropout.
// The masks themselves are tested for their statistics.
#include <cmath>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/dropout.h"
#include "models/lora.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/activation_checkpointing.h"
#include "train/optim/optimizer.h"
#include "train/tasks/text/text_step.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

// ---- the masks ------------------------------------------------------------------------------------------------

// Keep mask (as 0/1 doubles) that `dropout` draws for x = ones(sizes) under a context.
at::Tensor kept(const Dropout& dropout, at::IntArrayRef sizes, uint64_t seed, int64_t step, int64_t first,
                bool attention = false) {
  const DropoutScope scope(seed, step, first, sizes[0], at::kCPU);
  const at::Tensor x = at::ones(sizes);
  const at::Tensor y = attention ? dropout.attention(x, true) : dropout.forward(x, true);
  return (y != 0).to(at::kDouble);
}

double correlation(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.flatten() - a.mean(), y = b.flatten() - b.mean();
  return (x * y).sum().item<double>() / std::sqrt((x * x).sum().item<double>() * (y * y).sum().item<double>());
}

std::shared_ptr<Dropout> site(double p, const std::string& path) {
  auto d = std::make_shared<Dropout>(p);
  d->set_site(dropout_site_id(path));
  return d;
}

TEST(KeyedDropout, MasksKeepOneMinusPIndependentlyOfExamplesLayersStepsAndPositions) {
  const double p = 0.1;
  const auto layer0 = site(p, "decoder.block.0.layer.0.dropout"), layer1 = site(p, "decoder.block.1.layer.0.dropout");
  const int64_t b = 16, t = 64, d = 64;
  const at::Tensor m = kept(*layer0, {b, t, d}, 42, 7, 0);
  const double n = static_cast<double>(m.numel());
  // Keep rate: within 4 standard errors of 1 - p.
  EXPECT_NEAR(m.mean().item<double>(), 1 - p, 4 * std::sqrt(p * (1 - p) / n));
  // Scaling: kept elements are 1 / (1 - p).
  {
    const DropoutScope scope(42, 7, 0, b, at::kCPU);
    const at::Tensor y = layer0->forward(at::ones({b, t, d}), true);
    EXPECT_NEAR(y.masked_select(y != 0).mean().item<double>(), 1 / (1 - p), 1e-6);
  }
  // No correlation (within 4.5 standard errors of 0, 1/sqrt(elements)) between: every pair of examples; two layers;
  // two steps; two seeds; neighbouring positions and features.
  const double row_bound = 4.5 / std::sqrt(static_cast<double>(t * d)), all_bound = 4.5 / std::sqrt(n);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = i + 1; j < b; ++j)
      EXPECT_LT(std::abs(correlation(m[i], m[j])), row_bound) << "examples " << i << " and " << j;
  EXPECT_LT(std::abs(correlation(m, kept(*layer1, {b, t, d}, 42, 7, 0))), all_bound) << "layers";
  EXPECT_LT(std::abs(correlation(m, kept(*layer0, {b, t, d}, 42, 8, 0))), all_bound) << "steps";
  EXPECT_LT(std::abs(correlation(m, kept(*layer0, {b, t, d}, 43, 7, 0))), all_bound) << "seeds";
  EXPECT_LT(std::abs(correlation(m.narrow(1, 0, t - 1), m.narrow(1, 1, t - 1))), all_bound) << "positions";
  EXPECT_LT(std::abs(correlation(m.narrow(2, 0, d - 1), m.narrow(2, 1, d - 1))), all_bound) << "features";
  // A layer's masks in two steps are not shifted copies of each other (counter reuse across steps would show).
  const at::Tensor next = kept(*layer0, {b, t, d}, 42, 8, 0);
  EXPECT_LT(std::abs(correlation(m.narrow(0, 1, b - 1), next.narrow(0, 0, b - 1))), all_bound);

  // Attention probabilities (B, H, Tq, Tk): the same keep rate; heads and examples uncorrelated.
  const at::Tensor a = kept(*layer0, {4, 4, 48, 48}, 42, 7, 0, /*attention=*/true);
  EXPECT_NEAR(a.mean().item<double>(), 1 - p, 4 * std::sqrt(p * (1 - p) / static_cast<double>(a.numel())));
  EXPECT_LT(std::abs(correlation(a.select(1, 0), a.select(1, 1))), 4.5 / std::sqrt(4.0 * 48 * 48)) << "heads";
  EXPECT_LT(std::abs(correlation(a[0], a[1])), 4.5 / std::sqrt(4.0 * 48 * 48)) << "examples";
}

TEST(KeyedDropout, AMaskDependsOnTheExampleNotOnItsMicroBatchPaddingOrTheGenerator) {
  const auto layer = site(0.3, "encoder.block.0.layer.1.dropout");
  at::manual_seed(1);
  const at::Tensor whole = kept(*layer, {8, 20, 16}, 5, 3, 0);
  at::manual_seed(2);  // LibTorch's generator plays no part
  const at::Tensor part = kept(*layer, {2, 33, 16}, 5, 3, 4);  // examples 4 and 5, padded to 33 positions
  EXPECT_TRUE(at::equal(whole.narrow(0, 4, 2), part.narrow(1, 0, 20)));
  const at::Tensor attention = kept(*layer, {8, 4, 20, 20}, 5, 3, 0, true);
  const at::Tensor attention_part = kept(*layer, {2, 4, 27, 31}, 5, 3, 4, true);
  EXPECT_TRUE(at::equal(attention.narrow(0, 4, 2), attention_part.narrow(2, 0, 20).narrow(3, 0, 20)));
  // Evaluation draws nothing; a site without an id is a programming error, not a silent default.
  const at::Tensor x = at::randn({2, 3, 4});
  EXPECT_TRUE(at::equal(layer->forward(x, false), x));
  EXPECT_THROW(Dropout(0.1).forward(x, true), std::logic_error);
}

TEST(KeyedDropout, EverySiteOfTheModelsHasItsOwnId) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    auto model = load_model(test::source_path(std::string("configs/models/") + name), ModelInit::kRandom,
                            at::TensorOptions().dtype(at::kFloat), 1);
    std::map<uint64_t, std::string> ids;
    int64_t sites = 0;
    model->for_each_module([&](const std::string& path, Module& m) {
      if (auto* d = dynamic_cast<Dropout*>(&m)) {
        ++sites;
        ASSERT_TRUE(d->site().has_value()) << path;
        EXPECT_TRUE(ids.emplace(*d->site(), path).second) << path << " shares its id with " << ids[*d->site()];
      }
    });
    // T5: 2 per stack (embeddings, output) and per block 2 per attention layer (probabilities, residual) and 2 for
    // the feed-forward (hidden, residual); tiny-t5 has 2 encoder and 2 decoder blocks. Qwen2: one per layer.
    EXPECT_EQ(sites, std::string(name) == "tiny-t5" ? 2 * 2 + 2 * 4 + 2 * 6 : 2) << name;
  }
}

// ---- training with dropout ------------------------------------------------------------------------------------

enum class Kind { kT5, kQwen2Lora };

// tiny-t5 as shipped (dropout_rate 0.1, full fine-tuning), or tiny-qwen2 with attention_dropout 0.1 and LoRA
// (dropout 0.1) on q, v and down projections.
std::unique_ptr<LanguageModel> build(Kind kind, double dropout = 0.1) {
  const std::string dir = test::source_path(kind == Kind::kT5 ? "configs/models/tiny-t5" : "configs/models/tiny-qwen2");
  nlohmann::json config = read_json_file(dir + "/config.json");
  config[kind == Kind::kT5 ? "dropout_rate" : "attention_dropout"] = dropout;
  auto model = build_model(config, at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(7);
  model->init_weights();
  model->train(true);
  return model;
}

EffectiveBatch make_batch(Kind kind, int64_t count, uint64_t seed, int64_t min_length, int64_t length_range) {
  at::manual_seed(seed);
  EffectiveBatch batch;
  const int64_t vocab = kind == Kind::kT5 ? 256 : 500;
  for (int64_t i = 0; i < count; ++i) {
    auto random_ids = [&](int64_t length) {
      const at::Tensor ids = at::randint(3, vocab, {length}, at::kInt);
      return std::vector<int32_t>(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + length);
    };
    const int64_t length = min_length + at::randint(0, length_range, {1}).item<int64_t>();
    Example e;
    e.input_ids = random_ids(length);
    if (kind == Kind::kT5) {
      e.labels = random_ids(std::max<int64_t>(2, length / 2));
    } else {
      e.labels = e.input_ids;
      for (int64_t j = 0; j < length / 4; ++j) e.labels[static_cast<std::size_t>(j)] = -100;  // a prompt
    }
    batch.target_tokens += target_tokens(e, kind == Kind::kT5 ? DataFamily::kSeq2Seq : DataFamily::kCausal);
    batch.examples.push_back(std::move(e));
  }
  return batch;
}

struct Trainee {
  Kind kind;
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<LoraAdapters> lora;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<TrainStep> step;
  // With 1e-3, AdamW's first update of an element whose gradient is near eps (1e-8) turns float noise of the
  // split's sums into differences of 6e-5 (with dropout or without); 1e-4 keeps that at 6e-6, while a different
  // mask moves weights by 2e-4 per step.
  double lr = 1e-4;

  Trainee(Kind k, int64_t micro, uint64_t seed = 42) : kind(k) {
    model = build(kind);
    if (kind == Kind::kQwen2Lora) {
      LoraConfig config;
      config.r = 4;
      config.dropout = 0.1;
      config.target_modules = {"q_proj", "v_proj", "down_proj"};
      lora = apply_lora(*model, config, 0);
    } else {
      model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    }
    OptimizerConfig adam;
    adam.lr = 1e-3;
    optimizer = std::make_unique<AdamW>(trained(), adam);
    TrainingConfig training;
    training.batch_size = 8;
    training.micro_batch_size = MicroBatchSize::fixed(micro);
    policy = std::make_unique<MemoryPolicy>(MemoryConfig{}, training);
    StepOptions options;
    options.seed = seed;
    step = std::make_unique<TrainStep>(*model, *optimizer, *policy, options);
  }

  Module& trained() { return lora ? static_cast<Module&>(*lora) : *model; }

  std::map<std::string, at::Tensor> weights() {
    std::map<std::string, at::Tensor> out;
    trained().for_each_parameter([&](const std::string& name, at::Tensor& p) { out[name] = p.detach().clone(); });
    return out;
  }

  void run(const std::vector<EffectiveBatch>& batches, std::size_t from, std::size_t to) {
    for (std::size_t s = from; s < to; ++s) step->run(batches[s], static_cast<int64_t>(s) + 1, lr);
  }

  int64_t peak_above(int64_t base, const EffectiveBatch& batch, int64_t n) {
    reset_cpu_peak();
    const DropoutScope dropout(42, 1, 0, n, at::kCPU);
    step->forward_backward(std::span<const Example>(batch.examples).subspan(0, static_cast<std::size_t>(n)), 1.0);
    optimizer->zero_grad();
    return cpu_memory_stats().peak - base;
  }
};

std::vector<EffectiveBatch> batches(Kind kind, int64_t n, uint64_t seed) {
  std::vector<EffectiveBatch> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(make_batch(kind, 8, seed + static_cast<uint64_t>(i), 24, 16));
  return out;
}

double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) worst = std::max(worst, (t - b.at(name)).abs().max().item<double>());
  return worst;
}

void expect_close(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a)
    EXPECT_TRUE(at::allclose(t, b.at(name), tol, tol))
        << name << ": max difference " << (t - b.at(name)).abs().max().item<double>();
}

struct SourceScope {  // restores keyed dropout after a test that uses the generator
  ~SourceScope() { set_dropout_source(DropoutSource::kKeyed); }
};

class DropoutTraining : public ::testing::TestWithParam<Kind> {};

std::string kind_name(const ::testing::TestParamInfo<Kind>& info) {
  return info.param == Kind::kT5 ? "T5" : "Qwen2AttentionAndLoraDropout";
}

// 8 x 1, 4 x 2 and 1 x 8 over three steps: the same weights. With LibTorch's generator (before keyed masks) the
// same comparison differs, so the test exercises dropout.
TEST_P(DropoutTraining, AnySplitGivesTheSameWeights) {
  const auto data = batches(GetParam(), 3, 100);
  Trainee whole(GetParam(), 8), halves(GetParam(), 4), singles(GetParam(), 1);
  whole.run(data, 0, 3);
  halves.run(data, 0, 3);
  singles.run(data, 0, 3);
  const auto expected = whole.weights();
  // 2e-5: the float noise of the split's sums (about 6e-6 to 1.1e-5 after AdamW's first update, see Trainee::lr;
  // 1.06e-5 on T5 with the fused RMSNorm, whose sums round differently from ATen's) stays below it, while a
  // different mask moves weights by 2e-4 per step (the checks below).
  expect_close(expected, halves.weights(), 2e-5);
  expect_close(expected, singles.weights(), 2e-5);
  Trainee other_seed(GetParam(), 8, 43);
  other_seed.run(data, 0, 3);
  EXPECT_GT(max_difference(expected, other_seed.weights()), 1e-4) << "training.seed must change the masks";

  SourceScope restore;
  set_dropout_source(DropoutSource::kGlobalGenerator);
  Trainee old_whole(GetParam(), 8), old_halves(GetParam(), 4);
  at::manual_seed(5);
  old_whole.run(data, 0, 3);
  at::manual_seed(5);
  old_halves.run(data, 0, 3);
  EXPECT_GT(max_difference(old_whole.weights(), old_halves.weights()), 1e-4)
      << "with the generator's masks a split changes the weights: the comparison above must be sensitive to it";
}

// Five steps; after two, a budget arrives that fits micro-batches of two examples but not four (8 -> 4 -> 2 in step
// 3), with activation checkpointing on in the constrained run: the weights of five unconstrained steps.
TEST_P(DropoutTraining, OutOfMemoryMidRunWithCheckpointingReachesTheSameWeights) {
  install_cpu_budget();
  const auto data = batches(GetParam(), 5, 200);
  Trainee free_run(GetParam(), 8);
  free_run.run(data, 0, 5);

  Trainee constrained(GetParam(), 8);
  apply_activation_checkpointing(*constrained.model);
  constrained.run(data, 0, 2);
  ASSERT_TRUE(constrained.policy->adaptations().empty());
  const int64_t base = cpu_memory_stats().allocated;
  int64_t two = 0;
  for (std::size_t s = 2; s < data.size(); ++s) two = std::max(two, constrained.peak_above(base, data[s], 2));
  const int64_t four = constrained.peak_above(base, data[2], 4);
  ASSERT_LT(two, four);
  set_cpu_budget_limit(base + (two + four) / 2);
  constrained.run(data, 2, 5);
  set_cpu_budget_limit(0);

  const auto& a = constrained.policy->adaptations();
  ASSERT_EQ(a.size(), 2u) << "the budget must force 8 -> 4 -> 2 at step 3 and nothing after";
  EXPECT_EQ(a[0].step, 3);
  EXPECT_EQ(a[1].new_micro_batch, 2);
  expect_close(free_run.weights(), constrained.weights(), 1e-5);
}

// Loads `from`'s weights and AdamW state into `to` (a fresh model and optimizer), as a resume does, and scrambles
// LibTorch's generator as a new process would find it: no generator state travels.
void resume(Trainee& from, Trainee& to) {
  {
    at::NoGradGuard no_grad;
    const auto saved = from.weights();
    to.trained().for_each_parameter([&](const std::string& name, at::Tensor& p) { p.copy_(saved.at(name)); });
  }
  to.optimizer->load_state(from.optimizer->state_tensors(), from.optimizer->steps(), "in memory");
  at::manual_seed(987654);
}

// Steps 1-2, resume, steps 3-4: bit for bit the weights of four straight steps; and within float tolerance when
// the resumed run uses another micro-batch.
TEST_P(DropoutTraining, ResumeIsExactWithoutGeneratorState) {
  const auto data = batches(GetParam(), 4, 300);
  Trainee straight(GetParam(), 8);
  straight.run(data, 0, 4);

  Trainee first(GetParam(), 8), second(GetParam(), 8);
  first.run(data, 0, 2);
  resume(first, second);
  second.run(data, 2, 4);
  EXPECT_EQ(max_difference(straight.weights(), second.weights()), 0.0);

  Trainee third(GetParam(), 2);
  resume(first, third);
  third.run(data, 2, 4);
  expect_close(straight.weights(), third.weights(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, DropoutTraining, ::testing::Values(Kind::kT5, Kind::kQwen2Lora), kind_name);

// The explicit attention path that keyed attention dropout takes in training computes what
// scaled_dot_product_attention computes (a dropout so small that it keeps everything).
TEST(KeyedDropout, ExplicitAttentionEqualsScaledDotProductAttention) {
  for (const Kind kind : {Kind::kT5, Kind::kQwen2Lora}) {
    auto model = build(kind, 1e-12);
    const auto batch = make_batch(kind, 3, 9, 10, 8);
    const CollatedBatch c = collate(batch.examples, 0, at::kCPU);
    const Batch b{c.input_ids, c.attention_mask, c.labels, {}};
    at::NoGradGuard no_grad;
    const double explicit_path = forward_loss(*model, b).loss_sum.item<double>();
    model->train(false);
    const double sdpa = forward_loss(*model, b).loss_sum.item<double>();
    EXPECT_NEAR(explicit_path, sdpa, 1e-4 * std::abs(sdpa)) << (kind == Kind::kT5 ? "t5" : "qwen2");
  }
}

}  // namespace
}  // namespace trainer
