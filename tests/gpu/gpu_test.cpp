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
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/cuda_extras.h"
#include "models/model.h"
#include "support/metrics.h"
#include "support/process.h"
#include "support/tiny_models.h"
#include "trainer/device.h"
#include "trainer/errors.h"
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
