// The tests labelled `gpu` (CTest), run by scripts/gpu-check on a machine with an NVIDIA GPU and a CUDA LibTorch:
// a real out-of-memory error on the card under memory.limit, the allocator snapshot it leaves, bf16 numerics on the
// card against fp32 on the CPU, and device selection (device.type=auto, wait_for_device). Without a CUDA device
// every test skips and says why; nothing here needs CUDA headers, so the CPU build compiles it too.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/cuda_extras.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/segment_attention.h"
#include "support/metrics.h"
#include "support/packed_rows.h"
#include "support/process.h"
#include "support/tiny_models.h"
#include "trainer/device.h"
#include "trainer/errors.h"
#include "util/counter_rng.h"
#include "util/cuda_device.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

bool has_cuda_device() {
  const auto type = at::accelerator::getAccelerator(false);
  return type && *type == c10::kCUDA && at::accelerator::deviceCount() > 0;
}

std::string why_no_gpu() {
  const auto type = at::accelerator::getAccelerator(false);
  if (type || cuda_extras_available())
    return "no GPU: this CUDA build of LibTorch sees no CUDA device (no GPU, or no NVIDIA driver)";
  return "no GPU: this build's LibTorch is a CPU build; scripts/gpu-check builds against a CUDA PyTorch";
}

#define SKIP_WITHOUT_GPU() \
  if (!has_cuda_device()) GTEST_SKIP() << why_no_gpu()

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

double max_abs(const at::Tensor& x) { return x.abs().max().item<double>(); }

// A run directory with a causal dataset whose records are long enough that activations, not the tiny model's
// weights, dominate the memory of a step.
struct LongRun {
  fs::path dir;
  std::vector<std::string> args;

  explicit LongRun(const std::string& name) : dir(fs::temp_directory_path() / ("trainer-gpu-" + name)) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::vector<nlohmann::json> demo;
    std::ifstream file(source_path("data/demo/recipes-causal.jsonl"));
    for (std::string line; demo.size() < 64 && std::getline(file, line);) demo.push_back(nlohmann::json::parse(line));
    std::ofstream data(dir / "data.jsonl");
    for (std::size_t i = 0; i < 32; ++i) {
      std::string completion;
      for (std::size_t j = 0; j < 24; ++j) completion += demo[(i + j) % demo.size()]["completion"].get<std::string>();
      data << nlohmann::json{{"prompt", demo[i % demo.size()]["prompt"]}, {"completion", completion}}.dump() << "\n";
    }
    args = {"--config", "configs/tiny-qwen2.json", "--set", "device.type=cuda",
            "--set", "data.train_files=[\"" + (dir / "data.jsonl").string() + "\"]", "--set", "data.validation_files=[]",
            "--set", "data.shuffle=false", "--set", "data.max_length=2048", "--set", "training.batch_size=8",
            "--set", "training.micro_batch_size=8", "--set", "training.max_steps=4", "--set", "evaluation.every_steps=0",
            "--set", "evaluation.sample_prompts=[]", "--set", "checkpoint.every_steps=0"};
  }
  ~LongRun() { fs::remove_all(dir); }

  ProcessResult run(const std::string& out, std::vector<std::string> extra) const {
    auto all = args;
    all.insert(all.end(), {"--set", "checkpoint.output_dir=" + (dir / out).string()});
    all.insert(all.end(), extra.begin(), extra.end());
    return run_trainer(all);
  }
  double peak(const std::string& out) const {
    const auto peaks = metric_values(dir / out / "metrics.jsonl", "memory_peak");
    return peaks.empty() ? 0.0 : *std::max_element(peaks.begin(), peaks.end());
  }
  double sum(const std::string& out, const std::string& key) const {
    double total = 0;
    for (double v : metric_values(dir / out / "metrics.jsonl", key)) total += v;
    return total;
  }
  // A limit that the uncapped run's peak does not fit under, but that half the micro-batch fits under.
  std::string limit_below_peak(const std::string& uncapped) const {
    const auto mib = static_cast<int64_t>(0.6 * peak(uncapped) / (1024.0 * 1024.0));
    return "memory.limit=" + std::to_string(std::max<int64_t>(mib, 1)) + "MiB";
  }
};

}  // namespace

// A real out-of-memory error on the card: memory.limit caps the caching allocator below what the uncapped run
// needed, the step shrinks its micro-batch and runs again, and the weights are those of the uncapped run.
TEST(GpuMemory, OutOfMemoryUnderTheLimitAdaptsToTheUncappedWeights) {
  SKIP_WITHOUT_GPU();
  const LongRun run("oom");
  const auto uncapped = run.run("uncapped", {"--set", "memory.limit=0"});
  ASSERT_EQ(uncapped.exit_code, 0) << uncapped.err;
  ASSERT_GT(run.peak("uncapped"), 0) << "the uncapped run recorded no peak memory";
  EXPECT_EQ(run.sum("uncapped", "oom_retries"), 0);

  const auto capped = run.run("capped", {"--set", run.limit_below_peak("uncapped")});
  ASSERT_EQ(capped.exit_code, 0) << capped.err;
  EXPECT_GT(run.sum("capped", "oom_retries") + run.sum("capped", "adaptations"), 0)
      << "the cap caused no out-of-memory error, so nothing was tested\n" << capped.err;
  EXPECT_LT(run.peak("capped"), run.peak("uncapped"));

  const auto a = SafetensorsFile::open((run.dir / "uncapped" / "final" / "model.safetensors").string());
  const auto b = SafetensorsFile::open((run.dir / "capped" / "final" / "model.safetensors").string());
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& info : a.tensors()) {
    SCOPED_TRACE(info.name);
    const auto x = a.view(info.name).to(at::kFloat), y = b.view(info.name).to(at::kFloat);
    // Another split sums the same gradient in another order: equal up to fp32 rounding.
    EXPECT_TRUE(at::allclose(x, y, /*rtol=*/1e-4, /*atol=*/1e-5))
        << "max difference " << (x - y).abs().max().item<double>();
  }
}

// precision.mode=fp16-mixed on the card (what T4 / V100 users run): CUDA's fp16 kernels under autocast, a loss
// scale of 2^32 that overflows and backs off until it fits, then training; no overflow is taken for an
// out-of-memory error.
TEST(GpuNumerics, Fp16MixedBacksOffFromAnOverflowingScaleAndTrains) {
  SKIP_WITHOUT_GPU();
  const LongRun run("fp16");
  const auto result = run.run("fp16", {"--set", "precision.mode=fp16-mixed", "--set",
                                       "precision.initial_loss_scale=4294967296", "--set", "training.max_steps=24",
                                       "--set", "logging.every_steps=1"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto skipped = metric_values(run.dir / "fp16" / "metrics.jsonl", "skipped_steps");
  const auto loss = metric_values(run.dir / "fp16" / "metrics.jsonl", "loss");
  ASSERT_EQ(loss.size(), 24u);
  EXPECT_GE(skipped.back(), 1) << result.err;
  EXPECT_LE(skipped.back(), 18) << result.err;
  EXPECT_EQ(run.sum("fp16", "oom_retries"), 0);
  EXPECT_EQ(run.sum("fp16", "adaptations"), 0);
  EXPECT_LT(loss.back(), loss.front()) << result.err;
}

// memory.snapshot_on_oom: the out-of-memory error leaves memory-snapshot-step-N.pickle, which PyTorch's own
// memory_viz tooling reads (torch.cuda._memory_viz, the code behind pytorch.org/memory_viz).
TEST(GpuMemory, SnapshotOnOomWritesAPickleThatTorchMemoryVizReads) {
  SKIP_WITHOUT_GPU();
  const LongRun run("snapshot");
  const auto uncapped = run.run("uncapped", {"--set", "memory.limit=0", "--set", "training.max_steps=1"});
  ASSERT_EQ(uncapped.exit_code, 0) << uncapped.err;
  const auto capped = run.run("capped", {"--set", run.limit_below_peak("uncapped"), "--set", "training.max_steps=1",
                                         "--set", "memory.snapshot_on_oom=true"});
  ASSERT_EQ(capped.exit_code, 0) << capped.err;
  std::vector<fs::path> pickles;
  for (const auto& entry : fs::directory_iterator(run.dir / "capped"))
    if (entry.path().extension() == ".pickle") pickles.push_back(entry.path());
  ASSERT_EQ(pickles.size(), 1u) << capped.err;
  EXPECT_TRUE(contains(capped.out + capped.err, pickles[0].string())) << capped.err;

  const char* python = std::getenv("TRAINER_PYTHON");
  const std::string interpreter = python ? python : source_path(".venv/bin/python");
  const auto script = run.dir / "read_snapshot.py";
  std::ofstream(script) << R"(import pickle, sys
from torch.cuda import _memory_viz
with open(sys.argv[1], "rb") as f:
    snapshot = pickle.load(f)
assert snapshot["segments"], "no segments"
events = [e for trace in snapshot["device_traces"] for e in trace]
assert any(e["action"] == "alloc" for e in events), "no allocation events were recorded"
assert any(e.get("frames") for e in events), "no stack frames were recorded"
summary = _memory_viz.segsum(snapshot)
html = _memory_viz.trace_plot(snapshot)
assert "<html" in html.lower() or len(html) > 1000
print("segments", len(snapshot["segments"]), "events", len(events))
)";
  const std::string command = shell_quote(interpreter) + " " + shell_quote(script.string()) + " " +
                              shell_quote(pickles[0].string()) + " > " + shell_quote((run.dir / "py.log").string()) +
                              " 2>&1";
  const int status = std::system(command.c_str());
  EXPECT_EQ(status, 0) << read_text(run.dir / "py.log");
}

// precision.mode=bf16 on the card against fp32 on the CPU, same weights and batch: the logits agree within what
// bf16's 8-bit mantissa allows, and the loss closely.
TEST(GpuNumerics, Bf16LogitsOnTheGpuMatchFp32OnTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto cpu = tiny_model(name);
    auto gpu = build_model(cpu->hf_config(), at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
    gpu->train(false);
    {
      at::NoGradGuard no_grad;
      auto source = cpu->named_parameters();
      for (auto& [param_name, p] : gpu->named_parameters()) {
        const auto it =
            std::find_if(source.begin(), source.end(), [&](const auto& s) { return s.first == param_name; });
        ASSERT_NE(it, source.end()) << param_name;
        p.copy_(it->second);
      }
    }
    const Batch batch = padded_batch(cpu->family() == ModelFamily::kSeq2Seq);
    const Batch on_gpu{batch.input_ids.to(at::kCUDA), batch.attention_mask.to(at::kCUDA),
                       batch.labels.to(at::kCUDA), {}};
    at::NoGradGuard no_grad;
    const auto reference = forward_loss(*cpu, batch, true);
    const auto result = forward_loss(*gpu, on_gpu, true);
    const auto expected = reference.logits.to(at::kFloat);
    const auto actual = result.logits.to(at::kCPU).to(at::kFloat);
    ASSERT_EQ(expected.sizes(), actual.sizes());
    const double scale = expected.abs().max().item<double>();
    const double worst = (actual - expected).abs().max().item<double>();
    // A few bf16 roundings (relative 2^-8 each) through two layers: 3% of the largest logit.
    EXPECT_LT(worst, 0.03 * scale) << "max |bf16 GPU - fp32 CPU| " << worst << ", largest logit " << scale;
    const double mean_error = (actual - expected).abs().mean().item<double>();
    EXPECT_LT(mean_error, 0.01 * scale);
    EXPECT_EQ(result.target_tokens, reference.target_tokens);
    const double loss_cpu = reference.loss_sum.item<double>();
    const double loss_gpu = result.loss_sum.to(at::kFloat).item<double>();
    EXPECT_NEAR(loss_gpu, loss_cpu, 0.01 * std::abs(loss_cpu));
  }
}

// device.type=auto takes the device with the most free memory. With two or more cards the test fills the one that
// had the most until another has more, and auto must follow; with one card it must take that card.
TEST(GpuDevice, AutoPicksTheGpuWithTheMostFreeMemory) {
  SKIP_WITHOUT_GPU();
  const auto count = at::accelerator::deviceCount();
  auto free_of = [](c10::DeviceIndex i) { return at::accelerator::getMemoryInfo(i).first; };
  auto most_free = [&] {
    c10::DeviceIndex best = 0;
    for (c10::DeviceIndex i = 1; i < count; ++i)
      if (free_of(i) > free_of(best)) best = i;
    return best;
  };
  DeviceConfig config;
  config.type = "auto";
  const auto first = resolve_device(config);
  ASSERT_TRUE(first.device.is_cuda()) << first.description;
  EXPECT_FALSE(first.fell_back_to_cpu);
  EXPECT_EQ(first.device.index(), most_free()) << first.description;
  EXPECT_TRUE(contains(first.description, "free of")) << first.description;
  if (count < 2) {
    std::cout << "[ note ] one GPU: auto took cuda:0; the choice between cards needs two or more\n";
    return;
  }
  // Occupy the chosen card until the second-best has more free memory.
  c10::DeviceIndex runner_up = first.device.index() == 0 ? 1 : 0;
  for (c10::DeviceIndex i = 0; i < count; ++i)
    if (i != first.device.index() && free_of(i) > free_of(runner_up)) runner_up = i;
  const auto gap = static_cast<int64_t>(free_of(first.device.index())) - static_cast<int64_t>(free_of(runner_up));
  const auto ballast = at::empty({std::max<int64_t>(gap, 0) + (int64_t{1} << 30)},
                                 at::TensorOptions().dtype(at::kByte).device(at::kCUDA, first.device.index()));
  const auto second = resolve_device(config);
  EXPECT_EQ(second.device.index(), runner_up) << second.description;
  EXPECT_NE(second.device.index(), first.device.index());
}

// wait_for_device: with no card that has min_free_memory, trainer looks again every poll_interval_s and gives up
// after wait_timeout_s with a usage error; when memory is freed while it waits, it takes the card.
TEST(GpuDevice, WaitForDeviceWaitsAndTimesOut) {
  SKIP_WITHOUT_GPU();
  using Clock = std::chrono::steady_clock;
  const c10::DeviceIndex index = 0;
  const auto [free_before, total] = at::accelerator::getMemoryInfo(index);
  DeviceConfig config;
  config.type = "cuda:0";
  config.wait_for_device = true;
  config.poll_interval_s = 0.5;

  // More than the card has: never available; gives up after the timeout, not before.
  config.min_free_memory.bytes = total + 1;
  config.wait_timeout_s = 2.0;
  const auto start = Clock::now();
  try {
    resolve_device(config);
    ADD_FAILURE() << "a device with more free memory than its total was taken";
  } catch (const UsageError& e) {
    EXPECT_TRUE(contains(e.what(), "free")) << e.what();
  }
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(waited, 2.0);
  EXPECT_LT(waited, 10.0);

  // Fill most of the card, wait for half of what was free, and free the ballast after 2 s: taken after that.
  config.min_free_memory.bytes = free_before / 2;
  config.wait_timeout_s = 60.0;
  auto ballast = at::empty({static_cast<int64_t>(free_before * 0.8)},
                           at::TensorOptions().dtype(at::kByte).device(at::kCUDA, index));
  ASSERT_LT(at::accelerator::getMemoryInfo(index).first, config.min_free_memory.bytes);
  const auto wait_start = Clock::now();
  auto waiter = std::async(std::launch::async, [&] { return resolve_device(config); });
  std::this_thread::sleep_for(std::chrono::seconds(2));
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(0)), std::future_status::timeout) << "it did not wait";
  ballast = at::Tensor();
  at::accelerator::emptyCache();
  const auto resolved = waiter.get();
  const double taken_after = std::chrono::duration<double>(Clock::now() - wait_start).count();
  EXPECT_EQ(resolved.device, c10::Device(c10::kCUDA, index));
  EXPECT_GE(taken_after, 2.0);
  EXPECT_LT(taken_after, 30.0);
}

}  // namespace trainer::test

namespace trainer::test {

// The CUDA kernels of the counter-based random bits (src/util/counter_rng_cuda.cu) give the CPU kernel's bits: dropout
// keep-masks of every rank the models use, rows whose lines cross a multiple of 2^32, a grid larger than the kernel's
// block limit; bf16 stochastic rounding with infinities (NaN's payload aside). The masks are what make dropout the
// same on any split and on any device.
TEST(GpuCounterRng, KernelsGiveTheCpuBits) {
  SKIP_WITHOUT_GPU();
  const c10::Device cuda(at::kCUDA, 0);
  const uint64_t key = counter_key({42, 3, 5});
  const int64_t wrap = int64_t{1} << 32;
  const at::Tensor rows = at::tensor(std::vector<int64_t>{(int64_t{3} << 40) + wrap - 5, int64_t{0}, int64_t{11} << 40},
                                     at::kLong);
  struct Grid {
    std::vector<int64_t> sizes, strides;
  };
  const std::vector<Grid> grids = {
      {{3}, {}},
      {{3, 1000}, {1}},
      {{3, 77, 129}, {129, 1}},
      {{3, 5, 64, 1030}, {int64_t{1} << 32, int64_t{1} << 16, 1}},
      {{3, 2, 3, 4, 5}, {int64_t{1} << 30, 1000, 17, 3}},
      {{3, 40000, 40}, {40, 1}},  // more lines than one launch's blocks
  };
  for (const Grid& g : grids) {
    const at::Tensor cpu = counter_keep_mask(key, rows, g.sizes, g.strides, 0.1);
    const at::Tensor card = counter_keep_mask(key, rows.to(cuda), g.sizes, g.strides, 0.1);
    EXPECT_EQ(card.device().type(), at::kCUDA);
    EXPECT_TRUE(at::equal(card.cpu(), cpu)) << "rank " << g.sizes.size();
  }
  const at::Tensor src = at::randn({1 << 20}, at::kFloat) * 100;
  src[5] = INFINITY;
  src[6] = -INFINITY;
  const at::Tensor cpu = at::empty({1 << 20}, at::kBFloat16);
  const at::Tensor card = at::empty({1 << 20}, at::TensorOptions().dtype(at::kBFloat16).device(cuda));
  stochastic_round_bf16_(cpu, src, counter_key({5, 9, 2}), 777);
  stochastic_round_bf16_(card, src.to(cuda), counter_key({5, 9, 2}), 777);
  EXPECT_TRUE(at::equal(card.cpu().view(at::kShort), cpu.view(at::kShort)));
}

// Packed causal rows on the card take ATen's variable-length flash attention (models/segment_attention.h): in bf16,
// and in fp32 under bf16 autocast, its output and the gradients of q, k and v agree with fp32 whole-row attention
// under the block-diagonal mask (segment_mask) at every real position, within bf16 rounding; padding positions are
// zero; grouped-query heads; with and without a sliding window; rows with padding, a one-token example and a row
// that is one example.
TEST(GpuPacking, VarlenFlashAttentionMatchesWholeRowAttention) {
  SKIP_WITHOUT_GPU();
  if (!flash_attention_device(c10::Device(at::kCUDA, 0)))
    GTEST_SKIP() << "this card's compute capability is below 8.0: no flash attention kernels";
  const auto [segments, positions] = packed_rows({{5, 1, 17, 9}, {40}, {12, 3}}, 40, at::kCUDA);
  const int64_t b = 3, t = 40, heads = 4, kv_heads = 2, d = 32;
  const auto layout = plan_varlen_attention(segments, positions);
  ASSERT_NE(layout, nullptr);
  EXPECT_EQ(layout->examples, 7);
  EXPECT_EQ(layout->total, 32 + 40 + 15);
  EXPECT_EQ(layout->max_length, 40);
  const at::Tensor real = (segments != 0).unsqueeze(-1);  // (B, T, 1)
  for (const std::optional<int64_t> window : {std::optional<int64_t>(), std::optional<int64_t>(4)}) {
    for (const bool autocast : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "window " << window.value_or(0) << ", autocast " << autocast);
      at::manual_seed(5);
      const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
      const at::Tensor q0 = at::randn({b, heads, t, d}, f32), k0 = at::randn({b, kv_heads, t, d}, f32),
                       v0 = at::randn({b, kv_heads, t, d}, f32), grad = at::randn({b, t, heads * d}, f32);
      // The reference: fp32, whole rows, the mask.
      const at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(),
                       v = v0.clone().requires_grad_();
      const at::Tensor mask = segment_mask(segments, segments, positions, positions, /*causal=*/true, window);
      const at::Tensor expected = at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, std::nullopt, true)
                                      .transpose(1, 2)
                                      .reshape({b, t, heads * d}) * real;
      expected.backward(grad);
      // The varlen path: bf16 inputs, or fp32 inputs under bf16 autocast.
      const auto input = [&](const at::Tensor& x) {
        return (autocast ? x.clone() : x.to(at::kBFloat16)).requires_grad_();
      };
      const at::Tensor qv = input(q0), kv = input(k0), vv = input(v0);
      const int64_t calls = varlen_attention_calls();
      at::Tensor actual;
      {
        at::autocast::set_autocast_enabled(at::kCUDA, autocast);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        ASSERT_TRUE(varlen_attention_runs(qv, d));
        actual = attend_varlen(*layout, qv, kv, vv, window);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
      }
      EXPECT_EQ(varlen_attention_calls(), calls + 1);
      EXPECT_EQ(actual.scalar_type(), at::kBFloat16);
      actual.backward(grad.to(at::kBFloat16) * real);
      EXPECT_EQ(max_abs(actual.to(at::kFloat) * real.logical_not()), 0.0) << "padding positions are not zero";
      const double out_error = max_abs(actual.to(at::kFloat) - expected);
      EXPECT_LT(out_error, 0.02 * max_abs(expected)) << "max |varlen - whole row| " << out_error;
      for (const auto& [name, got, want] : {std::tuple{"q", qv.grad(), q.grad()}, std::tuple{"k", kv.grad(), k.grad()},
                                            std::tuple{"v", vv.grad(), v.grad()}}) {
        const double error = max_abs(got.to(at::kFloat) - want);
        EXPECT_LT(error, 0.03 * max_abs(want)) << "grad " << name << ": max difference " << error << " of "
                                               << max_abs(want);
      }
    }
  }
  // The CPU, fp32 without autocast and the non-auto modes do not take the path.
  EXPECT_FALSE(varlen_attention_runs(at::zeros({1}, at::kBFloat16), 32));
  EXPECT_FALSE(varlen_attention_runs(at::zeros({1}, at::TensorOptions().device(at::kCUDA)), 32));
  EXPECT_FALSE(varlen_attention_runs(at::zeros({1}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA)), 12));
  set_segment_attention_mode(SegmentAttentionMode::kPerExample);
  EXPECT_FALSE(varlen_attention_runs(at::zeros({1}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA)), 32));
  set_segment_attention_mode(SegmentAttentionMode::kAuto);
}

// A packed Qwen2 model in bf16 on the card: the forward takes the varlen path (one call per layer), and its loss and
// gradients agree with the per-segment path's within bf16 rounding; both agree with fp32 on the CPU.
TEST(GpuPacking, PackedQwen2OnTheCardTakesTheVarlenPathWithTheSameLossAndGradients) {
  SKIP_WITHOUT_GPU();
  if (!flash_attention_device(c10::Device(at::kCUDA, 0)))
    GTEST_SKIP() << "this card's compute capability is below 8.0: no flash attention kernels";
  auto cpu = tiny_model("tiny-qwen2");
  auto gpu = build_model(cpu->hf_config(), at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  {
    at::NoGradGuard no_grad;
    auto source = cpu->named_parameters();
    for (auto& [name, p] : gpu->named_parameters())
      for (auto& [other, value] : source)
        if (other == name) p.copy_(value);
  }
  for (auto* model : {cpu.get(), gpu.get()})
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const auto [segments, positions] = packed_rows({{9, 14, 1, 6}, {30}, {11, 4}}, 30, at::kCUDA);
  at::manual_seed(8);
  Batch batch;
  batch.input_ids = at::randint(3, 500, {3, 30}, at::kLong).to(at::kCUDA).masked_fill(segments == 0, 0);
  batch.attention_mask = (segments != 0).to(at::kLong);
  batch.labels = batch.input_ids.masked_fill(segments == 0, -100);
  batch.segment_ids = segments;
  batch.position_ids = positions;
  struct Result {
    double loss;
    std::vector<at::Tensor> grads;
  };
  const auto run = [&](LanguageModel& model, const Batch& input) {
    for (auto& [name, p] : model.named_parameters()) p.mutable_grad() = at::Tensor();
    const auto out = forward_loss(model, input);
    const at::Tensor loss = out.loss_sum.to(at::kFloat) / static_cast<double>(out.target_tokens);
    loss.backward();
    Result r{loss.item<double>(), {}};
    for (auto& [name, p] : model.named_parameters())
      r.grads.push_back(p.grad().defined() ? p.grad().to(at::kCPU, at::kFloat) : at::zeros(p.sizes()));
    return r;
  };
  gpu->train(true);
  cpu->train(true);
  const int64_t calls = varlen_attention_calls();
  const Result varlen = run(*gpu, batch);
  EXPECT_EQ(varlen_attention_calls() - calls, 2) << "one varlen call per layer (tiny-qwen2 has 2)";
  set_segment_attention_mode(SegmentAttentionMode::kPerExample);
  const Result per_segment = run(*gpu, batch);
  set_segment_attention_mode(SegmentAttentionMode::kAuto);
  EXPECT_EQ(varlen_attention_calls() - calls, 2) << "kPerExample must not take the varlen path";
  Batch on_cpu{batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.labels.cpu(), {}};
  on_cpu.segment_ids = segments.cpu();
  on_cpu.position_ids = positions.cpu();
  const Result reference = run(*cpu, on_cpu);
  EXPECT_NEAR(varlen.loss, reference.loss, 0.01 * reference.loss);
  EXPECT_NEAR(varlen.loss, per_segment.loss, 0.01 * reference.loss);
  ASSERT_EQ(varlen.grads.size(), reference.grads.size());
  for (std::size_t i = 0; i < varlen.grads.size(); ++i) {
    SCOPED_TRACE(i);
    const double scale = max_abs(reference.grads[i]);
    // bf16 parameters and activations through two layers: a few per cent of the largest gradient.
    EXPECT_LT(max_abs(varlen.grads[i] - reference.grads[i]), 0.08 * scale + 1e-6);
    EXPECT_LT(max_abs(varlen.grads[i] - per_segment.grads[i]), 0.08 * scale + 1e-6);
  }
}

// End to end on the card: packed rows (varlen attention) train like padded rows, bf16-mixed, step for step.
TEST(GpuPacking, PackedTrainingOnTheCardFollowsPaddedTraining) {
  SKIP_WITHOUT_GPU();
  const LongRun run("packing");
  // The demo's short records (the run's long ones would each fill a row alone).
  const std::vector<std::string> common = {
      "--set", "data.train_files=[\"" + source_path("data/demo/recipes-causal.jsonl") + "\"]", "--set",
      "precision.mode=bf16-mixed", "--set", "data.max_length=512", "--set", "training.max_steps=6", "--set",
      "logging.every_steps=1"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  const auto padded = run.run("padded", with({"--set", "data.packing=false"}));
  ASSERT_EQ(padded.exit_code, 0) << padded.err;
  const auto packed = run.run("packed", with({"--set", "data.packing=true"}));
  ASSERT_EQ(packed.exit_code, 0) << packed.err;
  const auto a = metric_values(run.dir / "padded" / "metrics.jsonl", "loss");
  const auto b = metric_values(run.dir / "packed" / "metrics.jsonl", "loss");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), a.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 0.02 * a[i]) << "step " << i + 1;
}

}  // namespace trainer::test
