// CLIP contrastive training (training.objective=contrastive) through the real binary on configs/tiny-clip.json:
// a run forced to a smaller micro-batch mid-run by a real CPU budget reaches the weights of an unconstrained
// full-batch run (gradient caching: the loss stays the whole batch's); it trains, evaluates recall and zero-shot
// accuracy, and a resumed run ends with the uninterrupted run's weights bit for bit; bad caption records stop with
// file:line or are skipped and counted; the objective needs a CLIPModel.
#include <filesystem>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {
namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The largest difference between two saved models' tensors (infinity when their names or shapes differ).
double max_difference(const fs::path& a, const fs::path& b) {
  const auto x = SafetensorsFile::open(a.string()), y = SafetensorsFile::open(b.string());
  if (x.tensors().size() != y.tensors().size()) return INFINITY;
  double worst = 0;
  for (const auto& t : x.tensors()) {
    const at::Tensor u = x.load(t.name, at::kFloat), v = y.load(t.name, at::kFloat);
    if (!u.sizes().equals(v.sizes())) return INFINITY;
    worst = std::max(worst, (u - v).abs().max().item<double>());
  }
  return worst;
}

// The values of a boolean key of metrics.jsonl's records, as 0/1.
std::vector<int> flags(const fs::path& metrics_jsonl, const std::string& key) {
  std::vector<int> values;
  std::ifstream file(metrics_jsonl);
  for (std::string line; std::getline(file, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains(key)) values.push_back(record[key].get<bool>() ? 1 : 0);
  }
  return values;
}

std::vector<std::string> clip_args(const fs::path& out, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--config", "configs/tiny-clip.json", "--set",
                                   "checkpoint.output_dir=" + out.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

}  // namespace

// THE promise of contrastive.negatives=batch: eight steps at micro-batch 16 (the whole batch), once without a limit
// and once under a CPU budget between the peaks of micro-batches of 4 and 16, with regrowth after 2 steps: the
// micro-batch falls at step 1, grows back and falls again mid-run. Both end with the same weights (fp32, attention
// dropout 0.1 on: masks keyed by pair, not by split; lr 1e-4 keeps AdamW from amplifying summation-order noise).
TEST(IntegrationContrastive, OutOfMemoryMidRunReachesTheFullBatchWeights) {
  const auto dir = fs::temp_directory_path() / "trainer-clip-oom";
  fs::remove_all(dir);
  const std::vector<std::string> common = {"--set", "training.max_steps=8", "--set", "training.micro_batch_size=16",
                                           "--set", "optimizer.lr=1e-4", "--set", "evaluation.every_steps=0",
                                           "--set", "data.validation_files=[]", "--set", "checkpoint.every_steps=0"};
  auto with = [&](const std::string& name, std::vector<std::string> extra) {
    auto args = clip_args(dir / name, common);
    args.insert(args.end(), extra.begin(), extra.end());
    return run_trainer(args);
  };
  auto peak = [&](const std::string& micro) {
    auto r = with("peak-" + micro, {"--set", "training.max_steps=1", "--set", "training.micro_batch_size=" + micro});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return metric_values(dir / ("peak-" + micro) / "metrics.jsonl", "memory_peak").at(0);
  };
  const double four = peak("4"), sixteen = peak("16");
  ASSERT_LT(four, sixteen);
  auto free_run = with("free", {});
  ASSERT_EQ(free_run.exit_code, 0) << free_run.err;
  const auto limit = static_cast<int64_t>((four + sixteen) / 2);
  auto constrained = with("constrained", {"--set", "memory.limit=" + std::to_string(limit), "--set",
                                          "memory.regrow_after_steps=2"});
  ASSERT_EQ(constrained.exit_code, 0) << constrained.err;
  const auto micro = metric_values(dir / "constrained" / "metrics.jsonl", "micro_batch");
  const auto retries = metric_values(dir / "constrained" / "metrics.jsonl", "oom_retries");
  ASSERT_EQ(micro.size(), 8u);
  EXPECT_LT(micro[0], 16) << constrained.err;
  int64_t later_retries = 0;
  for (std::size_t i = 1; i < retries.size(); ++i) later_retries += static_cast<int64_t>(retries[i]);
  EXPECT_GE(later_retries, 1) << "regrowth must run out of memory again mid-run\n" << constrained.err;
  EXPECT_LT(max_difference(dir / "free" / "final" / "model.safetensors",
                           dir / "constrained" / "final" / "model.safetensors"),
            1e-5);
  // The same split with micro-batch negatives trains another objective: its weights differ.
  auto approximate = with("micro-negatives", {"--set", "training.micro_batch_size=4", "--set",
                                              "contrastive.negatives=micro-batch"});
  ASSERT_EQ(approximate.exit_code, 0) << approximate.err;
  EXPECT_GT(max_difference(dir / "free" / "final" / "model.safetensors",
                           dir / "micro-negatives" / "final" / "model.safetensors"),
            1e-5);
  fs::remove_all(dir);
}

// micro_batch_size=auto measures a whole step (both passes of gradient caching, the batch's loss, the gradient norm)
// at the longest captions: with every caption cut to data.max_length=8 (so the probe's worst case is the data) and no
// safety margin, under two real CPU budgets the probed micro-batch n trains without an out-of-memory retry and a
// fixed n + 1 runs out of memory in step 1. (The former probe, one micro-batch's passes alone, fails this: at 1.5 MiB
// its choice ran out of memory in step 1 and shrank to 2, while 3 fits.)
TEST(IntegrationContrastive, AutoMicroBatchIsTheLargestAtWhichAWholeStepFits) {
  const auto dir = fs::temp_directory_path() / "trainer-clip-auto";
  for (const std::string budget : {"1500KiB", "2000KiB"}) {
    fs::remove_all(dir);
    const std::vector<std::string> common = {
        "--set", "training.max_steps=2", "--set", "evaluation.every_steps=0", "--set", "data.validation_files=[]",
        "--set", "checkpoint.every_steps=0", "--set", "logging.every_steps=1", "--set", "memory.limit=" + budget,
        "--set", "data.max_length=8", "--set", "memory.auto_safety_margin=0", "--set", "memory.regrow_after_steps=0"};
    auto probed = run_trainer(clip_args(dir / "auto", common));
    ASSERT_EQ(probed.exit_code, 0) << probed.err;
    EXPECT_TRUE(contains(probed.err, "micro_batch_size=auto: a step of 16 pairs in micro-batches of")) << probed.err;
    const auto micro = metric_values(dir / "auto" / "metrics.jsonl", "micro_batch");
    const auto retries = metric_values(dir / "auto" / "metrics.jsonl", "oom_retries");
    ASSERT_EQ(micro.size(), 2u);
    for (const double r : retries) EXPECT_EQ(r, 0) << budget << "\n" << probed.err;
    const auto n = static_cast<int64_t>(micro[0]);
    ASSERT_LT(n, 16) << budget << ": the budget must not hold the whole batch";
    auto args = clip_args(dir / "larger", common);
    args.insert(args.end(), {"--set", "training.micro_batch_size=" + std::to_string(n + 1)});
    auto larger = run_trainer(args);
    ASSERT_EQ(larger.exit_code, 0) << larger.err;
    EXPECT_GE(metric_values(dir / "larger" / "metrics.jsonl", "oom_retries").at(0), 1)
        << budget << ": micro-batch " << n + 1 << " should not fit\n" << larger.err;
  }
  fs::remove_all(dir);
}

// The demo trains and evaluates (recall both ways, zero-shot accuracy, loss) in the log and metrics.jsonl; a run
// resumed from its checkpoint-6 ends with the weights of the uninterrupted run, bit for bit, and the same losses.
TEST(IntegrationContrastive, TinyClipTrainsEvaluatesAndResumesExactly) {
  const auto straight = fs::temp_directory_path() / "trainer-clip-straight";
  const auto resumed = fs::temp_directory_path() / "trainer-clip-resumed";
  fs::remove_all(straight);
  fs::remove_all(resumed);
  const std::vector<std::string> common = {"--set", "training.max_steps=12", "--set", "checkpoint.every_steps=6",
                                           "--set", "evaluation.every_steps=6", "--set", "training.micro_batch_size=8"};
  auto dry = run_trainer(clip_args(straight, {"--dry-run"}));
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_TRUE(contains(dry.out, "contrastive image-text training")) << dry.out;
  EXPECT_TRUE(contains(dry.out, "gradient caching")) << dry.out;
  auto first = run_trainer(clip_args(straight, common));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_TRUE(contains(first.err, "image->text R@1/5/10")) << first.err;
  EXPECT_TRUE(contains(first.err, "zero-shot top-1")) << first.err;
  // The summary counts pairs, and a contrastive loss has no perplexity.
  EXPECT_TRUE(contains(first.out, "Done: 12 steps, 184 image-caption pairs; this run 184 in")) << first.out;  // 7 x 16, the epoch's last 8, 4 x 16
  EXPECT_TRUE(contains(first.out, "pairs/s)")) << first.out;
  EXPECT_FALSE(contains(first.out, "perplexity")) << first.out;
  const auto r10 = metric_values(straight / "metrics.jsonl", "eval_i2t_r10");
  const auto zero_shot = metric_values(straight / "metrics.jsonl", "eval_zero_shot_top1");
  ASSERT_EQ(r10.size(), 2u);
  ASSERT_EQ(zero_shot.size(), 2u);
  EXPECT_EQ(metric_values(straight / "metrics.jsonl", "eval_pairs").at(0), 40);
  for (const char* file : {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"})
    EXPECT_TRUE(fs::exists(straight / "final" / file)) << file;

  fs::create_directories(resumed);
  fs::copy(straight / "checkpoint-6", resumed / "checkpoint-6", fs::copy_options::recursive);
  auto args = clip_args(resumed, common);
  args.push_back("--resume");
  auto second = run_trainer(args);
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_TRUE(contains(second.err, "resuming from")) << second.err;
  EXPECT_TRUE(read_text(straight / "final" / "model.safetensors") == read_text(resumed / "final" / "model.safetensors"))
      << "the resumed run's weights differ from the uninterrupted run's";
  const auto a = metric_values(straight / "metrics.jsonl", "loss"), b = metric_values(resumed / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 6u);
  for (std::size_t i = 0; i < 6; ++i) EXPECT_EQ(a[6 + i], b[i]) << "loss of step " << 7 + i;
  // Another negatives mode is another objective: refused on resume.
  auto other = clip_args(fs::temp_directory_path() / "trainer-clip-other", common);
  other.insert(other.end(), {"--set", "contrastive.negatives=micro-batch", "--resume-from",
                             (straight / "checkpoint-6").string()});
  auto refused = run_trainer(other);
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_TRUE(contains(refused.err, "contrastive.negatives")) << refused.err;
  fs::remove_all(fs::temp_directory_path() / "trainer-clip-other");
  fs::remove_all(straight);
  fs::remove_all(resumed);
}

// contrastive.freeze_image_tower=true (LiT): between two checkpoints the image tower and its projection are
// unchanged, the text tower and the logit scale train.
TEST(IntegrationContrastive, LockedImageTowerTrainsOnlyTheText) {
  const auto dir = fs::temp_directory_path() / "trainer-clip-lit";
  fs::remove_all(dir);
  auto run = run_trainer(clip_args(dir, {"--set", "contrastive.freeze_image_tower=true", "--set",
                                         "training.max_steps=3", "--set", "checkpoint.every_steps=1", "--set",
                                         "evaluation.every_steps=0", "--set", "training.micro_batch_size=8"}));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.err, "(image tower locked)")) << run.err;
  const auto before = SafetensorsFile::open((dir / "checkpoint-2" / "model.safetensors").string());
  const auto after = SafetensorsFile::open((dir / "final" / "model.safetensors").string());
  int64_t image_changed = 0, text_changed = 0;
  for (const auto& t : before.tensors()) {
    const bool same = before.load(t.name, at::kFloat).equal(after.load(t.name, at::kFloat));
    const bool image = t.name.starts_with("vision_model.") || t.name.starts_with("visual_projection.");
    if (!same) ++(image ? image_changed : text_changed);
  }
  EXPECT_EQ(image_changed, 0);
  EXPECT_GT(text_changed, 10);
  fs::remove_all(dir);
}

// A record without a caption stops the run with file:line (exit 3), or is skipped and counted with skip; the
// objective needs a CLIPModel directory, and contrastive keys need the objective (exit 2).
TEST(IntegrationContrastive, BadCaptionRecordsAndWrongModels) {
  const auto dir = fs::temp_directory_path() / "trainer-clip-bad";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string root = std::string(TRAINER_SOURCE_DIR) + "/data/demo/images/";
  {
    std::ofstream listing(dir / "train.jsonl");
    std::ifstream demo(root + "train-captions.jsonl");
    int n = 0;
    for (std::string line; std::getline(demo, line) && n < 20; ++n) {
      auto record = nlohmann::json::parse(line);
      record["image"] = root + record["image"].get<std::string>();
      listing << record.dump() << "\n";
      if (n == 2) listing << nlohmann::json{{"image", record["image"]}, {"caption", 7}}.dump() << "\n";
    }
  }
  const std::vector<std::string> common = {"--set", "data.train_files=[\"" + (dir / "train.jsonl").string() + "\"]",
                                           "--set", "training.max_steps=1", "--set", "data.validation_files=[]",
                                           "--set", "training.micro_batch_size=8"};
  auto stop = run_trainer(clip_args(dir / "run-error", common));
  EXPECT_EQ(stop.exit_code, 3) << stop.err;
  EXPECT_TRUE(contains(stop.err, (dir / "train.jsonl").string() + ":4: needs \"caption\"")) << stop.err;
  auto with_skip = common;
  with_skip.insert(with_skip.end(), {"--set", "data.on_bad_record=skip"});
  auto skip = run_trainer(clip_args(dir / "run-skip", with_skip));
  ASSERT_EQ(skip.exit_code, 0) << skip.err;
  EXPECT_TRUE(contains(skip.out, "bad records skipped 1")) << skip.out;

  auto plan = run_trainer({"plan", "--config", "configs/tiny-clip.json"});
  EXPECT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_TRUE(contains(plan.out, "CLIP, contrastive: the estimate covers the image tower only")) << plan.out;
  auto vit = run_trainer(clip_args(dir / "run-vit", {"--set", "model.path=configs/models/tiny-vit", "--dry-run"}));
  EXPECT_EQ(vit.exit_code, 2) << vit.err;
  EXPECT_TRUE(contains(vit.err, "needs a CLIPModel directory")) << vit.err;
  auto keys = run_trainer({"--config", "configs/tiny-vit.json", "--set", "contrastive.negatives=micro-batch",
                           "--dry-run"});
  EXPECT_EQ(keys.exit_code, 2) << keys.err;
  EXPECT_TRUE(contains(keys.err, "training.objective=contrastive")) << keys.err;
  auto prompt = run_trainer(clip_args(dir / "run-prompt", {"--set", "evaluation.class_prompts=[\"a photo\"]",
                                                           "--dry-run"}));
  EXPECT_EQ(prompt.exit_code, 2) << prompt.err;
  EXPECT_TRUE(contains(prompt.err, "no {}")) << prompt.err;
  // --merge (text LoRA's merged copy) is not built for CLIP: refused before training, with PEFT's way.
  auto merge = run_trainer(clip_args(dir / "run-merge", {"--set", "lora.enabled=true", "--merge"}));
  EXPECT_EQ(merge.exit_code, 2) << merge.err;
  EXPECT_TRUE(contains(merge.err, "merge_and_unload")) << merge.err;
  EXPECT_FALSE(fs::exists(dir / "run-merge" / "final"));
  fs::remove_all(dir);
}

// Mixed precision in contrastive runs: bf16-mixed trains the tiny CLIP to about the evaluation loss of fp32;
// fp16-mixed with a loss scale that starts too high (the tiny CLIP's gradients fit fp16 at 2^16, not 2^17) and grows
// every 2 clean steps skips the overflowing steps (no
// weight, optimizer step or memory adaptation comes of them), and a run resumed from checkpoint-6 skips the same
// steps at the same scales and ends with the uninterrupted run's weights bit for bit.
TEST(IntegrationContrastive, MixedPrecisionTrainsAndFp16OverflowsAreSkippedAndResumeExactly) {
  const auto dir = fs::temp_directory_path() / "trainer-clip-precision";
  fs::remove_all(dir);
  const std::vector<std::string> common = {"--set", "training.max_steps=12", "--set", "training.micro_batch_size=8",
                                           "--set", "evaluation.every_steps=0", "--set", "checkpoint.every_steps=1",
                                           "--set", "checkpoint.keep_last=100"};
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    auto args = clip_args(dir / name, common);
    args.insert(args.end(), extra.begin(), extra.end());
    return run_trainer(args);
  };
  auto fp32 = run("fp32", {});
  ASSERT_EQ(fp32.exit_code, 0) << fp32.err;
  auto bf16 = run("bf16", {"--set", "precision.mode=bf16-mixed"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16.err;
  const double fp32_eval = metric_values(dir / "fp32" / "metrics.jsonl", "eval_loss").at(0);
  const double bf16_eval = metric_values(dir / "bf16" / "metrics.jsonl", "eval_loss").at(0);
  const auto bf16_losses = metric_values(dir / "bf16" / "metrics.jsonl", "loss");
  ASSERT_EQ(bf16_losses.size(), 12u);
  EXPECT_LT(std::abs(bf16_eval - fp32_eval), 0.05 * fp32_eval) << "bf16-mixed " << bf16_eval << ", fp32 " << fp32_eval;
  EXPECT_NE(bf16_eval, fp32_eval);  // autocast did run in bf16

  const std::vector<std::string> fp16 = {"--set", "precision.mode=fp16-mixed", "--set",
                                         "precision.initial_loss_scale=524288", "--set",
                                         "precision.loss_scale_growth_interval=2"};
  auto whole = run("fp16", fp16);
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const auto skipped = flags(dir / "fp16" / "metrics.jsonl", "skipped");
  const auto scales = metric_values(dir / "fp16" / "metrics.jsonl", "loss_scale");
  const auto retries = metric_values(dir / "fp16" / "metrics.jsonl", "oom_retries");
  ASSERT_EQ(skipped.size(), 12u);
  ASSERT_TRUE(skipped[0]) << "2^19 must overflow fp16 in the tiny CLIP's backward\n" << whole.err;
  int before = 0, after = 0;
  for (std::size_t i = 0; i < 12; ++i) {
    (i < 6 ? before : after) += skipped[i] != 0 ? 1 : 0;
    EXPECT_EQ(retries[i], 0) << "an overflow is no out-of-memory error (step " << i + 1 << ")";
    const auto checkpoint = [&](std::size_t step) {
      return dir / "fp16" / ("checkpoint-" + std::to_string(step)) / "model.safetensors";
    };
    if (i == 0) continue;
    if (skipped[i] != 0) {
      EXPECT_TRUE(read_text(checkpoint(i)) == read_text(checkpoint(i + 1))) << "skipped step " << i + 1 << " changed weights";
    } else {
      EXPECT_FALSE(read_text(checkpoint(i)) == read_text(checkpoint(i + 1))) << "step " << i + 1 << " changed nothing";
    }
  }
  EXPECT_GE(before, 1);
  EXPECT_LE(before, 5) << whole.err;
  EXPECT_GE(after, 1) << "the scale grows back into an overflow after checkpoint-6\n" << whole.err;
  EXPECT_TRUE(contains(whole.out, "fp16 loss scaling: " + std::to_string(before + after) + " steps skipped")) << whole.out;

  fs::create_directories(dir / "resumed");
  fs::copy(dir / "fp16" / "checkpoint-6", dir / "resumed" / "checkpoint-6", fs::copy_options::recursive);
  auto args = fp16;
  args.push_back("--resume");
  auto resumed = run("resumed", args);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  const auto resumed_scales = metric_values(dir / "resumed" / "metrics.jsonl", "loss_scale");
  const auto resumed_skipped = flags(dir / "resumed" / "metrics.jsonl", "skipped");
  ASSERT_EQ(resumed_scales.size(), 6u);
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(resumed_scales[i], scales[6 + i]) << "step " << i + 7;
    EXPECT_EQ(resumed_skipped[i], skipped[6 + i]) << "step " << i + 7;
  }
  EXPECT_TRUE(read_text(dir / "fp16" / "final" / "model.safetensors") ==
              read_text(dir / "resumed" / "final" / "model.safetensors"))
      << "the resumed run's weights differ from the uninterrupted run's";
  fs::remove_all(dir);
}

// LoRA (both towers, adapter dropout on): checkpoints hold the PEFT adapter; a run resumed from checkpoint-6 (its
// random base made again from the seed) ends with the uninterrupted run's adapter bit for bit.
TEST(IntegrationContrastive, LoraResumesExactly) {
  const auto dir = fs::temp_directory_path() / "trainer-clip-lora";
  fs::remove_all(dir);
  const std::vector<std::string> common = {"--set", "training.max_steps=12", "--set", "checkpoint.every_steps=6",
                                           "--set", "evaluation.every_steps=0", "--set", "training.micro_batch_size=8",
                                           "--set", "lora.enabled=true", "--set", "lora.r=4", "--set",
                                           "lora.dropout=0.1"};
  auto whole = run_trainer(clip_args(dir / "whole", common));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_TRUE(fs::exists(dir / "whole" / "checkpoint-6" / "adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "whole" / "checkpoint-6" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "whole" / "base" / "model.safetensors"));
  fs::create_directories(dir / "resumed");
  fs::copy(dir / "whole" / "checkpoint-6", dir / "resumed" / "checkpoint-6", fs::copy_options::recursive);
  auto args = clip_args(dir / "resumed", common);
  args.push_back("--resume");
  auto resumed = run_trainer(args);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(read_text(dir / "whole" / "final" / "adapter_model.safetensors") ==
              read_text(dir / "resumed" / "final" / "adapter_model.safetensors"))
      << "the resumed run's adapter differs from the uninterrupted run's";
  EXPECT_FALSE(read_text(dir / "whole" / "checkpoint-6" / "adapter_model.safetensors") ==
               read_text(dir / "whole" / "final" / "adapter_model.safetensors"));
  fs::remove_all(dir);
}

}  // namespace trainer::test
