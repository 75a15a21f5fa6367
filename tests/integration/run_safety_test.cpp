// Sharp edges that used to lose work silently, on the real binary: two runs in one output directory, a resume
// after the data or the settings changed, a truncated .gz file, and a memory limit below the weights.
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/process.h"
#include "support/temp_dir.h"

namespace trainer::test {
namespace {
namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

nlohmann::json train_state(const fs::path& checkpoint) {
  return nlohmann::json::parse(read_text(checkpoint / "train_state.json"));
}

// The first `n` records of a demo file, as JSONL text.
std::string demo_records(const std::string& name, std::size_t n, std::size_t skip = 0) {
  std::ifstream file(std::string(TRAINER_SOURCE_DIR) + "/data/demo/" + name);
  std::string text;
  std::size_t i = 0;
  for (std::string line; i < skip + n && std::getline(file, line); ++i)
    if (i >= skip) text += line + "\n";
  return text;
}

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

// A second run into an output directory in use exits 2 naming the directory and the holder; `plan`, `data` and
// --dry-run need no lock. kill -9 leaves no stale lock: a resume right after continues, and retention, which ran
// every step, kept the lock file.
TEST(IntegrationRunSafety, OneRunPerOutputDirectory) {
  TempDir dir;
  const auto run_dir = dir.path() / "run";
  const std::vector<std::string> args = {"--config", "configs/tiny-qwen2.json", "--set", "training.max_steps=100000",
                                         "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=2",
                                         "--set", "evaluation.every_steps=0", "--set",
                                         "checkpoint.output_dir=" + run_dir.string()};
  auto command = [&](std::vector<std::string> a) {
    std::string text = shell_quote(trainer_binary());
    for (const auto& x : a) text += " " + shell_quote(x);
    return text;
  };
  auto file = [&](const char* name) { return shell_quote(dir.file(name)); };
  const std::string script =
      "cd " + shell_quote(TRAINER_SOURCE_DIR) + " && { " + command(args) + " >/dev/null 2>" + file("a.err") +
      " & pid=$!; echo $pid >" + file("pid") + "; i=0; until grep -q 'checkpoint step 2:' " + file("a.err") +
      "; do i=$((i+1)); [ $i -gt 1200 ] && break; sleep 0.05; done; " +
      // Another run (as a queued job with another seed would be), and a resume, while the first one trains.
      command(with(args, {"--set", "training.max_steps=2", "--set", "training.seed=7"})) + " >/dev/null 2>" +
      file("b.err") + "; echo $? >" + file("b.rc") + "; " +
      command(with(args, {"--set", "training.max_steps=2", "--resume"})) + " >/dev/null 2>" + file("c.err") +
      "; echo $? >" + file("c.rc") + "; " +
      command(with(args, {"--dry-run"})) + " >/dev/null 2>&1; echo $? >" + file("dry.rc") + "; " +
      command({"plan", "--config", "configs/tiny-qwen2.json", "--set", "checkpoint.output_dir=" + run_dir.string()}) +
      " >/dev/null 2>&1; echo $? >" + file("plan.rc") + "; " +
      command({"data", "--config", "configs/tiny-qwen2.json", "--set", "checkpoint.output_dir=" + run_dir.string()}) +
      " >/dev/null 2>&1; echo $? >" + file("data.rc") + "; kill -KILL $pid; wait $pid; }";
  ASSERT_NE(std::system(script.c_str()), -1);
  auto rc = [&](const char* name) { return std::stoi(read_text(dir.path() / name)); };
  const std::string pid = read_text(dir.path() / "pid").substr(0, read_text(dir.path() / "pid").find('\n'));
  ASSERT_TRUE(contains(read_text(dir.path() / "a.err"), "checkpoint step 2:")) << read_text(dir.path() / "a.err");

  const std::string holder = "checkpoint.output_dir " + run_dir.string() + " is in use by another training run: pid " +
                             pid + " on host " + host_name();
  for (const char* second : {"b", "c"}) {
    SCOPED_TRACE(second);
    const auto err = read_text(dir.path() / (std::string(second) + ".err"));
    EXPECT_EQ(rc((std::string(second) + ".rc").c_str()), 2) << err;
    EXPECT_TRUE(contains(err, holder)) << err;
    EXPECT_TRUE(contains(err, "hint: wait for that run to end, or give this one its own checkpoint.output_dir")) << err;
  }
  EXPECT_EQ(rc("dry.rc"), 0);
  EXPECT_EQ(rc("plan.rc"), 0);
  EXPECT_EQ(rc("data.rc"), 0);
  // Only the first run wrote metrics: steps 1, 2, 3, ... once each.
  int64_t expected = 1;
  std::ifstream metrics(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("loss")) {
      EXPECT_EQ(record["step"].get<int64_t>(), expected++) << line;
    }
  }
  EXPECT_GT(expected, 2);

  // Killed with -9: the lock went with the process, the file stays (retention never removes it), and it does not
  // count as a checkpoint.
  EXPECT_TRUE(fs::exists(run_dir / ".lock"));
  int64_t newest = -1;
  for (const auto& entry : fs::directory_iterator(run_dir)) {
    const auto name = entry.path().filename().string();
    if (name.starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
      newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
  }
  ASSERT_GE(newest, 2);
  auto resumed = run_trainer(with(args, {"--set", "training.max_steps=" + std::to_string(newest + 1), "--resume"}));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "resuming from " + (run_dir / ("checkpoint-" + std::to_string(newest))).string()))
      << resumed.err;
  EXPECT_TRUE(fs::exists(run_dir / ".lock"));
}

// Records appended after a checkpoint: the resume stops with exit 3 naming the file with its old and new record
// counts and sizes; --allow-data-change goes on from the checkpoint's step with a new epoch over the new data. A
// changed tokenizer file is named the same way; a checkpoint from before fingerprints resumes with a warning.
TEST(IntegrationRunSafety, ResumeNoticesChangedData) {
  TempDir dir;
  const auto data = dir.path() / "data.jsonl";
  write_file(data.string(), demo_records("recipes-seq2seq.jsonl", 44));
  const auto run_dir = dir.path() / "run";
  const std::vector<std::string> args = {
      "--config", "configs/tiny-t5.json", "--set", "data.train_files=[\"" + data.string() + "\"]", "--set",
      "data.validation_files=[]", "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]",
      "--set", "training.micro_batch_size=16", "--set", "checkpoint.output_dir=" + run_dir.string()};
  auto first = run_trainer(with(args, {"--set", "training.max_steps=4"}));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const auto saved = train_state(run_dir / "checkpoint-4");
  ASSERT_TRUE(saved.contains("data_fingerprint"));
  EXPECT_EQ(saved["data_fingerprint"]["train_files"][0]["records"], 44);
  // 44 records, 16 per step: step 4 is the first of the second epoch.
  EXPECT_EQ(saved["data_cursor"]["epoch"], 1);
  EXPECT_EQ(saved["data_cursor"]["position"], 16);
  const auto size_before = fs::file_size(data);

  {
    std::ofstream append(data, std::ios::app);
    append << demo_records("recipes-seq2seq.jsonl", 50, 100);
  }
  auto refused = run_trainer(with(args, {"--set", "training.max_steps=6", "--resume"}));
  EXPECT_EQ(refused.exit_code, 3) << refused.err;
  EXPECT_TRUE(contains(refused.err, "the data changed since " + (run_dir / "checkpoint-4").string())) << refused.err;
  EXPECT_TRUE(contains(refused.err, data.string() + ": 44 records (" + std::to_string(size_before) +
                                        " bytes) in the checkpoint, 94 records (" +
                                        std::to_string(fs::file_size(data)) + " bytes) now"))
      << refused.err;
  EXPECT_TRUE(contains(refused.err, "--allow-data-change")) << refused.err;
  EXPECT_FALSE(fs::exists(run_dir / "checkpoint-6"));

  auto allowed = run_trainer(with(args, {"--set", "training.max_steps=6", "--resume", "--allow-data-change"}));
  ASSERT_EQ(allowed.exit_code, 0) << allowed.err;
  EXPECT_TRUE(contains(allowed.err, "at step 4")) << allowed.err;
  EXPECT_TRUE(contains(allowed.err, "the data changed: epoch 3 starts over it")) << allowed.err;
  const auto after = train_state(run_dir / "checkpoint-6");
  EXPECT_EQ(after["data_fingerprint"]["train_files"][0]["records"], 94);  // what the run trains on now
  EXPECT_EQ(after["data_cursor"]["epoch"], 2);
  EXPECT_EQ(after["data_cursor"]["position"], 32);  // two steps into the new epoch

  // A checkpoint written before fingerprints existed resumes, with a warning.
  {
    auto state = after;
    state.erase("data_fingerprint");
    std::ofstream(run_dir / "checkpoint-6" / "train_state.json") << state.dump(2);
  }
  auto older = run_trainer(with(args, {"--set", "training.max_steps=7", "--resume"}));
  EXPECT_EQ(older.exit_code, 0) << older.err;
  EXPECT_TRUE(contains(older.err, "was written before checkpoints recorded their data")) << older.err;

  // The tokenizer's files are part of it: a changed tokenizer_config.json beside tokenizer.json is named.
  const auto model = dir.path() / "model";
  fs::copy(std::string(TRAINER_SOURCE_DIR) + "/configs/models/tiny-qwen2", model);
  const std::vector<std::string> qwen = {"--config", "configs/tiny-qwen2.json", "--set", "model.path=" + model.string(),
                                         "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]",
                                         "--set", "checkpoint.output_dir=" + (dir.path() / "qwen").string()};
  ASSERT_EQ(run_trainer(with(qwen, {"--set", "training.max_steps=2"})).exit_code, 0);
  auto config = nlohmann::json::parse(read_text(model / "tokenizer_config.json"));
  config["model_max_length"] = 4096;
  std::ofstream(model / "tokenizer_config.json") << config.dump(2);
  auto tokenizer = run_trainer(with(qwen, {"--set", "training.max_steps=3", "--resume"}));
  EXPECT_EQ(tokenizer.exit_code, 3) << tokenizer.err;
  EXPECT_TRUE(contains(tokenizer.err, (model / "tokenizer_config.json").string() + ": the tokenizer file changed"))
      << tokenizer.err;
}

// A resume with other settings lists every changed key on one line; those that would make it another run are
// refused (exit 2) with both values, unless --allow-config-change.
TEST(IntegrationRunSafety, ResumeListsChangedSettingsAndRefusesTheBreakingOnes) {
  TempDir dir;
  const auto run_dir = dir.path() / "run";
  const std::vector<std::string> args = {"--config", "configs/tiny-qwen2.json", "--set", "evaluation.every_steps=0",
                                         "--set", "evaluation.sample_prompts=[]", "--set",
                                         "checkpoint.output_dir=" + run_dir.string()};
  ASSERT_EQ(run_trainer(with(args, {"--set", "training.max_steps=3"})).exit_code, 0);

  auto accepted = run_trainer(
      with(args, {"--set", "training.max_steps=4", "--set", "optimizer.lr=0.002", "--set", "logging.every_steps=1",
                  "--resume"}));
  EXPECT_EQ(accepted.exit_code, 0) << accepted.err;
  EXPECT_TRUE(contains(accepted.err, "resume: 3 setting(s) differ from " + (run_dir / "checkpoint-3").string() +
                                         ": training.max_steps 3 -> 4, optimizer.lr 0.003 -> 0.002, "
                                         "logging.every_steps 5 -> 1"))
      << accepted.err;
  EXPECT_TRUE(contains(accepted.err, "at step 3")) << accepted.err;

  for (const auto& [set, named] : std::vector<std::pair<std::string, std::string>>{
           {"precision.mode=bf16", "precision.mode: checkpoint \"fp32\", now \"bf16\""},
           {"training.seed=9", "training.seed: checkpoint 1, now 9"},
           {"training.batch_size=8", "training.batch_size: checkpoint 16, now 8"},
           {"data.max_length=64", "data.max_length: checkpoint 192, now 64"},
           {"optimizer.state_dtype=bf16", "optimizer.state_dtype: checkpoint \"fp32\", now \"bf16\""}}) {
    SCOPED_TRACE(set);
    auto refused = run_trainer(with(args, {"--set", "training.max_steps=5", "--set", set, "--resume"}));
    EXPECT_EQ(refused.exit_code, 2) << refused.err;
    EXPECT_TRUE(contains(refused.err, "with settings that would not continue the same run")) << refused.err;
    EXPECT_TRUE(contains(refused.err, named)) << refused.err;
    EXPECT_TRUE(contains(refused.err, "--allow-config-change")) << refused.err;
    EXPECT_FALSE(fs::exists(run_dir / "checkpoint-5"));
  }
  auto forced = run_trainer(
      with(args, {"--set", "training.max_steps=5", "--set", "training.seed=9", "--resume", "--allow-config-change"}));
  EXPECT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_TRUE(contains(forced.err, "--allow-config-change: continuing")) << forced.err;
  EXPECT_TRUE(fs::exists(run_dir / "checkpoint-5" / "COMPLETE"));
  // Both flags are documented in --help.
  const auto help = run_trainer({"train", "--help"}).out;
  EXPECT_TRUE(contains(help, "--allow-config-change")) << help;
  EXPECT_TRUE(contains(help, "--allow-data-change")) << help;
}

// A .gz file cut short says so, with the file and its last complete line, in `trainer data` and in training,
// whatever data.on_bad_record says (it is not a bad record).
TEST(IntegrationRunSafety, TruncatedGzipIsNamedAsSuch) {
  TempDir dir;
  const auto path = dir.file("recipes.jsonl.gz");
  {
    const std::string text = demo_records("recipes-seq2seq.jsonl", 400);
    gzFile gz = gzopen(path.c_str(), "wb");
    gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
    gzclose(gz);
    const std::string bytes = read_file(path);
    write_file(path, bytes.substr(0, bytes.size() * 2 / 3));
  }
  const std::vector<std::string> data = {"--set", "data.train_files=[\"" + path + "\"]", "--set",
                                         "data.validation_files=[]"};
  const std::string expected = path + ": the gzip stream ends before its end marker (file truncated?); the last "
                                      "complete line is line ";
  for (const auto& args : std::vector<std::vector<std::string>>{
           with({"data", "--config", "configs/tiny-t5.json"}, data),
           with({"data", "--config", "configs/tiny-t5.json", "--set", "data.on_bad_record=skip"}, data),
           with({"--config", "configs/tiny-t5.json", "--set", "checkpoint.output_dir=" + dir.file("run")}, data)}) {
    SCOPED_TRACE(args[0] + " " + args.back());
    auto r = run_trainer(args);
    EXPECT_EQ(r.exit_code, 3) << r.err;
    EXPECT_TRUE(contains(r.err, expected)) << r.err;
    EXPECT_FALSE(contains(r.err, "invalid JSON")) << r.err;
    EXPECT_TRUE(contains(r.err, "gzip -t")) << r.err;
  }
}

// memory.limit below the weights: exit 4 with what the weights, gradients and optimizer state need (the tiny T5:
// 213,824 fp32 parameters), against the limit, and a limit that would hold them.
TEST(IntegrationRunSafety, MemoryLimitBelowTheWeightsSaysWhatTheyNeed) {
  TempDir dir;
  auto r = run_trainer({"--config", "configs/tiny-t5.json", "--set", "memory.limit=64KiB", "--set",
                        "checkpoint.output_dir=" + dir.file("run")});
  EXPECT_EQ(r.exit_code, 4) << r.err;
  for (const char* text : {"out of memory allocating the model's weights: CPU memory budget exceeded",
                           "what the run needs before its first example (as `trainer plan` counts it):",
                           "weights                       835.25 KiB",
                           "gradients (during backward)   835.25 KiB",
                           "optimizer state (AdamW)       1.63 MiB",
                           "together                      3.26 MiB",
                           "memory.limit                  64.00 KiB",
                           "hint: a memory.limit of at least 3.26 MiB plus room for activations",
                           "lora.enabled=true", "optimizer.state_dtype=bf16"})
    EXPECT_TRUE(contains(r.err, text)) << text << "\n" << r.err;
  // Room for the weights but not for the AdamW state next to them: the same figures.
  auto state = run_trainer({"--config", "configs/tiny-t5.json", "--set", "memory.limit=1MiB", "--set",
                            "checkpoint.output_dir=" + dir.file("run")});
  EXPECT_EQ(state.exit_code, 4) << state.err;
  for (const char* text : {"out of memory allocating the AdamW state", "together                      3.26 MiB",
                           "memory.limit                  1.00 MiB", "hint: a memory.limit of at least 3.26 MiB"})
    EXPECT_TRUE(contains(state.err, text)) << text << "\n" << state.err;
}

}  // namespace trainer::test

namespace trainer::test {

// A checkpoint the disk cannot take (here: a file-size limit, as `ulimit -f` sets; writes past it fail as on a
// full disk): the run stops with exit 3 saying what the checkpoint needs and what is free, the partial
// .checkpoint-N.tmp is gone, the previous checkpoint stays the newest and complete, and --resume continues from it.
TEST(IntegrationRunSafety, ACheckpointTheDiskCannotTakeLeavesThePreviousOne) {
  TempDir dir;
  const auto run_dir = dir.path() / "run";
  auto args = [&](int steps) {
    return std::vector<std::string>{"--config", "configs/tiny-qwen2.json", "--set",
                                    "training.max_steps=" + std::to_string(steps), "--set", "checkpoint.every_steps=3",
                                    "--set", "evaluation.every_steps=0", "--set",
                                    "checkpoint.output_dir=" + run_dir.string()};
  };
  const auto first = run_trainer(args(3));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_TRUE(fs::exists(run_dir / "checkpoint-3" / "COMPLETE"));
  const auto weights = fs::file_size(run_dir / "checkpoint-3" / "model.safetensors");
  // Files up to a quarter of the weights file may be written (logs, metrics); the weights may not.
  const std::string limit = std::to_string(std::max<std::uintmax_t>(8, weights / 4 / 512));
  auto full = run_trainer(with(args(6), {"--resume"}), "trap '' XFSZ; ulimit -f " + limit + ";");
  EXPECT_EQ(full.exit_code, 3) << full.err;
  EXPECT_TRUE(contains(full.err, "checkpoint step 6 could not be written")) << full.err;
  EXPECT_TRUE(contains(full.err, "the checkpoint needs about")) << full.err;
  EXPECT_TRUE(contains(full.err, " free on ")) << full.err;
  EXPECT_TRUE(contains(full.err, "the newest complete checkpoint is still")) << full.err;
  EXPECT_TRUE(contains(full.err, "checkpoint-3")) << full.err;
  EXPECT_TRUE(contains(full.err, "hint: free space there")) << full.err;
  EXPECT_FALSE(fs::exists(run_dir / ".checkpoint-6.tmp")) << "the partial checkpoint is removed";
  EXPECT_FALSE(fs::exists(run_dir / "checkpoint-6"));
  EXPECT_TRUE(fs::exists(run_dir / "checkpoint-3" / "COMPLETE"));
  const auto again = run_trainer(with(args(6), {"--resume"}));
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(contains(again.err, "resuming from")) << again.err;
  EXPECT_TRUE(contains(again.err, "checkpoint-3")) << again.err;
  EXPECT_TRUE(fs::exists(run_dir / "checkpoint-6" / "COMPLETE"));
}

}  // namespace trainer::test
