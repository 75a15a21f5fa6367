// The memory-adaptive step against real out-of-memory errors from the CPU budget allocator (no faked exceptions).
#include <map>
#include <set>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/lora.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/activation_checkpointing.h"
#include "train/optim/optimizer.h"
#include "train/tasks/text/text_step.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

struct BudgetScope {
  BudgetScope() { install_cpu_budget(); }
  ~BudgetScope() { set_cpu_budget_limit(0); }
};

// Causal examples of different lengths (variable-length data is where wrong normalisation shows).
EffectiveBatch make_batch(int64_t count, uint64_t seed, int64_t min_length = 40, int64_t length_range = 80) {
  at::manual_seed(seed);
  EffectiveBatch batch;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t length = min_length + at::randint(0, length_range, {1}).item<int64_t>();
    Example e;
    const at::Tensor ids = at::randint(3, 500, {length}, at::kInt);
    e.input_ids.assign(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + length);
    e.labels = e.input_ids;
    for (int64_t j = 0; j < length / 4; ++j) e.labels[static_cast<std::size_t>(j)] = -100;  // a prompt
    batch.target_tokens += target_tokens(e, DataFamily::kCausal);
    batch.examples.push_back(std::move(e));
  }
  return batch;
}

struct Trainee {  // a model (with LoRA adapters on its frozen base, or not) with its optimizer, policy and step
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<LoraAdapters> lora;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<TrainStep> step;

  explicit Trainee(int64_t micro, MemoryConfig memory = {}, bool with_lora = false,
                   StateDtype state_dtype = StateDtype::kFp32, int64_t micro_batch_tokens = 0) {
    model = load_model(test::source_path("configs/models/tiny-qwen2"), ModelInit::kRandom,
                       at::TensorOptions().dtype(at::kFloat), 7);
    model->train(true);
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    if (with_lora) {
      LoraConfig config;
      config.r = 4;
      config.dropout = 0.0;
      config.target_modules = {"q_proj", "v_proj", "down_proj"};
      lora = apply_lora(*model, config, 0);
    }
    OptimizerConfig adam;
    adam.lr = 1e-3;
    adam.weight_decay = 0.01;
    adam.state_dtype = state_dtype;
    optimizer = std::make_unique<AdamW>(trained(), adam);
    TrainingConfig training;
    training.batch_size = 8;
    training.micro_batch_size = MicroBatchSize::fixed(micro);
    training.micro_batch_tokens = micro_batch_tokens;
    policy = std::make_unique<MemoryPolicy>(memory, training);
    StepOptions options;
    options.pad_id = 0;
    options.max_grad_norm = 1.0;
    step = std::make_unique<TrainStep>(*model, *optimizer, *policy, options);
  }

  std::map<std::string, at::Tensor> grads_of(const EffectiveBatch& batch) {
    optimizer->zero_grad();
    const std::span<const Example> examples(batch.examples);
    for (const auto& [begin, count] : split_counts(static_cast<int64_t>(examples.size()), policy->micro_batch()))
      step->forward_backward(examples.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)),
                             static_cast<double>(batch.target_tokens));
    std::map<std::string, at::Tensor> grads;
    trained().for_each_parameter([&](const std::string& name, at::Tensor& p) { grads[name] = p.grad().clone(); });
    return grads;
  }

  Module& trained() { return lora ? static_cast<Module&>(*lora) : *model; }

  // The CPU budget's peak above `base` for forward and backward of the first n examples of `batch`.
  int64_t peak_above(int64_t base, const EffectiveBatch& batch, int64_t n) {
    reset_cpu_peak();
    step->forward_backward(std::span<const Example>(batch.examples).subspan(0, static_cast<std::size_t>(n)), 1.0);
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

// Runs batches[first..] as steps first+1.. under a budget that every one of them fits with micro-batches of two
// examples, and that batches[first] does not fit with four (measured above what the model and optimizer hold).
StepResult run_rest_fitting_two_not_four(Trainee& t, const std::vector<EffectiveBatch>& batches, std::size_t first) {
  const int64_t base = cpu_memory_stats().allocated;
  int64_t two = 0;
  for (std::size_t b = first; b < batches.size(); ++b) two = std::max(two, t.peak_above(base, batches[b], 2));
  const int64_t four = t.peak_above(base, batches[first], 4);
  EXPECT_LT(two, four);
  set_cpu_budget_limit(base + (two + four) / 2);
  StepResult last;
  for (std::size_t b = first; b < batches.size(); ++b) last = t.step->run(batches[b], static_cast<int64_t>(b) + 1, 1e-3);
  set_cpu_budget_limit(0);
  return last;
}

}  // namespace

TEST(TrainStep, AnySplitGivesTheSameGradient) {
  // The loss is normalised by the target tokens of the whole effective batch, so 8 x 1, 4 x 2 and 1 x 8 agree.
  const auto batch = make_batch(8, 1);
  const auto whole = Trainee(8).grads_of(batch);
  expect_close(whole, Trainee(4).grads_of(batch), 1e-5);
  expect_close(whole, Trainee(1).grads_of(batch), 1e-5);
}

// Six steps; after two, a budget arrives that forces the micro-batch from 8 to 2 (8 -> 4 -> 2 in one step). The run
// reaches the weights of six unconstrained steps.
void out_of_memory_mid_run_reaches_the_same_weights(bool lora, bool checkpointing = false) {
  BudgetScope budget;
  std::vector<EffectiveBatch> batches;
  for (uint64_t i = 0; i < 6; ++i) batches.push_back(make_batch(8, 10 + i, 60, 20));

  Trainee free_run(8, {}, lora);
  for (int64_t s = 0; s < 6; ++s) free_run.step->run(batches[static_cast<std::size_t>(s)], s + 1, 1e-3);

  Trainee constrained(8, {}, lora);
  if (checkpointing) apply_activation_checkpointing(*constrained.model);
  for (int64_t s = 0; s < 2; ++s) constrained.step->run(batches[static_cast<std::size_t>(s)], s + 1, 1e-3);
  ASSERT_TRUE(constrained.policy->adaptations().empty());
  const StepResult last = run_rest_fitting_two_not_four(constrained, batches, 2);

  const auto& a = constrained.policy->adaptations();
  ASSERT_EQ(a.size(), 2u) << "the budget must force 8 -> 4 -> 2 at step 3 and nothing after";
  EXPECT_EQ(a[0].step, 3);
  EXPECT_EQ(a[0].old_micro_batch, 8);
  EXPECT_EQ(a[0].new_micro_batch, 4);
  EXPECT_EQ(a[1].step, 3);
  EXPECT_EQ(a[1].new_micro_batch, 2);
  EXPECT_EQ(last.micro_batch, 2);
  EXPECT_EQ(last.micro_steps, 4);
  expect_close(weights_of(*free_run.model), weights_of(*constrained.model), 1e-5);
  if (lora) expect_close(weights_of(*free_run.lora), weights_of(*constrained.lora), 1e-5);
}

TEST(TrainStep, OutOfMemoryMidRunReachesTheSameWeights) { out_of_memory_mid_run_reaches_the_same_weights(false); }

TEST(LoraTrainStep, OutOfMemoryMidRunReachesTheSameAdapterWeights) { out_of_memory_mid_run_reaches_the_same_weights(true); }

// LoRA, activation checkpointing (recomputed blocks) and the memory policy together.
TEST(LoraTrainStep, OutOfMemoryWithActivationCheckpointingReachesTheSameAdapterWeights) {
  out_of_memory_mid_run_reaches_the_same_weights(true, true);
}

// Token-budget mode: micro-batches of at most N padded tokens. After two steps a budget arrives that fits two of
// these examples but not four: 640 -> 320 -> 160 tokens in one step, and the weights equal an unconstrained run's.
TEST(TrainStep, TokenBudgetShrinksTheTokensAndReachesTheSameWeights) {
  BudgetScope budget;
  std::vector<EffectiveBatch> batches;
  for (uint64_t i = 0; i < 5; ++i) batches.push_back(make_batch(8, 30 + i, 60, 20));  // 60 to 79 tokens
  Trainee free_run(8);
  for (int64_t s = 0; s < 5; ++s) free_run.step->run(batches[static_cast<std::size_t>(s)], s + 1, 1e-3);

  Trainee by_tokens(8, {}, false, StateDtype::kFp32, 640);
  for (int64_t s = 0; s < 2; ++s)
    EXPECT_EQ(by_tokens.step->run(batches[static_cast<std::size_t>(s)], s + 1, 1e-3).micro_steps, 1);
  const StepResult last = run_rest_fitting_two_not_four(by_tokens, batches, 2);

  const auto& a = by_tokens.policy->adaptations();
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].old_micro_batch, 640);
  EXPECT_EQ(a[0].new_micro_batch, 320);
  EXPECT_EQ(a[1].new_micro_batch, 160);
  EXPECT_EQ(last.micro_batch, 2);  // examples in the largest micro-batch
  EXPECT_EQ(last.micro_steps, 4);
  expect_close(weights_of(*free_run.model), weights_of(*by_tokens.model), 1e-5);
  // The token budget survives a checkpoint; an examples-mode run does not take it for a count of examples.
  MemoryPolicy restored(MemoryConfig{}, [] { TrainingConfig t; t.micro_batch_tokens = 640; return t; }());
  restored.restore(by_tokens.policy->state());
  EXPECT_EQ(restored.micro_batch(), 160);
  MemoryPolicy by_examples(MemoryConfig{}, TrainingConfig{});
  by_examples.restore(by_tokens.policy->state());
  EXPECT_EQ(by_examples.micro_batch(), TrainingConfig{}.batch_size);
}

TEST(MemoryPolicy, TokenSplitKeepsEachMicroBatchWithinItsPaddedTokens) {
  auto examples = [](std::vector<std::pair<int, int>> lengths) {
    std::vector<Example> out;
    for (const auto& [input, labels] : lengths) {
      Example e;
      e.input_ids.assign(static_cast<std::size_t>(input), 5);
      e.labels.assign(static_cast<std::size_t>(labels), 5);
      out.push_back(e);
    }
    return out;
  };
  using Parts = std::vector<std::pair<int64_t, int64_t>>;
  const auto causal = examples({{10, 10}, {20, 20}, {5, 5}, {40, 40}, {40, 40}});
  EXPECT_EQ(split_tokens(causal, 40, false), (Parts{{0, 2}, {2, 1}, {3, 1}, {4, 1}}));
  EXPECT_EQ(split_tokens(causal, 80, false), (Parts{{0, 3}, {3, 2}}));
  EXPECT_EQ(split_tokens(causal, 1, false), (Parts{{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}}));  // at least one
  // seq2seq examples are padded in both sequences, each to its own longest: 10+30 and 30+10 pad to 2 x (30+30).
  const auto seq2seq = examples({{10, 30}, {30, 10}, {10, 10}});
  EXPECT_EQ(split_tokens(seq2seq, 80, true), (Parts{{0, 1}, {1, 2}}));
  EXPECT_EQ(split_tokens(seq2seq, 120, true), (Parts{{0, 2}, {2, 1}}));
  EXPECT_EQ(split_tokens(seq2seq, 180, true), (Parts{{0, 3}}));
}

TEST(TrainStep, RegrowsAfterStableStepsButNotToASizeThatFailed) {
  BudgetScope budget;
  // One batch of long examples, then short ones: the long batch forces 8 -> 4; after two stable steps the policy
  // grows to 7 (8 has failed), which the short batches fit. The weights still equal an unconstrained run's.
  std::vector<EffectiveBatch> batches{make_batch(8, 20, 110, 10)};
  for (uint64_t i = 0; i < 4; ++i) batches.push_back(make_batch(8, 21 + i, 12, 8));
  MemoryConfig memory;
  memory.regrow_after_steps = 2;

  Trainee free_run(8);
  for (std::size_t s = 0; s < batches.size(); ++s) free_run.step->run(batches[s], static_cast<int64_t>(s) + 1, 1e-3);

  Trainee constrained(8, memory);
  const int64_t base = cpu_memory_stats().allocated;
  auto extra = [&](const EffectiveBatch& batch, int64_t n) { return constrained.peak_above(base, batch, n); };
  const int64_t long_four = extra(batches[0], 4), long_eight = extra(batches[0], 8);
  const int64_t short_eight = extra(batches[1], 8);
  ASSERT_LT(short_eight, long_four) << "the short batches must fit whole where half a long batch does";
  set_cpu_budget_limit(base + (long_four + long_eight) / 2);
  std::vector<int64_t> micro;
  for (std::size_t s = 0; s < batches.size(); ++s)
    micro.push_back(constrained.step->run(batches[s], static_cast<int64_t>(s) + 1, 1e-3).micro_batch);
  set_cpu_budget_limit(0);

  const auto& a = constrained.policy->adaptations();
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].old_micro_batch, 8);
  EXPECT_EQ(a[0].new_micro_batch, 4);
  EXPECT_EQ(a[1].new_micro_batch, 7);
  EXPECT_NE(a[1].reason.find("regrow"), std::string::npos) << a[1].reason;
  EXPECT_EQ(micro, (std::vector<int64_t>{4, 4, 7, 7, 7}));
  expect_close(weights_of(*free_run.model), weights_of(*constrained.model), 1e-5);

  // The learned size, and the cap below the failed one, survive a checkpoint.
  MemoryPolicy restored(memory, TrainingConfig{});
  restored.restore(constrained.policy->state());
  EXPECT_EQ(restored.micro_batch(), 7);
  restored.step_succeeded(6, 8);
  restored.step_succeeded(7, 8);
  EXPECT_EQ(restored.micro_batch(), 7) << "8 ran out of memory: regrowth stays below it";
}

TEST(TrainStep, AtTheFloorItEscalatesThenStopsWithoutTouchingTheWeights) {
  BudgetScope budget;
  MemoryConfig memory;
  memory.max_retries = 20;
  Trainee run(8, memory);
  const auto before = weights_of(*run.model);
  const auto batch = make_batch(8, 3);
  set_cpu_budget_limit(cpu_memory_stats().allocated + (64 << 10));  // 64 KiB: nothing fits
  EXPECT_THROW(run.step->run(batch, 1, 1e-3), OutOfMemoryAtFloor);
  set_cpu_budget_limit(0);
  EXPECT_EQ(run.policy->micro_batch(), 1);
  EXPECT_EQ(run.policy->escalations(),
            (std::vector<std::string>{"activation_checkpointing", "smaller_loss_chunks"}));
  EXPECT_TRUE(run.model->has_block_runner()) << "activation checkpointing was turned on";
  EXPECT_TRUE(run.step->chunked_loss());
  EXPECT_EQ(run.step->loss_chunk_size(), kMinLossChunkSize) << "halved down to its minimum before stopping";
  expect_close(before, weights_of(*run.model), 0.0);
  EXPECT_EQ(run.optimizer->steps(), 0);
}

namespace {

// tiny-qwen2 with a 16k-token vocabulary (the loss's logits dominate the memory), checkpointing and chunked loss
// on from the start, at micro-batch 1 (the floor): the only escalation left is smaller_loss_chunks.
struct LargeVocabularyTrainee {
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<TrainStep> step;

  explicit LargeVocabularyTrainee(int64_t loss_chunk_size) {
    auto hf = read_json_file(test::source_path("configs/models/tiny-qwen2/config.json"));
    hf["vocab_size"] = 16384;
    model = build_model(hf, at::TensorOptions().dtype(at::kFloat));
    at::manual_seed(7);
    model->init_weights();
    model->train(true);
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    apply_activation_checkpointing(*model);
    optimizer = std::make_unique<AdamW>(*model, OptimizerConfig{});
    TrainingConfig training;
    training.batch_size = 2;
    training.micro_batch_size = MicroBatchSize::fixed(1);
    training.loss_chunk_size = loss_chunk_size;
    MemoryConfig memory;
    memory.max_retries = 4;
    policy = std::make_unique<MemoryPolicy>(memory, training);
    StepOptions options;
    options.chunked_loss = true;
    step = std::make_unique<TrainStep>(*model, *optimizer, *policy, options);
  }

  int64_t peak_above(int64_t base, const EffectiveBatch& batch) {
    reset_cpu_peak();
    step->forward_backward(std::span<const Example>(batch.examples).subspan(0, 1), 1.0);
    optimizer->zero_grad();
    return cpu_memory_stats().peak - base;
  }
};

}  // namespace

TEST(TrainStep, AtTheFloorSmallerLossChunksFitAndChangeNoResult) {
  BudgetScope budget;
  // 300 to 380 trained tokens an example: chunks of 256 or 128 tokens.
  const std::vector<EffectiveBatch> batches{make_batch(2, 60, 400, 100), make_batch(2, 61, 400, 100)};
  LargeVocabularyTrainee free_run(256), constrained(256), half(128);
  for (std::size_t s = 0; s < batches.size(); ++s) free_run.step->run(batches[s], static_cast<int64_t>(s) + 1, 1e-3);

  const int64_t base = cpu_memory_stats().allocated;
  int64_t fits = 0;  // chunks of 128 for every example
  for (const auto& batch : batches) fits = std::max(fits, half.peak_above(base, batch));
  const int64_t fails = constrained.peak_above(base, batches[0]);  // chunks of 256
  ASSERT_LT(fits, fails) << "halving the chunk must lower the peak";
  set_cpu_budget_limit(base + (fits + fails) / 2);
  std::vector<StepResult> results;
  for (std::size_t s = 0; s < batches.size(); ++s)
    results.push_back(constrained.step->run(batches[s], static_cast<int64_t>(s) + 1, 1e-3));
  set_cpu_budget_limit(0);

  EXPECT_EQ(constrained.policy->escalations(),
            (std::vector<std::string>{"activation_checkpointing", "smaller_loss_chunks"}));
  EXPECT_EQ(results[0].retries, 1) << "checkpointing and chunked loss were on already: no retry is spent on them";
  EXPECT_EQ(results[1].retries, 0) << "the second step ran at the learned chunk size at once";
  EXPECT_EQ(constrained.step->loss_chunk_size(), 128);
  EXPECT_EQ(constrained.policy->adaptations().back().reason, "escalate: loss_chunk_size 256 -> 128");
  expect_close(weights_of(*free_run.model), weights_of(*constrained.model), 1e-5);

  // The learned chunk size survives a checkpoint.
  TrainingConfig training;
  training.loss_chunk_size = 256;
  MemoryPolicy restored({}, training);
  restored.restore(constrained.policy->state());
  EXPECT_EQ(restored.loss_chunk_size(), 128);
}

TEST(TrainStep, TheOptimizerUpdateAllocatesNothing) {
  // So an out-of-memory error can never leave some parameters updated and others not.
  BudgetScope budget;
  for (const auto state_dtype : {StateDtype::kFp32, StateDtype::kBf16}) {
    Trainee run(8, {}, false, state_dtype);
    const auto batch = make_batch(8, 4);
    run.grads_of(batch);
    // Clipping computes the norm slice by slice: a few KiB of scalars and reduction buffers, never a gradient-sized
    // temporary (the embedding's gradient alone is larger than this headroom).
    set_cpu_budget_limit(cpu_memory_stats().allocated + 16 * 1024);
    EXPECT_NO_THROW(run.optimizer->clip_grad_norm(1e-3));
    set_cpu_budget_limit(cpu_memory_stats().allocated + 1);  // not one more byte
    EXPECT_NO_THROW(run.optimizer->step(1e-3));
    set_cpu_budget_limit(0);
    EXPECT_EQ(run.optimizer->steps(), 1);
  }
}

TEST(AdamW, Bf16MomentsHalveTheStateAndTrackFp32Moments) {
  Trainee fp32(8), bf16(8, {}, false, StateDtype::kBf16);
  EXPECT_EQ(bf16.optimizer->state_bytes() * 2, fp32.optimizer->state_bytes());
  const auto start = weights_of(*fp32.model);
  for (int64_t s = 0; s < 10; ++s) {
    const auto batch = make_batch(8, 40 + static_cast<uint64_t>(s));
    fp32.step->run(batch, s + 1, 1e-3);
    bf16.step->run(batch, s + 1, 1e-3);
  }
  // Both moved the same way: the bf16 run's total update is within 2% of the fp32 run's.
  const auto a = weights_of(*fp32.model), b = weights_of(*bf16.model);
  double update = 0, difference = 0;
  for (const auto& [name, w] : a) {
    update += (w - start.at(name)).pow(2).sum().item<double>();
    difference += (w - b.at(name)).pow(2).sum().item<double>();
  }
  EXPECT_GT(update, 0);
  EXPECT_LT(std::sqrt(difference), 0.02 * std::sqrt(update));
  // The moments are stored in bf16 and survive a checkpoint round trip exactly.
  // The moments are stored in bf16 and survive a checkpoint round trip (read back as fp32, as resume does) exactly.
  Trainee restored(8, {}, false, StateDtype::kBf16);
  std::vector<std::pair<std::string, at::Tensor>> saved;
  std::map<std::string, at::Tensor> saved_by_name;
  for (const auto& [name, t] : bf16.optimizer->state_tensors()) {
    EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
    saved.emplace_back(name, t.to(at::kFloat));
    saved_by_name[name] = t;
  }
  restored.optimizer->load_state(saved, 10, "optimizer.safetensors");
  for (const auto& [name, t] : restored.optimizer->state_tensors()) EXPECT_TRUE(at::equal(t, saved_by_name.at(name))) << name;
}

TEST(AdamW, LoadStateRefusesMissingOrMisshapenMomentsAndChangesNothing) {
  Trainee trainee(8);
  trainee.step->run(make_batch(8, 3), 1, 1e-3);
  const auto before = trainee.optimizer->state_tensors();
  auto missing = before;
  missing.erase(missing.begin() + 1);
  try {
    trainee.optimizer->load_state(missing, 5, "ckpt/optimizer.safetensors");
    FAIL() << "a missing moment was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt/optimizer.safetensors: no tensor " + before[1].first), std::string::npos)
        << e.what();
  }
  auto misshapen = before;
  misshapen.back().second = at::zeros({3});
  EXPECT_THROW(trainee.optimizer->load_state(misshapen, 5, "x"), DataError);
  const auto after = trainee.optimizer->state_tensors();
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i].second, after[i].second));
}

TEST(TrainStep, ChunkedLossAndCheckpointingGiveTheSameGradient) {
  const auto batch = make_batch(4, 5);
  Trainee plain(4), chunked(4), both(4);
  chunked.step->set_chunked_loss(true);
  both.step->set_chunked_loss(true);
  apply_activation_checkpointing(*both.model);
  const auto expected = plain.grads_of(batch);
  expect_close(expected, chunked.grads_of(batch), 1e-5);
  expect_close(expected, both.grads_of(batch), 1e-5);
}

TEST(LoraTrainStep, ChunkedLossAndCheckpointingGiveTheSameAdapterGradients) {
  const auto batch = make_batch(4, 5);
  Trainee plain(4, {}, true), wrapped(4, {}, true);
  plain.step->run(batch, 1, 1e-2);  // one update, so B is no longer zero and A's gradient is not either
  wrapped.step->run(batch, 1, 1e-2);
  wrapped.step->set_chunked_loss(true);
  apply_activation_checkpointing(*wrapped.model);
  const auto a = plain.grads_of(batch), b = wrapped.grads_of(batch);
  expect_close(a, b, 1e-5);
  for (const auto& [name, grad] : a) EXPECT_GT(grad.abs().max().item<double>(), 0.0) << name;
}

TEST(Scheduler, WarmupThenDecay) {
  SchedulerConfig s;
  s.warmup_steps = 10;
  s.name = SchedulerName::kLinear;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 0, 110), 0.1);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 9, 110), 1.0);
  EXPECT_NEAR(scheduled_lr(s, 1.0, 60, 110), 0.5, 1e-12);
  s.name = SchedulerName::kCosine;
  s.min_lr_ratio = 0.1;
  EXPECT_NEAR(scheduled_lr(s, 1.0, 60, 110), 0.55, 1e-12);
  EXPECT_NEAR(scheduled_lr(s, 1.0, 110, 110), 0.1, 1e-12);
  s.name = SchedulerName::kConstant;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 100, 110), 1.0);
}

}  // namespace trainer

namespace trainer {
namespace {

// micro_batch_size=auto's search: the largest size that fits, for every threshold and limit, asking each size at
// most once and never above the limit.
TEST(MemoryPolicy, LargestThatFitsFindsTheThresholdByDoublingThenBisection) {
  for (int64_t limit : {1, 2, 7, 16, 33}) {
    for (int64_t threshold = 0; threshold <= limit + 2; ++threshold) {
      std::vector<int64_t> asked;
      const int64_t found = largest_that_fits(limit, [&](int64_t n) {
        asked.push_back(n);
        return n <= threshold;
      });
      EXPECT_EQ(found, std::min(threshold, limit)) << "limit " << limit << " threshold " << threshold;
      for (const int64_t n : asked) EXPECT_TRUE(n >= 1 && n <= limit);
      EXPECT_EQ(std::set<int64_t>(asked.begin(), asked.end()).size(), asked.size()) << "a size asked twice";
    }
  }
}

}  // namespace
}  // namespace trainer
