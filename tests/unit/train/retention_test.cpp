// Checkpoint retention: keep_last, and keep_best by validation loss, recorded so that it survives --resume.
#include "train/retention.h"

#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/temp_dir.h"

namespace trainer {
namespace {
namespace fs = std::filesystem;

// What write_checkpoint leaves: checkpoint-N with its COMPLETE marker.
void make_checkpoint(const fs::path& dir, int64_t step) {
  const auto path = dir / ("checkpoint-" + std::to_string(step));
  fs::create_directories(path);
  std::ofstream(path / "COMPLETE") << step << "\n";
}

std::vector<int64_t> steps_in(const fs::path& dir) {
  std::vector<int64_t> steps;
  for (const auto& [step, path] : checkpoint_dirs(dir)) steps.push_back(step);
  return steps;
}

nlohmann::json record(const fs::path& dir) {
  std::ifstream file(dir / "best_checkpoint.json");
  return nlohmann::json::parse(file);
}

}  // namespace

TEST(TrainRetention, ListsCheckpointDirectoriesInStepOrder) {
  test::TempDir dir;
  for (const int64_t step : {30, 5, 100}) make_checkpoint(dir.path(), step);
  fs::create_directories(dir.path() / "checkpoint-x");  // not ours: left alone
  fs::create_directories(dir.path() / "final");
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{5, 30, 100}));
}

TEST(TrainRetention, KeepLastWithoutKeepBest) {
  test::TempDir dir;
  CheckpointRetention retention(dir.path(), 2, /*keep_best=*/false);
  retention.start(std::nullopt);
  for (const int64_t step : {10, 20, 30}) {
    make_checkpoint(dir.path(), step);
    retention.on_checkpoint(step, step == 10 ? std::optional<double>(0.5) : std::optional<double>(2.0));
  }
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{20, 30}));
  EXPECT_FALSE(retention.best().has_value());
  EXPECT_FALSE(fs::exists(dir.path() / "best_checkpoint.json"));
}

TEST(TrainRetention, TheBestSurvivesKeepLastAndIsReplacedByABetterOne) {
  test::TempDir dir;
  CheckpointRetention retention(dir.path(), 1, /*keep_best=*/true);
  retention.start(std::nullopt);
  const std::vector<std::pair<int64_t, std::optional<double>>> evals = {
      {10, 3.0}, {20, 1.5}, {30, 2.0}, {35, std::nullopt}, {40, 1.8}};
  for (const auto& [step, loss] : evals) {
    make_checkpoint(dir.path(), step);
    retention.on_checkpoint(step, loss);
  }
  // The newest (40) by keep_last=1, and 20 with the lowest validation loss.
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{20, 40}));
  ASSERT_TRUE(retention.best().has_value());
  EXPECT_EQ(retention.best()->step, 20);
  EXPECT_EQ(record(dir.path())["step"], 20);
  EXPECT_DOUBLE_EQ(record(dir.path())["eval_loss"].get<double>(), 1.5);
  EXPECT_EQ(record(dir.path())["path"], (dir.path() / "checkpoint-20").string());

  make_checkpoint(dir.path(), 50);
  retention.on_checkpoint(50, 1.0);  // a new best: 20 is now just old
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{50}));
  EXPECT_EQ(record(dir.path())["step"], 50);
}

TEST(TrainRetention, KeepBestByAMetricToMaximise) {
  test::TempDir dir;
  CheckpointRetention retention(dir.path(), 1, /*keep_best=*/true, "rougeL", /*maximize=*/true);
  retention.start(std::nullopt);
  // The lowest value would win by loss; by rougeL, max, 20 (0.41) does, and a tie later (40) does not replace it.
  const std::vector<std::pair<int64_t, std::optional<double>>> evals = {
      {10, 0.12}, {20, 0.41}, {30, 0.05}, {40, 0.41}, {50, 0.3}};
  for (const auto& [step, value] : evals) {
    make_checkpoint(dir.path(), step);
    retention.on_checkpoint(step, value);
  }
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{20, 50}));
  ASSERT_TRUE(retention.best().has_value());
  EXPECT_EQ(retention.best()->step, 20);
  EXPECT_EQ(record(dir.path())["metric"], "rougeL");
  EXPECT_DOUBLE_EQ(record(dir.path())["value"].get<double>(), 0.41);
  EXPECT_FALSE(record(dir.path()).contains("eval_loss"));

  // Resuming with the same metric keeps the record; with another metric the choice starts afresh.
  CheckpointRetention same(dir.path(), 1, true, "rougeL", true);
  same.start(50);
  ASSERT_TRUE(same.best().has_value());
  EXPECT_EQ(same.best()->step, 20);
  CheckpointRetention other(dir.path(), 1, true, "loss", false);
  other.start(50);
  EXPECT_FALSE(other.best().has_value());
}

TEST(TrainRetention, ResumeKeepsTheRecordedBestUpToTheResumeStep) {
  test::TempDir dir;
  {
    CheckpointRetention first(dir.path(), 1, true);
    first.start(std::nullopt);
    make_checkpoint(dir.path(), 10);
    first.on_checkpoint(10, 1.0);
    make_checkpoint(dir.path(), 20);
    first.on_checkpoint(20, 2.0);
  }
  CheckpointRetention resumed(dir.path(), 1, true);
  resumed.start(20);
  ASSERT_TRUE(resumed.best().has_value());
  EXPECT_EQ(resumed.best()->step, 10);
  EXPECT_DOUBLE_EQ(resumed.best()->value, 1.0);
  make_checkpoint(dir.path(), 30);
  resumed.on_checkpoint(30, 1.5);  // worse than the best before the resume
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{10, 30}));

  // Resuming from before the recorded best (--resume-from an older one): that best is not this run's.
  CheckpointRetention earlier(dir.path(), 1, true);
  fs::remove(dir.path() / "best_checkpoint.json");
  make_checkpoint(dir.path(), 5);
  {
    CheckpointRetention writer(dir.path(), 5, true);
    writer.start(std::nullopt);
    writer.on_checkpoint(30, 0.5);
  }
  earlier.start(5);
  EXPECT_FALSE(earlier.best().has_value());
  // A record naming a checkpoint that is gone (or incomplete) is ignored too.
  fs::remove(dir.path() / "checkpoint-30" / "COMPLETE");
  CheckpointRetention incomplete(dir.path(), 1, true);
  incomplete.start(40);
  EXPECT_FALSE(incomplete.best().has_value());
}

// keep_last=1 after --resume-from an older checkpoint: the one just written stays, a later stretch's checkpoint
// is neither counted nor deleted, and an incomplete one from a crash goes.
TEST(TrainRetention, KeepLastCountsOnlyThisStretchsCompleteCheckpoints) {
  test::TempDir dir;
  make_checkpoint(dir.path(), 10);
  make_checkpoint(dir.path(), 30);  // from a run that went further
  make_checkpoint(dir.path(), 15);
  fs::remove(dir.path() / "checkpoint-15" / "COMPLETE");  // a crash between rename and marker
  CheckpointRetention resumed(dir.path(), 1, false);
  resumed.start(10);
  make_checkpoint(dir.path(), 20);
  resumed.on_checkpoint(20, std::nullopt);
  EXPECT_EQ(steps_in(dir.path()), (std::vector<int64_t>{20, 30}));
}

TEST(TrainRetention, AFreshRunForgetsAnEarlierRunsBest) {
  test::TempDir dir;
  CheckpointRetention first(dir.path(), 1, true);
  first.start(std::nullopt);
  make_checkpoint(dir.path(), 10);
  first.on_checkpoint(10, 1.0);
  ASSERT_TRUE(fs::exists(dir.path() / "best_checkpoint.json"));
  CheckpointRetention fresh(dir.path(), 1, true);
  fresh.start(std::nullopt);
  EXPECT_FALSE(fs::exists(dir.path() / "best_checkpoint.json"));
  EXPECT_FALSE(fresh.best().has_value());
}

}  // namespace trainer
