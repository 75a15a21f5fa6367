// The reporter: the summary's contents, metrics.jsonl and TensorBoard files, plain progress lines, and the
// webhook payloads for start, checkpoint, stop, finish and failure.
#include "log/reporter.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/http_server.h"
#include "support/output.h"
#include "support/temp_dir.h"
#include "trainer/errors.h"

namespace trainer {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Sets TRAINER_WEBHOOK_URL for one test.
struct WebhookEnvironment {
  explicit WebhookEnvironment(const std::string& url) { setenv("TRAINER_WEBHOOK_URL", url.c_str(), 1); }
  ~WebhookEnvironment() { unsetenv("TRAINER_WEBHOOK_URL"); }
};

Config config_in(const fs::path& dir) {
  Config config;
  config.checkpoint.output_dir = dir.string();
  config.training.batch_size = 8;
  config.logging.progress = ProgressStyle::kPlain;
  config.logging.every_steps = 2;
  return config;
}

StepMetrics step_metrics(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.loss = 3.0 - 0.1 * static_cast<double>(step);
  m.lr = 1e-3;
  m.grad_norm = 0.5;
  m.counted = 100;
  m.seen = 100 * step;
  m.micro_batch = 4;
  m.micro_steps = 2;
  m.adaptations = step >= 3 ? 1 : 0;
  m.memory_allocated = 1 << 20;
  m.memory_peak = 2 << 20;
  m.seconds = 0.25;
  return m;
}

}  // namespace

TEST(LogReporter, SummaryNamesEverythingTheUserLooksFor) {
  RunSummary s;
  s.steps = 60;
  s.start_step = 30;
  s.seen = 48000;
  s.seen_this_run = 24000;
  s.seconds = 125;
  s.eval_loss = 1.25;
  s.data = {1000, 990, 4, 7, 3, {}};
  s.memory_peak = 3 << 20;
  s.adaptations = {{12, 16, 8, "out of memory in backward"}, {40, 8, 16, "regrow after 20 stable steps"}};
  s.escalations = {"activation_checkpointing"};
  s.model_dir = "runs/x/final";
  s.last_checkpoint = "runs/x/checkpoint-50";
  s.best_checkpoint = "runs/x/checkpoint-40";
  s.best_eval_loss = 1.2;
  s.metrics_file = "runs/x/metrics.jsonl";
  s.tensorboard_dir = "runs/x/tensorboard";
  const auto text = format_summary(s);
  for (const char* part : {"Done: 60 steps (resumed at step 30)", "48000 target tokens", "this run 24000 in 2m05s",
                           "(192 tokens/s)", "validation loss 1.2500 (perplexity 3.49)", "records 1000 read",
                           "bad records skipped 4", "truncated 7", "too long and skipped 3", "peak memory 3.00 MiB",
                           "micro-batch adaptations: 2", "step 12: 16 -> 8 (out of memory in backward)",
                           "step 40: 8 -> 16 (regrow after 20 stable steps)", "activation_checkpointing",
                           "model saved to runs/x/final", "last checkpoint runs/x/checkpoint-50",
                           "best checkpoint runs/x/checkpoint-40 (validation loss 1.2000)", "metrics runs/x/metrics.jsonl",
                           "tensorboard --logdir runs/x/tensorboard"})
    EXPECT_TRUE(contains(text, part)) << part << " missing from:\n" << text;
  // A short run without checkpoints says so.
  RunSummary bare;
  bare.steps = 3;
  bare.seconds = 1.5;
  const auto short_text = format_summary(bare);
  EXPECT_TRUE(contains(short_text, "in 1.5 s")) << short_text;
  EXPECT_TRUE(contains(short_text, "last checkpoint (none)")) << short_text;
  EXPECT_FALSE(contains(short_text, "validation loss")) << short_text;
}

TEST(LogReporter, GenerationMetricsGoToMetricsJsonlTensorboardAndTheLog) {
  test::TempDir dir;
  test::CapturedLog log("%v");
  std::ostringstream out;
  {
    const auto config = config_in(dir.path());
    Reporter reporter(config, out);
    reporter.on_eval_generation(20, {{"rougeL", 0.41}, {"exact_match", 0.1}, {"bleu", 12.5}}, 40,
                                "runs/x/evaluations/step-20/predictions.jsonl");
  }
  const auto records = test::read_jsonl(dir.path() / "metrics.jsonl");
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["step"], 20);
  EXPECT_DOUBLE_EQ(records[0]["eval_rougeL"].get<double>(), 0.41);
  EXPECT_DOUBLE_EQ(records[0]["eval_exact_match"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(records[0]["eval_bleu"].get<double>(), 12.5);
  EXPECT_EQ(records[0]["eval_generated"], 40);
  std::vector<std::string> keys;
  for (const auto& name : scalar_names()) keys.push_back(name.key);
  for (const auto& [key, value] : records[0].items())
    if (key != "step") EXPECT_NE(std::find(keys.begin(), keys.end(), key), keys.end()) << key << " has no tag";
  EXPECT_TRUE(contains(log.text(), "eval step 20: generated 40 answers: bleu 12.5000 exact_match 0.1000 rougeL 0.4100"))
      << log.text();
  EXPECT_TRUE(contains(log.text(), "predictions.jsonl")) << log.text();
}

TEST(LogReporter, MetricsTensorboardAndPlainProgressLines) {
  test::TempDir dir;
  test::CapturedLog log("%v");
  std::ostringstream out;
  {
    const auto config = config_in(dir.path());
    Reporter reporter(config, out);
    reporter.on_start({"t5", 1000, 900, 4, 4, 0, 0, ""});
    for (int64_t step = 1; step <= 4; ++step) reporter.on_step(step_metrics(step));
    reporter.on_eval(4, 2.0, 50);
    reporter.on_sample(4, 0, "prompt", "generation");
  }
  EXPECT_TRUE(contains(out.str(), "Training t5 (1000 parameters, 900 trainable) for 4 steps of 8 examples"));
  const auto records = test::read_jsonl(dir.path() / "metrics.jsonl");
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[0]["step"], 1);
  EXPECT_DOUBLE_EQ(records[0]["tokens_per_s"].get<double>(), 400.0);  // 100 tokens in 0.25 s
  EXPECT_EQ(records[3]["adaptations"], 1);
  EXPECT_EQ(records[3]["memory_peak"], 2 << 20);
  EXPECT_EQ(records[4]["step"], 4);
  EXPECT_DOUBLE_EQ(records[4]["eval_loss"].get<double>(), 2.0);
  EXPECT_NEAR(records[4]["eval_perplexity"].get<double>(), 7.389056, 1e-5);
  // Every metrics key with a number has a TensorBoard tag.
  std::vector<std::string> keys;
  for (const auto& name : scalar_names()) keys.push_back(name.key);
  for (const auto& record : records) {
    for (const auto& [key, value] : record.items()) {
      if (key == "step") continue;
      EXPECT_NE(std::find(keys.begin(), keys.end(), key), keys.end()) << key;
    }
  }
  // One event file, with something in it.
  std::vector<fs::path> events;
  for (const auto& entry : fs::directory_iterator(dir.path() / "tensorboard")) events.push_back(entry.path());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_GT(fs::file_size(events[0]), 200u);
  // Plain progress: a line every logging.every_steps (2) and at the last step.
  const auto text = log.text();
  EXPECT_FALSE(contains(text, "step 1/4")) << text;
  EXPECT_TRUE(contains(text, "step 2/4 loss 2.8000")) << text;
  EXPECT_TRUE(contains(text, "step 4/4 loss 2.6000")) << text;
  EXPECT_TRUE(contains(text, "eval step 4: loss 2.0000 perplexity 7.39")) << text;
  EXPECT_TRUE(contains(text, "sample step 4: \"prompt\" -> \"generation\"")) << text;
}

TEST(LogReporter, OffMeansNoFilesAndNoProgressLines) {
  test::TempDir dir;
  test::CapturedLog log("%v");
  std::ostringstream out;
  {
    auto config = config_in(dir.path());
    config.logging.metrics_jsonl = false;
    config.logging.tensorboard = false;
    config.logging.progress = ProgressStyle::kOff;
    Reporter reporter(config, out);
    reporter.on_start({"t5", 1000, 900, 2, 4, 0, 0, ""});
    for (int64_t step = 1; step <= 2; ++step) reporter.on_step(step_metrics(step));
  }
  EXPECT_FALSE(fs::exists(dir.path() / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir.path() / "tensorboard"));
  EXPECT_FALSE(contains(log.text(), "step 2/2")) << log.text();
}

TEST(LogReporter, WebhookPayloadsForEveryEvent) {
  test::TempDir dir;
  test::HttpServer server;
  WebhookEnvironment environment(server.url("/api/webhooks/1/s3cr3t"));
  test::CapturedLog log("%v");
  std::ostringstream out;
  {
    const auto config = config_in(dir.path());
    Reporter reporter(config, out);
    reporter.on_start({"qwen2", 1000, 1000, 10, 4, 0, 0, ""});
    reporter.on_step(step_metrics(1));
    reporter.on_eval(1, 2.5, 40);
    reporter.on_checkpoint(1, "out/checkpoint-1");
    reporter.on_stopped(SIGTERM, 1, "out/checkpoint-1");
    RunSummary summary;
    summary.steps = 1;
    summary.seen = 100;
    summary.model_dir = "out/final";
    reporter.on_finish(summary);
    reporter.on_failure(DataError("data.jsonl:7: invalid JSON\nmore detail", "fix the record"));
    try {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB");
    } catch (const c10::Error& e) {
      reporter.on_failure(e);
    }
  }
  EXPECT_TRUE(contains(log.text(), "webhook: on")) << log.text();
  EXPECT_FALSE(contains(log.text() + out.str(), "s3cr3t")) << "the URL is never printed";
  const auto requests = server.requests();
  ASSERT_EQ(requests.size(), 6u);
  std::vector<nlohmann::json> bodies;
  for (const auto& r : requests) bodies.push_back(nlohmann::json::parse(r.body));
  for (const auto& body : bodies) {
    EXPECT_TRUE(body["content"].get<std::string>().starts_with("trainer " + dir.path().string())) << body;
    EXPECT_EQ(body["run"], dir.path().string());
    EXPECT_EQ(body["allowed_mentions"]["parse"], nlohmann::json::array()) << "no pings from messages";
    EXPECT_LE(body["content"].get<std::string>().size(), 2000u);
  }
  EXPECT_EQ(bodies[0]["event"], "start");
  EXPECT_EQ(bodies[0]["model"], "qwen2");
  EXPECT_EQ(bodies[0]["total_steps"], 10);
  EXPECT_EQ(bodies[1]["event"], "checkpoint");
  EXPECT_EQ(bodies[1]["step"], 1);
  EXPECT_EQ(bodies[1]["path"], "out/checkpoint-1");
  EXPECT_DOUBLE_EQ(bodies[1]["eval_loss"].get<double>(), 2.5);
  EXPECT_TRUE(contains(bodies[1]["content"].get<std::string>(), "checkpoint at step 1/10 (loss 2.9000, validation loss 2.5000)"));
  EXPECT_EQ(bodies[2]["event"], "stopped");
  EXPECT_EQ(bodies[2]["signal"], "SIGTERM");
  EXPECT_EQ(bodies[3]["event"], "finish");
  EXPECT_EQ(bodies[3]["model_dir"], "out/final");
  EXPECT_EQ(bodies[3]["last_checkpoint"], "out/checkpoint-1");
  EXPECT_TRUE(contains(bodies[3]["content"].get<std::string>(), "finished 1 steps")) << bodies[3];
  EXPECT_EQ(bodies[4]["event"], "failure");
  EXPECT_EQ(bodies[4]["exit_code"], 3);
  EXPECT_EQ(bodies[4]["message"], "data.jsonl:7: invalid JSON\nmore detail");
  EXPECT_TRUE(contains(bodies[4]["content"].get<std::string>(), "FAILED at step 1/10 (exit code 3): data.jsonl:7: invalid JSON"));
  EXPECT_FALSE(contains(bodies[4]["content"].get<std::string>(), "more detail")) << "content is one line";
  EXPECT_EQ(bodies[5]["exit_code"], 4);
  EXPECT_TRUE(contains(bodies[5]["message"].get<std::string>(), "CUDA out of memory")) << bodies[5];
}

// fp16-mixed: each step record has the loss scale, whether the step was skipped (grad_norm null then) and the run's
// skipped steps; the numbers are TensorBoard scalars too; the summary counts the skips. Other modes have none.
TEST(LogReporter, LossScalingInMetricsAndSummary) {
  test::TempDir dir;
  test::CapturedLog log("%v");
  std::ostringstream out;
  {
    const auto config = config_in(dir.path());
    Reporter reporter(config, out);
    reporter.on_start({"qwen2", 1000, 1000, 3, 4, 0, 0, ""});
    auto skipped = step_metrics(1);
    skipped.grad_norm = std::nan("");
    skipped.loss_scaling = LossScaling{65536.0, true, 1};
    reporter.on_step(skipped);
    auto taken = step_metrics(2);
    taken.loss_scaling = LossScaling{32768.0, false, 1};
    reporter.on_step(taken);
    reporter.on_step(step_metrics(3));
  }
  const auto records = test::read_jsonl(dir.path() / "metrics.jsonl");
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0]["loss_scale"], 65536.0);
  EXPECT_EQ(records[0]["skipped"], true);
  EXPECT_EQ(records[0]["skipped_steps"], 1);
  EXPECT_TRUE(records[0]["grad_norm"].is_null());
  EXPECT_EQ(records[1]["loss_scale"], 32768.0);
  EXPECT_EQ(records[1]["skipped"], false);
  EXPECT_EQ(records[1]["grad_norm"], 0.5);
  EXPECT_FALSE(records[2].contains("loss_scale"));
  std::vector<std::string> tags;
  for (const auto& name : scalar_names()) tags.push_back(name.key);
  for (const char* key : {"loss_scale", "skipped_steps"})
    EXPECT_NE(std::find(tags.begin(), tags.end(), key), tags.end()) << key;

  RunSummary s;
  s.steps = 10;
  s.loss_scaling = RunSummary::LossScalingSummary{3, 1, 8192.0};
  EXPECT_TRUE(contains(format_summary(s), "fp16 loss scaling: 3 steps skipped for inf/NaN gradients (1 in this run); "
                                          "loss scale 8192"))
      << format_summary(s);
  s.loss_scaling = RunSummary::LossScalingSummary{1, 0, 65536.0};
  EXPECT_TRUE(contains(format_summary(s), "fp16 loss scaling: 1 step skipped for inf/NaN gradients (0 in this run)"))
      << format_summary(s);
  EXPECT_FALSE(contains(format_summary(RunSummary{}), "loss scaling"));
}

TEST(LogReporter, SummaryListsEveryRanksPeakMemoryAndTimeInCollectives) {
  RunSummary s;
  s.backend = "gloo";
  s.ranks = {{3 << 20, 1.25}, {5 << 20, 0.5}};
  const auto text = format_summary(s);
  for (const char* part : {"data parallelism: 2 ranks (gloo); peak memory and time in collectives",
                           "    rank 0: 3.00 MiB, 1.2 s", "    rank 1: 5.00 MiB, 0.5 s"})
    EXPECT_TRUE(contains(text, part)) << part << " missing from:\n" << text;
  EXPECT_FALSE(contains(format_summary(RunSummary{}), "data parallelism"));
  EXPECT_FALSE(contains(text, "tokenized")) << "image runs tokenize nothing: no column";
  // Text runs: the training records each rank tokenized (its share).
  s.ranks[0].records_tokenized = 31;
  s.ranks[1].records_tokenized = 30;
  const auto text_run = format_summary(s);
  for (const char* part :
       {"    rank 0: 3.00 MiB, 1.2 s, 31 records tokenized", "    rank 1: 5.00 MiB, 0.5 s, 30 records tokenized"})
    EXPECT_TRUE(contains(text_run, part)) << part << " missing from:\n" << text_run;
  // Beyond 16 ranks: rank 0 and the extremes, not a line per rank.
  s.ranks.assign(20, {1 << 20, 1.0});
  s.ranks[7] = {9 << 20, 1.0};
  s.ranks[11] = {1 << 20, 4.0};
  s.ranks[13] = {1 << 20, 0.25};
  const auto many = format_summary(s);
  for (const char* part : {"20 ranks", "highest peak memory:\n      rank 7: 9.00 MiB",
                           "longest in collectives:\n      rank 11: 1.00 MiB, 4.0 s",
                           "shortest in collectives:\n      rank 13: 1.00 MiB, 0.2 s"})
    EXPECT_TRUE(contains(many, part)) << part << " missing from:\n" << many;
  EXPECT_FALSE(contains(many, "rank 3:")) << many;
}

}  // namespace trainer
