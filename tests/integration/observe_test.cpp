// What a user watches, on the real binary: the webhook (a local HTTP server), the progress line and plain lines,
// the log file, keep_best across --resume, and the final summary.
#include <chrono>
#include <filesystem>
#include <future>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/http_server.h"
#include "support/output.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace trainer::test {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A short tiny-qwen2 run into `dir`: 6 steps, evaluation and checkpoints every 3.
std::vector<std::string> short_run(const fs::path& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--config", "configs/tiny-qwen2.json", "--set", "training.max_steps=6",
                                   "--set", "evaluation.every_steps=3", "--set", "checkpoint.every_steps=3",
                                   "--set", "checkpoint.output_dir=" + dir.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<nlohmann::json> bodies(const HttpServer& server) {
  std::vector<nlohmann::json> result;
  for (const auto& request : server.requests()) result.push_back(nlohmann::json::parse(request.body));
  return result;
}

}  // namespace

TEST(IntegrationObserve, WebhookHearsStartCheckpointFinishAndFailures) {
  TempDir dir;
  HttpServer server;
  const std::string env = "TRAINER_WEBHOOK_URL=" + shell_quote(server.url("/api/webhooks/42/s3cr3t-token"));
  auto run = run_trainer(short_run(dir.path() / "run"), env);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.err, "webhook: on")) << run.err;
  EXPECT_FALSE(contains(run.out + run.err, "s3cr3t")) << "the URL is never printed";
  auto events = bodies(server);
  ASSERT_EQ(events.size(), 4u) << server.requests().size();
  EXPECT_EQ(events[0]["event"], "start");
  EXPECT_EQ(events[0]["model"], "qwen2");
  EXPECT_EQ(events[0]["total_steps"], 6);
  EXPECT_EQ(events[1]["event"], "checkpoint");
  EXPECT_EQ(events[1]["step"], 3);
  EXPECT_EQ(events[1]["path"], (dir.path() / "run" / "checkpoint-3").string());
  EXPECT_TRUE(events[1].contains("eval_loss"));
  EXPECT_EQ(events[2]["event"], "checkpoint");  // the end of the run
  EXPECT_EQ(events[2]["step"], 6);
  EXPECT_EQ(events[3]["event"], "finish");
  EXPECT_EQ(events[3]["step"], 6);
  EXPECT_EQ(events[3]["model_dir"], (dir.path() / "run" / "final").string());
  for (const auto& e : events) EXPECT_TRUE(e["content"].get<std::string>().starts_with("trainer ")) << e;
  EXPECT_TRUE(contains(run_trainer({"train", "--help"}).out, "TRAINER_WEBHOOK_URL")) << "--help names the variable";

  // Exit 3: nothing to resume from.
  auto data_error = run_trainer(short_run(dir.path() / "empty", {"--resume"}), env);
  EXPECT_EQ(data_error.exit_code, 3) << data_error.err;
  // Exit 4: out of memory at the floor.
  auto oom = run_trainer(short_run(dir.path() / "oom", {"--set", "memory.limit=2MiB", "--set",
                                                         "training.micro_batch_size=16"}),
                         env);
  EXPECT_EQ(oom.exit_code, 4) << oom.err;
  events = bodies(server);
  ASSERT_EQ(events.size(), 4u + 1u + 3u) << "two failures; the OOM run's start and its checkpoint of step 0";
  EXPECT_EQ(events[4]["event"], "failure");
  EXPECT_EQ(events[4]["exit_code"], 3);
  EXPECT_TRUE(contains(events[4]["message"].get<std::string>(), "no complete checkpoint")) << events[4];
  EXPECT_EQ(events[5]["event"], "start");
  EXPECT_EQ(events[6]["event"], "checkpoint");
  EXPECT_EQ(events[6]["step"], 0);
  EXPECT_EQ(events[7]["event"], "failure");
  EXPECT_EQ(events[7]["exit_code"], 4);
  EXPECT_TRUE(contains(events[7]["content"].get<std::string>(), "FAILED at step 0/6 (exit code 4)")) << events[7];
}

// An endpoint that refuses every connection costs the run nothing: it ends as it would without a webhook (same exit
// code, same weights), and the log says a notification was not delivered. That posting never waits for the network
// is LogWebhook.PostReturnsWhileARequestIsInFlight's check (no timing in either).
TEST(IntegrationObserve, UnreachableWebhookNeitherFailsNorChangesTheRun) {
  TempDir dir;
  const auto plain = run_trainer(short_run(dir.path() / "plain"));
  const auto hooked = run_trainer(short_run(dir.path() / "hooked"),
                                  "TRAINER_WEBHOOK_URL=http://127.0.0.1:" + std::to_string(closed_port()) + "/hook");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(hooked.exit_code, 0) << hooked.err;
  EXPECT_TRUE(contains(hooked.out, "Done: 6 steps"));
  EXPECT_TRUE(contains(hooked.err, "webhook: a notification was not delivered")) << hooked.err;
  auto bytes = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const auto weights = bytes(dir.path() / "plain" / "final" / "model.safetensors");
  ASSERT_FALSE(weights.empty());
  EXPECT_EQ(weights, bytes(dir.path() / "hooked" / "final" / "model.safetensors")) << "the same weights";
}

TEST(IntegrationObserve, ProgressLineLogLinesAndTheLogFile) {
  TempDir dir;
  // bar: the live line even without a terminal; log lines are never written into it.
  auto bar = run_trainer(short_run(dir.path() / "bar", {"--set", "logging.progress=bar"}));
  ASSERT_EQ(bar.exit_code, 0) << bar.err;
  EXPECT_TRUE(contains(bar.err, "\r\033[K")) << bar.err;
  const auto lines = rendered_lines(bar.err);
  bool status_seen = false;
  for (const auto& line : lines) {
    if (contains(line, "ETA")) {
      status_seen = true;
      ADD_FAILURE() << "a status line was left on the screen: " << line;
    }
    if (contains(line, "eval step") || contains(line, "checkpoint step")) {
      EXPECT_TRUE(line.starts_with("[")) << "garbled: " << line;
    }
  }
  EXPECT_FALSE(status_seen);
  EXPECT_TRUE(contains(bar.err, "6/6 100% ETA 0s | loss ")) << "the last status line";
  EXPECT_TRUE(contains(bar.err, "tok/s | mem "));
  EXPECT_FALSE(contains(bar.err, "] step 5/6")) << "no plain lines with the live line";

  // auto without a terminal: plain lines every logging.every_steps (5) and at the end, no escape codes.
  const auto log_file = dir.path() / "logs" / "run.log";
  auto plain = run_trainer(short_run(dir.path() / "plain", {"--set", "logging.log_file=" + log_file.string()}));
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_FALSE(contains(plain.err, "\r")) << plain.err;
  EXPECT_TRUE(contains(plain.err, "step 5/6 loss ")) << plain.err;
  EXPECT_TRUE(contains(plain.err, "step 6/6 loss "));
  EXPECT_TRUE(contains(plain.err, " ETA "));
  // The log file has the same log.
  const auto logged = read_text(log_file);
  EXPECT_TRUE(contains(logged, "step 5/6 loss ")) << logged;
  EXPECT_TRUE(contains(logged, "eval step 6:"));
  EXPECT_TRUE(contains(logged, "sample step 3:"));

  // off: no progress lines, the rest of the log stays.
  auto off = run_trainer(short_run(dir.path() / "off", {"--set", "logging.progress=off"}));
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_FALSE(contains(off.err, "step 5/6 loss")) << off.err;
  EXPECT_TRUE(contains(off.err, "eval step 6:"));

  // An unwritable log file is a usage error naming the key.
  auto bad = run_trainer(short_run(dir.path() / "bad", {"--set", "logging.log_file=/proc/no/such/dir/run.log"}));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(contains(bad.err, "logging.log_file")) << bad.err;
}

// Both streams into one file (docker logs, CI, nohup): every line whole and in the order it happened: the
// start-up table and the plan before the micro-batch probe's log lines, the summary at the end.
TEST(IntegrationObserve, OneFileForBothStreamsKeepsTheLinesInOrder) {
  TempDir dir;
  auto run = run_trainer(short_run(dir.path() / "run", {"--set", "training.micro_batch_size=auto"}), "", true);
  ASSERT_EQ(run.exit_code, 0) << run.out;
  const auto at = [&](const std::string& text) { return run.out.find(text); };
  const auto table = at("Resolved configuration"), plan = at("Plan:"), probe = at("micro_batch_size=auto: 1 ");
  ASSERT_NE(table, std::string::npos) << run.out;
  ASSERT_NE(probe, std::string::npos) << run.out;
  EXPECT_LT(table, plan);
  EXPECT_LT(plan, probe) << run.out;
  EXPECT_LT(at("step 5/6 loss "), at("Done: 6 steps")) << run.out;
  // The table's rows are whole: between its header and the plan, every line is a row (key, value, default, from).
  std::istringstream lines(run.out.substr(table, plan - table));
  std::string line;
  std::getline(lines, line);
  while (std::getline(lines, line)) {
    if (!line.empty()) {
      EXPECT_FALSE(contains(line, "[info]") || contains(line, "[warn")) << "a log line in the table: " << line;
    }
  }
  EXPECT_TRUE(contains(run.out.substr(table, plan - table), "training.max_steps")) << "a changed key is listed";
}

TEST(IntegrationObserve, SummaryAndKeepBestAcrossResume) {
  TempDir dir;
  const auto out_dir = dir.path() / "best";
  const std::vector<std::string> common = {"--config", "configs/tiny-qwen2.json", "--set", "evaluation.every_steps=2",
                                           "--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep_last=1",
                                           "--set", "checkpoint.keep_best=true", "--set", "optimizer.lr=0.03",
                                           "--set", "scheduler.name=constant", "--set",
                                           "checkpoint.output_dir=" + out_dir.string()};
  auto with = [&](std::vector<std::string> extra) {
    auto args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return run_trainer(args);
  };
  // Whatever the losses do, the kept checkpoints are the newest and the one with the lowest validation loss.
  auto check_best = [&](int64_t last_checkpoint) {
    std::map<int64_t, double> eval_at;
    for (const auto& r : read_jsonl(out_dir / "metrics.jsonl"))
      if (r.contains("eval_loss") && r["step"].get<int64_t>() <= last_checkpoint &&
          (r["step"].get<int64_t>() % 2 == 0 || r["step"].get<int64_t>() == last_checkpoint))  // every 2 and the end
        eval_at[r["step"].get<int64_t>()] = r["eval_loss"].get<double>();
    ASSERT_FALSE(eval_at.empty());
    auto best = eval_at.begin();
    for (auto it = eval_at.begin(); it != eval_at.end(); ++it)
      if (it->second < best->second) best = it;
    std::ifstream record_file(out_dir / "best_checkpoint.json");
    const auto record = nlohmann::json::parse(record_file);
    EXPECT_EQ(record["step"].get<int64_t>(), best->first);
    EXPECT_DOUBLE_EQ(record["eval_loss"].get<double>(), best->second);
    std::set<std::string> expected = {"checkpoint-" + std::to_string(last_checkpoint),
                                      "checkpoint-" + std::to_string(best->first)};
    std::set<std::string> present;
    for (const auto& entry : fs::directory_iterator(out_dir))
      if (entry.path().filename().string().starts_with("checkpoint-")) present.insert(entry.path().filename().string());
    EXPECT_EQ(present, expected);
    EXPECT_TRUE(fs::exists(out_dir / ("checkpoint-" + std::to_string(best->first)) / "COMPLETE"));
  };
  auto first = with({"--set", "training.max_steps=11"});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  check_best(11);
  // The summary: steps, tokens, time, data, memory, adaptations, where everything is.
  for (const char* part : {"Done: 11 steps", "target tokens; this run", "tokens/s)", "validation loss",
                           "records ", "bad records skipped 0", "truncated ", "peak memory ",
                           "micro-batch adaptations: ", "model saved to ",
                           "last checkpoint ", "checkpoint-11", "best checkpoint ", "metrics ",
                           "tensorboard --logdir "})
    EXPECT_TRUE(contains(first.out, part)) << part << " missing from:\n" << first.out;

  auto resumed = with({"--set", "training.max_steps=15", "--resume"});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "checkpoint.keep_best: the best so far is")) << resumed.err;
  EXPECT_TRUE(contains(resumed.out, "(resumed at step 11)")) << resumed.out;
  check_best(15);
}

}  // namespace trainer::test
