// Gradient caching (train/tasks/contrastive/contrastive.h) on a tiny random CLIP: the gradients of the full batch's contrastive loss,
// whatever the micro-batch split, dropout on, and over ranks that gather their embeddings; the micro-batch negatives
// mode changes the objective.
#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/image/clip.h"
#include "models/dropout.h"
#include "train/tasks/contrastive/contrastive.h"
#include "train/rng.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

constexpr int64_t kPairs = 7, kVocab = 40, kEos = 39, kPad = 1;

nlohmann::json tiny_clip_config(double attention_dropout) {
  return {{"model_type", "clip"},
          {"projection_dim", 12},
          {"logit_scale_init_value", 2.6592},
          {"text_config",
           {{"hidden_size", 16}, {"intermediate_size", 24}, {"num_attention_heads", 2}, {"num_hidden_layers", 2},
            {"vocab_size", kVocab}, {"max_position_embeddings", 12}, {"eos_token_id", kEos},
            {"attention_dropout", attention_dropout}, {"hidden_act", "quick_gelu"}}},
          {"vision_config",
           {{"hidden_size", 20}, {"intermediate_size", 28}, {"num_attention_heads", 2}, {"num_hidden_layers", 2},
            {"image_size", 12}, {"patch_size", 4}, {"attention_dropout", attention_dropout}, {"hidden_act", "gelu"}}}};
}

std::unique_ptr<ClipModel> tiny_clip(double attention_dropout = 0.1) {
  auto model = std::make_unique<ClipModel>(tiny_clip_config(attention_dropout), at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(3);
  model->init_weights();
  model->train(true);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  return model;
}

struct Pairs {
  at::Tensor pixels, ids, mask;  // (N, 3, 12, 12), (N, 10), (N, 10)
};

// Captions of different lengths ending in EOS, right-padded.
Pairs make_pairs(uint64_t seed) {
  at::manual_seed(seed);
  Pairs p;
  p.pixels = at::randn({kPairs, 3, 12, 12});
  p.ids = at::full({kPairs, 10}, kPad, at::kLong);
  p.mask = at::zeros({kPairs, 10}, at::kLong);
  for (int64_t i = 0; i < kPairs; ++i) {
    const int64_t length = 3 + (i * 5) % 8;  // 3..10 with EOS
    p.ids[i].slice(0, 0, length - 1).copy_(at::randint(2, kEos, {length - 1}, at::kLong));
    p.ids[i][length - 1] = kEos;
    p.mask[i].slice(0, 0, length).fill_(1);
  }
  return p;
}

std::vector<ContrastiveMicroBatch> split(const Pairs& pairs, const std::vector<int64_t>& sizes) {
  std::vector<ContrastiveMicroBatch> out;
  int64_t first = 0;
  for (const int64_t size : sizes) {
    ContrastiveMicroBatch mb;
    mb.pixel_values = pairs.pixels.slice(0, first, first + size);
    mb.input_ids = pairs.ids.slice(0, first, first + size);
    mb.attention_mask = pairs.mask.slice(0, first, first + size);
    mb.first_example = first;
    mb.rng_seed = 1000 + static_cast<uint64_t>(first);
    out.push_back(mb);
    first += size;
  }
  return out;
}

using Grads = std::map<std::string, at::Tensor>;

Grads take_grads(ClipModel& model) {
  Grads grads;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) {
      grads[name] = p.grad().clone();
      p.mutable_grad() = at::Tensor();
    }
  });
  return grads;
}

// The reference: CLIPModel(return_loss=True) on the whole batch in one autograd graph, under the dropout context
// of the step (examples 0..N-1), as the trainer would run an unconstrained batch.
std::pair<double, Grads> full_batch(ClipModel& model, const Pairs& pairs, double loss_scale = 1.0) {
  const DropoutScope scope(5, 2, 0, kPairs, at::Device(at::kCPU));
  const ClipOutput out = model.forward(pairs.pixels, pairs.ids, pairs.mask, true);
  (out.loss * loss_scale).backward();
  return {out.loss.item<double>(), take_grads(model)};
}

ContrastiveOptions options_for(ContrastiveNegatives negatives) {
  ContrastiveOptions options;
  options.negatives = negatives;
  options.dropout_seed = 5;
  options.step = 2;
  return options;
}

// The largest difference over every gradient, each parameter's measured in units of its reference's largest
// magnitude when that exceeds 1 (fp32 sums of the same terms in another order differ in proportion to their size:
// the position embeddings' gradients sum over every example and position). The parameter goes to the output.
double max_difference(const Grads& a, const Grads& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  std::string where;
  for (const auto& [name, grad] : a) {
    const auto it = b.find(name);
    EXPECT_NE(it, b.end()) << name;
    if (it == b.end()) continue;
    const double scale = std::max(1.0, it->second.abs().max().item<double>());
    const double difference = (grad - it->second).abs().max().item<double>() / scale;
    if (difference > worst) {
      worst = difference;
      where = name;
    }
  }
  std::cout << "largest gradient difference " << worst << " (relative above magnitude 1) in " << where << "\n";
  return worst;
}

TEST(Contrastive, GradientCachingEqualsTheFullBatchForAnySplitWithDropoutOn) {
  auto model = tiny_clip();
  const Pairs pairs = make_pairs(11);
  const auto [reference_loss, reference] = full_batch(*model, pairs);
  ASSERT_EQ(reference.size(), model->named_parameters().size());  // logit_scale and every weight have a gradient
  for (const auto& sizes : std::vector<std::vector<int64_t>>{{1, 1, 1, 1, 1, 1, 1}, {3, 3, 1}, {7}, {2, 5}}) {
    const ContrastiveResult result =
        contrastive_forward_backward(*model, split(pairs, sizes), options_for(ContrastiveNegatives::kBatch));
    const Grads grads = take_grads(*model);
    EXPECT_NEAR(result.loss, reference_loss, 1e-5) << sizes.size() << " micro-batches";
    EXPECT_EQ(result.examples, kPairs);
    // Two forwards of each tower per micro-batch; a batch in one micro-batch goes the direct way (one each).
    EXPECT_EQ(result.tower_forwards, sizes.size() == 1 ? 2 : 4 * static_cast<int64_t>(sizes.size()));
    EXPECT_LT(max_difference(grads, reference), 1e-5) << sizes.size() << " micro-batches";
  }
}

// Data parallelism simulated in one process: "rank" 0 holds pairs 0..3 (micro-batches 2 + 2), "rank" 1 pairs 4..6
// (1 + 2), dropout on. Each rank's call sees the other's rows through `sum` (captured from a first call stopped at
// the gather, which must not have touched a gradient). Every rank reports the full batch's loss, and the two ranks'
// gradients summed are the full batch's, logit_scale's counted once (rank 0's). When another rank ran out of memory
// in pass (a) the attempt is dropped before the gather, with no gradient.
TEST(Contrastive, GatheredEmbeddingsAcrossRanksSumToTheFullBatchGradients) {
  auto model = tiny_clip();
  const Pairs pairs = make_pairs(15);
  const auto [reference_loss, reference] = full_batch(*model, pairs);
  const auto parts = split(pairs, {2, 2, 1, 2});
  const std::vector<ContrastiveMicroBatch> shares[2] = {{parts[0], parts[1]}, {parts[2], parts[3]}};
  auto ranks_for = [&](int r) {
    ContrastiveRanks ranks;
    ranks.batch = kPairs;
    ranks.offset = r == 0 ? 0 : 4;
    ranks.width = model->projection_dim();
    ranks.logit_scale_gradient = r == 0;
    ranks.agree = [](bool fit) { return fit; };
    return ranks;
  };
  struct StopAtGather {};
  at::Tensor rows[2];
  for (int r = 0; r < 2; ++r) {
    ContrastiveRanks ranks = ranks_for(r);
    ranks.sum = [&rows, r](at::Tensor& matrix) {
      rows[r] = matrix.clone();
      throw StopAtGather{};
    };
    ContrastiveOptions options = options_for(ContrastiveNegatives::kBatch);
    options.ranks = &ranks;
    EXPECT_THROW(contrastive_forward_backward(*model, shares[r], options), StopAtGather);
  }
  EXPECT_TRUE(take_grads(*model).empty());
  Grads total;
  for (int r = 0; r < 2; ++r) {
    ContrastiveRanks ranks = ranks_for(r);
    ranks.sum = [&rows, r](at::Tensor& matrix) { matrix.add_(rows[1 - r]); };
    ContrastiveOptions options = options_for(ContrastiveNegatives::kBatch);
    options.ranks = &ranks;
    const ContrastiveResult result = contrastive_forward_backward(*model, shares[r], options);
    EXPECT_FALSE(result.dropped);
    EXPECT_EQ(result.examples, kPairs);
    EXPECT_NEAR(result.loss, reference_loss, 1e-5) << "rank " << r;
    for (auto& [name, grad] : take_grads(*model)) total[name] = total.count(name) ? total[name] + grad : grad;
  }
  EXPECT_LT(max_difference(total, reference), 1e-5);
  ContrastiveRanks peer_failed = ranks_for(1);
  peer_failed.agree = [](bool) { return false; };
  bool summed = false;
  peer_failed.sum = [&summed](at::Tensor&) { summed = true; };
  ContrastiveOptions options = options_for(ContrastiveNegatives::kBatch);
  options.ranks = &peer_failed;
  EXPECT_TRUE(contrastive_forward_backward(*model, shares[1], options).dropped);
  EXPECT_FALSE(summed);
  EXPECT_TRUE(take_grads(*model).empty());
}

TEST(Contrastive, DropoutActsAndIsReplayedInTheSecondPass) {
  // With dropout on, the reference differs from evaluation mode; gradient caching still matches the reference (the
  // second pass saw the first pass's masks: otherwise the embedding gradients would belong to other embeddings).
  auto model = tiny_clip(0.3);
  const Pairs pairs = make_pairs(12);
  const auto [train_loss, train_grads] = full_batch(*model, pairs);
  model->train(false);
  const auto [eval_loss, eval_grads] = full_batch(*model, pairs);
  EXPECT_GT(std::abs(train_loss - eval_loss), 1e-4);
  model->train(true);
  contrastive_forward_backward(*model, split(pairs, {3, 3, 1}), options_for(ContrastiveNegatives::kBatch));
  EXPECT_LT(max_difference(take_grads(*model), train_grads), 1e-5);
}

TEST(Contrastive, MicroBatchNegativesChangeTheObjective) {
  auto model = tiny_clip();
  const Pairs pairs = make_pairs(13);
  const auto [reference_loss, reference] = full_batch(*model, pairs);
  // One micro-batch: the same objective.
  const ContrastiveResult whole =
      contrastive_forward_backward(*model, split(pairs, {7}), options_for(ContrastiveNegatives::kMicroBatch));
  EXPECT_NEAR(whole.loss, reference_loss, 1e-5);
  EXPECT_LT(max_difference(take_grads(*model), reference), 1e-5);
  // Split: fewer negatives per example, a smaller loss and other gradients.
  const ContrastiveResult split_result =
      contrastive_forward_backward(*model, split(pairs, {3, 3, 1}), options_for(ContrastiveNegatives::kMicroBatch));
  EXPECT_EQ(split_result.tower_forwards, 6);
  EXPECT_LT(split_result.loss, reference_loss - 0.1);
  EXPECT_GT(max_difference(take_grads(*model), reference), 1e-3);
}

TEST(Contrastive, LossScaleScalesEveryGradient) {
  auto model = tiny_clip();
  const Pairs pairs = make_pairs(14);
  const auto [reference_loss, reference] = full_batch(*model, pairs, 8.0);
  ContrastiveOptions options = options_for(ContrastiveNegatives::kBatch);
  options.loss_scale = 8.0;
  const ContrastiveResult result = contrastive_forward_backward(*model, split(pairs, {4, 3}), options);
  EXPECT_NEAR(result.loss, reference_loss, 1e-5);  // reported unscaled
  EXPECT_LT(max_difference(take_grads(*model), reference), 8e-5);
}

TEST(Contrastive, FrozenImageTowerRunsOnceAndTheTextGradientsStayExact) {
  // LiT: the image tower and its projection locked; only the text side (and logit_scale) trains.
  auto model = tiny_clip();
  model->for_each_parameter([](const std::string& name, at::Tensor& p) {
    for (const char* prefix : ClipModel::kVisionPrefixes)
      if (name.rfind(prefix, 0) == 0) p.requires_grad_(false);
  });
  const Pairs pairs = make_pairs(15);
  const auto [reference_loss, reference] = full_batch(*model, pairs);
  ContrastiveOptions options = options_for(ContrastiveNegatives::kBatch);
  options.image_tower_trainable = false;
  const ContrastiveResult result = contrastive_forward_backward(*model, split(pairs, {3, 3, 1}), options);
  EXPECT_EQ(result.tower_forwards, 6 + 3);  // both towers once, the text tower again
  const Grads grads = take_grads(*model);
  EXPECT_EQ(grads.count("vision_model.post_layernorm.weight"), 0u);
  EXPECT_EQ(grads.count("text_projection.weight"), 1u);
  EXPECT_LT(max_difference(grads, reference), 1e-5);
}

TEST(Contrastive, LeavesTheCallersGeneratorAsItWas) {
  auto model = tiny_clip();
  const Pairs pairs = make_pairs(16);
  const at::Tensor before = get_rng_state(at::Device(at::kCPU));
  contrastive_forward_backward(*model, split(pairs, {3, 4}), options_for(ContrastiveNegatives::kBatch));
  EXPECT_TRUE(at::equal(before, get_rng_state(at::Device(at::kCPU))));
}

TEST(Contrastive, MismatchedPairsAreAUsageError) {
  auto model = tiny_clip();
  const Pairs pairs = make_pairs(17);
  auto micro_batches = split(pairs, {3, 4});
  micro_batches[1].input_ids = micro_batches[1].input_ids.slice(0, 0, 2);
  try {
    contrastive_forward_backward(*model, micro_batches, options_for(ContrastiveNegatives::kBatch));
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("micro-batch 1 holds 4 images and 2 texts"), std::string::npos) << e.what();
  }
  EXPECT_THROW(contrastive_forward_backward(*model, {}, options_for(ContrastiveNegatives::kBatch)), UsageError);
}

TEST(Contrastive, ClampLogitScaleCapsTheTemperatureAt100) {
  auto model = tiny_clip();
  {
    at::NoGradGuard no_grad;
    model->logit_scale().fill_(6.0);
  }
  model->clamp_logit_scale();
  EXPECT_NEAR(model->logit_scale().exp().item<double>(), 100.0, 1e-3);
}

}  // namespace
}  // namespace trainer
