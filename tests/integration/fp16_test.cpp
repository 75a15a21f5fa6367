// precision.mode=fp16-mixed through the real binary on the CPU (fp16 autocast, dynamic loss scaling): a tiny Qwen2
// trains; real overflows (a loss scale fp16 cannot hold) skip exactly those steps, back the scale off and leave the
// weights of a run that never took them; a resume continues the scale exactly; T5 is refused with the reason. The
// image classifier (tiny ViT) takes the same loss scaling: overflows skip steps without touching a weight, and a
// resume is bit-exact.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

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

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// tiny-qwen2 in fp16-mixed for `steps` steps of 8 examples (micro-batches of 4), a constant learning rate (so that
// runs of different lengths and resumed runs share one schedule), no evaluation or samples, metrics every step.
std::vector<std::string> fp16_run(const fs::path& dir, int steps, const std::vector<std::string>& extra = {}) {
  return with({"--config", "configs/tiny-qwen2.json", "--set", "precision.mode=fp16-mixed", "--set",
               "training.batch_size=8", "--set", "training.micro_batch_size=4", "--set",
               "training.max_steps=" + std::to_string(steps), "--set", "scheduler.name=constant", "--set",
               "scheduler.warmup_steps=0", "--set", "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]",
               "--set", "data.validation_files=[]", "--set", "checkpoint.every_steps=0", "--set",
               "logging.every_steps=1", "--set", "checkpoint.output_dir=" + dir.string()},
              extra);
}

// The step records of metrics.jsonl (those with a loss), in order.
std::vector<nlohmann::json> step_records(const fs::path& dir) {
  std::vector<nlohmann::json> records;
  std::ifstream file(dir / "metrics.jsonl");
  for (std::string line; std::getline(file, line);) {
    auto record = nlohmann::json::parse(line);
    if (record.contains("loss")) records.push_back(std::move(record));
  }
  return records;
}

double max_difference(const fs::path& a_path, const fs::path& b_path) {
  const auto a = SafetensorsFile::open(a_path.string());
  const auto b = SafetensorsFile::open(b_path.string());
  EXPECT_EQ(a.tensors().size(), b.tensors().size());
  double largest = 0;
  for (const auto& t : a.tensors()) {
    const auto x = a.load(t.name, at::kFloat), y = b.load(t.name, at::kFloat);
    largest = std::max(largest, (x - y).abs().max().item<double>());
  }
  return largest;
}

double mean(const std::vector<double>& v, std::size_t begin, std::size_t end) {
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) sum += v[i];
  return sum / static_cast<double>(end - begin);
}

}  // namespace

// fp16-mixed trains tiny-qwen2 on the CPU as fp32 does: the loss falls, and ends close to fp32's; every step is
// logged with its loss scale, none skipped at the default 2^16.
TEST(IntegrationFp16, Fp16MixedTrainsTinyQwen2AndTheLossFallsAsInFp32) {
  TempDir dir;
  const std::vector<std::string> lr = {"--set", "optimizer.lr=3e-3"};
  const auto fp16 = run_trainer(fp16_run(dir.path() / "fp16", 20, lr), "OMP_NUM_THREADS=1");
  ASSERT_EQ(fp16.exit_code, 0) << fp16.err;
  const auto fp32 =
      run_trainer(fp16_run(dir.path() / "fp32", 20, with(lr, {"--set", "precision.mode=fp32"})), "OMP_NUM_THREADS=1");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.err;
  const auto loss16 = metric_values(dir.path() / "fp16" / "metrics.jsonl", "loss");
  const auto loss32 = metric_values(dir.path() / "fp32" / "metrics.jsonl", "loss");
  ASSERT_EQ(loss16.size(), 20u);
  ASSERT_EQ(loss32.size(), 20u);
  EXPECT_LT(mean(loss16, 15, 20), 0.7 * mean(loss16, 0, 5)) << fp16.err;
  EXPECT_NEAR(mean(loss16, 15, 20), mean(loss32, 15, 20), 0.05 * mean(loss32, 15, 20));
  EXPECT_NE(loss16, loss32);  // fp16 autocast really ran
  for (const auto& record : step_records(dir.path() / "fp16")) {
    EXPECT_EQ(record["loss_scale"].get<double>(), 65536.0) << record;
    EXPECT_FALSE(record["skipped"].get<bool>()) << record;
  }
  EXPECT_FALSE(step_records(dir.path() / "fp32")[0].contains("loss_scale"));
  EXPECT_TRUE(contains(fp16.out, "fp16 loss scaling: 0 steps skipped for inf/NaN gradients (0 in this run); loss "
                                 "scale 65536"))
      << fp16.out;
  EXPECT_FALSE(contains(fp32.out, "fp16 loss scaling")) << fp32.out;
}

// A loss scale of 2^34 overflows fp16 in backward (real infs in the gradients; about 2^19 fits this model). The
// first steps are skipped, each halving the scale, until it fits; nothing of them reaches the weights (the loss
// stays the same), the optimizer or the memory policy. Every effective batch holds the same record, so the run
// equals one that starts at the scale that fitted and never takes the skipped steps: the same losses, scales and
// skips (a later overflow, as training moves the gradients, comes at the same step of both) and the same weights.
TEST(IntegrationFp16, OverflowsSkipExactlyThoseStepsAndTheRunEqualsOneThatNeverTookThem) {
  TempDir dir;
  std::ifstream demo(std::string(TRAINER_SOURCE_DIR) + "/data/demo/recipes-causal.jsonl");
  std::string record;
  std::getline(demo, record);
  std::string same;
  for (int i = 0; i < 16; ++i) same += record + "\n";
  write_file(dir.file("same.jsonl"), same);
  const std::vector<std::string> data = {"--set", "data.train_files=[\"" + dir.file("same.jsonl") + "\"]",
                                         "--set", "optimizer.lr=1e-3"};
  constexpr int kSteps = 24, kPower = 34;

  const auto a = run_trainer(
      fp16_run(dir.path() / "a", kSteps, with(data, {"--set", "precision.initial_loss_scale=" +
                                                                  std::to_string(std::ldexp(1.0, kPower))})),
      "OMP_NUM_THREADS=1");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const auto records = step_records(dir.path() / "a");
  ASSERT_EQ(records.size(), static_cast<std::size_t>(kSteps));
  int first_skipped = 0;
  while (first_skipped < kSteps && records[static_cast<std::size_t>(first_skipped)]["skipped"].get<bool>())
    ++first_skipped;
  ASSERT_GE(first_skipped, 10) << a.err;  // 2^34 down to about 2^19 at least
  ASSERT_LE(first_skipped, kSteps - 5) << a.err;
  int skipped = 0;
  double scale = std::ldexp(1.0, kPower);
  for (int i = 0; i < kSteps; ++i) {
    const auto& r = records[static_cast<std::size_t>(i)];
    SCOPED_TRACE(r.dump());
    const bool skip = r["skipped"].get<bool>();
    skipped += skip ? 1 : 0;
    EXPECT_EQ(r["loss_scale"].get<double>(), scale);  // halved after each skip (no growth within 2000 steps)
    if (skip) scale /= 2;
    EXPECT_EQ(r["skipped_steps"].get<int64_t>(), skipped);
    EXPECT_EQ(r["grad_norm"].is_null(), skip);
    if (i > 0 && records[static_cast<std::size_t>(i - 1)]["skipped"].get<bool>()) {  // no update: the same loss again
      EXPECT_EQ(r["loss"].get<double>(), records[static_cast<std::size_t>(i - 1)]["loss"].get<double>());
    }
    EXPECT_EQ(r["oom_retries"].get<int64_t>(), 0);  // never taken for an out-of-memory error
    EXPECT_EQ(r["micro_batch"].get<int64_t>(), 4);  // and the memory policy never shrank
    EXPECT_EQ(r["adaptations"].get<int64_t>(), 0);
  }
  EXPECT_TRUE(contains(a.err, "gradients overflowed fp16 (inf/NaN) at loss scale 17179869184: update skipped, loss "
                              "scale -> 8589934592"))
      << a.err;
  EXPECT_FALSE(contains(a.err, "out of memory")) << a.err;
  EXPECT_TRUE(contains(a.out, "fp16 loss scaling: " + std::to_string(skipped) + " steps skipped")) << a.out;

  // The run that never took them: from the scale that fitted, kSteps - first_skipped steps.
  const auto b = run_trainer(
      fp16_run(dir.path() / "b", kSteps - first_skipped,
               with(data, {"--set", "precision.initial_loss_scale=" +
                                        std::to_string(std::ldexp(1.0, kPower - first_skipped))})),
      "OMP_NUM_THREADS=1");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const auto rest = step_records(dir.path() / "b");
  ASSERT_EQ(rest.size(), static_cast<std::size_t>(kSteps - first_skipped));
  EXPECT_FALSE(rest[0]["skipped"].get<bool>());
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const auto& r = records[static_cast<std::size_t>(first_skipped) + i];
    EXPECT_EQ(r["skipped"], rest[i]["skipped"]) << "step " << i + 1;
    EXPECT_EQ(r["loss_scale"], rest[i]["loss_scale"]) << "step " << i + 1;
    EXPECT_NEAR(r["loss"].get<double>(), rest[i]["loss"].get<double>(), 1e-6) << "step " << i + 1;
  }
  EXPECT_EQ(records[0]["loss"].get<double>(), rest[0]["loss"].get<double>());  // the same weights at the start
  EXPECT_LE(max_difference(dir.path() / "a" / "final" / "model.safetensors",
                           dir.path() / "b" / "final" / "model.safetensors"),
            1e-6);
}

// With the scale doubling after every 2 clean steps, it keeps climbing into overflows and backing off: skipped
// steps all through the run. Stopped after 6 steps and resumed, the run skips the same steps at the same scales
// and reaches the uninterrupted run's weights, because the checkpoint holds the scale and its growth tracker. A
// checkpoint without them (from before fp16-mixed) still resumes, at precision.initial_loss_scale.
TEST(IntegrationFp16, AResumeContinuesTheLossScaleExactly) {
  TempDir dir;
  const std::vector<std::string> scaling = {"--set", "precision.initial_loss_scale=1048576", "--set",
                                            "precision.loss_scale_growth_interval=2"};
  const auto whole = run_trainer(fp16_run(dir.path() / "whole", 12, scaling), "OMP_NUM_THREADS=1");
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const auto first = run_trainer(fp16_run(dir.path() / "resumed", 6, scaling), "OMP_NUM_THREADS=1");
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const auto state = nlohmann::json::parse(read_text(dir.path() / "resumed" / "checkpoint-6" / "train_state.json"));
  ASSERT_TRUE(state.contains("loss_scaler")) << state.dump(2);
  fs::copy(dir.path() / "resumed", dir.path() / "old", fs::copy_options::recursive);
  const auto resumed = run_trainer(with(fp16_run(dir.path() / "resumed", 12, scaling), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;

  const auto a = step_records(dir.path() / "whole"), b = step_records(dir.path() / "resumed");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  int skipped_before = 0, skipped_after = 0;
  for (std::size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(a[i]["loss_scale"], b[i]["loss_scale"]) << "step " << i + 1;
    EXPECT_EQ(a[i]["skipped"], b[i]["skipped"]) << "step " << i + 1;
    EXPECT_EQ(a[i]["skipped_steps"], b[i]["skipped_steps"]) << "step " << i + 1;
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-6) << "step " << i + 1;
    (i < 6 ? skipped_before : skipped_after) += a[i]["skipped"].get<bool>() ? 1 : 0;
  }
  EXPECT_GE(skipped_before, 1);
  EXPECT_GE(skipped_after, 1);  // the scale (and its tracker) mattered after the resume
  EXPECT_EQ(state["loss_scaler"]["scale"].get<double>(), a[6]["loss_scale"].get<double>());
  EXPECT_EQ(state["loss_scaler"]["skipped_steps"].get<int64_t>(), skipped_before);
  EXPECT_LE(max_difference(dir.path() / "whole" / "final" / "model.safetensors",
                           dir.path() / "resumed" / "final" / "model.safetensors"),
            1e-6);
  EXPECT_TRUE(contains(resumed.out, "fp16 loss scaling: " + std::to_string(skipped_before + skipped_after) +
                                        " steps skipped for inf/NaN gradients (" + std::to_string(skipped_after) +
                                        " in this run)"))
      << resumed.out;

  // A checkpoint of an older trainer, without the loss scaler's state: it resumes, from initial_loss_scale.
  auto old_state = state;
  old_state.erase("loss_scaler");
  write_file((dir.path() / "old" / "checkpoint-6" / "train_state.json").string(), old_state.dump(2) + "\n");
  const auto old = run_trainer(with(fp16_run(dir.path() / "old", 7, scaling), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(old.exit_code, 0) << old.err;
  EXPECT_TRUE(contains(old.err, "holds no loss scale")) << old.err;
  EXPECT_EQ(step_records(dir.path() / "old").back()["loss_scale"].get<double>(), 1048576.0);
}

// tiny-vit in fp16-mixed for `steps` steps of 16 images (micro-batches of 8), a constant learning rate, metrics and
// a checkpoint every `checkpoint_every` steps (all kept).
std::vector<std::string> image_fp16_run(const fs::path& dir, int steps, int checkpoint_every,
                                        const std::vector<std::string>& extra = {}) {
  return with({"--config", "configs/tiny-vit.json", "--set", "precision.mode=fp16-mixed", "--set",
               "training.batch_size=16", "--set", "training.micro_batch_size=8", "--set",
               "training.max_steps=" + std::to_string(steps), "--set", "scheduler.name=constant", "--set",
               "scheduler.warmup_steps=0", "--set", "evaluation.every_steps=0", "--set", "logging.every_steps=1",
               "--set", "checkpoint.every_steps=" + std::to_string(checkpoint_every), "--set",
               "checkpoint.keep_last=100", "--set", "checkpoint.output_dir=" + dir.string()},
              extra);
}

// An image classifier in fp16-mixed with a loss scale of 2^28: the cross-entropy's gradient times the scale
// overflows fp16 in backward (real infs), so the first steps are skipped, each halving the scale, until it fits.
// A skipped step changes no weight and no optimizer state (the checkpoints of the skipped steps are the same bytes,
// their optimizer has taken no step), it is counted, and it is never taken for an out-of-memory error.
TEST(IntegrationFp16, ImageClassifierOverflowsAreSkippedAndChangeNoWeight) {
  TempDir dir;
  constexpr int kSteps = 16, kPower = 28;
  const auto run = run_trainer(
      image_fp16_run(dir.path() / "vit", kSteps, 1,
                     {"--set", "precision.initial_loss_scale=" + std::to_string(std::ldexp(1.0, kPower))}),
      "OMP_NUM_THREADS=1");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto records = step_records(dir.path() / "vit");
  ASSERT_EQ(records.size(), static_cast<std::size_t>(kSteps));
  int first_skipped = 0;
  while (first_skipped < kSteps && records[static_cast<std::size_t>(first_skipped)]["skipped"].get<bool>())
    ++first_skipped;
  ASSERT_GE(first_skipped, 3) << run.err;
  ASSERT_LE(first_skipped, kSteps - 3) << run.err;
  int skipped = 0;
  double scale = std::ldexp(1.0, kPower);
  for (int i = 0; i < kSteps; ++i) {
    const auto& r = records[static_cast<std::size_t>(i)];
    SCOPED_TRACE(r.dump());
    const bool skip = r["skipped"].get<bool>();
    skipped += skip ? 1 : 0;
    EXPECT_EQ(r["loss_scale"].get<double>(), scale);  // halved after each skip (no growth within 2000 steps)
    if (skip) scale /= 2;
    EXPECT_EQ(r["skipped_steps"].get<int64_t>(), skipped);
    EXPECT_EQ(r["grad_norm"].is_null(), skip);
    EXPECT_EQ(r["oom_retries"].get<int64_t>(), 0);  // never taken for an out-of-memory error
    EXPECT_EQ(r["micro_batch"].get<int64_t>(), 8);  // and the memory policy never shrank
    EXPECT_EQ(r["adaptations"].get<int64_t>(), 0);
  }
  const auto checkpoint = [&](int step) { return dir.path() / "vit" / ("checkpoint-" + std::to_string(step)); };
  const auto state = [&](int step) {
    return nlohmann::json::parse(read_text(checkpoint(step) / "train_state.json"));
  };
  const std::string untouched = read_text(checkpoint(1) / "model.safetensors");
  for (int step = 1; step <= first_skipped; ++step) {
    SCOPED_TRACE("checkpoint-" + std::to_string(step));
    EXPECT_TRUE(read_text(checkpoint(step) / "model.safetensors") == untouched);
    EXPECT_EQ(state(step)["optimizer_steps"].get<int64_t>(), 0);
    EXPECT_EQ(state(step)["loss_scaler"]["skipped_steps"].get<int64_t>(), step);
    EXPECT_EQ(state(step)["loss_scaler"]["scale"].get<double>(), std::ldexp(1.0, kPower - step));
  }
  // The first step taken changes the weights (so the comparison above could fail).
  EXPECT_FALSE(read_text(checkpoint(first_skipped + 1) / "model.safetensors") == untouched);
  EXPECT_EQ(state(first_skipped + 1)["optimizer_steps"].get<int64_t>(), 1);
  EXPECT_TRUE(contains(run.err, "gradients overflowed fp16 (inf/NaN) at loss scale 268435456: update skipped, loss "
                                "scale -> 134217728"))
      << run.err;
  EXPECT_FALSE(contains(run.err, "out of memory")) << run.err;
  EXPECT_TRUE(contains(run.out, "fp16 loss scaling: " + std::to_string(skipped) + " steps skipped")) << run.out;
}

// With the scale doubling after every 2 clean steps it climbs into overflows and backs off all through the run.
// Resumed from the uninterrupted run's checkpoint-6, the image classifier skips the same steps at the same scales
// and ends with the same weights, bit for bit: the checkpoint holds the scale and its growth tracker.
TEST(IntegrationFp16, ImageClassifierResumeContinuesTheLossScaleExactly) {
  TempDir dir;
  const std::vector<std::string> scaling = {"--set", "precision.initial_loss_scale=262144", "--set",
                                            "precision.loss_scale_growth_interval=2"};
  const auto whole = run_trainer(image_fp16_run(dir.path() / "whole", 12, 6, scaling), "OMP_NUM_THREADS=1");
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const auto state = nlohmann::json::parse(read_text(dir.path() / "whole" / "checkpoint-6" / "train_state.json"));
  ASSERT_TRUE(state.contains("loss_scaler")) << state.dump(2);
  fs::create_directories(dir.path() / "resumed");
  fs::copy(dir.path() / "whole" / "checkpoint-6", dir.path() / "resumed" / "checkpoint-6", fs::copy_options::recursive);
  const auto resumed =
      run_trainer(with(image_fp16_run(dir.path() / "resumed", 12, 6, scaling), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;

  const auto a = step_records(dir.path() / "whole"), b = step_records(dir.path() / "resumed");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 6u);
  int skipped_before = 0, skipped_after = 0;
  for (std::size_t i = 0; i < 12; ++i) (i < 6 ? skipped_before : skipped_after) += a[i]["skipped"].get<bool>() ? 1 : 0;
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(a[6 + i]["loss_scale"], b[i]["loss_scale"]) << "step " << i + 7;
    EXPECT_EQ(a[6 + i]["skipped"], b[i]["skipped"]) << "step " << i + 7;
    EXPECT_EQ(a[6 + i]["skipped_steps"], b[i]["skipped_steps"]) << "step " << i + 7;
    EXPECT_EQ(a[6 + i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 7;
  }
  EXPECT_GE(skipped_before, 1) << whole.err;
  EXPECT_GE(skipped_after, 1) << whole.err;  // the scale (and its tracker) mattered after the resume
  EXPECT_EQ(state["loss_scaler"]["scale"].get<double>(), a[6]["loss_scale"].get<double>());
  EXPECT_EQ(state["loss_scaler"]["skipped_steps"].get<int64_t>(), skipped_before);
  EXPECT_TRUE(read_text(dir.path() / "whole" / "final" / "model.safetensors") ==
              read_text(dir.path() / "resumed" / "final" / "model.safetensors"))
      << "the resumed run's weights differ from the uninterrupted run's";
  EXPECT_TRUE(contains(resumed.out, "fp16 loss scaling: " + std::to_string(skipped_before + skipped_after) +
                                        " steps skipped for inf/NaN gradients (" + std::to_string(skipped_after) +
                                        " in this run)"))
      << resumed.out;
}

// T5-family activations overflow fp16 in the forward pass: fp16-mixed is refused when the model's config.json says
// model_type t5, with the reason and the modes that work (exit 2), before any weight is loaded; `plan` refuses it too.
TEST(IntegrationFp16, T5IsRefusedWithTheReason) {
  TempDir dir;
  const auto train = run_trainer({"--config", "configs/tiny-t5.json", "--set", "precision.mode=fp16-mixed", "--set",
                                  "checkpoint.output_dir=" + (dir.path() / "run").string()});
  EXPECT_EQ(train.exit_code, 2) << train.err;
  EXPECT_TRUE(contains(train.err, "precision.mode=fp16-mixed is refused for configs/models/tiny-t5/config.json "
                                  "(model_type \"t5\"): T5 / FLAN-T5 activations overflow fp16"))
      << train.err;
  EXPECT_TRUE(contains(train.err, "bf16-mixed")) << train.err;
  EXPECT_FALSE(contains(train.out, "Training ")) << train.out;
  const auto plan = run_trainer({"plan", "--config", "configs/tiny-t5.json", "--set", "precision.mode=fp16-mixed"});
  EXPECT_EQ(plan.exit_code, 2) << plan.err;
  EXPECT_TRUE(contains(plan.err, "activations overflow fp16")) << plan.err;
  // The same config in bf16-mixed trains.
  const auto bf16 = run_trainer({"--config", "configs/tiny-t5.json", "--set", "precision.mode=bf16-mixed", "--set",
                                 "training.max_steps=1", "--set", "evaluation.every_steps=0", "--set",
                                 "evaluation.sample_prompts=[]", "--set", "data.validation_files=[]", "--set",
                                 "checkpoint.output_dir=" + (dir.path() / "bf16").string()},
                                "OMP_NUM_THREADS=1");
  EXPECT_EQ(bf16.exit_code, 0) << bf16.err;
}

}  // namespace trainer::test
