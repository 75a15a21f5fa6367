// `trainer data`: the real binary streams the demo data and reports counts; a bad record exits 3 with file:line.
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

}  // namespace
}  // namespace trainer::test
