// CLIP contrastive training under data parallelism through the real binary: 2 Gloo ranks on 127.0.0.1 (the torchrun
// environment) train the weights one process trains with contrastive.negatives=batch (the embeddings are gathered,
// so the negatives are the global batch), also when a real CPU budget on one rank shrinks every rank's micro-batch
// mid-run; sharded evaluation reports one process's loss, recall and zero-shot accuracy; a 2-rank checkpoint resumes
// in one process; sharded optimizer state (ZeRO-1) trains one process's weights and its checkpoint (a part per rank)
// resumes in one process; each rank decodes only its share, and a bad image skipped in one rank's share still gives
// one process's weights; LoRA with a locked image tower and micro-batch negatives are defined; out of memory at the
// floor on one rank and SIGTERM to one rank stop every rank with one checkpoint. Every process runs under
// `timeout` (a hang ends the test). Named IntegrationDistributed* for CTest's `distributed` label.
#include <unistd.h>

#include <algorithm>
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
#include "support/ranks.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

// tiny-clip (attention dropout 0.1 on) for `steps` steps of 16 pairs, micro-batches of `micro`, into `dir`. lr 1e-4:
// AdamW at 1e-3 amplifies the summation-order noise of two ranks' gradient sums past 1e-5.
std::vector<std::string> clip_run(const fs::path& dir, int steps, int micro) {
  return {"--config", "configs/tiny-clip.json", "--set", "training.max_steps=" + std::to_string(steps), "--set",
          "training.micro_batch_size=" + std::to_string(micro), "--set", "optimizer.lr=1e-4", "--set",
          "evaluation.every_steps=0", "--set", "data.validation_files=[]", "--set", "checkpoint.every_steps=0",
          "--set", "logging.every_steps=1", "--set", "checkpoint.output_dir=" + dir.string()};
}

// The same loss and gradient norm every step. The norm is what catches a gradient counted on every rank (AdamW's
// update barely changes when the clipped gradient's direction does not): logit_scale's must count once.
void expect_same_losses(const fs::path& one, const fs::path& two) {
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(two / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
  const auto x = metric_values(one / "metrics.jsonl", "grad_norm"), y = metric_values(two / "metrics.jsonl", "grad_norm");
  ASSERT_EQ(x.size(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-5 * x[i]) << "gradient norm of step " << i + 1;
}

}  // namespace

// THE promise: 2 ranks with gathered embeddings train one process's weights (negatives = the global batch), even
// when a CPU budget on rank 1 alone (between the peaks of micro-batches of 2 and 8) makes every rank shrink at step
// 1, grow back after 2 steps and shrink again mid-run; evaluation, sharded and gathered, reports one process's loss,
// recall@1/5/10 and zero-shot accuracy. The plan names the world size and each rank's share.
TEST(IntegrationDistributedClip, TwoRanksWithOutOfMemoryOnOneTrainTheWeightsAndMetricsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  auto peak = [&](int micro) {
    const auto out = dir.path() / ("peak-" + std::to_string(micro));
    const auto r = run_trainer(clip_run(out, 1, micro), "OMP_NUM_THREADS=1");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return metric_values(out / "metrics.jsonl", "memory_peak").at(0);
  };
  const double small = peak(2), large = peak(8);
  ASSERT_LT(small, large);
  const std::vector<std::string> eval = {"--set", "evaluation.every_steps=3", "--set",
                                         "data.validation_files=[\"data/demo/images/validation-captions.jsonl\"]"};
  const auto single = run_trainer(with(clip_run(one, 6, 8), eval), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;

  const auto dry = run_trainer(with(clip_run(two, 6, 8), {"--dry-run"}),
                               "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 OMP_NUM_THREADS=1");
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_NE(dry.out.find("ranks        2"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("each rank embeds 8 pairs"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("gathered on every rank"), std::string::npos) << dry.out;

  const auto limit = std::to_string(static_cast<int64_t>((small + large) / 2));
  const auto ranks = run_ranks(2, with(with(clip_run(two, 6, 8), eval), {"--set", "memory.regrow_after_steps=2"}),
                                {{}, {"--set", "memory.limit=" + limit}});
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  // Rank 0 alone reports.
  EXPECT_NE(ranks[0].out.find("Done: 6 steps"), std::string::npos) << ranks[0].out;
  EXPECT_EQ(ranks[1].out.find("Done:"), std::string::npos) << ranks[1].out;
  const auto micro = metric_values(two / "metrics.jsonl", "micro_batch");
  const auto retries = metric_values(two / "metrics.jsonl", "oom_retries");
  ASSERT_EQ(micro.size(), 6u);
  EXPECT_LT(micro[0], 8) << all_errors(ranks);
  double later = 0;
  for (std::size_t i = 1; i < retries.size(); ++i) later += retries[i];
  EXPECT_GE(later, 1) << "regrowth must run out of memory again mid-run\n" << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("out of memory"), std::string::npos) << "rank 0 shrinks for rank 1's error\n"
                                                                      << all_errors(ranks);
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(one, two);
  for (const char* key : {"eval_loss", "eval_i2t_r1", "eval_i2t_r5", "eval_i2t_r10", "eval_t2i_r1", "eval_t2i_r5",
                          "eval_t2i_r10", "eval_zero_shot_top1", "eval_pairs"}) {
    const auto a = metric_values(one / "metrics.jsonl", key), b = metric_values(two / "metrics.jsonl", key);
    ASSERT_EQ(a.size(), 2u) << key;
    ASSERT_EQ(b.size(), 2u) << key;
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << key << " at evaluation " << i + 1;
  }
}

// A checkpoint that 2 ranks wrote (rank 0 alone, whole) resumes in one process: the weights of 4 steps in one process.
TEST(IntegrationDistributedClip, ACheckpointOfTwoRanksResumesInOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(clip_run(one, 4, 4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, clip_run(two, 2, 4));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  ASSERT_TRUE(fs::exists(two / "checkpoint-2" / "COMPLETE"));
  const auto resumed = run_trainer(with(clip_run(two, 4, 4), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("at step 2"), std::string::npos) << resumed.err;
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// distributed.shard_optimizer=true (ZeRO-1): each rank keeps and updates about half of the AdamW state, and the 2
// ranks still train one process's weights and losses; their checkpoint (one optimizer part per rank) resumes in one
// process to the weights of the uninterrupted one.
TEST(IntegrationDistributedClip, ShardedOptimizerStateOnTwoRanksTrainsOneProcessAndItsCheckpointResumesInOne) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two", resumed_dir = dir.path() / "resumed";
  const std::vector<std::string> sharded = {"--set", "distributed.shard_optimizer=true", "--set",
                                            "checkpoint.every_steps=2"};
  const auto single = run_trainer(clip_run(one, 4, 4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(clip_run(two, 4, 4), sharded));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].out.find("optimizer state sharded over the ranks"), std::string::npos) << ranks[0].out;
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(one, two);
  const auto checkpoint = two / "checkpoint-2";
  ASSERT_TRUE(fs::exists(checkpoint / "COMPLETE"));
  EXPECT_TRUE(fs::exists(checkpoint / "optimizer-rank-1-of-2.safetensors"));
  // Each part holds about half of the state, so neither alone would resume.
  EXPECT_LT(fs::file_size(checkpoint / "optimizer.safetensors"),
            fs::file_size(one / "checkpoint-4" / "optimizer.safetensors"));
  const auto resumed = run_trainer(with(clip_run(resumed_dir, 4, 4), {"--resume-from", checkpoint.string()}),
                                   "OMP_NUM_THREADS=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("at step 2"), std::string::npos) << resumed.err;
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", resumed_dir / "final" / "model.safetensors"),
            1e-5);
}

// data.on_bad_record=skip with a bad image in rank 1's share of the first batch (record 12 of 121, no shuffle): each
// rank decodes only its share, the ranks exchange how many pairs each kept, so the first batch is one process's 15
// pairs (rank 0's 8 and rank 1's 7), and the weights and losses are one process's; the summary counts the bad record.
TEST(IntegrationDistributedClip, ABadImageSkippedInOneRanksShareGivesTheWeightsOfOneProcess) {
  TempDir dir;
  std::ofstream(dir.path() / "bad.jpg") << "not an image";
  {
    std::ofstream listing(dir.path() / "train.jsonl");
    const std::string root = std::string(TRAINER_SOURCE_DIR) + "/data/demo/images/";
    std::ifstream demo(root + "train-captions.jsonl");
    int line_number = 0;
    for (std::string line; std::getline(demo, line); ++line_number) {
      if (line_number == 12)
        listing << nlohmann::json{{"image", (dir.path() / "bad.jpg").string()}, {"caption", "a broken photo"}}.dump()
                << "\n";
      auto record = nlohmann::json::parse(line);
      record["image"] = root + record["image"].get<std::string>();
      listing << record.dump() << "\n";
    }
  }
  const std::vector<std::string> data = {
      "--set", "data.train_files=[\"" + (dir.path() / "train.jsonl").string() + "\"]", "--set", "data.shuffle=false",
      "--set", "data.on_bad_record=skip"};
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(with(clip_run(one, 3, 4), data), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(clip_run(two, 3, 4), data));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].out.find("bad records skipped 1"), std::string::npos) << ranks[0].out;
  const auto pairs = metric_values(two / "metrics.jsonl", "tokens");
  ASSERT_EQ(pairs.size(), 3u);
  EXPECT_EQ(pairs.front(), 15);  // the first batch: 16 records, one bad
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(one, two);
}

// LoRA with a locked image tower (the text tower's adapters alone train) on 2 ranks: one process's adapter.
TEST(IntegrationDistributedClip, LoraWithALockedImageTowerOnTwoRanksTrainsTheAdapterOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> lora = {"--set", "lora.enabled=true", "--set", "contrastive.freeze_image_tower=true"};
  const auto single = run_trainer(with(clip_run(one, 3, 4), lora), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(clip_run(two, 3, 4), lora));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LT(max_difference(one / "final" / "adapter_model.safetensors", two / "final" / "adapter_model.safetensors"),
            1e-5);
  expect_same_losses(one, two);
  // Over fully sharded weights: the frozen towers sharded, the adapters whole on every rank.
  const auto sharded = dir.path() / "sharded";
  const auto three = run_ranks(2, with(with(clip_run(sharded, 3, 4), lora), {"--set", "distributed.shard_weights=true"}));
  for (const auto& r : three) ASSERT_EQ(r.exit_code, 0) << all_errors(three);
  EXPECT_LT(max_difference(one / "final" / "adapter_model.safetensors",
                           sharded / "final" / "adapter_model.safetensors"), 1e-5);
  expect_same_losses(one, sharded);
}

// contrastive.negatives=micro-batch on N ranks: each rank's micro-batches are their own negatives (no gather), so 2
// ranks with micro-batches of 8 train what one process trains with micro-batches of 8 (its halves are the shares);
// with batch negatives the objective differs.
TEST(IntegrationDistributedClip, MicroBatchNegativesOnTwoRanksAreEachRanksMicroBatches) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> micro = {"--set", "contrastive.negatives=micro-batch"};
  const auto single = run_trainer(with(clip_run(one, 3, 8), micro), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(clip_run(two, 3, 16), micro));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].out.find("negatives within each rank's micro-batches"), std::string::npos) << ranks[0].out;
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(one, two);
}

// Fully sharded weights (distributed.shard_weights): each rank keeps half of every weight, gradient and AdamW moment,
// both towers' encoder layers gathered one at a time, in both passes of gradient caching. 15 pairs over 2 ranks (8
// and 7) in micro-batches of 7: rank 1 runs an empty micro-batch beside its one, in each pass, so that the layers'
// collectives pair up. The model starts with logit_scale 5 (a scale of 148), above CLIP's cap (ln 100), so the cap
// binds: the rank that keeps logit_scale's piece applies it after the update. The final evaluation runs unit by unit
// too (40 validation pairs, batches of 15: 8 and 7 in evaluation micro-batches of 7, rank 1 runs an empty forward in
// each tower). The weights, losses, gradient norms and the final evaluation are one process's, and final/ holds the files one process writes (the tokenizer's
// too); checkpoint-2 holds each rank's half of the weights, and `trainer export` writes the last checkpoint as final/.
TEST(IntegrationDistributedClip, ShardedWeightsTrainEvaluateAndSaveAsOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two", model = dir.path() / "model";
  fs::copy(std::string(TRAINER_SOURCE_DIR) + "/configs/models/tiny-clip", model);
  auto config = nlohmann::json::parse(read_text(model / "config.json"));
  config["logit_scale_init_value"] = 5.0;  // exp(5) = 148 > 100: the cap binds from the first step
  std::ofstream(model / "config.json") << config.dump(2);
  const std::vector<std::string> common = {
      "--set", "training.batch_size=15", "--set", "checkpoint.every_steps=2", "--set",
      "data.validation_files=[\"data/demo/images/validation-captions.jsonl\"]", "--set",
      "model.path=" + model.string(), "--set", "evaluation.micro_batch_size=7"};
  const auto single = run_trainer(with(clip_run(one, 3, 7), common), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(clip_run(two, 3, 7), common), {"--set", "distributed.shard_weights=true"}));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("distributed.shard_weights: "), std::string::npos) << ranks[0].err;
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(one, two);
  const auto scale = SafetensorsFile::open((two / "final" / "model.safetensors").string()).load("logit_scale");
  EXPECT_LE(scale.item<double>(), std::log(100.0) + 1e-6) << "the cap on the logit scale";
  EXPECT_GT(scale.item<double>(), std::log(100.0) - 1e-2);
  for (const char* key : {"eval_loss", "eval_i2t_r1", "eval_t2i_r5", "eval_zero_shot_top1"}) {
    const auto a = metric_values(one / "metrics.jsonl", key), b = metric_values(two / "metrics.jsonl", key);
    ASSERT_EQ(a.size(), 1u) << key;
    ASSERT_EQ(b.size(), 1u) << key;
    EXPECT_NEAR(a[0], b[0], 1e-5) << key;
  }
  std::vector<std::string> files_one, files_two;
  for (const auto& entry : fs::directory_iterator(one / "final")) files_one.push_back(entry.path().filename());
  for (const auto& entry : fs::directory_iterator(two / "final")) files_two.push_back(entry.path().filename());
  std::sort(files_one.begin(), files_one.end());
  std::sort(files_two.begin(), files_two.end());
  EXPECT_EQ(files_one, files_two);
  for (const char* name : {"config.json", "preprocessor_config.json"})
    EXPECT_EQ(read_text(one / "final" / name), read_text(two / "final" / name)) << name;
  const auto checkpoint = two / "checkpoint-2";
  ASSERT_TRUE(fs::exists(checkpoint / "COMPLETE"));
  EXPECT_FALSE(fs::exists(checkpoint / "model.safetensors"));
  EXPECT_TRUE(fs::exists(checkpoint / "optimizer-rank-1-of-2.safetensors"));
  EXPECT_TRUE(fs::exists(checkpoint / "config.json"));
  // `trainer export` assembles the last checkpoint's parts offline into what final/ holds, files and weights.
  const auto exported_dir = dir.path() / "exported";
  const auto exported = run_trainer({"export", (two / "checkpoint-3").string(), "--output", exported_dir.string()});
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_EQ(max_difference(two / "final" / "model.safetensors", exported_dir / "model.safetensors"), 0.0);
  std::vector<std::string> files_exported;
  for (const auto& entry : fs::directory_iterator(exported_dir)) files_exported.push_back(entry.path().filename());
  std::sort(files_exported.begin(), files_exported.end());
  EXPECT_EQ(files_exported, files_two);
}

// A locked image tower (contrastive.freeze_image_tower) over sharded weights: its layers are gathered for pass (a)
// alone, the text tower's for both passes; one process's weights and losses.
TEST(IntegrationDistributedClip, ShardedWeightsWithALockedImageTowerTrainWhatOneProcessTrains) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> locked = {"--set", "contrastive.freeze_image_tower=true", "--set",
                                           "training.batch_size=15"};
  const auto single = run_trainer(with(clip_run(one, 2, 7), locked), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks =
      run_ranks(2, with(with(clip_run(two, 2, 7), locked), {"--set", "distributed.shard_weights=true"}));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LT(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(one, two);
}

// Micro-batch negatives over sharded weights: each micro-batch's towers and loss in one backward, the empty
// micro-batch (rank 1's second) a pair whose loss counts zero times; the weights and losses are those of 2 ranks
// without sharding.
TEST(IntegrationDistributedClip, ShardedWeightsWithMicroBatchNegativesTrainWhatUnshardedRanksTrain) {
  TempDir dir;
  const auto plain = dir.path() / "plain", sharded = dir.path() / "sharded";
  const std::vector<std::string> micro = {"--set", "contrastive.negatives=micro-batch", "--set",
                                          "training.batch_size=15"};
  const auto unsharded = run_ranks(2, with(clip_run(plain, 3, 7), micro));
  for (const auto& r : unsharded) ASSERT_EQ(r.exit_code, 0) << all_errors(unsharded);
  const auto ranks =
      run_ranks(2, with(with(clip_run(sharded, 3, 7), micro), {"--set", "distributed.shard_weights=true"}));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LT(max_difference(plain / "final" / "model.safetensors", sharded / "final" / "model.safetensors"), 1e-5);
  expect_same_losses(plain, sharded);
}

// At the floor on one rank (a budget on rank 1 that even one pair with activation checkpointing exceeds), every
// rank escalates and stops together: exit 4 on both, rank 0 names rank 1, and one checkpoint (rank 0's) of step 0.
TEST(IntegrationDistributedClip, OutOfMemoryAtTheFloorOnOneRankStopsEveryRankWithOneCheckpoint) {
  TempDir dir;
  const auto run = dir.path() / "run";
  const auto ranks = run_ranks(2, clip_run(run, 3, 4), {{}, {"--set", "memory.limit=1200KiB"}});
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 4) << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("every escalation used: rank(s) 1"), std::string::npos) << all_errors(ranks);
  int complete = 0;
  for (const auto& entry : fs::directory_iterator(run))
    if (entry.path().filename().string().starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
      ++complete;
  EXPECT_EQ(complete, 1) << all_errors(ranks);
  EXPECT_TRUE(fs::exists(run / "checkpoint-0" / "COMPLETE")) << all_errors(ranks);
}

// SIGTERM to one rank (of `trainer launch`'s two) stops both after the same step: exit 0, every process ended, one
// complete checkpoint (rank 0's).
TEST(IntegrationDistributedClip, SigtermToOneRankStopsEveryRankWithOneCheckpoint) {
  TempDir dir;
  const auto run = dir.path() / "run";
  const auto args = with({"launch", "--nproc-per-node", "2", "--"},
                         with(clip_run(run, 100000, 4), {"--set", "distributed.timeout_s=30"}));
  // `cd` on its own line: `cd && cmd &` would put a subshell, not the launcher, behind $!.
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) +
                        " || exit 1\nGLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 " + shell_quote(trainer_binary());
  for (const auto& a : args) command += " " + shell_quote(a);
  const std::string log = (dir.path() / "log").string(), rc = (dir.path() / "rc").string(),
                    ended = (dir.path() / "ended").string();
  command += " </dev/null >" + shell_quote(log) + " 2>&1 & L=$!; ";
  command += "for i in $(seq 1 1500); do [ -s " + shell_quote((run / "metrics.jsonl").string()) +
             " ] && break; sleep 0.2; done; C=$(pgrep -P $L); kill -TERM $(echo $C | cut -d' ' -f2); wait $L; "
             "echo $? >" + shell_quote(rc) + "; sleep 1; n=0; for p in $C; do kill -0 $p 2>/dev/null && n=$((n+1)); "
             "done; echo $n >" + shell_quote(ended);
  EXPECT_EQ(std::system(("timeout -k 5 300 bash -c " + shell_quote(command)).c_str()), 0);
  const std::string output = read_text(log);
  EXPECT_EQ(std::stoi(read_text(rc)), 0) << output;
  EXPECT_EQ(std::stoi(read_text(ended)), 0) << output;
  int complete = 0;
  for (const auto& entry : fs::directory_iterator(run))
    if (entry.path().filename().string().starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
      ++complete;
  EXPECT_EQ(complete, 1) << output;
}

}  // namespace trainer::test
