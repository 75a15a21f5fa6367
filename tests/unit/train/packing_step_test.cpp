// Packing changes the layout, not the maths (ARCHITECTURE.md): training on packed rows (data.packing) reaches the
// weights of training on padded rows, with accumulation over several micro-batches of rows, with LoRA, with
// dropout on (each example keeps its keyed masks wherever its row puts it), through a resume, and through an
// out-of-memory shrink of the token budget mid-run (real errors from the CPU budget allocator). For a Qwen2-shaped
// model, a Mistral-shaped one with a sliding window shorter than the examples, and T5 (encoder and decoder packed
// with segment ids; relative position bias, self- and cross-attention within the example).
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include "data/packing.h"
#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/dropout.h"
#include "models/lora.h"
#include "models/segment_attention.h"
#include "models/weights.h"
#include "support/paths.h"
#include "train/activation_checkpointing.h"
#include "train/optim/optimizer.h"
#include "train/tasks/text/text_step.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

enum class Kind { kQwen2, kQwen2LoraDropout, kMistralWindow, kT5Dropout };

bool seq2seq(Kind kind) { return kind == Kind::kT5Dropout; }

std::unique_ptr<LanguageModel> build(Kind kind) {
  const std::string dir = test::source_path(seq2seq(kind) ? "configs/models/tiny-t5" : "configs/models/tiny-qwen2");
  nlohmann::json config = read_json_file(dir + "/config.json");
  if (kind == Kind::kT5Dropout) config["dropout_rate"] = 0.1;
  if (kind == Kind::kQwen2LoraDropout) config["attention_dropout"] = 0.1;
  if (kind == Kind::kMistralWindow) {
    config["model_type"] = "mistral";
    config["sliding_window"] = 7;  // shorter than every example: the window must count within the example
    config["layer_types"] = {"sliding_attention", "full_attention"};
  }
  auto model = build_model(config, at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(7);
  model->init_weights();
  model->train(true);
  return model;
}

// Examples of 12 to 27 tokens (T5: targets of half that), causal ones with a masked prompt.
EffectiveBatch make_batch(Kind kind, uint64_t seed) {
  at::manual_seed(seed);
  EffectiveBatch batch;
  for (int64_t i = 0; i < 8; ++i) {
    auto random_ids = [](int64_t length) {
      const at::Tensor ids = at::randint(3, 250, {length}, at::kInt);
      return std::vector<int32_t>(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + length);
    };
    const int64_t length = 12 + at::randint(0, 16, {1}).item<int64_t>();
    Example e;
    e.input_ids = random_ids(length);
    if (seq2seq(kind)) {
      e.labels = random_ids(length / 2);
    } else {
      e.labels = e.input_ids;
      for (int64_t j = 0; j < length / 4; ++j) e.labels[static_cast<std::size_t>(j)] = -100;
    }
    batch.target_tokens += target_tokens(e, seq2seq(kind) ? DataFamily::kSeq2Seq : DataFamily::kCausal);
    batch.examples.push_back(std::move(e));
  }
  return batch;
}

std::vector<EffectiveBatch> batches(Kind kind, int64_t n, uint64_t seed) {
  std::vector<EffectiveBatch> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(make_batch(kind, seed + static_cast<uint64_t>(i)));
  return out;
}

struct Options {
  int64_t micro = 8;        // examples, or rows when packing
  bool packing = false;
  int64_t tokens = 0;       // token-budget mode
  uint64_t seed = 42;
  bool chunked_loss = false;  // the fused chunked loss (training.chunked_loss, the trainer's default)
  int64_t loss_chunk_size = 1024;
};

struct Trainee {
  Kind kind;
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<LoraAdapters> lora;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<MemoryPolicy> policy;
  std::unique_ptr<TrainStep> step;
  double lr = 1e-4;  // see dropout_test.cpp: 1e-3 turns float noise near AdamW's eps into 6e-5 differences

  Trainee(Kind k, Options o) : kind(k) {
    model = build(kind);
    if (kind == Kind::kQwen2LoraDropout) {
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
    adam.weight_decay = 0.01;
    // AdamW moves an element by about lr whatever the size of its gradient once |m| >> eps: an element whose
    // gradient is float noise (sums that differ only in rounding between two layouts) then moves by +-lr at
    // random. T5's decoder has such elements (with dropout on, two padded splits of one batch already differ by
    // 2e-5 after three steps with eps 1e-8). eps 1e-6 keeps them still and changes no real gradient's update.
    adam.eps = 1e-6;
    optimizer = std::make_unique<AdamW>(trained(), adam);
    TrainingConfig training;
    training.batch_size = 8;
    training.micro_batch_size = MicroBatchSize::fixed(o.micro);
    training.micro_batch_tokens = o.tokens;
    training.loss_chunk_size = o.loss_chunk_size;
    policy = std::make_unique<MemoryPolicy>(MemoryConfig{}, training);
    StepOptions options;
    options.seed = o.seed;
    options.chunked_loss = o.chunked_loss;
    options.packing = o.packing;
    options.pack_capacity = seq2seq(kind) ? PackCapacity{64, 32} : PackCapacity{64, 0};
    step = std::make_unique<TrainStep>(*model, *optimizer, *policy, options);
  }

  Module& trained() { return lora ? static_cast<Module&>(*lora) : *model; }

  std::map<std::string, at::Tensor> weights() {
    std::map<std::string, at::Tensor> out;
    trained().for_each_parameter([&](const std::string& name, at::Tensor& p) { out[name] = p.detach().clone(); });
    return out;
  }

  StepResult run(const std::vector<EffectiveBatch>& data, std::size_t from, std::size_t to) {
    StepResult last;
    for (std::size_t s = from; s < to; ++s) last = step->run(data[s], static_cast<int64_t>(s) + 1, lr);
    return last;
  }
};

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

class PackedTraining : public ::testing::TestWithParam<Kind> {};

std::string kind_name(const ::testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::kQwen2: return "Qwen2";
    case Kind::kQwen2LoraDropout: return "Qwen2LoraAndAttentionDropout";
    case Kind::kMistralWindow: return "MistralSlidingWindow";
    case Kind::kT5Dropout: return "T5Dropout";
  }
  return "?";
}

// Three steps: padded rows of one example each in one micro-batch; packed rows in one micro-batch; packed rows one
// per micro-batch (accumulation). The same weights.
TEST_P(PackedTraining, SameWeightsAsPaddedTrainingWithAccumulation) {
  const Kind kind = GetParam();
  const auto data = batches(kind, 3, 100);
  // The rows really are packed: 8 examples of 12 to 27 tokens in rows of 64.
  const auto rows = pack_rows(data[0].examples, seq2seq(kind) ? DataFamily::kSeq2Seq : DataFamily::kCausal,
                              seq2seq(kind) ? PackCapacity{64, 32} : PackCapacity{64, 0});
  EXPECT_LE(rows.size(), 5u);
  EXPECT_GT(rows.size(), 1u);

  Trainee padded(kind, {8, false}), packed(kind, {8, true}), accumulated(kind, {1, true});
  const int64_t calls_before = per_example_attention_calls();
  padded.run(data, 0, 3);
  EXPECT_EQ(per_example_attention_calls(), calls_before) << "padded rows keep whole-row attention";
  const StepResult one = packed.run(data, 0, 3);
  // The packed rows (several examples of 12 to 27 tokens in rows of 64) take per-example attention on their own.
  EXPECT_GT(per_example_attention_calls(), calls_before) << "packed rows must attend per example";
  const StepResult many = accumulated.run(data, 0, 3);
  EXPECT_EQ(one.micro_steps, 1);
  EXPECT_GT(many.micro_steps, 1);
  const auto expected = padded.weights();
  expect_close(expected, packed.weights(), 1e-5);
  expect_close(expected, accumulated.weights(), 1e-5);
  // The comparison is sensitive: a different seed (dropout masks) or no attention isolation would move the weights
  // by far more. Packing with the masks of a padded model (no segment ids) is what a mistake would look like.
  if (kind == Kind::kQwen2LoraDropout || kind == Kind::kT5Dropout) {
    Trainee other_seed(kind, {8, true, 0, 43});
    other_seed.run(data, 0, 3);
    EXPECT_GT(max_difference(expected, other_seed.weights()), 1e-4) << "training.seed must change the masks";
  }
}

// Packed rows with the chunked loss (the default, chunks of 16 trained tokens so that chunks cross examples and
// rows) in one micro-batch and one row per micro-batch: the weights of padded training with the plain loss.
TEST_P(PackedTraining, SameWeightsWithTheChunkedLoss) {
  const Kind kind = GetParam();
  const auto data = batches(kind, 3, 100);
  Trainee padded(kind, {8, false}), packed(kind, {8, true, 0, 42, true, 16}), accumulated(kind, {1, true, 0, 42, true, 16});
  padded.run(data, 0, 3);
  packed.run(data, 0, 3);
  EXPECT_GT(accumulated.run(data, 0, 3).micro_steps, 1);
  const auto expected = padded.weights();
  expect_close(expected, packed.weights(), 1e-5);
  expect_close(expected, accumulated.weights(), 1e-5);
}

// Steps 1-2, then a resume (weights and optimizer state into a fresh model), then steps 3-4: bit for bit the
// weights of four straight steps (packing is a function of the effective batch; the loader's cursor counts
// examples as without packing).
TEST_P(PackedTraining, ResumeIsExact) {
  const Kind kind = GetParam();
  const auto data = batches(kind, 4, 300);
  Trainee straight(kind, {2, true});
  straight.run(data, 0, 4);
  Trainee first(kind, {2, true}), second(kind, {2, true});
  first.run(data, 0, 2);
  {
    at::NoGradGuard no_grad;
    const auto saved = first.weights();
    second.trained().for_each_parameter([&](const std::string& name, at::Tensor& p) { p.copy_(saved.at(name)); });
  }
  second.optimizer->load_state(first.optimizer->state_tensors(), first.optimizer->steps(), "in memory");
  at::manual_seed(987654);
  second.run(data, 2, 4);
  EXPECT_EQ(max_difference(straight.weights(), second.weights()), 0.0);
}

// The peak of the CPU budget above `base` for one step's forward and backward of `batch` packed within `tokens`.
int64_t packed_peak(Trainee& t, const EffectiveBatch& batch, int64_t tokens, int64_t base) {
  const DataFamily family = seq2seq(t.kind) ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  const auto capacity = pack_capacity_within(seq2seq(t.kind) ? PackCapacity{64, 32} : PackCapacity{64, 0}, family, tokens);
  const std::span<const Example> examples(batch.examples);
  const auto rows = pack_rows(examples, family, capacity);
  int64_t peak = 0;
  for (const auto& [begin, count] : split_token_sizes(row_sizes(rows, family), tokens)) {
    reset_cpu_peak();
    t.step->forward_backward_packed(examples, std::span<const PackedRow>(rows).subspan(static_cast<std::size_t>(begin),
                                                                                        static_cast<std::size_t>(count)),
                                    1, 1.0);
    t.optimizer->zero_grad();
    peak = std::max(peak, cpu_memory_stats().peak - base);
  }
  return peak;
}

// Token-budget mode with packing: 384 tokens per micro-batch (rows of 64). After two steps a CPU budget arrives
// that the rows of a 96-token budget fit and those of 384 do not: the policy shrinks the budget (shorter rows,
// fewer per micro-batch) and the run reaches the weights of unconstrained padded training.
TEST_P(PackedTraining, OutOfMemoryShrinksTheTokenBudgetAndReachesThePaddedWeights) {
  const Kind kind = GetParam();
  install_cpu_budget();
  const auto data = batches(kind, 5, 200);
  Trainee padded(kind, {8, false});
  padded.run(data, 0, 5);

  Trainee packed(kind, {8, true, 384});
  packed.run(data, 0, 2);
  ASSERT_TRUE(packed.policy->adaptations().empty());
  const int64_t base = cpu_memory_stats().allocated;
  int64_t small = 0;
  for (std::size_t s = 2; s < data.size(); ++s) small = std::max(small, packed_peak(packed, data[s], 96, base));
  const int64_t large = packed_peak(packed, data[2], 384, base);
  ASSERT_LT(small, large);
  set_cpu_budget_limit(base + (small + large) / 2);
  const StepResult last = packed.run(data, 2, 5);
  set_cpu_budget_limit(0);

  const auto& a = packed.policy->adaptations();
  ASSERT_FALSE(a.empty()) << "the budget must force a shrink";
  EXPECT_EQ(a[0].step, 3);
  EXPECT_EQ(a[0].old_micro_batch, 384);
  EXPECT_GE(a.back().new_micro_batch, 96);
  EXPECT_GT(last.micro_steps, 1);
  expect_close(padded.weights(), packed.weights(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, PackedTraining,
                         ::testing::Values(Kind::kQwen2, Kind::kQwen2LoraDropout, Kind::kMistralWindow, Kind::kT5Dropout),
                         kind_name);

// Attention per example inside packed rows (models/segment_attention.h) against whole-row attention with the
// block-diagonal mask, in the models themselves, in training with dropout on (attention-probability masks drawn per
// example): the same loss and the same gradients of every parameter (relative position bias included), also under
// activation checkpointing (the layouts are recomputed with the blocks).
TEST(PackedForward, PerExampleAttentionEqualsWholeRowAttentionInTheModels) {
  for (const Kind kind : {Kind::kQwen2LoraDropout, Kind::kMistralWindow, Kind::kT5Dropout}) {
    SCOPED_TRACE(kind_name({kind, 0}));
    auto model = build(kind);
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
    const auto batch = make_batch(kind, 9);
    const DataFamily family = seq2seq(kind) ? DataFamily::kSeq2Seq : DataFamily::kCausal;
    const auto rows = pack_rows(batch.examples, family, seq2seq(kind) ? PackCapacity{64, 32} : PackCapacity{64, 0});
    const PackedBatch p = collate_packed(batch.examples, rows, family, 0, at::kCPU);
    Batch packed{p.input_ids, p.attention_mask, p.labels, {}};
    packed.segment_ids = p.segment_ids;
    packed.position_ids = p.position_ids;
    packed.decoder_segment_ids = p.decoder_segment_ids;
    packed.decoder_position_ids = p.decoder_position_ids;
    auto run = [&](SegmentAttentionMode mode) {
      set_segment_attention_mode(mode);
      model->for_each_parameter([](const std::string&, at::Tensor& t) { t.mutable_grad() = at::Tensor(); });
      std::vector<PackedDropoutStream> streams = {{p.segment_ids, p.position_ids, p.segment_examples, p.segment_starts}};
      if (seq2seq(kind))
        streams.push_back({p.decoder_segment_ids, p.decoder_position_ids, p.segment_examples, p.decoder_segment_starts});
      const DropoutScope dropout(5, 3, std::move(streams));
      const int64_t before = per_example_attention_calls();
      const LossSum loss = forward_loss(*model, packed);
      const int64_t forward_calls = per_example_attention_calls() - before;
      loss.loss_sum.backward();
      set_segment_attention_mode(SegmentAttentionMode::kAuto);
      // Every attention of the forward ran per example: T5's encoder self-attention, decoder self- and
      // cross-attention in every layer; each layer of the causal model.
      const auto& c = model->hf_config();
      const int64_t layers = c.value("num_layers", int64_t{0});
      const int64_t attentions = seq2seq(kind) ? layers + 2 * c.value("num_decoder_layers", layers)
                                               : c["num_hidden_layers"].get<int64_t>();
      EXPECT_EQ(forward_calls, mode == SegmentAttentionMode::kPerExample ? attentions : 0);
      std::map<std::string, at::Tensor> grads = {{"loss", loss.loss_sum.detach()}};
      model->for_each_parameter([&](const std::string& name, at::Tensor& t) { grads[name] = t.grad().clone(); });
      return grads;
    };
    const auto whole = run(SegmentAttentionMode::kWholeRow);
    const auto per_example = run(SegmentAttentionMode::kPerExample);
    apply_activation_checkpointing(*model);
    const auto checkpointed = run(SegmentAttentionMode::kPerExample);
    remove_activation_checkpointing(*model);
    ASSERT_EQ(whole.size(), per_example.size());
    ASSERT_EQ(whole.size(), checkpointed.size());
    // Within 1e-5 of each tensor's largest value: the loss is a sum over tokens (gradients up to ~100 here) and the
    // paths sum in other orders, so fp32 rounding differs by ~1e-6 of the largest value; masks or attention that
    // differed would differ by O(1).
    for (const auto* other : {&per_example, &checkpointed})
      for (const auto& [name, t] : whole)
        EXPECT_LE((t - other->at(name)).abs().max().item<double>(), 1e-5 * std::max(1.0, t.abs().max().item<double>()))
            << name << (other == &checkpointed ? " (checkpointed)" : "") << ": max difference "
            << (t - other->at(name)).abs().max().item<double>() << " of values up to " << t.abs().max().item<double>();
  }
}

// The packed forward itself: per-example losses of a packed row equal those of padded rows (T5 and Qwen2, no
// dropout), and the hidden states of each example's positions agree.
TEST(PackedForward, EachExampleGetsItsPaddedLossAndHiddenStates) {
  for (const Kind kind : {Kind::kQwen2, Kind::kT5Dropout}) {
    auto model = build(kind);
    model->train(false);
    const auto batch = make_batch(kind, 9);
    const DataFamily family = seq2seq(kind) ? DataFamily::kSeq2Seq : DataFamily::kCausal;
    const std::vector<PackedRow> rows = {{{0, 1, 2, 3, 4, 5, 6, 7}, 0, 0}};  // everything in one row
    const PackedBatch p = collate_packed(batch.examples, rows, family, 0, at::kCPU);
    Batch packed{p.input_ids, p.attention_mask, p.labels, {}};
    packed.segment_ids = p.segment_ids;
    packed.position_ids = p.position_ids;
    packed.decoder_segment_ids = p.decoder_segment_ids;
    packed.decoder_position_ids = p.decoder_position_ids;
    const CollatedBatch c = collate(batch.examples, 0, at::kCPU);
    at::NoGradGuard no_grad;
    const auto [packed_hidden, packed_targets] = model->hidden_and_targets(packed);
    const auto [padded_hidden, padded_targets] = model->hidden_and_targets(Batch{c.input_ids, c.attention_mask, c.labels, {}});
    // Example e's target positions, in order, in both layouts.
    const at::Tensor in_packed = packed_hidden[0].index({packed_targets[0] != -100});
    std::vector<at::Tensor> per_example;
    for (int64_t e = 0; e < 8; ++e) per_example.push_back(padded_hidden[e].index({padded_targets[e] != -100}));
    const at::Tensor in_padded = at::cat(per_example);
    ASSERT_EQ(in_packed.sizes(), in_padded.sizes());
    EXPECT_TRUE(at::allclose(in_packed, in_padded, 1e-5, 1e-5))
        << kind_name({kind, 0}) << ": max difference " << (in_packed - in_padded).abs().max().item<double>();
    EXPECT_EQ(forward_loss(*model, packed).target_tokens, batch.target_tokens);
    EXPECT_NEAR(forward_loss(*model, packed).loss_sum.item<double>(),
                forward_loss(*model, Batch{c.input_ids, c.attention_mask, c.labels, {}}).loss_sum.item<double>(), 1e-3);
  }
}

}  // namespace
}  // namespace trainer
