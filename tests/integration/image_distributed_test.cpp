// Data parallelism for image classification through the real binary: 2 Gloo ranks on 127.0.0.1 (the torchrun
// environment) reach the weights, losses and evaluation metrics one process reaches (augmentation and dropout on,
// accumulation), for a full fine-tune, a linear probe and LoRA with sharded optimizer state; a real CPU memory
// budget on one rank shrinks every rank's micro-batch mid-run and the weights stay one process's; a 2-rank
// checkpoint with sharded optimizer state resumes in one process; a budget too small for one image on one rank
// stops both with exit 4 and one checkpoint; fp16-mixed overflow skips are agreed; a signal to one rank stops both
// with one checkpoint. Every process runs under `timeout`, so a hang ends the test (CTest label `distributed`).
// AdamW amplifies float noise in gradients near zero (its first steps move every weight by about lr): lr 1e-4 keeps
// the summation-order differences between one process and two ranks under 1e-5.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "support/ranks.h"
#include "support/temp_dir.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Two ranks of `args` (rank r also gets extra[r]; its command starts with prefix[r], e.g. a timeout that signals it).
std::vector<ProcessResult> run_two_ranks(const std::vector<std::string>& args,
                                         const std::vector<std::vector<std::string>>& extra = {},
                                         const std::vector<std::string>& prefix = {}) {
  return run_ranks(2, args, extra, 0, "", prefix);
}

// configs/tiny-vit.json (augmentation on, dropout 0.1, effective batches of 16) for `steps` steps at micro-batch
// `micro` (accumulation on every rank: each rank's share is 8 images), into `dir`.
std::vector<std::string> vit_run(const fs::path& dir, int steps, int micro, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--config", "configs/tiny-vit.json", "--set",
                                   "training.max_steps=" + std::to_string(steps), "--set", "training.micro_batch_size=" + std::to_string(micro), "--set",
                                   "optimizer.lr=1e-4", "--set", "scheduler.warmup_steps=0", "--set",
                                   "evaluation.every_steps=0", "--set", "checkpoint.every_steps=0", "--set",
                                   "logging.every_steps=1", "--set", "checkpoint.output_dir=" + dir.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// One process and two ranks on the same arguments (`dir` differs): both succeed, and `file` in final/ and every
// step's loss agree to 1e-5. Returns the ranks' results.
using ArgsFor = std::function<std::vector<std::string>(const fs::path& dir)>;

std::vector<ProcessResult> expect_two_ranks_match_one(const fs::path& one, const fs::path& two, const ArgsFor& args,
                                                      const std::string& file) {
  const auto single = run_trainer(args(one), "OMP_NUM_THREADS=1");
  EXPECT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_two_ranks(args(two));
  for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / file, two / "final" / file), 1e-5) << file;
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(two / "metrics.jsonl", "loss");
  EXPECT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
  return ranks;
}

}  // namespace

// Full fine-tune: the weights, losses and sharded evaluation's loss, top-1, top-5 and image count of one process.
// Rank 0 alone prints the plan (naming the ranks and each one's share), progress and the summary (counting images);
// rank 0 evaluated only its share of the validation images.
TEST(IntegrationDistributedImages, TwoRanksTrainAndEvaluateAsOneProcess) {
  TempDir dir;
  const std::vector<std::string> eval = {"--set", "evaluation.every_steps=2", "--set",
                                         "evaluation.micro_batch_size=4", "--set", "logging.level=debug"};
  const auto ranks = expect_two_ranks_match_one(
      dir.path() / "one", dir.path() / "two", [&](const fs::path& d) { return vit_run(d, 4, 4, eval); },
      "model.safetensors");
  for (const char* metric : {"eval_loss", "eval_top1", "eval_top5", "eval_images"}) {
    const auto a = metric_values(dir.path() / "one" / "metrics.jsonl", metric);
    const auto b = metric_values(dir.path() / "two" / "metrics.jsonl", metric);
    ASSERT_EQ(a.size(), 2u) << metric;
    ASSERT_EQ(b.size(), 2u) << metric;
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6) << metric << " evaluation " << i + 1;
  }
  EXPECT_EQ(metric_values(dir.path() / "two" / "metrics.jsonl", "eval_images").back(), 40);
  // 40 validation images in batches of 16 (16, 16, 8): rank 0's shares are 8, 8 and 4.
  EXPECT_TRUE(contains(ranks[0].err, "evaluation: rank 0 of 2 evaluated its share: 20 images")) << ranks[0].err;
  EXPECT_TRUE(contains(ranks[0].out, "ranks        2 (this is rank 0")) << ranks[0].out;
  EXPECT_TRUE(contains(ranks[0].out, "each rank decodes and trains about 8 images")) << ranks[0].out;
  EXPECT_TRUE(contains(ranks[0].out, "Done: 4 steps, 64 images")) << ranks[0].out;
  EXPECT_FALSE(contains(ranks[1].out, "Done:")) << ranks[1].out;
  EXPECT_TRUE(fs::exists(dir.path() / "two" / "checkpoint-4" / "COMPLETE"));
}

// --dry-run on rank 0 of 3 (no rendezvous) plans the ranks and each rank's share, as `trainer plan --world-size`
// does (with the AdamW state shared out when sharded), for image classifiers and contrastive CLIP runs.
TEST(IntegrationDistributedImages, DryRunPlansTheRanksOfImageAndContrastiveRuns) {
  TempDir dir;
  const std::string rank0 = "RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 OMP_NUM_THREADS=1";
  auto args = vit_run(dir.path() / "dry", 3, 4);
  args.push_back("--dry-run");
  const auto dry = run_trainer(args, rank0);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_TRUE(contains(dry.out, "ranks        3 (this is rank 0")) << dry.out;
  EXPECT_TRUE(contains(dry.out, "each rank decodes and trains about 6 images of every effective batch")) << dry.out;
  EXPECT_FALSE(fs::exists(dir.path() / "dry"));
  // `trainer plan --world-size 2`: per rank, the AdamW moments (8 bytes per parameter) shared out when sharded.
  const auto plan = run_trainer({"plan", "--config", "configs/tiny-vit.json", "--world-size", "2"});
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_TRUE(contains(plan.out, "data parallelism: 2 ranks (backend gloo); each rank decodes and trains about 8 of "
                                 "the 16 images"))
      << plan.out;
  const auto sharded = run_trainer({"plan", "--config", "configs/tiny-vit.json", "--world-size", "2", "--set",
                                    "distributed.shard_optimizer=true"});
  ASSERT_EQ(sharded.exit_code, 0) << sharded.err;
  EXPECT_TRUE(contains(sharded.out, "about 1/2 of the AdamW state")) << sharded.out;
  auto fixed_of = [](const std::string& out) {
    const std::string key = "weights + grads + AdamW   ";
    const auto at = out.find(key);
    return at == std::string::npos ? std::string() : out.substr(at + key.size(), out.find('\n', at) - at - key.size());
  };
  EXPECT_NE(fixed_of(plan.out), fixed_of(sharded.out)) << plan.out << sharded.out;
  // Fully sharded weights: 1/2 of everything plus the gathered root and encoder layers, not the whole model.
  const auto weights = run_trainer({"plan", "--config", "configs/tiny-vit.json", "--world-size", "2", "--set",
                                    "distributed.shard_weights=true"});
  ASSERT_EQ(weights.exit_code, 0) << weights.err;
  EXPECT_TRUE(contains(weights.out, "fully sharded weights (distributed.shard_weights) over 2 ranks")) << weights.out;
  EXPECT_FALSE(contains(weights.out, "holds the whole model")) << weights.out;
  EXPECT_NE(fixed_of(plan.out), fixed_of(weights.out)) << plan.out << weights.out;
  // A contrastive CLIP run plans its ranks too: each embeds its share, the embeddings are gathered.
  const auto clip = run_trainer({"--config", "configs/tiny-clip.json", "--dry-run"}, rank0);
  ASSERT_EQ(clip.exit_code, 0) << clip.err;
  EXPECT_TRUE(contains(clip.out, "pairs of every effective batch, decoding only those; the embeddings of all"))
      << clip.out;
}

// A linear probe (the head alone trains), and LoRA with sharded optimizer state (each rank keeps AdamW state for
// its share of the adapter and head tensors).
TEST(IntegrationDistributedImages, LinearProbeAndShardedLoraOnTwoRanksTrainWhatOneProcessTrains) {
  TempDir dir;
  expect_two_ranks_match_one(
      dir.path() / "probe-one", dir.path() / "probe-two",
      [&](const fs::path& d) { return vit_run(d, 3, 4, {"--set", "training.linear_probe=true"}); },
      "model.safetensors");
  const auto ranks = expect_two_ranks_match_one(
      dir.path() / "lora-one", dir.path() / "lora-two",
      [&](const fs::path& d) {
        return vit_run(d, 3, 4, {"--set", "lora.enabled=true", "--set", "distributed.shard_optimizer=true"});
      },
      "adapter_model.safetensors");
  EXPECT_TRUE(fs::exists(dir.path() / "lora-two" / "checkpoint-3" / "optimizer-rank-1-of-2.safetensors"));
  EXPECT_TRUE(contains(ranks[0].out, "optimizer state sharded over the ranks")) << ranks[0].out;
}

// data.on_bad_record=skip with two bad images, both in rank 1's shares (records 12 and 121 of 122, no shuffle): the
// ranks exchange how many images each kept, so the loss is normalised by the batch's 15 (then 9) images as in one
// process and the weights and losses are one process's; the summary counts both bad records.
TEST(IntegrationDistributedImages, BadImagesSkippedOnOneRankAreCountedByAll) {
  TempDir dir;
  std::ofstream(dir.path() / "bad.jpg") << "not an image";
  {
    std::ofstream listing(dir.path() / "train.jsonl");
    const std::string root = std::string(TRAINER_SOURCE_DIR) + "/data/demo/images/";
    std::ifstream demo(root + "train.jsonl");
    const std::string bad =
        nlohmann::json{{"image", (dir.path() / "bad.jpg").string()}, {"label", "circle-red"}}.dump();
    int line_number = 0;
    for (std::string line; std::getline(demo, line); ++line_number) {
      if (line_number == 12) listing << bad << "\n";
      auto record = nlohmann::json::parse(line);
      record["image"] = root + record["image"].get<std::string>();
      listing << record.dump() << "\n";
    }
    listing << bad << "\n";
  }
  const std::vector<std::string> data = {"--set",
                                         "data.train_files=[\"" + (dir.path() / "train.jsonl").string() + "\"]", "--set", "data.shuffle=false", "--set", "data.on_bad_record=skip",
                                         "--set", "data.validation_files=[]"};
  const auto ranks = expect_two_ranks_match_one(dir.path() / "one", dir.path() / "two",
                                                [&](const fs::path& d) { return vit_run(d, 8, 4, data); },
                                                "model.safetensors");
  EXPECT_TRUE(contains(ranks[0].out, "bad records skipped 2")) << ranks[0].out;
  const auto images = metric_values(dir.path() / "two" / "metrics.jsonl", "tokens");
  ASSERT_EQ(images.size(), 8u);
  EXPECT_EQ(images.front(), 15);  // the first batch: 16 records, one bad
  EXPECT_EQ(images.back(), 120);
}

// A real CPU budget on rank 1 alone (memory.limit is a per-machine key), between the peaks of a step at micro-batch 4
// and 8 (measured on two ranks by the same binary): rank 1 runs out of memory at step 1, every rank shrinks to 4
// (rank 0's metrics say so), regrows after 2 steps and runs out again mid-run; the weights are those of one
// unconstrained process at micro-batch 8.
TEST(IntegrationDistributedImages, OutOfMemoryOnOneRankShrinksEveryRankAndKeepsTheWeights) {
  TempDir dir;
  auto peak = [&](int micro) {
    const auto d = dir.path() / ("peak-" + std::to_string(micro));
    const auto ranks = run_two_ranks(vit_run(d, 1, micro, {"--set", "data.validation_files=[]"}));
    for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << all_errors(ranks);
    return metric_values(d / "metrics.jsonl", "memory_peak").at(0);
  };
  const double four = peak(4), eight = peak(8);
  ASSERT_LT(four, eight);
  const auto limit = static_cast<int64_t>((four + eight) / 2);
  const std::vector<std::string> common = {"--set", "data.validation_files=[]"};
  const auto single = run_trainer(vit_run(dir.path() / "free", 6, 8, common), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_two_ranks(
      vit_run(dir.path() / "constrained", 6, 8,
              {"--set", "data.validation_files=[]", "--set", "memory.regrow_after_steps=2"}),
      {{"--set", "memory.limit=1GiB"}, {"--set", "memory.limit=" + std::to_string(limit)}});
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto micro = metric_values(dir.path() / "constrained" / "metrics.jsonl", "micro_batch");
  const auto retries = metric_values(dir.path() / "constrained" / "metrics.jsonl", "oom_retries");
  ASSERT_EQ(micro.size(), 6u);
  EXPECT_EQ(micro[0], 4) << all_errors(ranks);
  EXPECT_GE(retries[0], 1);
  double later = 0;
  for (std::size_t i = 1; i < retries.size(); ++i) later += retries[i];
  EXPECT_GE(later, 1) << "regrowth must run out of memory again mid-run\n" << all_errors(ranks);
  EXPECT_TRUE(contains(ranks[1].err, "micro-batch 8 -> 4 (out of memory")) << ranks[1].err;
  EXPECT_LE(max_difference(dir.path() / "free" / "final" / "model.safetensors",
                           dir.path() / "constrained" / "final" / "model.safetensors"),
            1e-5);
}

// A CPU budget on rank 1 that holds the model and its optimizer state but not one image even with activation
// checkpointing: every rank shrinks to the floor, escalates and stops together with exit 4, naming rank 1, and rank 0
// writes the one checkpoint of the last completed step (step 0).
TEST(IntegrationDistributedImages, OutOfMemoryAtTheFloorOnOneRankStopsEveryRankWithOneCheckpoint) {
  TempDir dir;
  const auto ranks = run_two_ranks(vit_run(dir.path() / "run", 3, 8, {"--set", "data.validation_files=[]"}),
                                   {{}, {"--set", "memory.limit=360000"}});
  for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 4) << all_errors(ranks);
  EXPECT_TRUE(contains(ranks[0].err, "every escalation used: rank(s) 1 ran out of memory")) << ranks[0].err;
  EXPECT_TRUE(contains(ranks[1].err, "turning on activation_checkpointing")) << ranks[1].err;
  std::vector<std::string> checkpoints;
  for (const auto& entry : fs::directory_iterator(dir.path() / "run"))
    if (entry.path().filename().string().starts_with("checkpoint-")) checkpoints.push_back(entry.path().filename());
  EXPECT_EQ(checkpoints, std::vector<std::string>{"checkpoint-0"});
  EXPECT_TRUE(fs::exists(dir.path() / "run" / "checkpoint-0" / "COMPLETE"));
}

// fp16-mixed with a loss scale of 2^20: the first steps' gradients overflow fp16. With sharded optimizer state each
// rank checks only the summed gradients it owns, so the ranks agree on the skip; they skip the same steps as one
// process, and the weights after the steps taken are one process's (one process ignores distributed.*). Each rank's
// share (8 images) is one micro-batch of the single process, so the fp16 forward passes are the same.
TEST(IntegrationDistributedImages, Fp16OverflowSkipsAreAgreedAndTheWeightsAreOneProcesss) {
  TempDir dir;
  const std::vector<std::string> fp16 = {"--set", "precision.mode=fp16-mixed", "--set",
                                         "precision.initial_loss_scale=1048576", "--set",
                                         "data.validation_files=[]", "--set", "distributed.shard_optimizer=true"};
  expect_two_ranks_match_one(dir.path() / "one", dir.path() / "two",
                             [&](const fs::path& d) { return vit_run(d, 8, 8, fp16); }, "model.safetensors");
  const auto a = metric_values(dir.path() / "one" / "metrics.jsonl", "skipped_steps");
  const auto b = metric_values(dir.path() / "two" / "metrics.jsonl", "skipped_steps");
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a, b);
  EXPECT_GE(a.back(), 2);  // some steps were skipped,
  EXPECT_LE(a.back(), 6);  // and some taken
}

// Two ranks with sharded optimizer state write checkpoint-3 as one directory (each rank's part listed in
// train_state.json); one process resumes from it and ends with the weights and losses of one process that ran
// straight through.
TEST(IntegrationDistributedImages, TwoRankShardedCheckpointResumesInOneProcess) {
  TempDir dir;
  const std::vector<std::string> common = {"--set", "data.validation_files=[]", "--set", "checkpoint.every_steps=3",
                                           "--set", "checkpoint.keep_last=5"};
  const auto straight = run_trainer(vit_run(dir.path() / "straight", 6, 4, common), "OMP_NUM_THREADS=1");
  ASSERT_EQ(straight.exit_code, 0) << straight.err;
  auto sharded = common;
  sharded.insert(sharded.end(), {"--set", "distributed.shard_optimizer=true"});
  // The same schedule (max_steps 6) as the straight run; its checkpoint-3 is what one process resumes from.
  const auto ranks = run_two_ranks(vit_run(dir.path() / "two", 6, 4, sharded));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto checkpoint = dir.path() / "two" / "checkpoint-3";
  ASSERT_TRUE(fs::exists(checkpoint / "COMPLETE"));
  const auto state = read_json_file((checkpoint / "train_state.json").string());
  EXPECT_EQ(state.at("optimizer_files"),
            nlohmann::json({"optimizer.safetensors", "optimizer-rank-1-of-2.safetensors"}));
  fs::create_directories(dir.path() / "resumed");
  fs::copy(checkpoint, dir.path() / "resumed" / "checkpoint-3", fs::copy_options::recursive);
  auto resume = vit_run(dir.path() / "resumed", 6, 4, common);
  resume.push_back("--resume");
  const auto resumed = run_trainer(resume, "OMP_NUM_THREADS=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "resuming from")) << resumed.err;
  EXPECT_LE(max_difference(dir.path() / "straight" / "final" / "model.safetensors",
                           dir.path() / "resumed" / "final" / "model.safetensors"),
            1e-5);
  const auto a = metric_values(dir.path() / "straight" / "metrics.jsonl", "loss");
  const auto b = metric_values(dir.path() / "resumed" / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(a[3 + i], b[i], 1e-5) << "loss of step " << 4 + i;
}

// The files of a saved model directory (names, and config.json and preprocessor_config.json parsed), so that two
// directories compare as what transformers loads from them; the weights are compared by max_difference.
std::map<std::string, nlohmann::json> saved_files(const fs::path& dir) {
  std::map<std::string, nlohmann::json> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    out[name] = name.ends_with(".json") ? read_json_file(entry.path().string()) : nlohmann::json(nullptr);
  }
  return out;
}

// Fully sharded weights (distributed.shard_weights): each rank keeps half of every weight, gradient and AdamW moment,
// the encoder layers gathered one at a time (again for their recomputation under activation checkpointing). 15
// images over 2 ranks (8 and 7) in micro-batches of 7: rank 0 runs 2 micro-batches, rank 1 one and an empty one, so
// that the layers' collectives pair up; the evaluation the same, unit by unit (the root gathered for it, each layer
// for its forward; evaluation micro-batches of 7 of the 15 validation images a batch). The weights, losses and final
// evaluation are one process's, and final/ holds
// what one process writes. checkpoint-2 holds each rank's half of the weights (nothing gathered), and one process
// resumes from it to the weights of the uninterrupted run; `trainer export` writes the last checkpoint as final/.
TEST(IntegrationDistributedImages, ShardedWeightsTrainEvaluateSaveAndResumeAsOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two", resumed = dir.path() / "resumed";
  const std::vector<std::string> common = {"--set", "training.batch_size=15", "--set",
                                           "training.activation_checkpointing=true", "--set",
                                           "checkpoint.every_steps=2", "--set", "evaluation.micro_batch_size=7"};
  const auto single = run_trainer(vit_run(one, 3, 7, common), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_two_ranks(vit_run(two, 3, 7, with(common, {"--set", "distributed.shard_weights=true"})));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_TRUE(contains(ranks[0].err, "distributed.shard_weights: ")) << ranks[0].err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  EXPECT_EQ(saved_files(one / "final"), saved_files(two / "final"));
  for (const char* metric : {"loss", "eval_loss", "eval_top1", "eval_top5"}) {
    const auto a = metric_values(one / "metrics.jsonl", metric), b = metric_values(two / "metrics.jsonl", metric);
    ASSERT_EQ(a.size(), metric == std::string("loss") ? 3u : 1u) << metric;
    ASSERT_EQ(a.size(), b.size()) << metric;
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << metric << " " << i + 1;
  }
  const auto checkpoint = two / "checkpoint-2";
  ASSERT_TRUE(fs::exists(checkpoint / "COMPLETE"));
  EXPECT_FALSE(fs::exists(checkpoint / "model.safetensors"));
  EXPECT_TRUE(fs::exists(checkpoint / "optimizer-rank-1-of-2.safetensors"));
  EXPECT_TRUE(read_json_file((checkpoint / "train_state.json").string()).value("weights_in_parts", false));
  EXPECT_TRUE(fs::exists(checkpoint / "config.json"));
  EXPECT_TRUE(fs::exists(checkpoint / "preprocessor_config.json"));
  // `trainer export` assembles the last checkpoint's parts offline into what final/ holds.
  const auto exported = run_trainer({"export", (two / "checkpoint-3").string(), "--output",
                                     (dir.path() / "exported").string()});
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_EQ(max_difference(two / "final" / "model.safetensors", dir.path() / "exported" / "model.safetensors"), 0.0);
  EXPECT_EQ(saved_files(two / "final"), saved_files(dir.path() / "exported"));
  auto resume = vit_run(resumed, 3, 7, common);
  resume.insert(resume.end(), {"--resume-from", checkpoint.string()});
  const auto again = run_trainer(resume, "OMP_NUM_THREADS=1");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(contains(again.err, "at step 2")) << again.err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", resumed / "final" / "model.safetensors"), 1e-5);
}

// A linear probe over sharded weights: the frozen encoder layers are gathered for their forward alone (no autograd),
// the head (in the root) trains; one process's weights and losses (one process ignores distributed.*).
TEST(IntegrationDistributedImages, ShardedWeightsTrainALinearProbeAsOneProcess) {
  TempDir dir;
  const std::vector<std::string> probe = {"--set", "training.batch_size=15", "--set", "training.linear_probe=true",
                                          "--set", "data.validation_files=[]", "--set", "distributed.shard_weights=true"};
  const auto ranks = expect_two_ranks_match_one(dir.path() / "one", dir.path() / "two",
                                                [&](const fs::path& d) { return vit_run(d, 2, 7, probe); },
                                                "model.safetensors");
  EXPECT_TRUE(contains(ranks[0].err, "distributed.shard_weights: ")) << ranks[0].err;
}

// What sharded weights do not cover for image classifiers is refused on every rank before any work, naming the keys:
// LoRA (its head trains in full beside the adapters).
// LoRA over fully sharded weights: the frozen backbone sharded, the adapters and the head (trained in full beside
// them) whole on every rank. The adapter and the losses are one process's. Under bf16-mixed, where the sharded root is
// gathered in bf16 for compute, the head in the adapter's file (the checkpoint's and final/) holds fp32 values.
TEST(IntegrationDistributedImages, ShardedWeightsWithLoraTrainTheAdapterOfOneProcess) {
  TempDir dir;
  const std::vector<std::string> lora = {"--set", "lora.enabled=true", "--set", "distributed.shard_weights=true"};
  expect_two_ranks_match_one(dir.path() / "one", dir.path() / "two",
                             [&](const fs::path& d) { return vit_run(d, 3, 4, lora); }, "adapter_model.safetensors");
  const auto mixed = dir.path() / "mixed";
  const auto ranks = run_two_ranks(vit_run(mixed, 2, 4, with(lora, {"--set", "precision.mode=bf16-mixed"})));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto opened = SafetensorsFile::open((mixed / "final" / "adapter_model.safetensors").string());
  int64_t heads = 0;
  for (const auto& t : opened.tensors()) {
    if (t.name.find("classifier") == std::string::npos) continue;
    ++heads;
    const at::Tensor values = opened.load(t.name);
    ASSERT_EQ(values.scalar_type(), at::kFloat) << t.name;
    EXPECT_TRUE(values.ne(values.to(at::kBFloat16).to(at::kFloat)).any().item<bool>()) << t.name << " holds bf16 values";
  }
  EXPECT_GT(heads, 0);
  EXPECT_LE(max_difference(mixed / "checkpoint-2" / "adapter_model.safetensors",
                           mixed / "final" / "adapter_model.safetensors"), 0.0);
}

// SIGTERM to rank 1 alone: both ranks stop after the same step (exit 0), and rank 0 writes one complete checkpoint
// of it.
TEST(IntegrationDistributedImages, SignalToOneRankStopsBothWithOneCheckpoint) {
  TempDir dir;
  const auto ranks = run_two_ranks(vit_run(dir.path() / "run", 100000, 8, {"--set", "data.validation_files=[]"}), {},
                                   {"", "timeout --preserve-status -s TERM 4"});
  for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << all_errors(ranks);
  ASSERT_TRUE(contains(ranks[0].out, "Stopped by SIGTERM")) << ranks[0].out;
  const auto steps = metric_values(dir.path() / "run" / "metrics.jsonl", "step");
  ASSERT_FALSE(steps.empty());
  const auto last = static_cast<int64_t>(steps.back());
  EXPECT_TRUE(fs::exists(dir.path() / "run" / ("checkpoint-" + std::to_string(last)) / "COMPLETE"));
  int checkpoints = 0;
  for (const auto& entry : fs::directory_iterator(dir.path() / "run"))
    checkpoints += entry.path().filename().string().starts_with("checkpoint-");
  EXPECT_EQ(checkpoints, 1);
}

}  // namespace trainer::test
