// Batched generation (models/generation.h) on the shipped tiny models: a prompt gets the same answer in a batch of
// prompts of other lengths as alone, with greedy and beam search; options from generation_config.json.
// (The parity with transformers' generate is tests/parity/test_generation.py.)
#include "models/generation.h"

#include <algorithm>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
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

// Prompts are prefilled in groups of similar length (kv_cache.h): runs of the prompts sorted by extent, split
// only where the padding saved pays for another pass.
TEST(Generation, PrefillGroupsSplitWhereThePaddingSavedPaysForAPass) {
  auto widths = [](const std::vector<PrefillGroup>& groups) {
    std::vector<std::pair<int64_t, std::vector<int64_t>>> out;
    for (const auto& g : groups) out.emplace_back(g.width, g.rows);
    return out;
  };
  using Groups = std::vector<std::pair<int64_t, std::vector<int64_t>>>;
  // 4 x 8 padded positions + one pass (64) is cheaper than any split: one group.
  EXPECT_EQ(widths(prefill_groups({6, 2, 8, 1})), (Groups{{8, {2, 0, 1, 3}}}));
  // Long and short prompts: (2 x 90 + 64) + (2 x 5 + 64) < 4 x 90 + 64.
  EXPECT_EQ(widths(prefill_groups({5, 90, 3, 88})), (Groups{{90, {1, 3}}, {5, {0, 2}}}));
  // A pass costing nothing: every distinct extent runs alone.
  EXPECT_EQ(widths(prefill_groups({5, 90, 3, 90}, 0)), (Groups{{90, {1, 3}}, {5, {0}}, {3, {2}}}));
  EXPECT_EQ(prompt_extents(at::tensor({0, 0, 1, 1, 0, 1, 1, 1, 1, 1}, at::kLong).reshape({2, 5}), true),
            (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(prompt_extents(at::tensor({1, 0, 1, 0, 0, 1, 1, 1, 1, 1}, at::kLong).reshape({2, 5}), false),
            (std::vector<int64_t>{3, 5}));
}

// Parts of a batch written into one cache end at the same position, left-padded with zeros, in their rows.
TEST(Generation, KvCacheWriteRowsPlacesPartsRightAligned) {
  at::manual_seed(1);
  KvCache whole(1, 6), long_part(1, 4), short_part(1, 2);
  const at::Tensor k_long = at::randn({2, 2, 4, 3}), v_long = at::randn({2, 2, 4, 3});
  const at::Tensor k_short = at::randn({1, 2, 2, 3}), v_short = at::randn({1, 2, 2, 3});
  long_part.append(0, k_long, v_long);
  short_part.append(0, k_short, v_short);
  whole.write_rows(long_part, at::tensor({2, 0}, at::kLong), 3, 4);
  whole.write_rows(short_part, at::tensor({1}, at::kLong), 3, 4);
  EXPECT_EQ(whole.length(), 4);
  // The next position goes after the prompts, in the room the capacity left.
  const at::Tensor k_next = at::randn({3, 2, 1, 3}), v_next = at::randn({3, 2, 1, 3});
  const auto [keys, values] = whole.append(0, k_next, v_next);
  ASSERT_EQ(keys.sizes(), (at::IntArrayRef{3, 2, 5, 3}));
  EXPECT_TRUE(at::equal(keys[2].narrow(1, 0, 4), k_long[0]));
  EXPECT_TRUE(at::equal(keys[0].narrow(1, 0, 4), k_long[1]));
  EXPECT_TRUE(at::equal(values[0].narrow(1, 0, 4), v_long[1]));
  EXPECT_TRUE(at::equal(keys[1].narrow(1, 2, 2), k_short[0]));
  EXPECT_TRUE(at::equal(values[1].narrow(1, 2, 2), v_short[0]));
  EXPECT_TRUE(at::equal(keys[1].narrow(1, 0, 2), at::zeros({2, 2, 3})));
  EXPECT_TRUE(at::equal(values[1].narrow(1, 0, 2), at::zeros({2, 2, 3})));
  EXPECT_TRUE(at::equal(keys.narrow(2, 4, 1), k_next));
}

// A batch of long and short prompts is prefilled in two groups; each row's logits at the prefill and at the
// decoding steps after it are those of the prompt prefilled alone (one group), and so are the answers.
TEST(Generation, GroupedPrefillGivesEachPromptWhatItGetsAlone) {
  std::vector<std::vector<int64_t>> prompts(4);
  for (int64_t i = 0; i < 70; ++i) prompts[0].push_back(3 + (i * 37) % 190);
  prompts[1] = {7, 3, 9};
  for (int64_t i = 0; i < 66; ++i) prompts[2].push_back(5 + (i * 53) % 180);
  prompts[3] = {40};
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto model = test::tiny_model(name);
    const bool causal = model->family() == ModelFamily::kCausal;
    // The padded batch as generate_batch builds it: causal prompts on the left, seq2seq ones on the right.
    auto padded = [&](const std::vector<std::vector<int64_t>>& rows) {
      std::size_t width = 0;
      for (const auto& p : rows) width = std::max(width, p.size());
      at::Tensor ids = at::zeros({static_cast<int64_t>(rows.size()), static_cast<int64_t>(width)}, at::kLong);
      at::Tensor mask = at::zeros_like(ids);
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const auto n = static_cast<int64_t>(rows[r].size());
        const int64_t first = causal ? static_cast<int64_t>(width) - n : 0;
        ids[static_cast<int64_t>(r)].narrow(0, first, n).copy_(at::tensor(rows[r], at::kLong));
        mask[static_cast<int64_t>(r)].narrow(0, first, n).fill_(1);
      }
      return std::pair{ids, mask};
    };
    const auto [ids, mask] = padded(prompts);
    ASSERT_EQ(prefill_groups(prompt_extents(mask, causal)).size(), 2u) << "the batch must take the grouped path";
    at::NoGradGuard no_grad;
    auto [state, logits] = model->prefill(ids, mask, 3);
    const at::Tensor next = at::tensor({11, 12, 13, 14}, at::kLong).unsqueeze(1);
    const at::Tensor step = model->decode_step(*state, next);
    for (std::size_t r = 0; r < prompts.size(); ++r) {
      SCOPED_TRACE("prompt " + std::to_string(r));
      const auto [one_ids, one_mask] = padded({prompts[r]});
      auto [one_state, one_logits] = model->prefill(one_ids, one_mask, 3);
      const at::Tensor one_step = model->decode_step(*one_state, next[static_cast<int64_t>(r)].unsqueeze(0));
      EXPECT_TRUE(at::allclose(logits[static_cast<int64_t>(r)], one_logits[0], 1e-5, 1e-5));
      EXPECT_TRUE(at::allclose(step[static_cast<int64_t>(r)], one_step[0], 1e-5, 1e-5));
    }
    for (const int64_t beams : {1, 3}) {
      GenerateOptions options;
      options.max_new_tokens = 6;
      options.num_beams = beams;
      const auto together = generate_batch(*model, prompts, options);
      for (std::size_t i = 0; i < prompts.size(); ++i)
        EXPECT_EQ(together[i], generate_batch(*model, {prompts[i]}, options).front()) << "beams " << beams << " prompt " << i;
    }
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
