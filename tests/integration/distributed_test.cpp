// Data parallelism through the real binary: N Gloo ranks on 127.0.0.1 (started with the torchrun environment)
// reach the weights one process reaches, with accumulation, LoRA and token-budget micro-batches; out of memory on
// one rank is decided by all; bad launches fail with exit 2 naming the variable or key. Every process runs under
// `timeout`, so a hang ends the test instead of blocking it (CTest label `distributed`).
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "support/metrics.h"
#include "support/process.h"
#include "support/ranks.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

// A short run of a tiny config into `dir`: `steps` optimizer steps of 8 examples, micro-batches of 2 (so the
// gradient accumulates over micro-batches on every rank), no evaluation, the final model saved.
std::vector<std::string> short_run(const std::string& config, const fs::path& dir, int steps = 3) {
  return {"--config", config, "--set", "training.batch_size=8", "--set", "training.micro_batch_size=2", "--set",
          "training.max_steps=" + std::to_string(steps), "--set", "evaluation.every_steps=0", "--set",
          "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0", "--set", "logging.every_steps=1",
          "--set", "checkpoint.output_dir=" + dir.string()};
}

// Gradient buckets of 16 KiB: the tiny models' gradients in dozens of buckets, so that with
// distributed.overlap_grad_reduce (on by default) the last backward of each step starts many sums while it goes on,
// in the order its gradients become final. Debug logging shows how many (buckets_started_during_backward).
const std::vector<std::string> kSmallBuckets = {"--set", "distributed.bucket_size=16KiB", "--set",
                                                "logging.level=debug"};

// From rank 0's debug lines: the most buckets one step started during backward, and the bucket count (0, 0: none).
std::pair<int64_t, int64_t> buckets_started_during_backward(const std::string& log) {
  const std::string tail = " gradient buckets started their sum during backward";
  std::pair<int64_t, int64_t> most{0, 0};
  for (auto at = log.find(tail); at != std::string::npos; at = log.find(tail, at + 1)) {
    const auto line = log.rfind("data parallelism: ", at);
    if (line == std::string::npos) continue;
    int64_t started = 0, total = 0;
    if (std::sscanf(log.c_str() + line, "data parallelism: %ld of %ld", &started, &total) == 2)
      most = std::max(most, std::pair<int64_t, int64_t>{started, total});
  }
  return most;
}

// Trains `args` in one process and on `world` ranks; the saved weights (`file` in final/) must agree to `tolerance`.
void expect_same_weights(const std::vector<std::string>& args_for_dir_one, const std::vector<std::string>& args_for_dir_n,
                         const fs::path& one, const fs::path& n, int world, const std::string& file,
                         double tolerance = 1e-5) {
  const auto single = run_trainer(args_for_dir_one, "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(world, args_for_dir_n);
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / file, n / "final" / file), tolerance);
  // The same losses too: rank 0 reports the whole effective batch's loss.
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(n / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
}

}  // namespace

TEST(IntegrationDistributed, TwoRanksTrainTheWeightsOfOneProcessT5) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  expect_same_weights(short_run("configs/tiny-t5.json", one), short_run("configs/tiny-t5.json", two), one, two, 2,
                      "model.safetensors");
  // Rank 0 alone wrote the run's files; the other rank printed no progress.
  EXPECT_TRUE(fs::exists(two / "checkpoint-3" / "COMPLETE"));
}

// ---- each rank tokenizes only its share of the records (RecordShare) and the ranks exchange them ----

// From rank 0's end summary: the records the run read ("records N read") and each rank's "N records tokenized".
int64_t records_read(const std::string& out) {
  const auto at = out.find("  records ");
  long read = -1;
  if (at != std::string::npos) std::sscanf(out.c_str() + at, "  records %ld read", &read);
  return read;
}
std::vector<int64_t> records_tokenized(const std::string& out, int world) {
  std::vector<int64_t> counts;
  for (int r = 0; r < world; ++r) {
    const auto line = out.find("    rank " + std::to_string(r) + ": ");
    const auto end = line == std::string::npos ? line : out.find('\n', line);
    const auto at = line == std::string::npos ? line : out.rfind(", ", out.find(" records tokenized", line));
    long count = -1;
    if (at != std::string::npos && at > line && at < end) std::sscanf(out.c_str() + at, ", %ld", &count);
    counts.push_back(count);
  }
  return counts;
}

// Three ranks of a causal model: each tokenized a third of the records the run read (they count positions of the
// record stream, 8 of the 24 here), and together one process's weights and losses (the training data and the final
// evaluation's, whose records are shared out the same way).
TEST(IntegrationDistributed, EachOfThreeRanksTokenizesAThirdOfTheRecordsAndTrainsTheWeightsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  const auto single = run_trainer(short_run("configs/tiny-qwen2.json", one), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(3, short_run("configs/tiny-qwen2.json", three));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", three / "final" / "model.safetensors"), 1e-5);
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(three / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
  const auto ea = metric_values(one / "metrics.jsonl", "eval_loss");
  const auto eb = metric_values(three / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(ea.size(), 1u);
  ASSERT_EQ(eb.size(), 1u);
  EXPECT_NEAR(ea[0], eb[0], 1e-5);
  const int64_t read = records_read(ranks[0].out);
  EXPECT_EQ(read, records_read(single.out)) << ranks[0].out;
  EXPECT_EQ(read, 24) << ranks[0].out;  // 3 steps of 8 examples, no record skipped
  EXPECT_EQ(records_tokenized(ranks[0].out, 3), (std::vector<int64_t>{8, 8, 8})) << ranks[0].out;
  EXPECT_NE(ranks[0].out.find("of every effective batch and tokenizes 1/3 of the records"), std::string::npos)
      << ranks[0].out;
  EXPECT_EQ(single.out.find("records tokenized"), std::string::npos) << "one process: no per-rank figures";
}

// Data with a bad record in rank 1's share (line 4, unshuffled: position 3 of 2 ranks) and two over-length records.
// With data.on_bad_record=error every rank stops with one process's error (file:line, exit 3) though only rank 1
// parsed the record; with skip, length grouping and token-budget micro-batches, the same counts and weights as one
// process.
TEST(IntegrationDistributed, BadAndOverLengthRecordsInOneRanksShareActAsInOneProcess) {
  TempDir dir;
  const std::string data = (dir.path() / "train.jsonl").string();
  {
    const std::string demo = read_text(fs::path(TRAINER_SOURCE_DIR) / "data" / "demo" / "recipes-seq2seq.jsonl");
    std::string text;
    std::size_t at = 0;
    for (int line = 1; line <= 60; ++line) {
      if (line == 4) {
        text += "{\"input\": \"Write the steps for nothing.\", \"target\": 7}\n";
        continue;
      }
      if (line == 10 || line == 11) {
        std::string longer = "Write the steps for a very long dish.";
        for (int k = 0; k < 40; ++k) longer += " Stir the soup again.";
        text += "{\"input\": \"" + longer + "\", \"target\": \"1. Stir.\"}\n";
        continue;
      }
      const auto end = demo.find('\n', at);
      text += demo.substr(at, end - at + 1);
      at = end + 1;
    }
    write_file(data, text);
  }
  const std::vector<std::string> setup = {"--set", "data.train_files=[\"" + data + "\"]", "--set", "data.shuffle=false",
                                          "--set", "data.on_overlength=skip", "--set", "data.max_input_length=128",
                                          "--set", "data.max_target_length=192"};  // the demo records all fit
  const auto failing = with(setup, {"--set", "data.on_bad_record=error"});
  const auto single_error = run_trainer(with(short_run("configs/tiny-t5.json", dir.path() / "e1"), failing),
                                        "OMP_NUM_THREADS=1");
  EXPECT_EQ(single_error.exit_code, 3) << single_error.err;
  const std::string where = data + ":4: field \"target\" must be a string, not number";
  EXPECT_NE(single_error.err.find(where), std::string::npos) << single_error.err;
  const auto errors = run_ranks(2, with(short_run("configs/tiny-t5.json", dir.path() / "e2"), failing));
  for (const auto& r : errors) {
    EXPECT_EQ(r.exit_code, 3) << all_errors(errors);
    EXPECT_NE(r.err.find(where), std::string::npos) << all_errors(errors);
  }

  const auto skipping = with(setup, {"--set", "data.on_bad_record=skip", "--set", "data.group_by_length=true", "--set",
                                     "training.micro_batch_size=auto", "--set", "training.micro_batch_tokens=400"});
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(with(short_run("configs/tiny-t5.json", one), skipping), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(short_run("configs/tiny-t5.json", two), skipping));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  const auto summary_line = [](const std::string& out) {
    const auto at = out.find("  records ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  // Length grouping reads the whole mega-batch (here all 60 records) before its first batch.
  EXPECT_EQ(summary_line(single.out), "  records 60 read, bad records skipped 1, truncated 0, too long and skipped 2")
      << single.out;
  EXPECT_EQ(summary_line(ranks[0].out), summary_line(single.out)) << ranks[0].out;
  EXPECT_EQ(records_tokenized(ranks[0].out, 2), (std::vector<int64_t>{30, 30})) << ranks[0].out;
}

TEST(IntegrationDistributed, ThreeRanksTrainTheWeightsOfOneProcessQwen2) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  // 8 examples over 3 ranks: shares of 3, 3 and 2.
  expect_same_weights(short_run("configs/tiny-qwen2.json", one),
                      with(short_run("configs/tiny-qwen2.json", three), kSmallBuckets), one, three, 3,
                      "model.safetensors");
}

// distributed.overlap_grad_reduce (the default): during the last micro-batch's backward of each step (here the
// second of two: accumulation), buckets start their sums as their gradients become final; the weights and losses
// are one process's. Off, every bucket is summed after backward, to the same weights.
TEST(IntegrationDistributed, OverlappedGradientSumsStartDuringBackwardAndTrainTheWeightsOfOneProcessT5) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two", off = dir.path() / "off";
  const auto log_file = dir.path() / "rank0.log";
  expect_same_weights(short_run("configs/tiny-t5.json", one),
                      with(with(short_run("configs/tiny-t5.json", two), kSmallBuckets),
                           {"--set", "logging.log_file=" + log_file.string()}),
                      one, two, 2, "model.safetensors");
  const auto log = read_text(log_file);
  const auto [started, buckets] = buckets_started_during_backward(log);
  EXPECT_GT(buckets, 10) << log.substr(0, 3000);
  EXPECT_GT(started, 0) << log.substr(0, 3000);  // not all left to the end of backward
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-t5.json", off), kSmallBuckets),
                                       {"--set", "distributed.overlap_grad_reduce=false"}));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_EQ(buckets_started_during_backward(ranks[0].err + ranks[0].out).second, 0);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", off / "final" / "model.safetensors"), 1e-5);
}

// Evaluation is sharded: each rank evaluates its share of every validation batch, and the loss sums and token
// counts are summed, so metrics.jsonl's eval_loss and eval_tokens are the single process's. Rank 0's debug line
// shows it evaluated only its share (not the whole set, as an unsharded evaluation on rank 0 would). A sample
// prompt is generated on rank 0 alone while the other ranks go on (no deadlock). `micro`: the evaluation
// micro-batch, chosen so that the ranks' micro-batches are the single process's (padding to another length changes
// the float sums in the last digits).
static void expect_same_evaluation(const std::string& config, int world, int micro) {
  TempDir dir;
  const auto one = dir.path() / "one", n = dir.path() / "n";
  const std::vector<std::string> eval = {"--set", "evaluation.every_steps=2", "--set",
                                         "evaluation.micro_batch_size=" + std::to_string(micro),
                                         "--set", "evaluation.max_new_tokens=4", "--set", "logging.level=debug"};
  const auto single = run_trainer(with(short_run(config, one, 4), eval), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(world, with(with(short_run(config, n, 4), eval),
                                           {"--set", "evaluation.sample_prompts=[\"Write the steps\"]"}));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto a = metric_values(one / "metrics.jsonl", "eval_loss"), b = metric_values(n / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  // Relative 1e-7: the ranks sum the same float32 gradients in another order, and the weights after 4 steps differ in
  // the last bits; on an AVX2-only CPU (AMD EPYC, no AVX-512) the losses (30.17 and 18.52) differed by 0.9e-6 and
  // 1.03e-6 absolute, the same with the binary before the one engine, past the former absolute 1e-6.
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-7 * std::abs(a[i])) << "evaluation " << i + 1;
  const auto tokens = metric_values(n / "metrics.jsonl", "eval_tokens");
  EXPECT_EQ(metric_values(one / "metrics.jsonl", "eval_tokens"), tokens);
  // 40 validation examples in batches of 8: rank 0's share is 3 of each batch of 8 (3 ranks) or 4 (2 ranks).
  const std::string log = ranks[0].out + ranks[0].err;
  const std::string share = "evaluation: rank 0 of " + std::to_string(world) + " evaluated its share: " +
                            std::to_string(world == 2 ? 20 : 15) + " examples, ";
  const auto at = log.find(share);
  ASSERT_NE(at, std::string::npos) << log.substr(0, 4000);
  EXPECT_LT(std::stoll(log.substr(at + share.size())), static_cast<int64_t>(tokens.at(0)));
}

TEST(IntegrationDistributed, EvaluationIsShardedAndReportsTheLossOfOneProcessT5) {
  expect_same_evaluation("configs/tiny-t5.json", 2, 4);  // shares of 4: micro-batches [0,4) [4,8) either way
}

TEST(IntegrationDistributed, EvaluationIsShardedAndReportsTheLossOfOneProcessQwen2ThreeRanks) {
  expect_same_evaluation("configs/tiny-qwen2.json", 3, 1);  // shares of 3, 3, 2: one example at a time
}

TEST(IntegrationDistributed, LoraOnThreeRanksTrainsTheAdapterOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  const std::vector<std::string> lora = {"--set", "lora.enabled=true", "--set", "lora.r=8", "--set",
                                         "optimizer.lr=1e-2"};
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one), lora),
                      with(with(short_run("configs/tiny-qwen2.json", three), lora), {"--set", "distributed.bucket_size=1KiB"}),
                      one, three, 3, "adapter_model.safetensors");
}

// DPO on 2 ranks: each rank scores its share of the pairs (and its reference log-probabilities), the gradients and
// the reward metrics are summed over the ranks: the adapter, the loss and every metric of one process. A full
// fine-tune (a frozen reference copy on each rank) the same, and a full fine-tune with dpo.precompute_reference (the
// ranks score shares of each piece of the reference pass and sum them; rank 0 writes one process's files).
TEST(IntegrationDistributed, DpoOnTwoRanksTrainsTheWeightsAndMetricsOfOneProcess) {
  for (const auto& [lora, precompute] : {std::pair{true, false}, std::pair{false, false}, std::pair{false, true}}) {
    SCOPED_TRACE(lora ? "LoRA" : precompute ? "full fine-tune, precomputed reference" : "full fine-tune");
    TempDir dir;
    const auto one = dir.path() / "one", two = dir.path() / "two";
    const std::vector<std::string> dpo = {"--set", "data.max_length=96", "--set",
                                          std::string("lora.enabled=") + (lora ? "true" : "false"), "--set",
                                          "optimizer.lr=1e-3", "--set",
                                          std::string("dpo.precompute_reference=") + (precompute ? "true" : "false")};
    expect_same_weights(with(short_run("configs/tiny-qwen2-dpo.json", one), dpo),
                        with(with(short_run("configs/tiny-qwen2-dpo.json", two), dpo), kSmallBuckets), one, two, 2,
                        lora ? "adapter_model.safetensors" : "model.safetensors");
    for (const char* metric : {"rewards/chosen", "rewards/accuracies", "rewards/margins", "logps/rejected",
                               "logits/chosen"}) {
      const auto a = metric_values(one / "metrics.jsonl", metric), b = metric_values(two / "metrics.jsonl", metric);
      ASSERT_EQ(a.size(), 3u) << metric;
      ASSERT_EQ(a.size(), b.size()) << metric;
      for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << metric << " step " << i + 1;
    }
    if (precompute) {
      for (const auto& run : {one, two})
        EXPECT_TRUE(fs::is_regular_file(run / "dpo-reference" / "complete.json")) << run;
      EXPECT_EQ(fs::file_size(one / "dpo-reference" / "train-000000.bin"),
                fs::file_size(two / "dpo-reference" / "train-000000.bin"));
    }
  }
}

TEST(IntegrationDistributed, TokenBudgetMicroBatchesOnTwoRanksTrainTheWeightsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> tokens = {"--set", "training.micro_batch_size=auto", "--set",
                                           "training.micro_batch_tokens=400"};
  expect_same_weights(with(short_run("configs/tiny-t5.json", one), tokens),
                      with(short_run("configs/tiny-t5.json", two), tokens), one, two, 2, "model.safetensors");
}

// Only rank 1 has a memory budget, too small for its micro-batch of 4: both ranks shrink together (the same
// adaptation in rank 0's log), and the weights are those of the unconstrained single process.
// Packing on every rank: each rank packs its share into rows, and each packed example keeps the dropout masks of
// its place in the whole effective batch (the tiny T5 has dropout_rate 0.1), so two ranks of packed rows train
// the weights of one process with padded rows.
TEST(IntegrationDistributed, PackedRowsOnTwoRanksTrainThePaddedWeightsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  expect_same_weights(short_run("configs/tiny-t5.json", one),
                      with(short_run("configs/tiny-t5.json", two), {"--set", "data.packing=true"}), one, two, 2,
                      "model.safetensors");
}

TEST(IntegrationDistributed, OutOfMemoryOnOneRankShrinksEveryRankAndKeepsTheWeights) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> micro4 = {"--set", "training.micro_batch_size=4", "--set", "memory.limit=2GiB"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one), micro4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", two), micro4), kSmallBuckets),
                               {{}, {"--set", "memory.limit=6MiB"}});
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("out of memory"), std::string::npos) << all_errors(ranks);
  // Overlap on: rank 0, which fit, started sums during the backward of attempts rank 1 did not finish; rank 1 took
  // its part in them (with filler) before the ranks agreed, so nothing hung and nothing of it reached the weights.
  EXPECT_GT(buckets_started_during_backward(ranks[0].err).first, 0) << all_errors(ranks);
  const auto micro = metric_values(two / "metrics.jsonl", "micro_batch");
  ASSERT_FALSE(micro.empty());
  EXPECT_LT(micro.back(), 4) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// Under activation checkpointing (recomputation runs nested backward passes) the sums run after backward, overlap
// or not: no bucket starts during backward, and the weights are one process's.
TEST(IntegrationDistributed, UnderActivationCheckpointingTheSumsRunAfterBackwardToTheWeightsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> checkpointing = {"--set", "training.activation_checkpointing=true"};
  const auto log_file = dir.path() / "rank0.log";
  expect_same_weights(with(short_run("configs/tiny-t5.json", one), checkpointing),
                      with(with(with(short_run("configs/tiny-t5.json", two), checkpointing), kSmallBuckets),
                           {"--set", "logging.log_file=" + log_file.string()}),
                      one, two, 2, "model.safetensors");
  const auto log = read_text(log_file);
  EXPECT_NE(log.find("step 3/3"), std::string::npos) << log.substr(0, 3000);
  EXPECT_EQ(buckets_started_during_backward(log).second, 0) << log.substr(0, 3000);
}

// An untied LM head (the tiny Qwen2 with tie_word_embeddings false): the fused loss accumulates the head's gradient
// outside autograd, before backward, and marks it final then, so the head's bucket (the first: reverse order) does
// not hold back the others: every bucket of every step starts during backward. Weights equal one process's.
TEST(IntegrationDistributed, AnUntiedHeadStartsItsBucketBeforeBackwardAndTrainsTheWeightsOfOneProcess) {
  TempDir dir;
  const auto model = dir.path() / "untied";
  fs::copy(fs::path(TRAINER_SOURCE_DIR) / "configs/models/tiny-qwen2", model);
  std::string config = read_text(model / "config.json");
  const std::string tied = "\"tie_word_embeddings\": true";
  ASSERT_NE(config.find(tied), std::string::npos);
  config.replace(config.find(tied), tied.size(), "\"tie_word_embeddings\": false");
  write_file((model / "config.json").string(), config);
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> untied = {"--set", "model.path=" + model.string()};
  const auto log_file = dir.path() / "rank0.log";
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one), untied),
                      with(with(with(short_run("configs/tiny-qwen2.json", two), untied), kSmallBuckets),
                           {"--set", "logging.log_file=" + log_file.string()}),
                      one, two, 2, "model.safetensors");
  const auto log = read_text(log_file);
  const auto [started, buckets] = buckets_started_during_backward(log);
  EXPECT_GT(buckets, 5) << log.substr(0, 3000);
  EXPECT_EQ(started, buckets) << log.substr(0, 3000);
}

// Evaluation's out-of-memory errors: only rank 1 has a budget (3 MiB) that its training steps (short examples,
// micro-batch 1) fit and its evaluation of long validation examples does not, even at one example per micro-batch.
// Rank 1 stops evaluating and says so in the evaluation's final sum: every rank stops with exit 4 and the same error
// naming rank 1, instead of rank 0 waiting in a collective for a rank that left.
TEST(IntegrationDistributed, EvaluationOutOfMemoryOnOneRankStopsEveryRankNamingIt) {
  TempDir dir;
  std::string train, validation;
  const char* words[] = {"salt", "pepper", "garlic", "onion", "stir", "bake", "boil", "roast"};
  for (int i = 0; i < 32; ++i)
    train += std::string(R"({"prompt": "Recipe: )") + words[i % 8] + R"(", "completion": " )" + words[(i * 3) % 8] +
             "\"}\n";
  for (int i = 0; i < 8; ++i) {
    std::string prompt, completion;
    for (int w = 0; w < 200; ++w) prompt += std::string(" ") + words[(i + w * 5) % 8];
    for (int w = 0; w < 100; ++w) completion += std::string(" ") + words[(i + w * 3) % 8];
    validation += R"({"prompt": "Recipe:)" + prompt + R"(", "completion": ")" + completion + "\"}\n";
  }
  write_file(dir.file("train.jsonl"), train);
  write_file(dir.file("val.jsonl"), validation);
  const std::vector<std::string> args = {
      "--config", "configs/tiny-qwen2.json", "--set", "data.train_files=[\"" + dir.file("train.jsonl") + "\"]",
      "--set", "data.validation_files=[\"" + dir.file("val.jsonl") + "\"]", "--set", "data.max_length=512",
      "--set", "training.batch_size=4", "--set", "training.micro_batch_size=1", "--set", "training.max_steps=2",
      "--set", "evaluation.every_steps=1", "--set", "evaluation.micro_batch_size=2", "--set",
      "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0", "--set",
      "checkpoint.output_dir=" + (dir.path() / "out").string()};
  const auto ranks = run_ranks(2, args, {{}, {"--set", "memory.limit=3MiB"}});
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 4) << all_errors(ranks);
    EXPECT_NE(r.err.find("evaluation ran out of memory on rank(s) 1 "), std::string::npos) << all_errors(ranks);
    EXPECT_EQ(r.err.find("died or hangs"), std::string::npos) << all_errors(ranks);
  }
}

// Checkpoints do not depend on the world size: 2 ranks train 2 steps, one process resumes for 2 more, and the weights
// are those of 4 steps in one process.
TEST(IntegrationDistributed, ACheckpointOfTwoRanksResumesInOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(short_run("configs/tiny-qwen2.json", one, 4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, short_run("configs/tiny-qwen2.json", two, 2));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto resumed = run_trainer(with(short_run("configs/tiny-qwen2.json", two, 4), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("at step 2"), std::string::npos) << resumed.err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// Chat records (configs/tiny-qwen2-chat.json: conversations rendered by the Qwen2.5 template, the loss on the
// assistant's turns) shard, pack and resume as text records do: two ranks each render and tokenize half of the
// records and train one process's weights and losses; two ranks packing their shares, stopped after 2 steps and
// resumed on two ranks, reach the same 4-step weights.
TEST(IntegrationDistributed, ChatRecordsOnTwoRanksTrainTheWeightsOfOneProcessPackedAndResumed) {
  TempDir dir;
  const std::string config = "configs/tiny-qwen2-chat.json";
  const auto one = dir.path() / "one", two = dir.path() / "two", packed = dir.path() / "packed";
  const auto single = run_trainer(short_run(config, one, 4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, short_run(config, two, 4));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(two / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
  EXPECT_EQ(records_read(ranks[0].out), 32) << ranks[0].out;  // 4 steps of 8 conversations
  EXPECT_EQ(records_tokenized(ranks[0].out, 2), (std::vector<int64_t>{16, 16})) << ranks[0].out;

  const std::vector<std::string> packing = {"--set", "data.packing=true"};
  const auto first = run_ranks(2, with(short_run(config, packed, 2), packing));
  for (const auto& r : first) ASSERT_EQ(r.exit_code, 0) << all_errors(first);
  const auto resumed = run_ranks(2, with(with(short_run(config, packed, 4), packing), {"--resume"}));
  for (const auto& r : resumed) ASSERT_EQ(r.exit_code, 0) << all_errors(resumed);
  EXPECT_NE(resumed[0].err.find("at step 2"), std::string::npos) << resumed[0].err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", packed / "final" / "model.safetensors"), 1e-5);
}

// ---- sharded optimizer state (distributed.shard_optimizer, ZeRO-1) ----

const std::vector<std::string> kSharded = {"--set", "distributed.shard_optimizer=true"};

// The names of a safetensors file's tensors, without the RNG state.
static std::vector<std::string> state_names(const fs::path& file) {
  std::vector<std::string> names;
  const auto opened = SafetensorsFile::open(file.string());  // alive for the loop (C++20 range-for)
  for (const auto& t : opened.tensors())
    if (!t.name.starts_with("rng.")) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  return names;
}

// Each of 2 ranks keeps the AdamW moments (fused kernel: fp32) of its half of the parameters, sums gradients to
// their owners, clips by the global norm and broadcasts what it updated: the weights of one process, with
// accumulation. The checkpoint's optimizer state is in one part per rank, disjoint, together the whole state.
TEST(IntegrationDistributed, ShardedOptimizerOnTwoRanksTrainsTheWeightsOfOneProcessT5) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  expect_same_weights(short_run("configs/tiny-t5.json", one),
                      with(with(short_run("configs/tiny-t5.json", two), kSharded), kSmallBuckets), one, two, 2,
                      "model.safetensors");
  const auto part0 = state_names(two / "checkpoint-3" / "optimizer.safetensors");
  const auto part1 = state_names(two / "checkpoint-3" / "optimizer-rank-1-of-2.safetensors");
  EXPECT_FALSE(part0.empty());
  EXPECT_FALSE(part1.empty());
  std::vector<std::string> both = part0;
  both.insert(both.end(), part1.begin(), part1.end());
  std::sort(both.begin(), both.end());
  EXPECT_EQ(both, state_names(one / "checkpoint-3" / "optimizer.safetensors"));
}

// Three ranks, Qwen2 with Adafactor (per-parameter statistics: whole parameters keep them on one rank).
TEST(IntegrationDistributed, ShardedAdafactorOnThreeRanksTrainsTheWeightsOfOneProcessQwen2) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  const std::vector<std::string> adafactor = {"--set", "optimizer.name=adafactor"};
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one), adafactor),
                      with(with(short_run("configs/tiny-qwen2.json", three), adafactor), kSharded), one, three, 3,
                      "model.safetensors");
  EXPECT_TRUE(fs::exists(three / "checkpoint-3" / "optimizer-rank-2-of-3.safetensors"));
}

TEST(IntegrationDistributed, ShardedOptimizerWithLoraOnThreeRanksTrainsTheAdapterOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  const std::vector<std::string> lora = {"--set", "lora.enabled=true", "--set", "lora.r=8", "--set",
                                         "optimizer.lr=1e-2"};
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one), lora),
                      with(with(short_run("configs/tiny-qwen2.json", three), lora), kSharded), one, three, 3,
                      "adapter_model.safetensors");
}

// A run moves between world sizes and sharding through its checkpoints: 2 sharded ranks train 2 steps, one process
// continues to 4, 2 sharded ranks again to 6; the weights are those of 6 uninterrupted steps in one process.
TEST(IntegrationDistributed, ShardedCheckpointsResumeOnOtherWorldSizesExactly) {
  TempDir dir;
  const auto one = dir.path() / "one", run = dir.path() / "run";
  const auto single = run_trainer(short_run("configs/tiny-qwen2.json", one, 6), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto first = run_ranks(2, with(short_run("configs/tiny-qwen2.json", run, 2), kSharded));
  for (const auto& r : first) ASSERT_EQ(r.exit_code, 0) << all_errors(first);
  EXPECT_TRUE(fs::exists(run / "checkpoint-2" / "optimizer-rank-1-of-2.safetensors"));
  const auto middle =
      run_trainer(with(short_run("configs/tiny-qwen2.json", run, 4), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(middle.exit_code, 0) << middle.err;
  EXPECT_NE(middle.err.find("at step 2"), std::string::npos) << middle.err;
  const auto last = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", run, 6), kSharded), {"--resume"}));
  for (const auto& r : last) ASSERT_EQ(r.exit_code, 0) << all_errors(last);
  EXPECT_NE(last[0].err.find("at step 4"), std::string::npos) << last[0].err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", run / "final" / "model.safetensors"), 1e-5);
}

// A checkpoint with a rank's part missing is refused, naming the file, before anything trains.
TEST(IntegrationDistributed, ACheckpointWithAMissingOptimizerPartIsRefusedNamingIt) {
  TempDir dir;
  const auto run = dir.path() / "run";
  const auto ranks = run_ranks(2, with(short_run("configs/tiny-t5.json", run, 1), kSharded));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  ASSERT_TRUE(fs::remove(run / "checkpoint-1" / "optimizer-rank-1-of-2.safetensors"));
  const auto resumed = run_trainer(with(short_run("configs/tiny-t5.json", run, 2), {"--resume"}), "OMP_NUM_THREADS=1");
  EXPECT_EQ(resumed.exit_code, 3) << resumed.err;
  EXPECT_NE(resumed.err.find("optimizer-rank-1-of-2.safetensors is missing"), std::string::npos) << resumed.err;
}

// fp16-mixed with a loss scale that overflows (2^20 on this model) and, doubling after every clean step, overflows
// again and again: the ranks take one overflow decision (each checks the summed gradients it holds: all of them,
// or with a sharded optimizer its own parameters'), skip the steps one process skips and reach its weights: within
// 1e-4 here, because fp16 autocast with lr 3e-3 amplifies the summation order (two ranks sum two micro-batches each
// and then each other's; one process sums four): on an AVX2-only CPU (AMD EPYC) the weights differed by 3.1e-5,
// with the binary before the one engine too, where AVX-512 machines stayed under 1e-5. The skip decisions and loss
// scales must be equal.
TEST(IntegrationDistributed, TwoRanksSkipTheFp16OverflowStepsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> fp16 = {"--set", "precision.mode=fp16-mixed", "--set",
                                         "precision.initial_loss_scale=1048576", "--set",
                                         "precision.loss_scale_growth_interval=1"};
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one, 6), fp16),
                      with(short_run("configs/tiny-qwen2.json", two, 6), fp16), one, two, 2, "model.safetensors", 1e-4);
  const auto a = metric_values(one / "metrics.jsonl", "skipped_steps");
  const auto b = metric_values(two / "metrics.jsonl", "skipped_steps");
  EXPECT_EQ(a, b);
  ASSERT_FALSE(a.empty());
  EXPECT_GT(a.back(), 0);
  EXPECT_EQ(metric_values(one / "metrics.jsonl", "loss_scale"), metric_values(two / "metrics.jsonl", "loss_scale"));
  const auto sharded = dir.path() / "sharded";
  const auto ranks = run_ranks(
      2, with(with(with(short_run("configs/tiny-qwen2.json", sharded, 6), fp16), kSharded), kSmallBuckets));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", sharded / "final" / "model.safetensors"), 1e-4);
  EXPECT_EQ(a, metric_values(sharded / "metrics.jsonl", "skipped_steps"));
}

TEST(IntegrationDistributed, BadLaunchEnvironmentsFailWithExitTwoNamingTheVariable) {
  TempDir dir;
  const auto args = short_run("configs/tiny-t5.json", dir.path() / "run", 1);
  auto r = run_trainer(args, "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("WORLD_SIZE=2 is set but RANK is not"), std::string::npos) << r.err;
  r = run_trainer(args, "RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("RANK=2 is not an integer from 0 to 1"), std::string::npos) << r.err;
  r = run_trainer(args, "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=http");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("MASTER_PORT=http"), std::string::npos) << r.err;
}

// Rank 0 cannot serve the rendezvous on a port another program holds: exit 2 naming MASTER_PORT. A rank that finds
// no rendezvous gives up after distributed.timeout_s, naming MASTER_ADDR:MASTER_PORT.
TEST(IntegrationDistributed, APortInUseIsAnErrorNamingMasterPort) {
  TempDir dir;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  const auto args = with(short_run("configs/tiny-t5.json", dir.path() / "run", 1), {"--set", "distributed.timeout_s=5"});
  const std::string launch = "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
                             " GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout -k 5 120";
  const auto rank0 = run_trainer(args, launch);
  ::close(fd);
  EXPECT_EQ(rank0.exit_code, 2) << rank0.err;
  EXPECT_NE(rank0.err.find("MASTER_PORT=" + std::to_string(port)), std::string::npos) << rank0.err;
  EXPECT_NE(rank0.err.find("the port is in use"), std::string::npos) << rank0.err;

  // Nobody serves the rendezvous: rank 1 gives up after distributed.timeout_s (not killed by `timeout`: exit 2).
  const auto rank1 = run_trainer(args, "RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                           std::to_string(free_port()) +
                                           " GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout -k 5 120");
  EXPECT_EQ(rank1.exit_code, 2) << rank1.err;
  EXPECT_NE(rank1.err.find("[rank 1] error: rank 1 of 2: the rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:"),
            std::string::npos)
      << rank1.err;
}

TEST(IntegrationDistributed, RanksWithDifferentConfigsFailOnEveryRankNamingTheKey) {
  TempDir dir;
  const auto ranks = run_ranks(2, short_run("configs/tiny-t5.json", dir.path() / "run", 1),
                               {{}, {"--set", "optimizer.lr=0.5"}});
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_EQ(ranks[r].exit_code, 2) << all_errors(ranks);
    EXPECT_NE(ranks[r].err.find("rank 1 differs from rank 0 in: optimizer.lr"), std::string::npos)
        << all_errors(ranks);
  }
  EXPECT_NE(ranks[1].err.find("[rank 1] error:"), std::string::npos) << ranks[1].err;
}

// `trainer launch` starts the ranks itself (no Python): the same weights as one process.
TEST(IntegrationDistributed, LaunchStartsTheRanksAndTrainsTheWeightsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(short_run("configs/tiny-t5.json", one), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto launched = run_trainer(with({"launch", "--nproc-per-node", "2", "--"}, short_run("configs/tiny-t5.json", two)),
                                    "GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout -k 5 300");
  ASSERT_EQ(launched.exit_code, 0) << launched.err;
  // Rank 0 alone prints the summary.
  const auto done = launched.out.find("Done: 3 steps");
  EXPECT_NE(done, std::string::npos) << launched.out;
  EXPECT_EQ(launched.out.find("Done: 3 steps", done + 1), std::string::npos) << launched.out;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// Runs `trainer launch` in the background, waits until training has begun, does `action` to it (a shell snippet
// with $L = the launcher's pid and $C = its children's pids), and returns the launcher's exit code and log, and
// whether every process it started has ended.
struct LaunchOutcome {
  int exit_code = -1;
  std::string log;
  bool all_ended = false;
};
LaunchOutcome launch_and(const fs::path& dir, const std::string& action, int timeout_s = 30) {
  const auto args = with({"launch", "--nproc-per-node", "2", "--"},
                         with(short_run("configs/tiny-t5.json", dir / "run", 100000),
                              {"--set", "distributed.timeout_s=" + std::to_string(timeout_s)}));
  // `cd` on its own line: `cd && cmd &` would put a subshell, not the launcher, behind $!.
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " || exit 1\nGLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 " +
                        shell_quote(trainer_binary());
  for (const auto& a : args) command += " " + shell_quote(a);
  const std::string log = (dir / "log").string(), rc = (dir / "rc").string(), ended = (dir / "ended").string();
  command += " </dev/null >" + shell_quote(log) + " 2>&1 & L=$!; ";
  command += "for i in $(seq 1 1500); do [ -s " + shell_quote((dir / "run" / "metrics.jsonl").string()) +
             " ] && break; sleep 0.2; done; C=$(pgrep -P $L); " + action + "; wait $L; echo $? >" + shell_quote(rc) +
             "; sleep 1; n=0; for p in $C; do kill -0 $p 2>/dev/null && n=$((n+1)); done; echo $n >" +
             shell_quote(ended);
  // The whole script is bounded in time: a hang ends the test.
  EXPECT_EQ(std::system(("timeout -k 5 400 bash -c " + shell_quote(command)).c_str()), 0);
  LaunchOutcome outcome;
  outcome.exit_code = std::stoi(read_text(rc));
  outcome.log = read_text(log);
  outcome.all_ended = std::stoi(read_text(ended)) == 0;
  return outcome;
}

// SIGTERM to the launcher reaches every rank: they stop after the same step, rank 0 writes one checkpoint, exit 0.
TEST(IntegrationDistributed, LaunchForwardsSigtermAndTheRanksStopTogetherWithOneCheckpoint) {
  TempDir dir;
  const auto outcome = launch_and(dir.path(), "kill -TERM $L");
  EXPECT_EQ(outcome.exit_code, 0) << outcome.log;
  EXPECT_TRUE(outcome.all_ended) << outcome.log;
  int complete = 0;
  for (const auto& entry : fs::directory_iterator(dir.path() / "run"))
    if (entry.path().filename().string().starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
      ++complete;
  EXPECT_EQ(complete, 1) << outcome.log;
}

// A rank killed with SIGKILL: the launcher ends the other and exits with the dead rank's code (128 + 9).
TEST(IntegrationDistributed, LaunchEndsTheOtherRanksWhenOneDiesAndExitsWithItsCode) {
  TempDir dir;
  const auto outcome = launch_and(dir.path(), "kill -KILL $(echo $C | cut -d' ' -f2)");
  EXPECT_EQ(outcome.exit_code, 137) << outcome.log;
  EXPECT_TRUE(outcome.all_ended) << outcome.log;
  EXPECT_NE(outcome.log.find("exited with code 137; stopping the other ranks"), std::string::npos) << outcome.log;
}

// torchrun (its agent serves the store: TORCHELASTIC_USE_AGENT_STORE) starts trainer as it starts Python scripts.
const fs::path kTorchrun = fs::path(TRAINER_SOURCE_DIR) / ".venv" / "bin" / "torchrun";

// `nproc` ranks of `args` under torchrun (one node); the exit status and the log into `log`.
int run_torchrun(int nproc, const std::vector<std::string>& args, const fs::path& log) {
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " && GLOO_SOCKET_IFNAME=lo timeout -k 5 300 " +
                        shell_quote(kTorchrun.string()) + " --nproc-per-node " + std::to_string(nproc) +
                        " --master-port " + std::to_string(free_port()) + " --no-python " + shell_quote(trainer_binary());
  for (const auto& a : args) command += " " + shell_quote(a);
  command += " </dev/null >" + shell_quote(log.string()) + " 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(IntegrationDistributed, TorchrunStartsTheRanksAndTrainsTheWeightsOfOneProcess) {
  if (!fs::exists(kTorchrun)) GTEST_SKIP() << "no torchrun in .venv";
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(short_run("configs/tiny-t5.json", one), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  ASSERT_EQ(run_torchrun(2, short_run("configs/tiny-t5.json", two), dir.path() / "log"), 0)
      << read_text(dir.path() / "log");
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// ---- fully sharded weights (distributed.shard_weights: ZeRO-3) ----

const std::vector<std::string> kShardWeights = {"--set", "distributed.shard_weights=true"};

// The elements of a checkpoint part's AdamW state (weights: of the pieces of the weights it holds).
int64_t state_elements(const fs::path& file, bool weights = false) {
  int64_t n = 0;
  const auto opened = SafetensorsFile::open(file.string());
  for (const auto& t : opened.tensors())
    if (!t.name.starts_with("rng.") && t.name.starts_with("weights.") == weights) n += c10::multiply_integers(t.shape);
  return n;
}

// Two ranks under torchrun, T5 under activation checkpointing (each block gathered again for its recomputation):
// every weight, gradient and moment lives in halves, and the weights and losses are one process's. Each rank's
// optimizer part holds half the state.
TEST(IntegrationDistributed, ShardedWeightsUnderTorchrunTrainTheWeightsOfOneProcessT5) {
  if (!fs::exists(kTorchrun)) GTEST_SKIP() << "no torchrun in .venv";
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> checkpointing = {"--set", "training.activation_checkpointing=true"};
  const auto single = run_trainer(with(short_run("configs/tiny-t5.json", one), checkpointing), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  ASSERT_EQ(run_torchrun(2, with(with(short_run("configs/tiny-t5.json", two), kShardWeights), checkpointing),
                         dir.path() / "log"),
            0)
      << read_text(dir.path() / "log");
  EXPECT_NE(read_text(dir.path() / "log").find("distributed.shard_weights: "), std::string::npos);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(two / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
  const auto checkpoint = two / "checkpoint-3";
  const int64_t whole = state_elements(one / "checkpoint-3" / "optimizer.safetensors");
  const int64_t part0 = state_elements(checkpoint / "optimizer.safetensors");
  const int64_t part1 = state_elements(checkpoint / "optimizer-rank-1-of-2.safetensors");
  EXPECT_EQ(part0 + part1, whole);
  EXPECT_LE(std::abs(part0 - part1), 8) << part0 << " " << part1;  // halves, up to the padding
  // The weights too: each rank's part holds its half, and no file holds them whole (nothing was gathered).
  EXPECT_FALSE(fs::exists(checkpoint / "model.safetensors"));
  const int64_t weights0 = state_elements(checkpoint / "optimizer.safetensors", true);
  const int64_t weights1 = state_elements(checkpoint / "optimizer-rank-1-of-2.safetensors", true);
  EXPECT_EQ(2 * (weights0 + weights1), whole);  // AdamW: two moments per weight
  EXPECT_LE(std::abs(weights0 - weights1), 4) << weights0 << " " << weights1;
  // `trainer export` assembles them offline into the Hugging Face model final/ holds; a missing part is named.
  const auto exported = run_trainer({"export", checkpoint.string(), "--output", (dir.path() / "exported").string()});
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_EQ(max_difference(two / "final" / "model.safetensors", dir.path() / "exported" / "model.safetensors"), 0.0);
  fs::remove(checkpoint / "optimizer-rank-1-of-2.safetensors");
  const auto incomplete = run_trainer({"export", checkpoint.string(), "--output", (dir.path() / "again").string()});
  EXPECT_EQ(incomplete.exit_code, 3);
  EXPECT_NE(incomplete.err.find("optimizer-rank-1-of-2.safetensors is missing"), std::string::npos) << incomplete.err;
}

// Three ranks by `trainer launch`, a decoder (Qwen2) with packed rows and the blocks kept gathered from forward to
// backward (distributed.reshard_after_forward=false); 8 examples over 3 ranks: one rank runs an empty micro-batch to
// keep the blocks' collectives paired.
TEST(IntegrationDistributed, ShardedWeightsOnThreeLaunchedRanksTrainTheWeightsOfOneProcessQwen2) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  const std::vector<std::string> packed = {"--set", "data.packing=true"};
  const auto single = run_trainer(short_run("configs/tiny-qwen2.json", one), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto launched = run_trainer(
      with(with({"launch", "--nproc-per-node", "3", "--"}, short_run("configs/tiny-qwen2.json", three)),
           with(with(kShardWeights, packed), {"--set", "distributed.reshard_after_forward=false"})),
      "GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout -k 5 300");
  ASSERT_EQ(launched.exit_code, 0) << launched.err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", three / "final" / "model.safetensors"), 1e-5);
  EXPECT_TRUE(fs::exists(three / "checkpoint-3" / "optimizer-rank-2-of-3.safetensors"));
}

// A sharded run resumes on any world size, sharded or not: 2 sharded ranks train 2 steps, 3 sharded ranks continue
// to 3, one process to 4; the weights are those of 4 uninterrupted steps in one process.
TEST(IntegrationDistributed, ShardedWeightsResumeOnThreeRanksAndInOneProcessExactly) {
  TempDir dir;
  const auto one = dir.path() / "one", run = dir.path() / "run";
  const auto single = run_trainer(short_run("configs/tiny-qwen2.json", one, 4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto first = run_ranks(2, with(short_run("configs/tiny-qwen2.json", run, 2), kShardWeights));
  for (const auto& r : first) ASSERT_EQ(r.exit_code, 0) << all_errors(first);
  const auto middle = run_ranks(3, with(with(short_run("configs/tiny-qwen2.json", run, 3), kShardWeights), {"--resume"}));
  for (const auto& r : middle) ASSERT_EQ(r.exit_code, 0) << all_errors(middle);
  EXPECT_NE(middle[0].err.find("at step 2"), std::string::npos) << middle[0].err;
  const auto last = run_trainer(with(short_run("configs/tiny-qwen2.json", run, 4), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(last.exit_code, 0) << last.err;
  EXPECT_NE(last.err.find("at step 3"), std::string::npos) << last.err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", run / "final" / "model.safetensors"), 1e-5);
}

// Adafactor over sharded weights (T5's optimizer; scale_parameter and a first moment so that every sum over the ranks
// counts): 3 sharded ranks train 2 steps, whose pieces cut matrices mid-row; 2 sharded ranks continue to 3 (the row
// and column statistics whole in every part, the rest in pieces), one process to 4: the weights of 4 uninterrupted
// steps in one process.
TEST(IntegrationDistributed, ShardedWeightsWithAdafactorResumeOnTwoRanksAndInOneProcessAsOneProcessT5) {
  TempDir dir;
  const auto one = dir.path() / "one", run = dir.path() / "run";
  const std::vector<std::string> adafactor = {"--set", "optimizer.name=adafactor", "--set",
                                              "optimizer.scale_parameter=true", "--set",
                                              "optimizer.adafactor_beta1=true", "--set", "optimizer.lr=1e-2"};
  const auto args = [&](const fs::path& out, int steps) {
    return with(short_run("configs/tiny-t5.json", out, steps), adafactor);
  };
  const auto single = run_trainer(args(one, 4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto first = run_ranks(3, with(args(run, 2), kShardWeights));
  for (const auto& r : first) ASSERT_EQ(r.exit_code, 0) << all_errors(first);
  const auto part = SafetensorsFile::open((run / "checkpoint-2" / "optimizer-rank-1-of-3.safetensors").string());
  // A matrix's row statistics whole (2-D matrices: one value per row), its first moment a flat piece.
  bool whole_rows = false, piece_of_moment = false;
  for (const auto& t : part.tensors())
    if (t.name.starts_with("exp_avg_sq_row.") && t.shape.size() == 1) {
      const std::string name = t.name.substr(std::string("exp_avg_sq_row.").size());
      for (const auto& u : part.tensors())
        if (u.name == "exp_avg." + name && u.shape.size() == 1) piece_of_moment = true;
      whole_rows = true;
    }
  EXPECT_TRUE(whole_rows && piece_of_moment);
  const auto middle = run_ranks(2, with(with(args(run, 3), kShardWeights), {"--resume"}));
  for (const auto& r : middle) ASSERT_EQ(r.exit_code, 0) << all_errors(middle);
  EXPECT_NE(middle[0].err.find("at step 2"), std::string::npos) << middle[0].err;
  const auto last = run_trainer(with(args(run, 4), {"--resume"}), "OMP_NUM_THREADS=1");
  ASSERT_EQ(last.exit_code, 0) << last.err;
  EXPECT_NE(last.err.find("at step 3"), std::string::npos) << last.err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", run / "final" / "model.safetensors"), 1e-5);
}

// Rank 1 runs out of memory inside the blocks' collectives (a 6 MiB budget for micro-batches of 4): it tells rank
// 0 at the next status all-reduce, both drop the attempt, shrink and retry, and the weights are one process's.
TEST(IntegrationDistributed, ShardedWeightsOutOfMemoryOnOneRankShrinksEveryRankAndKeepsTheWeights) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> micro4 = {"--set", "training.micro_batch_size=4", "--set", "memory.limit=2GiB"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one), micro4), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(with(short_run("configs/tiny-qwen2.json", two), micro4), kShardWeights),
                                       {"--set", "logging.level=debug"}),
                               {{}, {"--set", "memory.limit=6MiB"}});
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  // Rank 0 learnt it inside the attempt, at a status all-reduce (not only at the attempt's end).
  EXPECT_NE(ranks[0].err.find("another rank ran out of memory during this attempt"), std::string::npos)
      << all_errors(ranks);
  const auto micro = metric_values(two / "metrics.jsonl", "micro_batch");
  ASSERT_FALSE(micro.empty());
  EXPECT_LT(micro.back(), 4) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// micro_batch_size=auto over sharded weights: each try of the probe is a collective attempt. Rank 1 alone has a
// budget too small for the larger tries: rank 0 learns it inside the collectives, both take each decision together
// and start with the same micro-batch, and the weights are one process's (which probes its own).
TEST(IntegrationDistributed, ShardedWeightsProbeTheMicroBatchTogetherAndTrainTheWeightsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> automatic = {"--set", "training.micro_batch_size=auto", "--set", "memory.limit=2GiB"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one), automatic), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", two), automatic), kShardWeights),
                               {{}, {"--set", "memory.limit=8MiB"}});
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("does not fit (out of memory on another rank)"), std::string::npos) << ranks[0].err;
  for (const auto& r : ranks)  // the same start on both (micro-batch 2: rank 1 runs out of memory at 4)
    EXPECT_NE(r.err.find("micro-batch 8 -> 2 (micro_batch_size=auto probe)"), std::string::npos) << all_errors(ranks);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

// From a pretrained model.path, each rank reads the weights unit by unit as it shards them (the model stays on the
// meta device until then), and trains one process's weights; with LoRA and QLoRA (each 4-bit layer quantized as its
// unit is cut), the frozen base alike and one process's adapter.
TEST(IntegrationDistributed, ShardedWeightsReadAPretrainedModelUnitByUnitAndTrainTheWeightsOfOneProcess) {
  TempDir dir;
  const auto base = dir.path() / "base", one = dir.path() / "one", two = dir.path() / "two";
  const auto made = run_trainer(short_run("configs/tiny-qwen2.json", base, 1), "OMP_NUM_THREADS=1");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  const std::vector<std::string> pretrained = {"--set", "model.path=" + (base / "final").string(), "--set",
                                               "model.init=pretrained"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one), pretrained), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", two), pretrained), kShardWeights));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("the whole model was never in memory"), std::string::npos) << ranks[0].err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
  // LoRA over the same pretrained base: the frozen base read unit by unit too, the adapters made whole at once.
  const std::vector<std::string> lora = {"--set", "lora.enabled=true", "--set", "lora.r=4", "--set",
                                         "optimizer.lr=1e-2"};
  const auto lora_one = dir.path() / "lora-one", lora_two = dir.path() / "lora-two";
  const auto adapter =
      run_trainer(with(with(short_run("configs/tiny-qwen2.json", lora_one), pretrained), lora), "OMP_NUM_THREADS=1");
  ASSERT_EQ(adapter.exit_code, 0) << adapter.err;
  const auto adapters =
      run_ranks(2, with(with(with(short_run("configs/tiny-qwen2.json", lora_two), pretrained), lora), kShardWeights));
  for (const auto& r : adapters) ASSERT_EQ(r.exit_code, 0) << all_errors(adapters);
  EXPECT_NE(adapters[0].err.find("the whole model was never in memory"), std::string::npos) << adapters[0].err;
  EXPECT_LE(max_difference(lora_one / "final" / "adapter_model.safetensors",
                           lora_two / "final" / "adapter_model.safetensors"),
            1e-5);
  // QLoRA: each 4-bit layer is quantized as its unit is cut (its codes and scales laid out on the meta device first).
  const std::vector<std::string> qlora = with(lora, {"--set", "model.quantize=nf4"});
  const auto qlora_one = dir.path() / "qlora-one", qlora_two = dir.path() / "qlora-two";
  const auto quantized =
      run_trainer(with(with(short_run("configs/tiny-qwen2.json", qlora_one), pretrained), qlora), "OMP_NUM_THREADS=1");
  ASSERT_EQ(quantized.exit_code, 0) << quantized.err;
  const auto quantized_ranks =
      run_ranks(2, with(with(with(short_run("configs/tiny-qwen2.json", qlora_two), pretrained), qlora), kShardWeights));
  for (const auto& r : quantized_ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(quantized_ranks);
  EXPECT_NE(quantized_ranks[0].err.find("the whole model was never in memory"), std::string::npos)
      << quantized_ranks[0].err;
  EXPECT_LE(max_difference(qlora_one / "final" / "adapter_model.safetensors",
                           qlora_two / "final" / "adapter_model.safetensors"),
            1e-5);
}

// Evaluation and rank 0's samples run on the gathered model: the validation losses and the sampled text are one
// process's.
TEST(IntegrationDistributed, ShardedWeightsEvaluateAndSampleAsOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> evaluation = {"--set", "evaluation.every_steps=1", "--set",
                                               "evaluation.sample_prompts=[\"Recipe: soup\"]"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one, 2), evaluation), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", two, 2), evaluation), kShardWeights));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto a = metric_values(one / "metrics.jsonl", "eval_loss"), b = metric_values(two / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "evaluation " << i + 1;
  auto samples = [](const std::string& log) {
    std::vector<std::string> lines;
    for (auto at = log.find("sample step "); at != std::string::npos; at = log.find("sample step ", at + 1))
      lines.push_back(log.substr(at, log.find('\n', at) - at));
    return lines;
  };
  EXPECT_EQ(samples(single.err), samples(ranks[0].err));
  EXPECT_EQ(samples(ranks[0].err).size(), 2u) << ranks[0].err;
}

// The validation loss unit by unit with a budget on rank 1 alone that an evaluation micro-batch of 8 (and 4) exceeds:
// rank 1 runs out of memory inside a forward, rank 0 learns it at the next collective, both halve together, and the
// loss is one unconstrained process's.
TEST(IntegrationDistributed, ShardedWeightsEvaluationOutOfMemoryOnOneRankHalvesEveryRank) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> evaluation = {"--set", "evaluation.every_steps=1", "--set",
                                               "evaluation.micro_batch_size=8"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one, 1), evaluation), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", two, 1), evaluation), kShardWeights),
                               {{}, {"--set", "memory.limit=3MiB"}});
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  for (const auto& r : ranks)
    EXPECT_NE(r.err.find("evaluation micro-batch 8 -> 4"), std::string::npos) << all_errors(ranks);
  const auto a = metric_values(one / "metrics.jsonl", "eval_loss"), b = metric_values(two / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_NEAR(a[0], b[0], 1e-5);
}

// LoRA over a sharded frozen base: the base lives in halves, the adapters whole on every rank with their gradients
// summed; the adapter and its checkpoint (the adapter alone, as unsharded) are one process's.
TEST(IntegrationDistributed, LoraOverShardedWeightsTrainsTheAdapterOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> lora = {"--set", "lora.enabled=true", "--set", "lora.r=8", "--set",
                                         "optimizer.lr=1e-2"};
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one), lora),
                      with(with(short_run("configs/tiny-qwen2.json", two), lora), kShardWeights), one, two, 2,
                      "adapter_model.safetensors");
  EXPECT_FALSE(fs::exists(two / "checkpoint-3" / "optimizer-rank-1-of-2.safetensors"));
}

// An untied decoder (Qwen3): its embeddings and its head are units of their own, gathered only around their forward
// and backward (the embeddings' backward ends when their gradient has accumulated: ids come in). Three ranks, 8
// examples in micro-batches of 2: a rank runs an empty pass through the same units. The fused loss (the head
// gathered around it) and the plain one (the head through autograd) both give one process's weights. The validation
// loss runs unit by unit too (the root and the head gathered for it; empty passes where a rank's share is smaller).
TEST(IntegrationDistributed, ShardedWeightsMakeAnUntiedDecodersEmbeddingsAndHeadUnitsOfTheirOwn) {
  TempDir dir;
  for (const std::string chunked : {"true", "false"}) {
    SCOPED_TRACE("training.chunked_loss=" + chunked);
    const auto one = dir.path() / ("one-" + chunked), three = dir.path() / ("three-" + chunked);
    const std::vector<std::string> loss = {"--set", "training.chunked_loss=" + chunked, "--set",
                                           "evaluation.every_steps=1", "--set", "evaluation.micro_batch_size=2"};
    const auto single = run_trainer(with(short_run("configs/tiny-qwen3.json", one, 2), loss), "OMP_NUM_THREADS=1");
    ASSERT_EQ(single.exit_code, 0) << single.err;
    const auto ranks = run_ranks(3, with(with(short_run("configs/tiny-qwen3.json", three, 2), loss), kShardWeights));
    for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
    // The root, the embeddings, 2 blocks, the head.
    EXPECT_NE(ranks[0].err.find(" in 5 units over 3 ranks"), std::string::npos) << ranks[0].err;
    // From the second step, each gather starts the next unit's (distributed.prefetch): the embeddings, the blocks
    // and the head in forward order, then the blocks and the embeddings in backward order.
    EXPECT_NE(ranks[0].err.find("prefetch: each of 6 gathers of a pass starts the next unit's"), std::string::npos)
        << ranks[0].err;
    EXPECT_LE(max_difference(one / "final" / "model.safetensors", three / "final" / "model.safetensors"), 1e-5);
    const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(three / "metrics.jsonl", "loss");
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
    const auto ea = metric_values(one / "metrics.jsonl", "eval_loss");
    const auto eb = metric_values(three / "metrics.jsonl", "eval_loss");
    ASSERT_EQ(ea.size(), 2u);
    ASSERT_EQ(ea.size(), eb.size());
    for (std::size_t i = 0; i < ea.size(); ++i) EXPECT_NEAR(ea[i], eb[i], 1e-5) << "evaluation " << i + 1;
  }
}

// precision.mode=bf16 over sharded weights: bf16 shards, gathered and reduced in bf16, stepped with stochastic
// rounding keyed as in one process. The gradients' bf16 sums run in another order (each micro-batch's reduced as
// its backward ends, as FSDP2 does), so the weights are one process's within bf16's rounding: no element further
// than one bf16 step at 1.0, and on average under 1e-4 where the three AdamW steps (lr 6e-4, 1.2e-3, 1.8e-3 in the
// warmup) moved each weight by about 3.6e-3; final/ is bf16, as one process writes it.
TEST(IntegrationDistributed, ShardedWeightsTrainPureBf16WithinItsRoundingOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> bf16 = {"--set", "precision.mode=bf16"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one), bf16), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", two), bf16), kShardWeights));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  const auto a = SafetensorsFile::open((one / "final" / "model.safetensors").string());
  const auto b = SafetensorsFile::open((two / "final" / "model.safetensors").string());
  double largest = 0, sum = 0;
  int64_t count = 0;
  for (const auto& t : a.tensors()) {
    ASSERT_NE(b.find(t.name), nullptr) << t.name;
    const at::Tensor x = a.load(t.name), y = b.load(t.name);
    EXPECT_EQ(x.scalar_type(), at::kBFloat16) << t.name;
    EXPECT_EQ(y.scalar_type(), at::kBFloat16) << t.name;
    const at::Tensor d = (x.to(at::kFloat) - y.to(at::kFloat)).abs();
    largest = std::max(largest, d.max().item<double>());
    sum += d.sum().item<double>();
    count += d.numel();
  }
  EXPECT_LE(largest, 1.0 / 128);
  EXPECT_LT(sum / static_cast<double>(count), 1e-4);
}

// Mixed precision as FSDP2's policy: under bf16-mixed the fp32 shards are gathered in bf16 (distributed.param_dtype
// auto) and the gradients reduced in fp32; final/ holds the fp32 master weights. The bf16 weights make the model run
// in bf16 where one process's autocast keeps fp32 (the embeddings' output, the residual stream), so the first step's
// gradient norm (the same weights, the same data) is one process's within bf16's noise, and the weights stay within
// the two AdamW updates (lr 3e-3 each) of one process's. param_dtype=fp32 gathers fp32: one process's numbers.
TEST(IntegrationDistributed, ShardedWeightsGatherInBf16AndReduceInFp32UnderBf16Mixed) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two", kept = dir.path() / "kept";
  const std::vector<std::string> mixed = {"--set", "precision.mode=bf16-mixed"};
  const auto single = run_trainer(with(short_run("configs/tiny-qwen3.json", one, 2), mixed), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen3.json", two, 2), mixed), kShardWeights));
  for (const auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
  EXPECT_NE(ranks[0].err.find("fp32 weights gathered in BFloat16, gradients reduced in Float"), std::string::npos)
      << ranks[0].err;
  const auto fp32 = run_ranks(2, with(with(with(short_run("configs/tiny-qwen3.json", kept, 2), mixed), kShardWeights),
                                      {"--set", "distributed.param_dtype=fp32"}));
  for (const auto& r : fp32) ASSERT_EQ(r.exit_code, 0) << all_errors(fp32);
  EXPECT_NE(fp32[0].err.find("fp32 weights gathered in Float"), std::string::npos) << fp32[0].err;
  const auto opened = SafetensorsFile::open((two / "final" / "model.safetensors").string());
  for (const auto& t : opened.tensors()) EXPECT_EQ(t.dtype_name, "F32") << t.name;
  const auto norms = metric_values(one / "metrics.jsonl", "grad_norm");
  const auto bf16_norms = metric_values(two / "metrics.jsonl", "grad_norm");
  const auto fp32_norms = metric_values(kept / "metrics.jsonl", "grad_norm");
  ASSERT_EQ(norms.size(), 2u);
  ASSERT_EQ(bf16_norms.size(), 2u);
  ASSERT_EQ(fp32_norms.size(), 2u);
  EXPECT_NEAR(bf16_norms[0], norms[0], 1e-3 * norms[0]);
  EXPECT_NEAR(fp32_norms[0], norms[0], 1e-5 * norms[0]);
  const auto a = metric_values(one / "metrics.jsonl", "loss"), b = metric_values(two / "metrics.jsonl", "loss");
  const auto c = metric_values(kept / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), c.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-3) << "step " << i + 1;
    EXPECT_NEAR(a[i], c[i], 1e-5) << "step " << i + 1;
  }
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 6e-3);
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", kept / "final" / "model.safetensors"), 2e-3);
}

// A sharded rank killed mid-run (SIGKILL, no launcher to end the others): the other rank stops by itself within
// distributed.timeout_s with an error, and the newest complete checkpoint (each rank's part written, COMPLETE last)
// resumes to the weights of an uninterrupted run.
TEST(IntegrationDistributed, ShardedWeightsRankKilledMidRunTheOtherStopsAndTheNewestCompleteCheckpointResumes) {
  TempDir dir;
  const auto run = dir.path() / "run", one = dir.path() / "one";
  // A constant learning rate: the schedule does not depend on max_steps, which the resume sets. Every checkpoint kept:
  // pruned, checkpoint-2 could be gone before the loop below sees it (under load), and the run would go on for
  // minutes, its resumed weights hundreds of steps from one process's.
  const std::vector<std::string> settings = {"--set", "scheduler.name=constant", "--set", "checkpoint.every_steps=1",
                                             "--set", "distributed.timeout_s=5", "--set", "checkpoint.keep_last=1000"};
  const auto args = with(with(short_run("configs/tiny-qwen2.json", run, 100000), kShardWeights), settings);
  const int port = free_port();
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " || exit 1\n";
  for (int r = 0; r < 2; ++r) {
    command += "RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
               " LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
               " GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 " + shell_quote(trainer_binary());
    for (const auto& a : args) command += " " + shell_quote(a);
    command += " </dev/null >" + shell_quote((dir.path() / ("rank" + std::to_string(r) + ".log")).string()) +
               " 2>&1 & P" + std::to_string(r) + "=$!\n";
  }
  // Rank 1 dies once checkpoint-2 is complete, wherever it is then (often inside the next checkpoint's writing).
  command += "for i in $(seq 1 1500); do [ -e " + shell_quote((run / "checkpoint-2" / "COMPLETE").string()) +
             " ] && break; sleep 0.1; done\nkill -KILL $P1\nS=$(date +%s)\nwait $P0; echo $? >" +
             shell_quote((dir.path() / "rc").string()) + "\necho $(( $(date +%s) - S )) >" +
             shell_quote((dir.path() / "seconds").string()) + "\n";
  ASSERT_EQ(std::system(("timeout -k 5 300 bash -c " + shell_quote(command)).c_str()), 0);
  const std::string log0 = read_text(dir.path() / "rank0.log");
  EXPECT_NE(std::stoi(read_text(dir.path() / "rc")), 0) << log0;
  EXPECT_LE(std::stoi(read_text(dir.path() / "seconds")), 60) << log0;  // timeout_s 5, and the rest of its step
  EXPECT_NE(log0.find("distributed.timeout_s"), std::string::npos) << log0;
  int64_t newest = 0;
  for (const auto& entry : fs::directory_iterator(run)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("checkpoint-") && fs::exists(entry.path() / "COMPLETE"))
      newest = std::max<int64_t>(newest, std::stoll(name.substr(11)));
  }
  ASSERT_GE(newest, 2) << log0;
  // Resumed on 2 ranks for one more step: the weights of newest + 1 uninterrupted steps in one process.
  const auto resumed = run_ranks(2, with(with(with(short_run("configs/tiny-qwen2.json", run, static_cast<int>(newest) + 1),
                                                   kShardWeights), settings), {"--resume"}));
  for (const auto& r : resumed) ASSERT_EQ(r.exit_code, 0) << all_errors(resumed);
  EXPECT_NE(resumed[0].err.find("at step " + std::to_string(newest)), std::string::npos) << resumed[0].err;
  const auto single = run_trainer(with(short_run("configs/tiny-qwen2.json", one, static_cast<int>(newest) + 1), settings),
                                  "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", run / "final" / "model.safetensors"), 1e-5);
}

// DPO over fully sharded weights, with LoRA: the reference is the base under the adapters, run unit by unit as the
// policy is. An untied Qwen3 base (its head a unit of its own, gathered from the reference's scores to the policy's
// fused loss), 3 ranks, 8 pairs in micro-batches of 2 (rank 2 runs an empty pass through the same units): the adapter,
// the loss and the reward metrics of one process. A full fine-tune with a frozen reference copy is refused, naming
// dpo.precompute_reference.
TEST(IntegrationDistributed, DpoWithLoraOverShardedWeightsTrainsTheAdapterAndMetricsOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", three = dir.path() / "three";
  const std::vector<std::string> dpo = {"--set", "model.path=configs/models/tiny-qwen3", "--set", "data.max_length=96",
                                        "--set", "optimizer.lr=1e-3"};
  expect_same_weights(with(short_run("configs/tiny-qwen2-dpo.json", one), dpo),
                      with(with(short_run("configs/tiny-qwen2-dpo.json", three), dpo), kShardWeights), one, three, 3,
                      "adapter_model.safetensors");
  for (const char* metric : {"rewards/chosen", "rewards/margins", "logps/rejected", "logits/chosen", "grad_norm"}) {
    const auto a = metric_values(one / "metrics.jsonl", metric), b = metric_values(three / "metrics.jsonl", metric);
    ASSERT_EQ(a.size(), 3u) << metric;
    ASSERT_EQ(a.size(), b.size()) << metric;
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << metric << " step " << i + 1;
  }
  const auto full = run_ranks(2, with(with(with(short_run("configs/tiny-qwen2-dpo.json", dir.path() / "full"), dpo),
                                           kShardWeights), {"--set", "lora.enabled=false"}));
  for (const auto& r : full) {
    EXPECT_EQ(r.exit_code, 2) << all_errors(full);
    EXPECT_NE(r.err.find("dpo.precompute_reference=true"), std::string::npos) << r.err;
  }
}

// A DPO full fine-tune over fully sharded weights against the reference pass's table (dpo.precompute_reference):
// before the first step the pass runs the sharded model unit by unit (the validation split's 3 pieces of 8 pairs on 2
// ranks: rank 1 runs an empty forward); then training, and evaluation unit by unit in micro-batches of 3 (unequal
// forwards per rank), are one process's: the weights, the losses, the reward metrics, the validation loss. With a
// budget on rank 1 alone that the pass's forwards of 8 pairs exceed, every rank halves them together, and the weights
// are still one process's.
TEST(IntegrationDistributed, DpoFullFineTuneOverShardedWeightsWithAPrecomputedReferenceTrainsAsOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two", tight = dir.path() / "tight";
  const std::vector<std::string> dpo = {"--set", "data.max_length=96", "--set", "lora.enabled=false", "--set",
                                        "dpo.precompute_reference=true", "--set", "optimizer.lr=1e-4", "--set",
                                        "evaluation.every_steps=2", "--set", "evaluation.micro_batch_size=3"};
  expect_same_weights(with(short_run("configs/tiny-qwen2-dpo.json", one, 2), dpo),
                      with(with(short_run("configs/tiny-qwen2-dpo.json", two, 2), dpo), kShardWeights), one, two, 2,
                      "model.safetensors");
  for (const char* metric : {"rewards/chosen", "rewards/margins", "logps/rejected", "eval_loss"}) {
    const auto a = metric_values(one / "metrics.jsonl", metric), b = metric_values(two / "metrics.jsonl", metric);
    ASSERT_FALSE(a.empty()) << metric;
    ASSERT_EQ(a.size(), b.size()) << metric;
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << metric << " " << i;
  }
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2-dpo.json", tight, 2), dpo), kShardWeights),
                               {{}, {"--set", "memory.limit=3MiB"}});
  for (const auto& r : ranks) {
    ASSERT_EQ(r.exit_code, 0) << all_errors(ranks);
    EXPECT_NE(r.err.find("DPO reference pass: out of memory; DPO reference pass micro-batch 8 -> 4"),
              std::string::npos)
        << all_errors(ranks);
  }
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", tight / "final" / "model.safetensors"), 1e-5);
}

// QLoRA over a sharded 4-bit base (the answer.ai recipe): each rank keeps 1/N of the packed codes and block scales,
// gathered as they are stored (never cast) and dequantized at each use; the adapters are whole on every rank. The
// adapter is one process's QLoRA adapter, also under bf16-mixed, where the gathered full-precision weights (norms,
// embeddings) are bf16 but the 4-bit layers' scales and code tables stay fp32.
TEST(IntegrationDistributed, QloraOverShardedWeightsTrainsTheAdapterOfOneProcess) {
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> qlora = {"--set", "lora.enabled=true", "--set", "lora.r=8", "--set",
                                          "optimizer.lr=1e-2", "--set", "model.quantize=nf4"};
  expect_same_weights(with(short_run("configs/tiny-qwen2.json", one), qlora),
                      with(with(short_run("configs/tiny-qwen2.json", two), qlora), kShardWeights), one, two, 2,
                      "adapter_model.safetensors");
  const auto ranks = run_ranks(2, with(with(short_run("configs/tiny-qwen2.json", dir.path() / "kept"), qlora),
                                       with(kShardWeights, {"--set", "memory.dequantized_base=keep"})));
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 2) << all_errors(ranks);
    EXPECT_NE(r.err.find("memory.dequantized_base=auto"), std::string::npos) << r.err;
  }
}

// Two "nodes" on this machine, each a torchrun agent with one rank, the way a two-machine job is started
// (docs/distributed.md): with a static master (--nnodes 2 --node-rank r --master-addr --master-port) and with the
// c10d rendezvous (--rdzv-backend c10d --rdzv-endpoint). The output directory stands for a shared filesystem.
static void expect_two_nodes_train_one_process(const std::vector<std::string>& rendezvous_for_node0,
                                               const std::vector<std::string>& rendezvous_for_node1) {
  const fs::path torchrun = fs::path(TRAINER_SOURCE_DIR) / ".venv" / "bin" / "torchrun";
  if (!fs::exists(torchrun)) GTEST_SKIP() << "no torchrun in .venv";
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const auto single = run_trainer(short_run("configs/tiny-qwen2.json", one), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " || exit 1; ";
  for (int node = 0; node < 2; ++node) {
    command += "( GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout -k 5 300 " + shell_quote(torchrun.string()) +
               " --nnodes 2 --nproc-per-node 1";
    for (const auto& a : node == 0 ? rendezvous_for_node0 : rendezvous_for_node1) command += " " + shell_quote(a);
    command += " --no-python " + shell_quote(trainer_binary());
    for (const auto& a : short_run("configs/tiny-qwen2.json", two)) command += " " + shell_quote(a);
    const std::string log = (dir.path() / ("node" + std::to_string(node))).string();
    command += " </dev/null >" + shell_quote(log + ".log") + " 2>&1; echo $? >" + shell_quote(log + ".rc") + " ) & ";
  }
  command += "wait";
  ASSERT_EQ(std::system(command.c_str()), 0);
  for (int node = 0; node < 2; ++node) {
    const auto log = dir.path() / ("node" + std::to_string(node));
    EXPECT_EQ(std::stoi(read_text(log.string() + ".rc")), 0) << read_text(log.string() + ".log");
  }
  // One world of two ranks (with the c10d rendezvous either node may become rank 0).
  const std::string logs = read_text(dir.path() / "node0.log") + read_text(dir.path() / "node1.log");
  // The end summary lists every rank's peak memory and time in collectives.
  EXPECT_NE(logs.find("data parallelism: 2 ranks (gloo); peak memory and time in collectives"), std::string::npos)
      << logs;
  EXPECT_NE(logs.find("    rank 1: "), std::string::npos) << logs;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5);
}

TEST(IntegrationDistributed, TwoTorchrunNodesWithAStaticMasterTrainTheWeightsOfOneProcess) {
  const std::string port = std::to_string(free_port());
  expect_two_nodes_train_one_process({"--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port},
                                     {"--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port});
}

TEST(IntegrationDistributed, TwoTorchrunNodesWithTheC10dRendezvousTrainTheWeightsOfOneProcess) {
  const std::vector<std::string> rendezvous = {"--rdzv-backend", "c10d", "--rdzv-endpoint",
                                               "127.0.0.1:" + std::to_string(free_port()), "--rdzv-id", "test-job"};
  expect_two_nodes_train_one_process(rendezvous, rendezvous);
}

// Two ranks started by hand (the plain environment), each under `timeout`; once training has begun, `action` is
// done to rank 1's trainer process ($P1). Returns rank 0's exit code, its stderr and the seconds from the action to
// rank 0's end; rank 1 is killed after (it may be stopped) and must have ended too.
struct SurvivorOutcome {
  int exit_code = -1;
  std::string err;
  double seconds = 0;
  bool all_ended = false;
};
static SurvivorOutcome act_on_rank_one(const fs::path& dir, const std::string& action, int timeout_s) {
  const auto args = with(short_run("configs/tiny-t5.json", dir / "run", 100000),
                         {"--set", "distributed.timeout_s=" + std::to_string(timeout_s)});
  const int port = free_port();
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " || exit 1\n";
  for (int r = 0; r < 2; ++r) {
    command += "RANK=" + std::to_string(r) + " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
               " GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout -k 5 300 " + shell_quote(trainer_binary());
    for (const auto& a : args) command += " " + shell_quote(a);
    command += " </dev/null >/dev/null 2>" + shell_quote((dir / ("err" + std::to_string(r))).string()) + " & T" +
               std::to_string(r) + "=$!\n";
  }
  command += "for i in $(seq 1 1500); do [ -s " + shell_quote((dir / "run" / "metrics.jsonl").string()) +
             " ] && break; sleep 0.2; done; P0=$(pgrep -P $T0); P1=$(pgrep -P $T1); S=$(date +%s%N); " + action +
             "; wait $T0; echo $? >" + shell_quote((dir / "rc").string()) + "; E=$(date +%s%N); echo $(((E - S) / 1000000)) >" +
             shell_quote((dir / "ms").string()) + "; kill -KILL $P1 2>/dev/null; wait $T1; sleep 0.5; n=0; " +
             "for p in $P0 $P1 $T0 $T1; do kill -0 $p 2>/dev/null && n=$((n+1)); done; echo $n >" +
             shell_quote((dir / "ended").string());
  EXPECT_EQ(std::system(("timeout -k 5 400 bash -c " + shell_quote(command)).c_str()), 0);
  SurvivorOutcome outcome;
  outcome.exit_code = std::stoi(read_text(dir / "rc"));
  outcome.err = read_text(dir / "err0");
  outcome.seconds = std::stod(read_text(dir / "ms")) / 1000.0;
  outcome.all_ended = std::stoi(read_text(dir / "ended")) == 0;
  return outcome;
}

// A rank killed outright: the survivor's next collective fails at once (closed connection); it exits 1 well within
// distributed.timeout_s, naming the dead rank (its heartbeat stopped).
TEST(IntegrationDistributed, ARankKilledMidTrainingStopsTheOtherNamingIt) {
  TempDir dir;
  const auto outcome = act_on_rank_one(dir.path(), "kill -KILL $P1", 20);
  EXPECT_EQ(outcome.exit_code, 1) << outcome.err;
  EXPECT_NE(outcome.err.find("rank 1 died or hangs"), std::string::npos) << outcome.err;
  // Within the timeout (20 s), plus slack for a loaded machine.
  EXPECT_LT(outcome.seconds, 20 + 15) << outcome.err;
  EXPECT_TRUE(outcome.all_ended);
}

// A rank that hangs (SIGSTOP): the survivor gives up after distributed.timeout_s (+ the few seconds that find the
// silent rank), exit 1, naming it; nothing waits forever.
TEST(IntegrationDistributed, AHangingRankStopsTheOtherAfterTheTimeoutNamingIt) {
  TempDir dir;
  const auto outcome = act_on_rank_one(dir.path(), "kill -STOP $P1", 10);
  EXPECT_EQ(outcome.exit_code, 1) << outcome.err;
  EXPECT_NE(outcome.err.find("rank 1 died or hangs"), std::string::npos) << outcome.err;
  EXPECT_GE(outcome.seconds, 10 - 1) << outcome.err;  // it waited the timeout, not less
  EXPECT_LT(outcome.seconds, 10 + 3 + 20) << outcome.err;
  EXPECT_TRUE(outcome.all_ended);
}

// Under `trainer launch` a hanging rank: rank 0 gives up after the timeout naming rank 1, and the launcher ends the
// stopped rank too (SIGTERM with SIGCONT) and exits non-zero.
TEST(IntegrationDistributed, LaunchEndsAHangingRankAfterTheOthersGiveUp) {
  TempDir dir;
  const auto outcome = launch_and(dir.path(), "kill -STOP $(echo $C | cut -d' ' -f2)", 10);
  EXPECT_EQ(outcome.exit_code, 1) << outcome.log;
  EXPECT_TRUE(outcome.all_ended) << outcome.log;
  EXPECT_NE(outcome.log.find("rank 1 died or hangs"), std::string::npos) << outcome.log;
}

// torchrun --max-restarts 1 with --resume-if-present: the first start finds no checkpoint and starts fresh; a rank
// killed after a checkpoint makes torchrun restart both ranks, which resume from the newest complete checkpoint
// and reach the weights of one uninterrupted process.
TEST(IntegrationDistributed, TorchrunRestartsAKilledRankAndTheRunResumesFromTheLastCheckpoint) {
  const fs::path torchrun = fs::path(TRAINER_SOURCE_DIR) / ".venv" / "bin" / "torchrun";
  if (!fs::exists(torchrun)) GTEST_SKIP() << "no torchrun in .venv";
  TempDir dir;
  const auto one = dir.path() / "one", two = dir.path() / "two";
  const std::vector<std::string> cadence = {"--set", "checkpoint.every_steps=2"};
  const auto single = run_trainer(with(short_run("configs/tiny-t5.json", one, 40), cadence), "OMP_NUM_THREADS=1");
  ASSERT_EQ(single.exit_code, 0) << single.err;
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " || exit 1\nGLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 " +
                        shell_quote(torchrun.string()) + " --nproc-per-node 2 --max-restarts 1 --master-port " +
                        std::to_string(free_port()) + " --no-python " + shell_quote(trainer_binary()) +
                        " --resume-if-present";
  for (const auto& a : with(short_run("configs/tiny-t5.json", two, 40), cadence)) command += " " + shell_quote(a);
  const std::string log = (dir.path() / "log").string();
  command += " </dev/null >" + shell_quote(log) + " 2>&1 & L=$!; ";
  command += "for i in $(seq 1 3000); do [ -e " + shell_quote((two / "checkpoint-2" / "COMPLETE").string()) +
             " ] && break; sleep 0.1; done; C=$(pgrep -P $L -x trainer); kill -KILL $(echo $C | cut -d' ' -f2); "
             "wait $L; echo $? >" + shell_quote((dir.path() / "rc").string()) +
             "; sleep 0.5; n=0; for p in $C; do kill -0 $p 2>/dev/null && n=$((n+1)); done; echo $n >" +
             shell_quote((dir.path() / "ended").string());
  ASSERT_EQ(std::system(("timeout -k 5 500 bash -c " + shell_quote(command)).c_str()), 0) << read_text(log);
  const std::string text = read_text(log);
  EXPECT_EQ(std::stoi(read_text(dir.path() / "rc")), 0) << text;
  EXPECT_EQ(std::stoi(read_text(dir.path() / "ended")), 0) << text;
  // The first start: no checkpoint yet; the restart: from a checkpoint (the kill came before the end).
  EXPECT_NE(text.find("--resume-if-present: no complete checkpoint"), std::string::npos) << text;
  EXPECT_NE(text.find("resuming from "), std::string::npos) << text;
  EXPECT_LE(max_difference(one / "final" / "model.safetensors", two / "final" / "model.safetensors"), 1e-5) << text;
}

}  // namespace trainer::test
