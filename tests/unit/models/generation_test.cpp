// Batched generation (models/generation.h) on the shipped tiny models: a prompt gets the same answer in a batch of
// prompts of other lengths as alone, with greedy and beam search; options from generation_config.json.
// (The parity with transformers' generate is tests/parity/test_generation.py.)
#include "models/generation.h"

#include <set>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/kv_cache.h"
#include "support/tiny_models.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

const std::vector<std::vector<int64_t>> kPrompts = {{5, 17, 42, 8, 9, 33}, {7, 3}, {11, 12, 13, 14, 15, 16, 17, 18}, {40}};

}  // namespace

// The cache written in place holds what concatenating each step's keys and values would: appends past the
// capacity grow it, and row selection (repeated, reordered, fewer rows) keeps the chosen rows' filled positions.
TEST(Generation, KvCacheHoldsWhatConcatenationWould) {
  at::manual_seed(0);
  KvCache cache(2, 3);
  std::vector<at::Tensor> keys(2), values(2);
  int64_t rows = 3;
  for (int step = 0; step < 6; ++step) {  // a 2-position prompt, then one position a step: past the capacity of 3
    SCOPED_TRACE("step " + std::to_string(step));
    const int64_t positions = step == 0 ? 2 : 1;
    for (std::size_t layer = 0; layer < 2; ++layer) {
      const at::Tensor k = at::randn({rows, 2, positions, 4}), v = at::randn({rows, 2, positions, 4});
      keys[layer] = keys[layer].defined() ? at::cat({keys[layer], k}, 2) : k;
      values[layer] = values[layer].defined() ? at::cat({values[layer], v}, 2) : v;
      const auto [cached_keys, cached_values] = cache.append(layer, k, v);
      EXPECT_TRUE(at::equal(cached_keys, keys[layer]));
      EXPECT_TRUE(at::equal(cached_values, values[layer]));
    }
    EXPECT_EQ(cache.length(), step + 2);
    std::vector<int64_t> picked;
    if (step == 1) picked = {2, 0, 0};  // beams: repeated and reordered rows
    if (step == 3) picked = {1, 2};     // a finished row dropped
    if (picked.empty()) continue;
    const at::Tensor index = at::tensor(picked, at::kLong);
    cache.select_rows(index);
    for (std::size_t layer = 0; layer < 2; ++layer) {
      keys[layer] = keys[layer].index_select(0, index);
      values[layer] = values[layer].index_select(0, index);
    }
    rows = static_cast<int64_t>(picked.size());
  }
}

TEST(Generation, APromptInABatchGetsWhatItGetsAlone) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    auto model = test::tiny_model(name);
    for (const int64_t beams : {1, 3}) {
      SCOPED_TRACE(std::string(name) + " beams " + std::to_string(beams));
      GenerateOptions options;
      options.max_new_tokens = 7;
      options.num_beams = beams;
      options.no_repeat_ngram_size = 2;
      const auto together = generate_batch(*model, kPrompts, options);
      ASSERT_EQ(together.size(), kPrompts.size());
      for (std::size_t i = 0; i < kPrompts.size(); ++i) {
        EXPECT_EQ(together[i], generate_batch(*model, {kPrompts[i]}, options).front()) << "prompt " << i;
        EXPECT_FALSE(together[i].empty());
        EXPECT_LE(together[i].size(), 7u);
      }
    }
  }
}

TEST(Generation, NoRepeatNgramSizeLeavesNoRepeatedNgram) {
  auto model = test::tiny_model("tiny-qwen2");
  GenerateOptions options;
  options.max_new_tokens = 24;
  options.eos_token_ids = {-1};  // never stops early: long enough to repeat without the rule
  const auto free = generate_batch(*model, kPrompts, options);
  options.no_repeat_ngram_size = 2;
  const auto ruled = generate_batch(*model, kPrompts, options);
  auto repeats = [](const std::vector<int64_t>& prompt, const std::vector<int64_t>& answer) {
    std::vector<int64_t> all = prompt;
    all.insert(all.end(), answer.begin(), answer.end());
    std::set<std::pair<int64_t, int64_t>> seen;
    for (std::size_t i = 0; i + 1 < all.size(); ++i)
      if (!seen.insert({all[i], all[i + 1]}).second) return true;
    return false;
  };
  bool any_free_repeat = false;
  for (std::size_t i = 0; i < kPrompts.size(); ++i) {
    any_free_repeat = any_free_repeat || repeats(kPrompts[i], free[i]);
    EXPECT_FALSE(repeats(kPrompts[i], ruled[i])) << "prompt " << i;
  }
  EXPECT_TRUE(any_free_repeat) << "the model repeats bigrams without the rule, so the test means something";
}

TEST(Generation, OptionsFromGenerationConfigJson) {
  GenerateOptions options;
  apply_generation_config(nlohmann::json{{"num_beams", 4},
                                         {"max_length", 30},
                                         {"early_stopping", true},
                                         {"length_penalty", 0.6},
                                         {"no_repeat_ngram_size", 3},
                                         {"eos_token_id", {1, 2}},
                                         {"pad_token_id", 0}},
                          ModelFamily::kSeq2Seq, options);
  EXPECT_EQ(options.num_beams, 4);
  EXPECT_EQ(options.max_new_tokens, 29);  // max_length counts the decoder start token
  EXPECT_EQ(options.early_stopping, EarlyStopping::kWhenFull);
  EXPECT_DOUBLE_EQ(options.length_penalty, 0.6);
  EXPECT_EQ(options.no_repeat_ngram_size, 3);
  EXPECT_EQ(options.eos_token_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(options.pad_token_id, 0);
  EXPECT_EQ(options.temperature, 0.0);

  GenerateOptions sampled;
  apply_generation_config(nlohmann::json{{"do_sample", true}, {"top_p", 0.8}, {"early_stopping", "never"}},
                          ModelFamily::kCausal, sampled);
  EXPECT_DOUBLE_EQ(sampled.temperature, 1.0);
  EXPECT_EQ(sampled.top_k, 50);  // transformers' default
  EXPECT_DOUBLE_EQ(sampled.top_p, 0.8);
  EXPECT_EQ(sampled.early_stopping, EarlyStopping::kNever);
  EXPECT_THROW(apply_generation_config(nlohmann::json{{"num_beams", "4"}}, ModelFamily::kCausal, sampled), DataError);
}

TEST(Generation, SamplingIsSeeded) {
  auto model = test::tiny_model("tiny-qwen2");
  GenerateOptions options;
  options.max_new_tokens = 10;
  options.temperature = 1.5;
  options.seed = 4;
  const auto a = generate_batch(*model, kPrompts, options);
  EXPECT_EQ(a, generate_batch(*model, kPrompts, options));
  options.seed = 5;
  EXPECT_NE(a, generate_batch(*model, kPrompts, options));
}

}  // namespace trainer
