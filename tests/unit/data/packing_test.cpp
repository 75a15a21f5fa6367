// Packing (data/packing.h): which examples share a row, what a packed row holds, and the masks models build from
// segment ids. The training-level promise (packed weights = padded weights) is in tests/unit/train/packing_step_test.
#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "data/packing.h"
#include "models/layers.h"

namespace trainer {
namespace {

Example causal_example(int64_t length, int32_t first_id, int64_t prompt = 0) {
  Example e;
  for (int64_t i = 0; i < length; ++i) e.input_ids.push_back(first_id + static_cast<int32_t>(i));
  e.labels = e.input_ids;
  for (int64_t i = 0; i < prompt; ++i) e.labels[static_cast<std::size_t>(i)] = -100;
  return e;
}

TEST(Packing, FirstFitDecreasingWithinTheCapacityAndDeterministic) {
  std::vector<Example> examples;
  for (const int64_t length : {7, 3, 9, 2, 5, 5, 8, 1, 4, 6}) examples.push_back(causal_example(length, 10));
  const PackCapacity capacity{10, 0};
  const auto rows = pack_rows(examples, DataFamily::kCausal, capacity);
  std::multiset<int64_t> seen;
  int64_t tokens = 0;
  for (const auto& row : rows) {
    int64_t sum = 0;
    for (const int64_t i : row.examples) {
      seen.insert(i);
      sum += static_cast<int64_t>(examples[static_cast<std::size_t>(i)].input_ids.size());
    }
    EXPECT_EQ(sum, row.input);
    EXPECT_LE(row.input, capacity.input);
    EXPECT_TRUE(std::is_sorted(row.examples.begin(), row.examples.end()));
    tokens += sum;
  }
  EXPECT_EQ(seen.size(), examples.size());
  for (int64_t i = 0; i < static_cast<int64_t>(examples.size()); ++i) EXPECT_EQ(seen.count(i), 1u) << i;
  EXPECT_EQ(tokens, 50);
  // First fit decreasing: 9+1, 8+2, 7+3, 6+4, 5+5: five full rows (a first fit in data order needs more).
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[0].examples, (std::vector<int64_t>{2, 7}));
  EXPECT_EQ(rows[4].examples, (std::vector<int64_t>{4, 5}));
  // The same examples give the same rows.
  const auto again = pack_rows(examples, DataFamily::kCausal, capacity);
  ASSERT_EQ(again.size(), rows.size());
  for (std::size_t r = 0; r < rows.size(); ++r) EXPECT_EQ(again[r].examples, rows[r].examples);
  // An example longer than the capacity takes a row alone.
  examples.push_back(causal_example(12, 10));
  const auto with_long = pack_rows(examples, DataFamily::kCausal, capacity);
  EXPECT_EQ(with_long[0].examples, (std::vector<int64_t>{10}));
  EXPECT_EQ(with_long[0].input, 12);
}

TEST(Packing, Seq2SeqRowsRespectBothCapacities) {
  std::vector<Example> examples(4);
  const std::vector<std::pair<int, int>> lengths = {{6, 1}, {2, 5}, {3, 3}, {1, 1}};
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    examples[i].input_ids.assign(static_cast<std::size_t>(lengths[i].first), 5);
    examples[i].labels.assign(static_cast<std::size_t>(lengths[i].second), 6);
  }
  const auto rows = pack_rows(examples, DataFamily::kSeq2Seq, {8, 6});
  for (const auto& row : rows) {
    EXPECT_LE(row.input, 8);
    EXPECT_LE(row.labels, 6);
  }
  // By decreasing total: 0 (7), 1 (7), 2 (6), 3 (2). 0 opens row A; 1 fits A (8 inputs, 6 targets); 2 opens B; 3 fits B.
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].examples, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(rows[1].examples, (std::vector<int64_t>{2, 3}));
  // A token budget below the maxima shrinks both in their ratio.
  const PackCapacity cut = pack_capacity_within({512, 128}, DataFamily::kSeq2Seq, 320);
  EXPECT_EQ(cut.input, 256);
  EXPECT_EQ(cut.labels, 64);
  EXPECT_EQ(pack_capacity_within({1024, 0}, DataFamily::kCausal, 300).input, 300);
  EXPECT_EQ(pack_capacity_within({1024, 0}, DataFamily::kCausal, 3000).input, 1024);
}

TEST(Packing, CollatedRowsRestartPositionsPerExampleAndTrainNoCrossExamplePrediction) {
  std::vector<Example> examples = {causal_example(3, 100, 1), causal_example(2, 200), causal_example(4, 300, 2)};
  const std::vector<PackedRow> rows = {{{0, 1}, 5, 0}, {{2}, 4, 0}};
  const PackedBatch b = collate_packed(examples, rows, DataFamily::kCausal, 0, at::kCPU);
  EXPECT_TRUE(at::equal(b.input_ids, at::tensor({100, 101, 102, 200, 201, 300, 301, 302, 303, 0}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(b.segment_ids, at::tensor({1, 1, 1, 2, 2, 1, 1, 1, 1, 0}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(b.position_ids, at::tensor({0, 1, 2, 0, 1, 0, 1, 2, 3, 0}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(b.attention_mask, (b.segment_ids != 0).to(at::kLong)));
  // Each example's first label is -100: in a packed row it would be the previous example's last prediction.
  EXPECT_TRUE(at::equal(b.labels, at::tensor({-100, 101, 102, -100, 201, -100, -100, 302, 303, -100}, at::kLong).view({2, 5})));
  EXPECT_TRUE(at::equal(b.segment_examples, at::tensor({0, 0, 1, 0, 2, 0}, at::kLong).view({2, 3})));
  EXPECT_TRUE(at::equal(b.segment_starts, at::tensor({0, 0, 3, 0, 0, 0}, at::kLong).view({2, 3})));
  // The target tokens are those of the examples (the loss normaliser is unchanged).
  int64_t targets = 0;
  for (const auto& e : examples) targets += target_tokens(e, DataFamily::kCausal);
  EXPECT_EQ(b.labels.ne(-100).sum().item<int64_t>(), targets);
}

TEST(Packing, SegmentMaskIsBlockDiagonalCausalAndNeverEmpty) {
  const at::Tensor segments = at::tensor({1, 1, 2, 2, 2, 0}, at::kLong).view({1, 6});
  const at::Tensor positions = at::tensor({0, 1, 0, 1, 2, 0}, at::kLong).view({1, 6});
  const at::Tensor mask = segment_mask(segments, segments, positions, positions, true, std::nullopt).squeeze();
  const at::Tensor expected = at::tensor({1, 0, 0, 0, 0, 0,  //
                                          1, 1, 0, 0, 0, 0,  //
                                          0, 0, 1, 0, 0, 0,  //
                                          0, 0, 1, 1, 0, 0,  //
                                          0, 0, 1, 1, 1, 0,  //
                                          1, 1, 1, 1, 1, 1},  // padding query: sees all (its output is unused)
                                         at::kLong)
                                   .view({6, 6})
                                   .to(at::kBool);
  EXPECT_TRUE(at::equal(mask, expected)) << mask;
  // Sliding window of 2 within a segment: position 2 sees positions 1 and 2 of its example.
  const at::Tensor window = segment_mask(segments, segments, positions, positions, true, 2).squeeze();
  EXPECT_FALSE(window[4][2].item<bool>());
  EXPECT_TRUE(window[4][3].item<bool>());
  // Cross-attention: decoder segments to encoder segments, no causality.
  const at::Tensor decoder = at::tensor({1, 2, 2, 0}, at::kLong).view({1, 4});
  const at::Tensor cross = segment_mask(decoder, segments, {}, {}, false, std::nullopt).squeeze();
  EXPECT_TRUE(at::equal(cross[1], at::tensor({0, 0, 1, 1, 1, 0}, at::kLong).to(at::kBool)));
}

TEST(Packing, FiguresCountRealTokensAgainstRowCapacity) {
  std::vector<Example> examples;
  for (const int64_t length : {6, 4, 3, 3}) examples.push_back(causal_example(length, 1));
  const PackingFigures f = packing_figures(examples, DataFamily::kCausal, {10, 0});
  EXPECT_EQ(f.rows, 2);  // 6+4, 3+3
  EXPECT_EQ(f.tokens, 16);
  EXPECT_EQ(f.capacity_tokens, 20);
  EXPECT_EQ(f.padded_tokens, 20);  // the longest row is full
}

}  // namespace
}  // namespace trainer
