// Batched generation (models/generation.h) on the shipped tiny models: a prompt gets the same answer in a batch of
// prompts of other lengths as alone, with greedy and beam search; options from generation_config.json.
// (The parity with transformers' generate is tests/parity/test_generation.py.)
#include "models/generation.h"

#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/tiny_models.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

const std::vector<std::vector<int64_t>> kPrompts = {{5, 17, 42, 8, 9, 33}, {7, 3}, {11, 12, 13, 14, 15, 16, 17, 18}, {40}};

}  // namespace

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
