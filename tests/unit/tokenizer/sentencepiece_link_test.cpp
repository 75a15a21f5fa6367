// LibTorch and sentencepiece each carry protobuf; loading both into one process has crashed elsewhere
// (see LIBTORCH_NOTES.md). This test loads a sentencepiece model and runs LibTorch ops in the same process,
// in the binary CI builds, so a clash shows here first.
#include <sentencepiece_processor.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "support/paths.h"

TEST(SentencePieceWithLibTorch, LoadEncodeAndComputeInOneProcess) {
  sentencepiece::SentencePieceProcessor processor;
  const auto status = processor.Load(trainer::test::source_path("configs/models/tiny-t5/spiece.model"));
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(processor.pad_id(), 0);  // T5's special ids
  EXPECT_EQ(processor.eos_id(), 1);
  EXPECT_EQ(processor.unk_id(), 2);

  const std::string text = "Whisk the eggs until smooth.";
  std::vector<int> ids;
  ASSERT_TRUE(processor.Encode(text, &ids).ok());
  ASSERT_FALSE(ids.empty());
  std::string decoded;
  ASSERT_TRUE(processor.Decode(ids, &decoded).ok());
  EXPECT_EQ(decoded, text);

  const at::Tensor tensor = at::tensor(std::vector<int64_t>(ids.begin(), ids.end()), at::kLong);
  const at::Tensor one_hot = at::one_hot(tensor, processor.GetPieceSize()).to(at::kFloat);
  EXPECT_EQ(one_hot.sum().item<float>(), static_cast<float>(ids.size()));
  EXPECT_LT(tensor.max().item<int64_t>(), processor.GetPieceSize());
}
