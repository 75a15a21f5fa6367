// Model behaviour that needs no reference implementation: names, masking, cache consistency, split invariance.
// Numerical agreement with transformers is in tests/parity/test_models.py.
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "models/weights.h"
#include "support/paths.h"
#include "support/tiny_models.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

using test::padded_batch;
using test::tiny_model;

Batch rows(const Batch& b, int64_t begin, int64_t count) {
  return {b.input_ids.narrow(0, begin, count), b.attention_mask.narrow(0, begin, count), b.labels.narrow(0, begin, count),
          {}};
}

}  // namespace

TEST(Models, ParameterNamesAreTheHuggingFaceKeys) {
  auto t5 = tiny_model("tiny-t5");
  std::vector<std::string> names;
  for (auto& [name, p] : t5->named_parameters()) names.push_back(name);
  for (const char* expected :
       {"shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder.block.1.layer.1.DenseReluDense.wi_0.weight", "decoder.block.1.layer.1.EncDecAttention.o.weight",
        "decoder.block.0.layer.2.layer_norm.weight", "decoder.final_layer_norm.weight"})
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  // Only block 0 of each stack has the relative bias; the tied LM head is no second parameter.
  EXPECT_EQ(std::find(names.begin(), names.end(), "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"),
            names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "lm_head.weight"), names.end());

  auto qwen = tiny_model("tiny-qwen2");
  std::map<std::string, std::vector<int64_t>> shapes;
  for (auto& [name, p] : qwen->named_parameters()) shapes[name] = p.sizes().vec();
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.k_proj.weight"), (std::vector<int64_t>{32, 64}));  // 2 KV heads x 16
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_proj.bias"), (std::vector<int64_t>{64}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u);  // tied
}

TEST(Models, LossSumsAddUpOverAnySplit) {
  // The memory-adaptive step relies on this: summed token losses of parts equal the loss sum of the whole.
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto model = tiny_model(name);
    const Batch batch = padded_batch(model->family() == ModelFamily::kSeq2Seq);
    at::NoGradGuard no_grad;
    const auto whole = forward_loss(*model, batch);
    const auto a = forward_loss(*model, rows(batch, 0, 1));
    const auto b = forward_loss(*model, rows(batch, 1, 2));
    EXPECT_EQ(whole.target_tokens, a.target_tokens + b.target_tokens);
    EXPECT_NEAR(whole.loss_sum.item<double>(), (a.loss_sum + b.loss_sum).item<double>(), 1e-3);
    EXPECT_TRUE(std::isfinite(whole.loss_sum.item<double>()));
  }
}

TEST(Models, PaddingDoesNotChangeTheRealPositions) {
  auto model = tiny_model("tiny-qwen2");
  const Batch batch = padded_batch(false);
  at::NoGradGuard no_grad;
  const auto padded = forward_loss(*model, batch, true).logits;
  // Row 2 alone, unpadded (3 real tokens).
  Batch alone{batch.input_ids.narrow(0, 2, 1).narrow(1, 0, 3), at::ones({1, 3}, at::kLong),
              batch.labels.narrow(0, 2, 1).narrow(1, 0, 3), {}};
  const auto single = forward_loss(*model, alone, true).logits;
  EXPECT_TRUE(at::allclose(padded.narrow(0, 2, 1).narrow(1, 0, 3), single, 1e-5, 1e-5));
}

TEST(Models, CachedGenerationEqualsRecomputingTheWholeSequence) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto model = tiny_model(name);
    const std::vector<int64_t> prompt = {5, 17, 42, 8, 9};
    GenerateOptions options;
    options.max_new_tokens = 8;
    const auto cached = generate(*model, at::tensor(prompt, at::kLong).unsqueeze(0), options);
    ASSERT_FALSE(cached.empty());

    at::NoGradGuard no_grad;
    std::vector<int64_t> recomputed;
    for (std::size_t step = 0; step < cached.size(); ++step) {
      Batch b;
      if (model->family() == ModelFamily::kSeq2Seq) {
        b.input_ids = at::tensor(prompt, at::kLong).unsqueeze(0);
        std::vector<int64_t> labels = recomputed;
        labels.push_back(0);  // the position whose logits predict the next token
        b.labels = at::tensor(labels, at::kLong).unsqueeze(0);
      } else {
        std::vector<int64_t> ids = prompt;
        ids.insert(ids.end(), recomputed.begin(), recomputed.end());
        b.input_ids = at::tensor(ids, at::kLong).unsqueeze(0);
        b.labels = b.input_ids.clone();
      }
      b.attention_mask = at::ones_like(b.input_ids);
      const auto logits = forward_loss(*model, b, true).logits;
      recomputed.push_back(logits[0][logits.size(1) - 1].argmax().item<int64_t>());
    }
    EXPECT_EQ(cached, recomputed);
  }
}

TEST(Models, RandomInitialisationIsSeeded) {
  auto a = tiny_model("tiny-t5", 5), b = tiny_model("tiny-t5", 5), c = tiny_model("tiny-t5", 6);
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  EXPECT_TRUE(at::equal(pa[0].second, pb[0].second));
  EXPECT_FALSE(at::equal(pa[0].second, pc[0].second));
}

TEST(Models, UnsupportedModelTypeListsTheSupportedOnes) {
  try {
    build_model(nlohmann::json{{"model_type", "bert"}}, at::TensorOptions());
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.hint()).find("t5, llama, qwen2, mistral, qwen3"), std::string::npos) << e.hint();
  }
  EXPECT_THROW(build_model(nlohmann::json{{"model_type", "llama"}, {"vocab_size", 10}}, at::TensorOptions()),
               DataError);  // hidden_size missing
}

}  // namespace trainer
