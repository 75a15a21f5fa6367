// data.packing through the real binary: a packed run of the shipped tiny configs (T5 with its dropout 0.1, and
// Qwen2) reaches the weights of the padded run, resumes exactly from its checkpoint, and `trainer data` reports
// how full packed rows are.
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "support/process.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

double max_weight_difference(const fs::path& a, const fs::path& b) {
  const auto fa = SafetensorsFile::open(a.string()), fb = SafetensorsFile::open(b.string());
  EXPECT_EQ(fa.tensors().size(), fb.tensors().size());
  double worst = 0;
  for (const auto& t : fa.tensors())
    worst = std::max(worst, (fa.load(t.name, at::kFloat) - fb.load(t.name, at::kFloat)).abs().max().item<double>());
  return worst;
}

class IntegrationPacking : public ::testing::TestWithParam<std::string> {};

TEST_P(IntegrationPacking, PackedRunMatchesThePaddedRunAndResumesExactly) {
  const std::string config = "configs/tiny-" + GetParam() + ".json";
  TempDir dir;
  const fs::path padded = dir.file("padded"), packed = dir.file("packed"), resumed = dir.file("resumed");
  // lr 1e-4: see tests/unit/train/dropout_test.cpp (AdamW's first steps amplify float noise at larger rates).
  auto run = [&](const fs::path& out, std::vector<std::string> extra) {
    std::vector<std::string> args = {"--config", config, "--set", "training.max_steps=6", "--set",
                                     "training.micro_batch_size=4", "--set", "checkpoint.every_steps=3", "--set",
                                     "evaluation.every_steps=0", "--set", "optimizer.lr=1e-4", "--set",
                                     "scheduler.warmup_steps=0", "--set", "checkpoint.output_dir=" + out.string()};
    // Rows long enough for several demo examples (about 135 tokens each): packing really packs.
    if (GetParam() == "t5") args.insert(args.end(), {"--set", "data.max_input_length=384", "--set", "data.max_target_length=384"});
    else args.insert(args.end(), {"--set", "data.max_length=512"});
    args.insert(args.end(), extra.begin(), extra.end());
    return run_trainer(args);
  };
  const auto a = run(padded, {});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const auto b = run(packed, {"--set", "data.packing=true"});
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_LT(max_weight_difference(padded / "final" / "model.safetensors", packed / "final" / "model.safetensors"), 1e-5);

  fs::create_directories(resumed);
  fs::copy(packed / "checkpoint-3", resumed / "checkpoint-3", fs::copy_options::recursive);
  const auto c = run(resumed, {"--set", "data.packing=true", "--resume"});
  ASSERT_EQ(c.exit_code, 0) << c.err;
  EXPECT_NE(c.err.find("resuming from"), std::string::npos) << c.err;
  EXPECT_TRUE(read_text(packed / "final" / "model.safetensors") == read_text(resumed / "final" / "model.safetensors"))
      << "the resumed packed run's weights differ from the uninterrupted packed run's";
}

INSTANTIATE_TEST_SUITE_P(Models, IntegrationPacking, ::testing::Values("t5", "qwen2"),
                         [](const ::testing::TestParamInfo<std::string>& test_info) { return test_info.param; });

// Pre-tokenized records of 6, 4, 3 and 3 tokens, rows of 10: two rows (6 + 4, 3 + 3), 16 real tokens of 20.
TEST(IntegrationPackingData, DataCommandReportsPackingEfficiency) {
  TempDir dir;
  std::ofstream(dir.file("ids.jsonl")) << "{\"input_ids\": [5, 6, 7, 8, 9, 10]}\n{\"input_ids\": [5, 6, 7, 8]}\n"
                                          "{\"input_ids\": [5, 6, 7]}\n{\"input_ids\": [5, 6, 7]}\n";
  const ProcessResult r = run_trainer({"data", "--config", "configs/tiny-qwen2.json", "--set",
                                       "data.train_files=[\"" + dir.file("ids.jsonl") + "\"]", "--set",
                                       "data.validation_files=[]", "--set", "data.max_length=10", "--set",
                                       "training.batch_size=4", "--set", "data.shuffle=false"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("packing             2 rows for 4 examples (data.packing, rows of 10 tokens): 80.0% of the "
                       "row capacity is real tokens; 20.0% padding after collation"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("33.3% padding after collation"), std::string::npos) << r.out;  // padded: 16 of 24
}

}  // namespace
}  // namespace trainer::test
