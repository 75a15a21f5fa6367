// `trainer data`: the real binary streams the demo data and reports counts; a bad record exits 3 with file:line.
// An image classifier's config streams its images (decoded and preprocessed as training does).
#include <filesystem>

#include <gtest/gtest.h>

#include "support/process.h"
#include "support/temp_dir.h"

namespace trainer::test {
namespace {

TEST(IntegrationDataCommand, StreamsTheDemoDataAndPrintsCounts) {
  const ProcessResult r = run_trainer({"data", "--config", "configs/tiny-qwen2.json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("examples            400"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("examples            40"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("examples/s"), std::string::npos) << r.out;
}

TEST(IntegrationDataCommand, BadRecordExitsWithCode3AndFileLine) {
  TempDir dir;
  write_file(dir.file("bad.jsonl"), "{\"input\": \"a\", \"target\": \"b\"}\n{\"input\": \"a\"\n");
  const ProcessResult r = run_trainer({"data", "--config", "configs/tiny-t5.json", "--set",
                                       "data.train_files=[\"" + dir.file("bad.jsonl") + "\"]"});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_NE(r.err.find(dir.file("bad.jsonl") + ":2: invalid JSON"), std::string::npos) << r.err;
  const ProcessResult skipped = run_trainer({"data", "--config", "configs/tiny-t5.json", "--set",
                                             "data.train_files=[\"" + dir.file("bad.jsonl") + "\"]", "--set",
                                             "data.on_bad_record=skip"});
  EXPECT_EQ(skipped.exit_code, 0) << skipped.err;
  EXPECT_NE(skipped.out.find("bad records skipped 1"), std::string::npos) << skipped.out;
}

TEST(IntegrationDataCommand, StreamsTheDemoImagesOfAnImageConfig) {
  const ProcessResult r = run_trainer({"data", "--config", "configs/tiny-vit.json", "--set", "data.num_workers=2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("image classifier (5 classes), 2 worker(s)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("images              120 (32 x 32 pixels)"), std::string::npos) << r.out;  // train
  EXPECT_NE(r.out.find("images              40 (32 x 32 pixels)"), std::string::npos) << r.out;   // validation
  EXPECT_NE(r.out.find("images/s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("peak RSS"), std::string::npos) << r.out;

  // A file that is no image in a class folder: exit 3 naming it, or counted and left out with skip.
  TempDir dir;
  const std::filesystem::path folder = dir.path() / "images";
  std::filesystem::copy(std::string(TRAINER_SOURCE_DIR) + "/data/demo/images/train", folder,
                        std::filesystem::copy_options::recursive);
  write_file((folder / "circle-red" / "broken.jpg").string(), "not an image\n");
  const std::string files = "data.train_files=[\"" + folder.string() + "\"]";
  const ProcessResult bad = run_trainer({"data", "--config", "configs/tiny-vit.json", "--set", files});
  EXPECT_EQ(bad.exit_code, 3) << bad.out << bad.err;
  EXPECT_NE(bad.err.find("broken.jpg"), std::string::npos) << bad.err;
  const ProcessResult skipped = run_trainer(
      {"data", "--config", "configs/tiny-vit.json", "--set", files, "--set", "data.on_bad_record=skip"});
  EXPECT_EQ(skipped.exit_code, 0) << skipped.err;
  EXPECT_NE(skipped.out.find("bad records skipped 1"), std::string::npos) << skipped.out;
  EXPECT_NE(skipped.out.find("images              120 "), std::string::npos) << skipped.out;
}

}  // namespace
}  // namespace trainer::test
