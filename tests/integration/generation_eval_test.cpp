// Evaluation by generation on the real binary: configs/tiny-t5.json with evaluation.generate reports ROUGE and
// exact match at each evaluation (metrics.jsonl, the log, evaluations/step-N/predictions.jsonl), keep_best by
// rougeL keeps the checkpoint with the highest value, and `trainer evaluate` scores the saved model as the run's
// last evaluation did.
#include <filesystem>
#include <fstream>
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/output.h"
#include "support/process.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace trainer::test {
namespace {
namespace fs = std::filesystem;

const std::vector<std::string> kGenerate = {
    "--set", "evaluation.generate=true",
    "--set", "evaluation.generate_examples=8",
    "--set", "evaluation.generate_max_new_tokens=12",
    "--set", R"(evaluation.generate_metrics=["exact_match", "rouge1", "rougeL", "bleu"])"};

}  // namespace

TEST(IntegrationGenerationEval, TinyT5ReportsRougeAtEachEvaluationKeepsTheBestAndEvaluateScoresTheModel) {
  TempDir dir;
  const fs::path out = dir.path() / "run";
  std::vector<std::string> args = {"--config", "configs/tiny-t5.json", "--set", "training.max_steps=9",
                                   "--set", "evaluation.every_steps=3", "--set", "checkpoint.every_steps=3",
                                   "--set", "checkpoint.keep_last=1", "--set", "checkpoint.keep_best=true",
                                   "--set", "checkpoint.best_metric=rougeL", "--set",
                                   "checkpoint.output_dir=" + out.string()};
  args.insert(args.end(), kGenerate.begin(), kGenerate.end());
  const auto run = run_trainer(args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.err.find("generated 8 answers"), std::string::npos) << run.err;

  std::map<int64_t, double> rouge_l;
  for (const auto& record : read_jsonl(out / "metrics.jsonl")) {
    if (!record.contains("eval_rougeL")) continue;
    const int64_t step = record["step"];
    rouge_l[step] = record["eval_rougeL"];
    EXPECT_TRUE(record.contains("eval_exact_match")) << record;
    EXPECT_TRUE(record.contains("eval_rouge1")) << record;
    EXPECT_TRUE(record.contains("eval_bleu")) << record;
    EXPECT_EQ(record["eval_generated"], 8);
    const auto lines = read_jsonl(out / "evaluations" / ("step-" + std::to_string(step)) / "predictions.jsonl");
    ASSERT_EQ(lines.size(), 8u);
    for (const auto& line : lines)
      for (const char* key : {"prompt", "reference", "prediction"}) EXPECT_TRUE(line.contains(key)) << line;
  }
  ASSERT_EQ(rouge_l.size(), 3u) << "an evaluation at steps 3, 6 and 9";

  // keep_best by rougeL, max: the first step with the highest value.
  int64_t best_step = 0;
  for (const auto& [step, value] : rouge_l)
    if (best_step == 0 || value > rouge_l[best_step]) best_step = step;
  std::ifstream record_file(out / "best_checkpoint.json");
  const auto record = nlohmann::json::parse(record_file);
  EXPECT_EQ(record["metric"], "rougeL");
  EXPECT_EQ(record["step"], best_step);
  EXPECT_DOUBLE_EQ(record["value"].get<double>(), rouge_l[best_step]);
  EXPECT_TRUE(fs::exists(out / ("checkpoint-" + std::to_string(best_step)) / "COMPLETE"));

  // The saved model, evaluated alone: the answers and scores of the run's last evaluation.
  std::vector<std::string> evaluate = {"evaluate", "--config", "configs/tiny-t5.json", "--model",
                                       (out / "final").string(), "--output", (dir.path() / "eval").string()};
  evaluate.insert(evaluate.end(), kGenerate.begin(), kGenerate.end());
  const auto scored = run_trainer(evaluate);
  ASSERT_EQ(scored.exit_code, 0) << scored.err;
  std::ifstream metrics_file(dir.path() / "eval" / "metrics.json");
  const auto metrics = nlohmann::json::parse(metrics_file);
  EXPECT_DOUBLE_EQ(metrics["eval_rougeL"].get<double>(), rouge_l[9]);
  EXPECT_TRUE(metrics.contains("eval_exact_match"));
  EXPECT_TRUE(metrics.contains("eval_loss"));
  EXPECT_EQ(read_jsonl(dir.path() / "eval" / "predictions.jsonl"),
            read_jsonl(out / "evaluations" / "step-9" / "predictions.jsonl"));
  EXPECT_NE(scored.out.find("rougeL"), std::string::npos) << scored.out;
}

// Two data-parallel ranks each generate for half of the examples; the gathered scores and answers are one
// process's. (lr 1e-12 leaves fp32 weights unchanged: both runs evaluate the same weights, so only the sharing of the examples differs.)
TEST(IntegrationGenerationEval, TwoRanksScoreAsOneProcess) {
  TempDir dir;
  auto args_for = [&](const fs::path& out) {
    std::vector<std::string> args = {"--config", "configs/tiny-t5.json", "--set", "training.max_steps=2",
                                     "--set", "training.batch_size=8", "--set", "optimizer.lr=1e-12",
                                     "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]",
                                     "--set", "checkpoint.every_steps=0", "--set", "checkpoint.output_dir=" + out.string()};
    args.insert(args.end(), kGenerate.begin(), kGenerate.end());
    return args;
  };
  const auto single = run_trainer(args_for(dir.path() / "one"), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, args_for(dir.path() / "two"));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  auto generation_record = [](const fs::path& out) {
    for (const auto& record : read_jsonl(out / "metrics.jsonl"))
      if (record.contains("eval_rougeL")) return record;
    return nlohmann::json();
  };
  const auto one = generation_record(dir.path() / "one"), two = generation_record(dir.path() / "two");
  ASSERT_FALSE(one.is_null());
  EXPECT_EQ(one, two);
  EXPECT_EQ(read_jsonl(dir.path() / "two" / "evaluations" / "step-2" / "predictions.jsonl"),
            read_jsonl(dir.path() / "one" / "evaluations" / "step-2" / "predictions.jsonl"));
}

// Over fully sharded weights generation runs unit by unit, every forward a collective: 3 ranks share the 8 examples
// 2/3/3 in batches of 2 (the rank with one batch generates for a one-token prompt while the others run their second),
// and each decoding step is agreed (a batch whose answers all ended steps on with its outputs unused). Greedy and
// beam search: the scores and answers are one process's.
TEST(IntegrationGenerationEval, ShardedWeightsGenerateUnitByUnitAsOneProcess) {
  TempDir dir;
  auto args_for = [&](const fs::path& out, const std::string& beams) {
    std::vector<std::string> args = {"--config", "configs/tiny-t5.json", "--set", "training.max_steps=2",
                                     "--set", "training.batch_size=8", "--set", "training.micro_batch_size=4",
                                     "--set", "optimizer.lr=1e-12", "--set", "evaluation.every_steps=0",
                                     "--set", "evaluation.sample_prompts=[]", "--set", "evaluation.micro_batch_size=2",
                                     "--set", "evaluation.generate_num_beams=" + beams,
                                     "--set", "checkpoint.every_steps=0", "--set", "checkpoint.output_dir=" + out.string()};
    args.insert(args.end(), kGenerate.begin(), kGenerate.end());
    return args;
  };
  auto generation_record = [](const fs::path& out) {
    for (const auto& record : read_jsonl(out / "metrics.jsonl"))
      if (record.contains("eval_rougeL")) return record;
    return nlohmann::json();
  };
  for (const std::string beams : {"1", "2"}) {
    SCOPED_TRACE("num_beams " + beams);
    const fs::path one = dir.path() / ("one-" + beams), three = dir.path() / ("three-" + beams);
    const auto single = run_trainer(args_for(one, beams), "OMP_NUM_THREADS=1");
    ASSERT_EQ(single.exit_code, 0) << single.err;
    auto sharded = args_for(three, beams);
    sharded.insert(sharded.end(), {"--set", "distributed.shard_weights=true"});
    const auto ranks = run_ranks(3, sharded);
    for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
    const auto a = generation_record(one), b = generation_record(three);
    ASSERT_FALSE(a.is_null());
    for (const char* key : {"eval_rougeL", "eval_exact_match", "eval_bleu", "eval_generated"})
      EXPECT_NEAR(a.at(key).get<double>(), b.at(key).get<double>(), 1e-9) << key;
    EXPECT_EQ(read_jsonl(three / "evaluations" / "step-2" / "predictions.jsonl"),
              read_jsonl(one / "evaluations" / "step-2" / "predictions.jsonl"));
  }
}

TEST(IntegrationGenerationEval, BestMetricMustBeMeasured) {
  TempDir dir;
  const auto run = run_trainer({"--config", "configs/tiny-t5.json", "--set", "checkpoint.keep_best=true", "--set",
                                "checkpoint.best_metric=rougeL", "--set", "evaluation.every_steps=30", "--set",
                                "checkpoint.output_dir=" + (dir.path() / "run").string(), "--dry-run"});
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_NE(run.err.find("checkpoint.best_metric"), std::string::npos) << run.err;
}

}  // namespace trainer::test
