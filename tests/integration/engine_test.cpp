// The engine's guarantees, each one test run over every task (text, image classification, contrastive CLIP, text
// with QLoRA: LoRA over a 4-bit base, and DPO with LoRA and as a full fine-tune) through the real binary on the tiny demo configs: --resume-if-present continues, kill -9 at a random moment resumes to the
// uninterrupted weights, SIGTERM writes a checkpoint and exits 0, an out-of-memory error mid-run ends at the
// unconstrained weights, the end of the memory ladder moves the run to the CPU, --allow-data-change starts a new
// epoch, memory.snapshot_on_oom is honoured, a missing model directory gets one error, the progress counts what the
// task counts. Before the one engine, each held for text runs only (docs/architecture.md "The engine").
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "support/ranks.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {
namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

struct TaskCase {
  std::string name;    // the test's suffix
  std::string config;  // the tiny demo config
  std::string unit;    // what the progress line counts per second
  std::vector<std::string> extra;
  std::string task;                                  // train_state.json's "task"
  std::string train_file;                            // text: the demo's training file
  std::string weights_file = "model.safetensors";   // in final/: what the run trains
};

std::ostream& operator<<(std::ostream& out, const TaskCase& c) { return out << c.name; }

const TaskCase kText{"Text", "configs/tiny-t5.json", "tok", {"--set", "evaluation.sample_prompts=[]"}, "text",
                     "data/demo/recipes-seq2seq.jsonl"};
const TaskCase kImage{"Image", "configs/tiny-vit.json", "images", {}, "image"};
const TaskCase kClip{"Contrastive", "configs/tiny-clip.json", "pairs", {}, "contrastive"};
// QLoRA: LoRA on every linear layer of a tiny Qwen2 whose frozen base is held in NF4 (the adapter is what trains).
const TaskCase kQlora{"Qlora",
                      "configs/tiny-qwen2.json",
                      "tok",
                      {"--set", "evaluation.sample_prompts=[]", "--set", "model.quantize=nf4", "--set",
                       "lora.enabled=true", "--set",
                       "lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"]"},
                      "text",
                      "data/demo/recipes-causal.jsonl",
                      "adapter_model.safetensors"};

// DPO: preference pairs on the tiny Qwen2, with LoRA (the reference is the base under the adapters) and as a full
// fine-tune (a frozen copy of the starting weights is the reference, and moves with the run). Sequences of 128 tokens
// keep the runs short.
const TaskCase kDpo{"Dpo",
                    "configs/tiny-qwen2-dpo.json",
                    "pairs",
                    {"--set", "data.max_length=128"},
                    "dpo",
                    "data/demo/preferences.jsonl",
                    "adapter_model.safetensors"};
const TaskCase kDpoFull{"DpoFull",
                        "configs/tiny-qwen2-dpo.json",
                        "pairs",
                        {"--set", "data.max_length=128", "--set", "lora.enabled=false", "--set", "optimizer.lr=3e-4"},
                        "dpo",
                        "data/demo/preferences.jsonl"};

// DPO with dpo.precompute_reference: a full fine-tune whose reference ran in one pass before training (no frozen
// copy); resumes reuse its file, --allow-data-change computes it again, a memory limit halves its pieces.
const TaskCase kDpoPrecomputed{"DpoPrecomputed",
                               "configs/tiny-qwen2-dpo.json",
                               "pairs",
                               {"--set", "data.max_length=128", "--set", "lora.enabled=false", "--set",
                                "optimizer.lr=3e-4", "--set", "dpo.precompute_reference=true"},
                               "dpo",
                               "data/demo/preferences.jsonl"};

bool same_bytes(const fs::path& a, const fs::path& b) { return read_text(a) == read_text(b); }

class Task : public ::testing::TestWithParam<TaskCase> {
 protected:
  // A short run of the task's demo into `out`: micro-batches of 8 (accumulation over two), a constant learning rate
  // (so a run cut short and continued with a longer max_steps follows the same schedule), no evaluation, a checkpoint
  // every 2 steps, a log line every step.
  std::vector<std::string> args(const fs::path& out, int steps, std::vector<std::string> more = {}) const {
    std::vector<std::string> a = {"--config", GetParam().config, "--set", "checkpoint.output_dir=" + out.string(),
                                  "--set", "training.max_steps=" + std::to_string(steps), "--set",
                                  "training.micro_batch_size=8", "--set", "scheduler.name=constant", "--set",
                                  "scheduler.warmup_steps=0", "--set", "evaluation.every_steps=0", "--set",
                                  "data.validation_files=[]", "--set", "checkpoint.every_steps=2", "--set",
                                  "logging.every_steps=1"};
    a.insert(a.end(), GetParam().extra.begin(), GetParam().extra.end());
    a.insert(a.end(), more.begin(), more.end());
    return a;
  }
  static fs::path weights(const fs::path& out) { return out / "final" / GetParam().weights_file; }

  TempDir dir;
};

// A run stopped after step 4 and started again with a longer max_steps and --resume-if-present (one command for a
// job's first start and its restarts) continues at step 5: metrics.jsonl gets steps 5 and 6 once, and the weights are
// those of one uninterrupted run of 6 steps, bit for bit. A first start with the flag and no checkpoint starts at 1.
TEST_P(Task, ResumeIfPresentContinuesTheRun) {
  const fs::path out = dir.path() / "run", straight = dir.path() / "straight";
  auto first = run_trainer(args(out, 4, {"--resume-if-present"}));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_TRUE(contains(first.err, "no complete checkpoint")) << first.err;
  auto second = run_trainer(args(out, 6, {"--resume-if-present"}));
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_TRUE(contains(second.err, "resuming from")) << second.err;
  EXPECT_TRUE(contains(second.err, "checkpoint-4")) << second.err;
  EXPECT_EQ(metric_values(out / "metrics.jsonl", "step"), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  auto whole = run_trainer(args(straight, 6));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_TRUE(same_bytes(weights(out), weights(straight))) << max_difference(weights(out), weights(straight));
  EXPECT_EQ(metric_values(out / "metrics.jsonl", "loss"), metric_values(straight / "metrics.jsonl", "loss"));
}

// kill -9 at a random moment after the first checkpoint (before, during or after later checkpoint writes), then
// --resume-if-present until the run ends: the weights of the uninterrupted run, bit for bit.
TEST_P(Task, KillNineAtARandomMomentResumesToTheUninterruptedWeights) {
  const fs::path out = dir.path() / "killed", straight = dir.path() / "straight";
  std::mt19937 random(std::random_device{}());
  const double delay = std::uniform_real_distribution<double>(0.0, 1.5)(random);
  SCOPED_TRACE("killed " + std::to_string(delay) + " s after the first checkpoint");
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " && { " + shell_quote(trainer_binary());
  for (const auto& a : args(out, 10, {"--set", "checkpoint.every_steps=1"})) command += " " + shell_quote(a);
  const auto log = dir.file("killed.log");
  command += " >/dev/null 2>" + shell_quote(log) + " & pid=$!; until grep -q 'checkpoint step' " + shell_quote(log) +
             " 2>/dev/null || ! kill -0 $pid 2>/dev/null; do sleep 0.02; done; sleep " + std::to_string(delay) +
             "; kill -KILL $pid 2>/dev/null; wait $pid; }";
  std::system(command.c_str());
  auto resumed = run_trainer(args(out, 10, {"--set", "checkpoint.every_steps=1", "--resume-if-present"}));
  ASSERT_EQ(resumed.exit_code, 0) << read_text(log) << resumed.err;
  auto whole = run_trainer(args(straight, 10, {"--set", "checkpoint.every_steps=1"}));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_TRUE(same_bytes(weights(out), weights(straight))) << max_difference(weights(out), weights(straight));
}

// SIGTERM (a preempted container) once a checkpoint exists: the run finishes its step, writes a checkpoint of it,
// says how to continue and exits 0; the checkpoint is the last step metrics.jsonl logged.
TEST_P(Task, SigtermWritesACheckpointAndExitsZero) {
  const fs::path out = dir.path() / "stopped";
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " && { " + shell_quote(trainer_binary());
  for (const auto& a : args(out, 100000)) command += " " + shell_quote(a);
  command += " >" + shell_quote(dir.file("out")) + " 2>" + shell_quote(dir.file("err")) + " & pid=$!; until [ -e " +
             shell_quote((out / "checkpoint-2" / "COMPLETE").string()) +
             " ] || ! kill -0 $pid 2>/dev/null; do sleep 0.05; done; kill -TERM $pid; wait $pid; }";
  const int status = std::system(command.c_str());
  const std::string printed = read_text(dir.file("out")), err = read_text(dir.file("err"));
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << err;
  EXPECT_TRUE(contains(printed, "Stopped by SIGTERM")) << printed << err;
  const auto steps = metric_values(out / "metrics.jsonl", "step");
  ASSERT_FALSE(steps.empty());
  const auto last = out / ("checkpoint-" + std::to_string(static_cast<int64_t>(steps.back())));
  EXPECT_TRUE(fs::exists(last / "COMPLETE")) << last;
  std::ifstream state(last / "train_state.json");
  EXPECT_EQ(nlohmann::json::parse(state).value("task", ""), GetParam().task);
}

// A budget between the peaks of micro-batches of 4 and 16, with regrowth after 2 steps: the micro-batch falls at
// step 1, grows back and falls again mid-run, and the run ends at the weights of a run without a limit. Within 3e-5:
// another split sums the same gradients in another order (float32 rounding, about 1e-7 relative), and six AdamW steps
// at a constant 1e-4 (each moves a weight by up to the learning rate, whatever the gradient's size) amplify it;
// CLIP's gradient caching measured 1.2e-5 here.
TEST_P(Task, OutOfMemoryMidRunReachesTheUnconstrainedWeights) {
  const std::vector<std::string> whole_batch = {"--set", "training.micro_batch_size=16", "--set",
                                                "optimizer.lr=1e-4", "--set", "checkpoint.every_steps=0"};
  auto peak = [&](const std::string& micro) {
    const fs::path out = dir.path() / ("peak-" + micro);
    auto a = args(out, 1, whole_batch);
    a.insert(a.end(), {"--set", "training.micro_batch_size=" + micro});
    auto r = run_trainer(a);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return metric_values(out / "metrics.jsonl", "memory_peak").at(0);
  };
  const double four = peak("4"), sixteen = peak("16");
  ASSERT_LT(four, sixteen);
  auto free_run = run_trainer(args(dir.path() / "free", 6, whole_batch));
  ASSERT_EQ(free_run.exit_code, 0) << free_run.err;
  auto constrained_args = args(dir.path() / "constrained", 6, whole_batch);
  constrained_args.insert(constrained_args.end(),
                          {"--set", "memory.limit=" + std::to_string(static_cast<int64_t>((four + sixteen) / 2)),
                           "--set", "memory.regrow_after_steps=2"});
  auto constrained = run_trainer(constrained_args);
  ASSERT_EQ(constrained.exit_code, 0) << constrained.err;
  const auto micro = metric_values(dir.path() / "constrained" / "metrics.jsonl", "micro_batch");
  const auto retries = metric_values(dir.path() / "constrained" / "metrics.jsonl", "oom_retries");
  ASSERT_EQ(micro.size(), 6u);
  EXPECT_LT(micro[0], 16) << constrained.err;
  double later_retries = 0;
  for (std::size_t i = 1; i < retries.size(); ++i) later_retries += retries[i];
  EXPECT_GE(later_retries, 1) << "regrowth must run out of memory again mid-run\n" << constrained.err;
  EXPECT_LT(max_difference(weights(dir.path() / "free"), weights(dir.path() / "constrained")), 3e-5);
}

// The end of the memory ladder: a budget that holds the model and its optimizer state but not one example's step, and
// device.allow_cpu_fallback=true: the run moves off the budgeted device to the CPU at step 1, goes on, and reaches the
// weights of a run without a limit. Without the fallback it stops with exit 4, a memory report and what to change.
TEST_P(Task, TheEndOfTheLadderMovesTheRunToTheCpu) {
  const std::vector<std::string> single = {"--set", "training.micro_batch_size=1", "--set", "training.batch_size=2",
                                           "--set", "checkpoint.every_steps=0", "--set",
                                           "memory.escalation=[\"move_to_cpu\"]"};
  auto free_run = run_trainer(args(dir.path() / "free", 3, single));
  ASSERT_EQ(free_run.exit_code, 0) << free_run.err;
  const auto metrics = dir.path() / "free" / "metrics.jsonl";
  // Between what stays allocated after a step (weights, gradients, optimizer state) and a step's peak.
  const double held = metric_values(metrics, "memory_allocated").at(0), peak = metric_values(metrics, "memory_peak").at(0);
  ASSERT_LT(held, peak);
  const std::string limit = std::to_string(static_cast<int64_t>(held + (peak - held) / 4));
  auto moved_args = args(dir.path() / "moved", 3, single);
  moved_args.insert(moved_args.end(), {"--set", "memory.limit=" + limit, "--set", "device.allow_cpu_fallback=true"});
  auto moved = run_trainer(moved_args);
  ASSERT_EQ(moved.exit_code, 0) << moved.err;
  EXPECT_TRUE(contains(moved.err, "MOVING THE RUN")) << moved.err;
  EXPECT_EQ(metric_values(dir.path() / "moved" / "metrics.jsonl", "device_moves"), (std::vector<double>{1, 1, 1}));
  EXPECT_LT(max_difference(weights(dir.path() / "free"), weights(dir.path() / "moved")), 1e-5);

  auto stopped_args = args(dir.path() / "stopped", 3, single);
  stopped_args.insert(stopped_args.end(), {"--set", "memory.limit=" + limit});
  auto stopped = run_trainer(stopped_args);
  EXPECT_EQ(stopped.exit_code, 4) << stopped.err;
  for (const char* part : {"memory report:", "move_to_cpu not made: device.allow_cpu_fallback=false",
                           "device.allow_cpu_fallback=true", "the last completed step (0) is saved in"})
    EXPECT_TRUE(contains(stopped.err, part)) << part << "\n" << stopped.err;
}

// The training data changed since the checkpoint: a resume is refused, exit 3, naming what changed; with
// --allow-data-change it continues from the checkpoint's step with a new epoch over the data as it is now.
TEST_P(Task, AllowDataChangeStartsANewEpochOverTheNewData) {
  // A copy of the task's training data with one record fewer.
  std::vector<std::string> data;
  if (!GetParam().train_file.empty()) {
    fs::copy_file(fs::path(TRAINER_SOURCE_DIR) / GetParam().train_file, dir.file("train.jsonl"));
    data = {"--set", "data.train_files=[\"" + dir.file("train.jsonl") + "\"]"};
  } else {
    fs::copy(fs::path(TRAINER_SOURCE_DIR) / "data/demo/images", dir.path() / "images", fs::copy_options::recursive);
    data = {"--set", GetParam().name == "Image"
                         ? "data.train_files=[\"" + (dir.path() / "images" / "train").string() + "\"]"
                         : "data.train_files=[\"" + (dir.path() / "images" / "train-captions.jsonl").string() + "\"]"};
  }
  const fs::path out = dir.path() / "run";
  auto first = run_trainer(args(out, 2, data));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  if (GetParam().name == "Image") {
    fs::remove(dir.path() / "images" / "train" / "checker-purple" / "checker-purple-0000.jpg");
  } else {
    const fs::path file = !GetParam().train_file.empty() ? fs::path(dir.file("train.jsonl"))
                                                    : dir.path() / "images" / "train-captions.jsonl";
    std::string text = read_text(file);
    text.erase(0, text.find('\n') + 1);
    write_file(file.string(), text);
  }
  auto refused = run_trainer(args(out, 4, with(data, {"--resume"})));
  EXPECT_EQ(refused.exit_code, 3) << refused.err;
  EXPECT_TRUE(contains(refused.err, "--allow-data-change")) << refused.err;
  auto allowed = run_trainer(args(out, 4, with(data, {"--resume", "--allow-data-change"})));
  ASSERT_EQ(allowed.exit_code, 0) << allowed.err;
  EXPECT_TRUE(contains(allowed.err, "the data changed: epoch 2 starts over it")) << allowed.err;
  EXPECT_EQ(metric_values(out / "metrics.jsonl", "step"), (std::vector<double>{1, 2, 3, 4}));
}

// memory.snapshot_on_oom needs a CUDA device: on the CPU every task says that none will be written (it was silently
// ignored by image and CLIP runs).
TEST_P(Task, SnapshotOnOomIsHonouredOrSaysWhyNot) {
  auto r = run_trainer(args(dir.path() / "run", 1, {"--set", "memory.snapshot_on_oom=true"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "memory.snapshot_on_oom: allocator snapshots need a CUDA device")) << r.err;
}

// A model directory that does not exist: exit 3 and the same message for every task.
TEST_P(Task, AMissingModelDirectoryGetsOneError) {
  for (const bool dry_run : {true, false}) {
    auto a = args(dir.path() / "run", 1, {"--set", "model.path=" + dir.file("no-such-model")});
    if (dry_run) a.push_back("--dry-run");
    auto r = run_trainer(a);
    EXPECT_EQ(r.exit_code, 3) << r.err;
    EXPECT_TRUE(contains(r.err, "model directory " + dir.file("no-such-model") + " does not exist")) << r.err;
  }
}

// memory.limit below the model's weights: exit 4 with what the weights, gradients and optimizer state need, as
// `trainer plan` counts them, and a limit that would hold them.
TEST_P(Task, AMemoryLimitBelowTheWeightsSaysWhatTheyNeed) {
  auto r = run_trainer(args(dir.path() / "run", 1, {"--set", "memory.limit=16KiB"}));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  for (const char* part : {"out of memory allocating the model's weights",
                           "what the run needs before its first example (as `trainer plan` counts it):",
                           "hint: a memory.limit of at least"})
    EXPECT_TRUE(contains(r.err, part)) << part << "\n" << r.err;
}

// A fresh run in a directory that holds an earlier run's checkpoints says so, and how to continue that run instead.
TEST_P(Task, AFreshRunBesideAnEarlierRunsCheckpointsSaysSo) {
  auto first = run_trainer(args(dir.path() / "run", 2));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_FALSE(contains(first.err, "earlier run")) << first.err;
  auto second = run_trainer(args(dir.path() / "run", 2));
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_TRUE(contains(second.err, "already holds checkpoints of an earlier run (newest checkpoint-2)")) << second.err;
}

// The progress line and the summary count what the task counts: target tokens, images or image-caption pairs.
TEST_P(Task, TheProgressCountsWhatTheTaskCounts) {
  auto r = run_trainer(args(dir.path() / "run", 2));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, " " + std::string(GetParam().unit == "tok" ? "tokens" : GetParam().unit) + "/s "))
      << r.err;
  EXPECT_TRUE(contains(r.out, GetParam().unit == "tok" ? "tokens/s)" : GetParam().unit + "/s)")) << r.out;
  if (GetParam().unit != "tok") {
    EXPECT_FALSE(contains(r.err, "tokens/s")) << r.err;
    EXPECT_EQ(metric_values(dir.path() / "run" / "metrics.jsonl", GetParam().unit).size(), 2u);
  }
}

INSTANTIATE_TEST_SUITE_P(IntegrationEngine, Task,
                         ::testing::Values(kText, kImage, kClip, kQlora, kDpo, kDpoFull, kDpoPrecomputed),
                         [](const ::testing::TestParamInfo<TaskCase>& param) { return param.param.name; });

// Evaluation out of memory at evaluation micro-batch 1 on one of two ranks: every rank stops with exit 4 and one error
// naming that rank, none waits in a collective for it. Rank 1's budget holds its training steps but not the scores
// over every validation pair (CLIP's similarity matrix over 1200 pairs); the text task's case (long validation
// examples) is IntegrationDistributed.EvaluationOutOfMemoryOnOneRankStopsEveryRankNamingIt. (An image classifier's
// evaluation of one image needs less than its training step of one image: no budget separates them on the CPU.)
TEST(IntegrationDistributed, EvaluationOutOfMemoryOnOneRankIsAgreedContrastive) {
  TempDir dir;
  fs::copy(fs::path(TRAINER_SOURCE_DIR) / "data/demo/images", dir.path() / "images", fs::copy_options::recursive);
  const std::string pairs = read_text(dir.path() / "images" / "validation-captions.jsonl");
  std::string many;
  while (std::count(many.begin(), many.end(), '\n') < 1200) many += pairs;
  write_file((dir.path() / "images" / "many-captions.jsonl").string(), many);
  const std::vector<std::string> args = {
      "--config", "configs/tiny-clip.json", "--set",
      "data.train_files=[\"" + (dir.path() / "images" / "train-captions.jsonl").string() + "\"]", "--set",
      "data.validation_files=[\"" + (dir.path() / "images" / "many-captions.jsonl").string() + "\"]", "--set",
      "training.micro_batch_size=2", "--set", "training.max_steps=1", "--set", "evaluation.every_steps=1", "--set",
      "evaluation.class_prompts=[]", "--set", "checkpoint.every_steps=0", "--set",
      "checkpoint.output_dir=" + (dir.path() / "out").string()};
  const auto ranks = run_ranks(2, args, {{}, {"--set", "memory.limit=4MiB"}});
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 4) << all_errors(ranks);
    EXPECT_TRUE(contains(r.err, "evaluation ran out of memory on rank(s) 1 ")) << all_errors(ranks);
    EXPECT_FALSE(contains(r.err, "died or hangs")) << all_errors(ranks);
  }
}

}  // namespace
}  // namespace trainer::test
