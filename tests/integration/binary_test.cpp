// The real trainer binary: exit codes and messages a user (or a CI script) relies on.
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"

namespace trainer::test {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string write_temp_config(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

}  // namespace

TEST(IntegrationCli, TinyConfigsDryRunAndRun) {
  for (const char* config : {"configs/tiny-t5.json", "configs/tiny-qwen2.json"}) {
    SCOPED_TRACE(config);
    auto dry = run_trainer({"--config", config, "--dry-run"});
    EXPECT_EQ(dry.exit_code, 0) << dry.err;
    EXPECT_TRUE(contains(dry.out, "Resolved configuration"));
    EXPECT_TRUE(contains(dry.out, "Plan:"));
    EXPECT_TRUE(contains(dry.out, "Dry run"));
  }
}

// The README's main command: each tiny config trains on the CPU, its loss falls clearly, the model is saved.
TEST(IntegrationTrain, TinyConfigsTrainAndTheLossFalls) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    const auto out_dir = std::filesystem::temp_directory_path() / ("trainer-train-" + std::string(name));
    std::filesystem::remove_all(out_dir);
    auto run = run_trainer({"--config", std::string("configs/") + name + ".json", "--set",
                            "checkpoint.output_dir=" + out_dir.string()});
    ASSERT_EQ(run.exit_code, 0) << run.err;
    EXPECT_TRUE(contains(run.out, "Done: 60 steps"));
    const auto losses = metric_values(out_dir / "metrics.jsonl", "loss");
    const auto eval_losses = metric_values(out_dir / "metrics.jsonl", "eval_loss");
    ASSERT_EQ(losses.size(), 60u);
    const double first = (losses[0] + losses[1] + losses[2]) / 3, last = (losses[57] + losses[58] + losses[59]) / 3;
    EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;
    ASSERT_EQ(eval_losses.size(), 3u);
    EXPECT_LT(eval_losses.back(), eval_losses.front());
    EXPECT_TRUE(std::filesystem::exists(out_dir / "final" / "model.safetensors"));
    EXPECT_TRUE(std::filesystem::exists(out_dir / "final" / "config.json"));
    // The saved directory is complete: generate --prompt works on it with its own tokenizer.
    auto sample = run_trainer({"generate", "--model", (out_dir / "final").string(), "--prompt", "Recipe: Golden soup",
                               "--max-new-tokens", "8"});
    EXPECT_EQ(sample.exit_code, 0) << sample.err;
    EXPECT_TRUE(contains(sample.out, "text: ")) << sample.out;
    std::filesystem::remove_all(out_dir);
  }
}

// Two batches of short records, then one of a long record that no micro-batch fits under the budget: exit code 4,
// a memory report with what to change, and a full checkpoint of step 2 that continues with more memory and trains
// the long batch (its data cursor is from before that batch).
TEST(IntegrationTrain, OutOfMemoryAtTheFloorExitsFourWithACheckpointThatResumes) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / "trainer-train-floor";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<nlohmann::json> demo;
  {
    std::ifstream file(std::string(TRAINER_SOURCE_DIR) + "/data/demo/recipes-causal.jsonl");
    for (std::string line; demo.size() < 40 && std::getline(file, line);) demo.push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(demo.size(), 40u);
  std::string completion;
  for (std::size_t i = 5; i < 40; ++i) completion += demo[i]["completion"].get<std::string>();
  {
    std::ofstream data(dir / "data.jsonl");
    for (std::size_t i = 0; i < 4; ++i) data << demo[i].dump() << "\n";
    for (int i = 0; i < 2; ++i) data << nlohmann::json{{"prompt", demo[4]["prompt"]}, {"completion", completion}}.dump() << "\n";
  }
  const std::vector<std::string> args = {
      "--config", "configs/tiny-qwen2.json", "--set", "data.train_files=[\"" + (dir / "data.jsonl").string() + "\"]",
      "--set", "data.validation_files=[]", "--set", "data.shuffle=false", "--set", "data.max_length=4096",
      "--set", "training.batch_size=2", "--set", "training.micro_batch_size=2", "--set", "training.max_steps=3",
      "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]",
      "--set", "checkpoint.output_dir=" + (dir / "run").string()};
  auto with = [&](std::vector<std::string> extra) {
    auto all = args;
    all.insert(all.end(), extra.begin(), extra.end());
    return run_trainer(all);
  };
  auto run = with({"--set", "memory.limit=12MiB"});
  EXPECT_EQ(run.exit_code, 4) << run.err;
  for (const char* text : {"out of memory", "memory report", "weights", "gradients", "optimizer state (AdamW)",
                           "activations", "allocations refused", "escalations used: 2 of 4", "move_to_cpu not made: device.allow_cpu_fallback=false", "hint:", "trainer plan",
                           "the last completed step (2)", "--resume-from"})
    EXPECT_TRUE(contains(run.err, text)) << text << "\n" << run.err;
  const auto saved = dir / "run" / "checkpoint-2";
  ASSERT_TRUE(fs::exists(saved / "COMPLETE")) << run.err;
  EXPECT_TRUE(fs::exists(saved / "optimizer.safetensors"));

  // With more memory it continues from step 2 and trains the long batch as step 3.
  auto resumed = with({"--set", "memory.limit=256MiB", "--resume-from", saved.string()});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "at step 2")) << resumed.err;
  std::map<int64_t, int64_t> tokens;
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("loss")) tokens[record["step"].get<int64_t>()] = record["tokens"].get<int64_t>();
  }
  ASSERT_TRUE(tokens.count(2) && tokens.count(3));
  EXPECT_GT(tokens[3] - tokens[2], 1000) << "step 3 after the resume must be the long batch";
  EXPECT_TRUE(fs::exists(dir / "run" / "final" / "model.safetensors"));
  fs::remove_all(dir);
}

// data.on_bad_record=skip in a training run: the problem is shown as it happens with file:line, the end of each
// epoch prints the counts so far, and the summary lists the problem.
TEST(IntegrationTrain, SkippedRecordsAreShownAndCountedPerEpoch) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / "trainer-train-skip";
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ifstream demo(std::string(TRAINER_SOURCE_DIR) + "/data/demo/recipes-causal.jsonl");
    std::ofstream data(dir / "data.jsonl");
    std::string line;
    for (int i = 0; i < 5 && std::getline(demo, line); ++i) {
      data << line << "\n";
      if (i == 2) data << "{\"prompt\": \"no completion\"\n";  // line 4: not JSON
    }
  }
  auto run = run_trainer({"--config", "configs/tiny-qwen2.json", "--set",
                          "data.train_files=[\"" + (dir / "data.jsonl").string() + "\"]", "--set",
                          "data.validation_files=[]", "--set", "data.on_bad_record=skip", "--set",
                          "training.batch_size=2", "--set", "training.micro_batch_size=2", "--set",
                          "training.max_steps=5", "--set", "evaluation.every_steps=0", "--set",
                          "evaluation.sample_prompts=[]", "--set", "checkpoint.output_dir=" + (dir / "run").string()});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::string where = (dir / "data.jsonl").string() + ":4: ";
  EXPECT_TRUE(contains(run.err, "data: skipped " + where)) << run.err;
  EXPECT_TRUE(contains(run.err, "epoch 1 done (data so far: records ")) << run.err;
  EXPECT_TRUE(contains(run.out, "bad records skipped ")) << run.out;
  EXPECT_TRUE(contains(run.out, "    " + where)) << run.out;
  fs::remove_all(dir);
}

TEST(IntegrationCli, HelpAndVersion) {
  EXPECT_EQ(run_trainer({"--help"}).exit_code, 0);
  EXPECT_EQ(run_trainer({"train", "--help"}).exit_code, 0);
  auto version = run_trainer({"--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_TRUE(contains(version.out, "LibTorch 2."));
}

TEST(IntegrationCli, ConfigErrorsExitTwoWithEveryProblem) {
  const auto path = write_temp_config("trainer-bad-config.json", R"({
    "model": {"path": "configs/models/tiny-t5"},
    "data": {"train_files": ["data/demo/recipes-seq2seq.jsonl"]},
    "training": {"batchsize": 8, "seed": "one"}
  })");
  auto r = run_trainer({"--config", path, "--set", "optimizer.lr=fast"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "3 problems")) << r.err;
  EXPECT_TRUE(contains(r.err, "training.batchsize: unknown key; did you mean training.batch_size?"));
  EXPECT_TRUE(contains(r.err, "training.seed: expected an integer"));
  EXPECT_TRUE(contains(r.err, "--set optimizer.lr=fast"));
  EXPECT_EQ(r.out.find("Resolved configuration"), std::string::npos) << "nothing runs on a bad config";

  auto syntax = run_trainer({"--config", write_temp_config("trainer-syntax.json", "{\n  \"model\": {,}\n}")});
  EXPECT_EQ(syntax.exit_code, 2);
  EXPECT_TRUE(contains(syntax.err, "trainer-syntax.json:2:")) << syntax.err;
}

TEST(IntegrationCli, UsageErrorsExitTwo) {
  auto unknown = run_trainer({"--config", "configs/tiny-t5.json", "--no-such-flag"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_TRUE(contains(unknown.err, "--no-such-flag"));
  EXPECT_EQ(run_trainer({"train"}).exit_code, 2);
  auto missing = run_trainer({"--config", "configs/does-not-exist.json"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_TRUE(contains(missing.err, "configs/does-not-exist.json"));
  EXPECT_TRUE(contains(missing.err, "hint:"));
}

TEST(IntegrationCli, MissingDataOrModelExitsThree) {
  auto data = run_trainer({"--config", "configs/tiny-t5.json", "--set", "data.train_files=data/none/*.jsonl"});
  EXPECT_EQ(data.exit_code, 3);
  EXPECT_TRUE(contains(data.err, "data.train_files: no file matches 'data/none/*.jsonl'")) << data.err;
  auto model = run_trainer({"--config", "configs/tiny-t5.json", "--set", "model.path=/nonexistent/model"});
  EXPECT_EQ(model.exit_code, 3);
  EXPECT_TRUE(contains(model.err, "/nonexistent/model"));
  // Pretrained weights asked for where there are none: says how to convert or start from random.
  auto weights = run_trainer({"--config", "configs/tiny-t5.json", "--set", "model.init=pretrained"});
  EXPECT_EQ(weights.exit_code, 3);
  EXPECT_TRUE(contains(weights.err, "model.init=random")) << weights.err;
}

// memory.allocator_conf becomes PYTORCH_ALLOC_CONF unless the environment already sets it (the user's wins).
TEST(IntegrationCli, AllocatorConfIsExportedUnlessTheEnvironmentSetsIt) {
  const std::vector<std::string> args = {"--config", "configs/tiny-t5.json", "--set",
                                         "memory.allocator_conf=expandable_segments:True", "--dry-run"};
  auto ours = run_trainer(args, "env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF");
  EXPECT_EQ(ours.exit_code, 0) << ours.err;
  EXPECT_TRUE(contains(ours.out, "PYTORCH_ALLOC_CONF=expandable_segments:True (memory.allocator_conf)")) << ours.out;
  auto theirs = run_trainer(args, "PYTORCH_ALLOC_CONF=max_split_size_mb:128");
  EXPECT_EQ(theirs.exit_code, 0) << theirs.err;
  EXPECT_TRUE(contains(theirs.out, "PYTORCH_ALLOC_CONF=max_split_size_mb:128 (from the environment)")) << theirs.out;
  EXPECT_TRUE(contains(theirs.err, "memory.allocator_conf is not applied")) << theirs.err;
}

TEST(IntegrationCli, UnavailableDeviceIsAClearUsageError) {
  auto r = run_trainer({"--config", "configs/tiny-t5.json", "--set", "device.type=cuda", "--dry-run"});
  // On a machine with a usable GPU this config is fine; on the CPU build it must say why not and how to fix.
  if (r.exit_code == 0) GTEST_SKIP() << "a CUDA device is available here";
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.err, "device.type=cuda cannot be used"));
  EXPECT_TRUE(contains(r.err, "allow_cpu_fallback"));
  auto fallback = run_trainer({"--config", "configs/tiny-t5.json", "--set", "device.type=cuda", "--set",
                               "device.allow_cpu_fallback=true", "--dry-run"});
  EXPECT_EQ(fallback.exit_code, 0) << fallback.err;
  EXPECT_TRUE(contains(fallback.err + fallback.out, "RUNNING ON THE CPU"));
}

}  // namespace trainer::test

namespace trainer::test {

TEST(IntegrationModels, InspectDescribesAModelWithoutLoadingIt) {
  auto r = run_trainer({"inspect", "configs/models/tiny-qwen2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.find("qwen2 (causal)") != std::string::npos) << r.out;
  EXPECT_TRUE(r.out.find("bf16-mixed") != std::string::npos);
  EXPECT_TRUE(r.out.find("trainable parameters") != std::string::npos);
  auto missing = run_trainer({"inspect", "configs/models/nothing-here"});
  EXPECT_EQ(missing.exit_code, 3);
  EXPECT_TRUE(missing.err.find("configs/models/nothing-here") != std::string::npos);
}

TEST(IntegrationModels, PlanPrintsTheBudgetAndARecommendation) {
  auto r = run_trainer({"plan", "--config", "configs/tiny-t5.json", "--set", "memory.limit=12MiB"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("optimizer state (AdamW)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("activations per example"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("recommendation: micro_batch_size "), std::string::npos) << r.out;
  // Per rank for data parallelism: the share of the batch of 16 that each of 4 ranks trains.
  auto ranks = run_trainer({"plan", "--config", "configs/tiny-t5.json", "--set", "memory.limit=12MiB", "--world-size", "4"});
  EXPECT_EQ(ranks.exit_code, 0) << ranks.err;
  EXPECT_NE(ranks.out.find("data parallelism: 4 ranks (backend gloo); each rank trains about 4 of the 16 examples"),
            std::string::npos) << ranks.out;
  EXPECT_NE(ranks.out.find("accumulation steps for batch_size 4"), std::string::npos) << ranks.out;
  EXPECT_EQ(r.out.find("data parallelism"), std::string::npos) << r.out;
  auto missing = run_trainer({"plan", "--config", "configs/tiny-t5.json", "--set", "model.path=configs/models/nothing"});
  EXPECT_EQ(missing.exit_code, 3) << missing.err;
  EXPECT_NE(missing.err.find("configs/models/nothing"), std::string::npos) << missing.err;
}

// With distributed.shard_optimizer the plan holds each rank's part of the optimizer state: every rank listed, and
// the optimizer-state row (the fullest rank's) smaller than the unsharded plan's.
TEST(IntegrationModels, PlanWithShardedOptimizerStateShowsEachRanksPart) {
  const std::vector<std::string> base = {"plan", "--config", "configs/tiny-t5.json", "--set", "memory.limit=12MiB",
                                         "--world-size", "2"};
  auto whole = run_trainer(base);
  auto sharded_args = base;
  sharded_args.insert(sharded_args.end(), {"--set", "distributed.shard_optimizer=true"});
  auto sharded = run_trainer(sharded_args);
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  ASSERT_EQ(sharded.exit_code, 0) << sharded.err;
  EXPECT_NE(sharded.out.find("sharded optimizer state (distributed.shard_optimizer): "), std::string::npos)
      << sharded.out;
  EXPECT_NE(sharded.out.find("; per rank: 0: "), std::string::npos) << sharded.out;
  EXPECT_EQ(whole.out.find("sharded optimizer state"), std::string::npos) << whole.out;
  auto row = [](const std::string& out) {
    const auto at = out.find("optimizer state (AdamW)");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  ASSERT_FALSE(row(sharded.out).empty()) << sharded.out;
  EXPECT_NE(row(whole.out), row(sharded.out));
}

TEST(IntegrationModels, GenerateChecksItsInputs) {
  auto ok = run_trainer({"generate", "--model", "configs/models/tiny-t5", "--random-init", "--ids", "5,6,7",
                         "--max-new-tokens", "4"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(ok.out.starts_with("ids:")) << ok.out;
  auto out_of_range = run_trainer({"generate", "--model", "configs/models/tiny-t5", "--random-init", "--ids", "5,999"});
  EXPECT_EQ(out_of_range.exit_code, 2);
  EXPECT_TRUE(out_of_range.err.find("outside the vocabulary") != std::string::npos);
  auto no_weights = run_trainer({"generate", "--model", "configs/models/tiny-t5", "--ids", "5"});
  EXPECT_EQ(no_weights.exit_code, 3);
  EXPECT_TRUE(no_weights.err.find("--random-init") != std::string::npos || no_weights.err.find("model.init") != std::string::npos);
}

}  // namespace trainer::test

namespace trainer::test {

int64_t state_step(const std::filesystem::path& checkpoint) {
  std::ifstream file(checkpoint / "train_state.json");
  return nlohmann::json::parse(file)["step"].get<int64_t>();
}

TEST(IntegrationTrain, CheckpointsAreCompleteAndPruned) {
  const auto out_dir = std::filesystem::temp_directory_path() / "trainer-train-checkpoints";
  std::filesystem::remove_all(out_dir);
  auto run = run_trainer({"--config", "configs/tiny-qwen2.json", "--set", "checkpoint.output_dir=" + out_dir.string(),
                          "--set", "training.max_steps=12", "--set", "checkpoint.every_steps=3", "--set",
                          "checkpoint.keep_last=2"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  // Steps 3, 6, 9 and the end (12) were written; the newest two are kept; `final` holds the model too.
  EXPECT_FALSE(std::filesystem::exists(out_dir / "checkpoint-3"));
  EXPECT_FALSE(std::filesystem::exists(out_dir / "checkpoint-6"));
  EXPECT_TRUE(std::filesystem::exists(out_dir / "final" / "model.safetensors"));
  for (const char* name : {"checkpoint-9", "checkpoint-12"}) {
    EXPECT_TRUE(std::filesystem::exists(out_dir / name / "COMPLETE")) << name;
    EXPECT_TRUE(std::filesystem::exists(out_dir / name / "model.safetensors")) << name;
    EXPECT_TRUE(std::filesystem::exists(out_dir / name / "optimizer.safetensors")) << name;
    std::ifstream state_file(out_dir / name / "train_state.json");
    const auto state = nlohmann::json::parse(state_file);
    EXPECT_EQ(state["config"]["training"]["max_steps"], 12);
    EXPECT_TRUE(state.contains("data_cursor"));
    EXPECT_TRUE(state.contains("memory_policy"));
  }
  EXPECT_EQ(state_step(out_dir / "checkpoint-9"), 9);
  EXPECT_EQ(state_step(out_dir / "checkpoint-12"), 12);
  // Each checkpoint's line says its size and how long it took to write (scripts/gpu_full.py reads them).
  const std::regex written(R"(checkpoint step 12: \S+checkpoint-12 \(([0-9.]+) (B|KiB|MiB|GiB) written in ([0-9.]+) s\))");
  std::smatch found;
  ASSERT_TRUE(std::regex_search(run.err, found, written)) << run.err;
  EXPECT_GT(std::stod(found[1].str()), 0.0) << found[0];
  // A longer run continues from the end checkpoint: steps 13 to 15 only.
  auto longer = run_trainer({"--config", "configs/tiny-qwen2.json", "--set", "checkpoint.output_dir=" + out_dir.string(),
                             "--set", "training.max_steps=15", "--set", "checkpoint.every_steps=3", "--set",
                             "checkpoint.keep_last=2", "--resume"});
  ASSERT_EQ(longer.exit_code, 0) << longer.err;
  EXPECT_TRUE(longer.err.find("at step 12") != std::string::npos) << longer.err;
  EXPECT_EQ(state_step(out_dir / "checkpoint-15"), 15);
  EXPECT_FALSE(contains(longer.err, "micro_batch_size=auto:")) << "a resume reuses the probed micro-batch, no probe";
  // A checkpoint of another format version is refused with both versions named.
  {
    const auto path = out_dir / "checkpoint-15" / "train_state.json";
    auto state = nlohmann::json::parse(read_text(path));
    state["version"] = 2;
    std::ofstream(path) << state.dump();
  }
  auto newer = run_trainer({"--config", "configs/tiny-qwen2.json", "--set", "checkpoint.output_dir=" + out_dir.string(),
                            "--set", "training.max_steps=18", "--resume-from", (out_dir / "checkpoint-15").string()});
  EXPECT_EQ(newer.exit_code, 3) << newer.err;
  EXPECT_TRUE(contains(newer.err, "format version 2; this trainer reads version 1")) << newer.err;
  std::filesystem::remove_all(out_dir);
}

}  // namespace trainer::test

namespace trainer::test {

// 20 steps straight and 10 + resume + 10 reach identical weights (fp32 on the CPU, T5 with dropout on).
TEST(IntegrationTrain, ResumeContinuesExactly) {
  namespace fs = std::filesystem;
  const auto straight = fs::temp_directory_path() / "trainer-resume-straight";
  const auto resumed = fs::temp_directory_path() / "trainer-resume-resumed";
  fs::remove_all(straight);
  fs::remove_all(resumed);
  const std::vector<std::string> common = {"--config", "configs/tiny-t5.json", "--set", "training.max_steps=20",
                                           "--set", "checkpoint.every_steps=10", "--set", "evaluation.every_steps=0"};
  auto with = [&](const fs::path& dir, std::vector<std::string> extra) {
    auto args = common;
    args.insert(args.end(), {"--set", "checkpoint.output_dir=" + dir.string()});
    args.insert(args.end(), extra.begin(), extra.end());
    return run_trainer(args);
  };
  ASSERT_EQ(with(straight, {}).exit_code, 0);
  fs::create_directories(resumed);
  fs::copy(straight / "checkpoint-10", resumed / "checkpoint-10", fs::copy_options::recursive);
  auto second = with(resumed, {"--resume"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_TRUE(second.err.find("resuming from") != std::string::npos);
  const auto a = read_text(straight / "final" / "model.safetensors");
  const auto b = read_text(resumed / "final" / "model.safetensors");
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "the resumed run's weights differ from the uninterrupted run's";
  // The same data in the same order: steps 11 to 20 trained the same number of target tokens with the same loss.
  auto steps = [](const fs::path& metrics) {
    std::map<int64_t, std::pair<int64_t, double>> by_step;  // step -> (tokens so far, loss)
    std::ifstream file(metrics);
    for (std::string line; std::getline(file, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record.contains("loss") && record.contains("step"))
        by_step[record["step"].get<int64_t>()] = {record["tokens"].get<int64_t>(), record["loss"].get<double>()};
    }
    return by_step;
  };
  const auto straight_steps = steps(straight / "metrics.jsonl"), resumed_steps = steps(resumed / "metrics.jsonl");
  ASSERT_EQ(resumed_steps.size(), 10u);
  for (int64_t s = 11; s <= 20; ++s) {
    ASSERT_TRUE(resumed_steps.count(s) && straight_steps.count(s)) << "step " << s;
    EXPECT_EQ(resumed_steps.at(s).first, straight_steps.at(s).first) << "tokens by step " << s;
    EXPECT_EQ(resumed_steps.at(s).second, straight_steps.at(s).second) << "loss of step " << s;
  }

  // Nothing to resume from, and a checkpoint of another model, are data errors that say what is wrong.
  auto nothing = with(fs::temp_directory_path() / "trainer-resume-none", {"--resume"});
  EXPECT_EQ(nothing.exit_code, 3);
  EXPECT_TRUE(nothing.err.find("no complete checkpoint") != std::string::npos) << nothing.err;
  // Its own output_dir: a run locks it, and tests run in parallel (the config's default is shared).
  auto other = run_trainer({"--config", "configs/tiny-qwen2.json", "--set",
                            "checkpoint.output_dir=" + (fs::temp_directory_path() / "trainer-resume-other").string(),
                            "--resume-from", (straight / "checkpoint-10").string()});
  EXPECT_EQ(other.exit_code, 3);
  EXPECT_TRUE(other.err.find("belongs to another model") != std::string::npos) << other.err;
  fs::remove_all(straight);
  fs::remove_all(resumed);
  fs::remove_all(fs::temp_directory_path() / "trainer-resume-other");
}

}  // namespace trainer::test

namespace trainer::test {

// SIGTERM (a preempted container) and SIGINT (Ctrl-C): finish the step, write a checkpoint, exit 0 or 130, and
// the run continues from it with --resume.
TEST(IntegrationTrain, SignalsStopWithACheckpoint) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / "trainer-signals";
  fs::remove_all(dir);
  const std::vector<std::string> args = {"--config", "configs/tiny-qwen2.json", "--set", "training.max_steps=5000",
                                         "--set", "checkpoint.output_dir=" + dir.string()};
  auto term = run_trainer(args, "timeout --preserve-status -s TERM 4");
  EXPECT_EQ(term.exit_code, 0) << term.err;
  EXPECT_TRUE(term.out.find("Stopped by SIGTERM") != std::string::npos) << term.out;
  EXPECT_TRUE(term.out.find("--resume") != std::string::npos);
  bool complete = false;
  for (const auto& entry : fs::directory_iterator(dir)) complete = complete || fs::exists(entry.path() / "COMPLETE");
  EXPECT_TRUE(complete);

  auto resume_args = args;
  resume_args.push_back("--resume");
  auto interrupted = run_trainer(resume_args, "timeout --preserve-status -s INT 4");
  EXPECT_EQ(interrupted.exit_code, 130) << interrupted.err;
  EXPECT_TRUE(interrupted.err.find("resuming from") != std::string::npos) << interrupted.err;
  EXPECT_TRUE(interrupted.out.find("Stopped by SIGINT") != std::string::npos) << interrupted.out;
  fs::remove_all(dir);
}

}  // namespace trainer::test

namespace trainer::test {

// A stop delivered twice at once (GNU timeout signals the child, then its process group) is one request: the run
// still checkpoints and exits 0. A second signal later stops at once, and the newest complete checkpoint survives.
TEST(IntegrationTrain, SecondSignalStopsAtOnceAndDuplicatesAreOneStop) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / "trainer-signals-twice";
  fs::remove_all(dir);
  const std::string trainer = shell_quote(trainer_binary());
  const std::string common = " --config configs/tiny-qwen2.json --set training.max_steps=100000 --set "
                             "evaluation.every_steps=0 --set checkpoint.every_steps=5 --set checkpoint.output_dir=" +
                             shell_quote(dir.string());
  auto shell = [&](const std::string& script) {
    const auto err = dir.string() + ".err";
    const int status = std::system(("cd " + shell_quote(TRAINER_SOURCE_DIR) + " && { " + script + " ; } 2>" +
                                    shell_quote(err) + " >/dev/null").c_str());
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text(err));
  };
  // Wait for a complete checkpoint, then two SIGTERMs back to back: one stop, exit 0.
  auto [twice, twice_err] = shell(
      trainer + common + " & pid=$!; while [ ! -e " + shell_quote((dir / "checkpoint-5" / "COMPLETE").string()) +
      " ]; do sleep 0.1; done; kill -TERM $pid; kill -TERM $pid; wait $pid");
  EXPECT_EQ(twice, 0) << twice_err;
  EXPECT_TRUE(contains(twice_err, "SIGTERM: finishing this step")) << twice_err;
  EXPECT_FALSE(contains(twice_err, "second stop signal")) << twice_err;

  // A new run in the same directory, on long records (a step takes seconds): SIGINT once step 1 is logged, another
  // 0.6 s later, inside step 2: it ends at once, and what the directory holds is untouched.
  {
    std::ifstream demo(std::string(TRAINER_SOURCE_DIR) + "/data/demo/recipes-causal.jsonl");
    std::string line, prompt, completion;
    for (int i = 0; i < 40 && std::getline(demo, line); ++i) {
      const auto record = nlohmann::json::parse(line);
      if (i == 0) prompt = record["prompt"];
      else completion += record["completion"].get<std::string>();
    }
    std::ofstream data(dir.string() + ".jsonl");
    for (int i = 0; i < 16; ++i) data << nlohmann::json{{"prompt", prompt}, {"completion", completion}}.dump() << "\n";
  }
  const auto log = dir.string() + ".second";
  const std::string slow = " --set data.train_files='[\"" + dir.string() + ".jsonl\"]' --set data.max_length=4096 "
                           "--set training.micro_batch_size=16 --set logging.every_steps=1 --set logging.progress=plain";
  auto [second, second_err] = shell(
      trainer + common + slow + " 2>" + shell_quote(log) + " & pid=$!; until grep -q '] step 1/' " +
      shell_quote(log) + "; do sleep 0.05; done; kill -INT $pid; sleep 0.6; kill -INT $pid; wait $pid");
  const auto second_log = read_text(log);
  fs::remove(log);
  fs::remove(dir.string() + ".jsonl");
  EXPECT_EQ(second, 130) << second_log;
  EXPECT_TRUE(contains(second_log, "SIGINT: finishing this step")) << second_log;
  EXPECT_TRUE(contains(second_log, "second stop signal")) << second_log;
  int64_t newest = -1;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (name.starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
      newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
  }
  ASSERT_GE(newest, 5);
  auto resumed = run_trainer({"--config", "configs/tiny-qwen2.json", "--set",
                              "training.max_steps=" + std::to_string(newest + 1), "--set", "evaluation.every_steps=0",
                              "--set", "checkpoint.every_steps=5", "--set", "checkpoint.output_dir=" + dir.string(),
                              "--resume"});
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "at step " + std::to_string(newest))) << resumed.err;
  fs::remove_all(dir);
  fs::remove(dir.string() + ".err");
}

// kill -9 at many moments, checkpoints written every step: the newest complete checkpoint always loads and the
// run resumes from it.
TEST(IntegrationTrain, KillNineNeverLosesTheLastCompleteCheckpoint) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / "trainer-kill9";
  fs::remove_all(dir);
  const std::vector<std::string> args = {"--config", "configs/tiny-qwen2.json", "--set", "training.max_steps=100000",
                                         "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=2",
                                         "--set", "evaluation.every_steps=0",
                                         "--set", "checkpoint.output_dir=" + dir.string()};
  int64_t last_step = -1;
  // Each run is killed a while after its first checkpoint of this run is logged (so one exists whatever the
  // machine's speed), at moments that fall before, during and after further checkpoint writes (one every step).
  for (const char* seconds : {"0", "0.35", "0.7", "1.3"}) {
    SCOPED_TRACE(seconds);
    std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " && { " + shell_quote(trainer_binary());
    for (const auto& a : args) command += " " + shell_quote(a);
    if (last_step >= 0) command += " --resume";
    const auto log = dir.string() + ".log";
    command += " >/dev/null 2>" + shell_quote(log) + " & pid=$!; until grep -q 'checkpoint step' " + shell_quote(log) +
               " 2>/dev/null; do sleep 0.02; done; sleep " + seconds + "; kill -KILL $pid; wait $pid; }";
    const int status = std::system(command.c_str());
    const std::string err = read_text(log);
    fs::remove(log);
    EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 128 + 9) << err;
    // The newest complete checkpoint: its weights load and its state parses; it never goes backwards.
    int64_t newest = -1;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const auto name = entry.path().filename().string();
      if (name.starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
        newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
    }
    ASSERT_GE(newest, 0) << "no complete checkpoint after the kill\n" << err;
    EXPECT_GE(newest, last_step);
    last_step = newest;
    const auto checkpoint = dir / ("checkpoint-" + std::to_string(newest));
    auto load = run_trainer({"generate", "--model", checkpoint.string(), "--ids", "5", "--max-new-tokens", "1"});
    EXPECT_EQ(load.exit_code, 0) << load.err;
    std::ifstream state_file(checkpoint / "train_state.json");
    EXPECT_EQ(nlohmann::json::parse(state_file)["step"].get<int64_t>(), newest);
  }
  // And the run finishes from there.
  auto finish_args = args;
  finish_args[3] = "training.max_steps=" + std::to_string(last_step + 2);
  finish_args.push_back("--resume");
  auto finished = run_trainer(finish_args);
  EXPECT_EQ(finished.exit_code, 0) << finished.err;
  EXPECT_TRUE(finished.err.find("resuming from") != std::string::npos);
  fs::remove_all(dir);
}

}  // namespace trainer::test
