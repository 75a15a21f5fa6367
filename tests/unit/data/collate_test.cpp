// Collation pads to the longest sequence of the micro-batch (never to a maximum), int64, with masks and -100.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "trainer/data.h"

namespace trainer {
namespace {

TEST(Collate, PadsToTheLongestSequenceOfTheExamples) {
  std::vector<Example> examples(2);
  examples[0].input_ids = {5, 6, 7};
  examples[0].labels = {-100, 6, 7};
  examples[1].input_ids = {8};
  examples[1].labels = {8};
  const CollatedBatch b = collate(examples, 0, c10::Device(c10::kCPU));
  EXPECT_EQ(b.input_ids.scalar_type(), at::kLong);
  EXPECT_EQ(b.labels.scalar_type(), at::kLong);
  EXPECT_EQ(b.attention_mask.scalar_type(), at::kLong);
  EXPECT_EQ(b.input_ids.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(at::equal(b.input_ids, at::tensor({5, 6, 7, 8, 0, 0}, at::kLong).view({2, 3})));
  EXPECT_TRUE(at::equal(b.attention_mask, at::tensor({1, 1, 1, 1, 0, 0}, at::kLong).view({2, 3})));
  EXPECT_TRUE(at::equal(b.labels, at::tensor({-100, 6, 7, 8, -100, -100}, at::kLong).view({2, 3})));
}

TEST(Collate, Seq2SeqLabelsArePaddedToTheirOwnLongest) {
  std::vector<Example> examples(2);
  examples[0].input_ids = {1, 2, 3, 4, 5};
  examples[0].labels = {9};
  examples[1].input_ids = {1};
  examples[1].labels = {9, 8};
  const CollatedBatch b = collate(examples, 3, c10::Device(c10::kCPU));
  EXPECT_EQ(b.input_ids.sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(b.labels.sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(b.input_ids[1][1].item<int64_t>(), 3);
  EXPECT_EQ(b.labels[0][1].item<int64_t>(), -100);
  EXPECT_EQ(b.attention_mask.sum().item<int64_t>(), 6);
}

}  // namespace
}  // namespace trainer
