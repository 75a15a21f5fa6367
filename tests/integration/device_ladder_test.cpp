// The end of the memory ladder in the real binary: a step that does not fit even at the floor moves the run to the
// CPU (device.allow_cpu_fallback=true) and the same step goes on; the weights are those of a run that had memory
// enough. On this CPU-only build the device left behind is the CPU under memory.limit (a real budget that refuses
// allocations) and the move lifts that budget, through the code a CUDA -> CPU move runs (every tensor re-created
// by .to(device)); what a GPU adds (the copy across, another GPU's free memory) is not exercised here.
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Four short records, then two whose completion is 35 records long: batches 1, 2 and (of two) 3 per epoch, and
// only batch 3 is too large for a 12 MiB budget at any micro-batch.
void write_data(const fs::path& path) {
  std::vector<nlohmann::json> demo;
  std::ifstream file(std::string(TRAINER_SOURCE_DIR) + "/data/demo/recipes-causal.jsonl");
  for (std::string line; demo.size() < 40 && std::getline(file, line);) demo.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(demo.size(), 40u);
  std::string completion;
  for (std::size_t i = 5; i < 40; ++i) completion += demo[i]["completion"].get<std::string>();
  std::ofstream data(path);
  for (std::size_t i = 0; i < 4; ++i) data << demo[i].dump() << "\n";
  for (int i = 0; i < 2; ++i) data << nlohmann::json{{"prompt", demo[4]["prompt"]}, {"completion", completion}}.dump() << "\n";
}

double max_difference(const fs::path& a, const fs::path& b) {
  const auto fa = SafetensorsFile::open(a.string()), fb = SafetensorsFile::open(b.string());
  EXPECT_EQ(fa.tensors().size(), fb.tensors().size());
  double worst = 0;
  for (const auto& t : fa.tensors()) {
    EXPECT_TRUE(fb.find(t.name)) << t.name;
    if (!fb.find(t.name)) return 1e9;
    worst = std::max(worst, (fa.load(t.name, at::kFloat) - fb.load(t.name, at::kFloat)).abs().max().item<double>());
  }
  return worst;
}

struct Runs {
  TempDir dir;
  std::vector<std::string> args;
  explicit Runs(const std::string& optimizer) {
    write_data(dir.path() / "data.jsonl");
    args = {"--config", "configs/tiny-qwen2.json", "--set",
            "data.train_files=[\"" + (dir.path() / "data.jsonl").string() + "\"]", "--set", "data.validation_files=[]",
            "--set", "data.shuffle=false", "--set", "data.max_length=4096", "--set", "training.batch_size=2", "--set",
            "training.micro_batch_size=2", "--set", "training.max_steps=6", "--set", "evaluation.every_steps=0",
            "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=3", "--set",
            "optimizer.name=" + optimizer};
  }
  ProcessResult run(const std::string& name, std::vector<std::string> extra) const {
    auto all = args;
    all.insert(all.end(), {"--set", "checkpoint.output_dir=" + (dir.path() / name).string()});
    all.insert(all.end(), extra.begin(), extra.end());
    return run_trainer(all);
  }
  fs::path final_weights(const std::string& name) const { return dir.path() / name / "final" / "model.safetensors"; }
};

void expect_moved_at_step(const ProcessResult& r, int step) {
  const std::string at = "step " + std::to_string(step) + " does not fit on cpu even at the micro-batch floor";
  for (const std::string& text : {std::string("!!! MOVING THE RUN (move_to_cpu)"), at, std::string("the CPU without memory.limit"),
                                 std::string("of optimizer state from cpu to cpu"),
                                 std::string("escalate: move_to_cpu (cpu -> cpu)")})
    EXPECT_TRUE(contains(r.err + r.out, text)) << text << "\n" << r.err << r.out;
}

// AdamW: the run moves at step 3 and reaches the unconstrained run's weights; its checkpoint-3 (written after the
// move) resumes in a new process, which starts under the budget again, moves again at step 6 (the long batch of
// epoch 2), and reaches the same weights.
TEST(IntegrationDeviceLadder, AdamWMovesToTheCpuAndContinuesTheSameStep) {
  Runs runs("adamw");
  const auto free = runs.run("free", {"--set", "memory.limit=256MiB"});
  ASSERT_EQ(free.exit_code, 0) << free.err;
  EXPECT_FALSE(contains(free.err, "MOVING THE RUN")) << free.err;

  const auto moved = runs.run("moved", {"--set", "memory.limit=12MiB", "--set", "device.allow_cpu_fallback=true"});
  ASSERT_EQ(moved.exit_code, 0) << moved.err;
  expect_moved_at_step(moved, 3);
  EXPECT_TRUE(contains(moved.out, "move_to_cpu")) << "the summary lists the move\n" << moved.out;
  EXPECT_EQ(metric_values(runs.dir.path() / "moved" / "metrics.jsonl", "device_moves"),
            (std::vector<double>{0, 0, 1, 1, 1, 1}));
  EXPECT_LT(max_difference(runs.final_weights("moved"), runs.final_weights("free")), 1e-5);

  const auto resumed = runs.run("resumed", {"--set", "memory.limit=12MiB", "--set", "device.allow_cpu_fallback=true",
                                            "--resume-from", (runs.dir.path() / "moved" / "checkpoint-3").string()});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "at step 3")) << resumed.err;
  expect_moved_at_step(resumed, 6);
  EXPECT_LT(max_difference(runs.final_weights("resumed"), runs.final_weights("free")), 1e-5);
}

// Adafactor (its row and column statistics and first moment move): the same; and without
// device.allow_cpu_fallback the same budget stops the run at step 3 with exit code 4, as before the device moves.
TEST(IntegrationDeviceLadder, AdafactorMovesToTheCpuAndWithoutFallbackStillStops) {
  Runs runs("adafactor");
  const std::vector<std::string> budget = {"--set", "memory.limit=12MiB", "--set", "optimizer.adafactor_beta1=true"};
  auto with = [&](std::vector<std::string> extra) {
    auto all = budget;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const auto stopped = runs.run("stopped", budget);
  EXPECT_EQ(stopped.exit_code, 4) << stopped.err;
  EXPECT_TRUE(contains(stopped.err, "move_to_cpu not made: device.allow_cpu_fallback=false")) << stopped.err;
  EXPECT_TRUE(contains(stopped.err, "hint:")) << stopped.err;
  EXPECT_TRUE(contains(stopped.err, "device.allow_cpu_fallback=true")) << stopped.err;
  EXPECT_TRUE(fs::exists(runs.dir.path() / "stopped" / "checkpoint-2" / "COMPLETE"));

  const auto free = runs.run("free", {"--set", "memory.limit=256MiB", "--set", "optimizer.adafactor_beta1=true"});
  ASSERT_EQ(free.exit_code, 0) << free.err;
  const auto moved = runs.run("moved", with({"--set", "device.allow_cpu_fallback=true"}));
  ASSERT_EQ(moved.exit_code, 0) << moved.err;
  expect_moved_at_step(moved, 3);
  EXPECT_LT(max_difference(runs.final_weights("moved"), runs.final_weights("free")), 1e-5);
}

}  // namespace
}  // namespace trainer::test
