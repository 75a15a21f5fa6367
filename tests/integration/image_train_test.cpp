// Image-classification training through the real binary: configs/tiny-vit.json trains and reports accuracy, an
// out-of-memory adaptation mid-run (a real CPU budget) reaches the weights of an unconstrained run, and a resumed
// run the weights of an uninterrupted one.
#include <filesystem>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "support/temp_dir.h"
#include "train/run_lock.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {
namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::map<std::string, at::Tensor> tensors_of(const fs::path& file) {
  const auto f = SafetensorsFile::open(file.string());
  std::map<std::string, at::Tensor> out;
  for (const auto& t : f.tensors()) out[t.name] = f.load(t.name, at::kFloat).clone();
  return out;
}

// The largest difference between two saved models' tensors (infinity when their names or shapes differ).
double max_difference(const fs::path& a, const fs::path& b) {
  const auto x = tensors_of(a), y = tensors_of(b);
  if (x.size() != y.size()) return INFINITY;
  double worst = 0;
  for (const auto& [name, t] : x) {
    if (!y.count(name) || !y.at(name).sizes().equals(t.sizes())) return INFINITY;
    worst = std::max(worst, (t - y.at(name)).abs().max().item<double>());
  }
  return worst;
}

std::vector<std::string> image_args(const fs::path& out, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--config", "configs/tiny-vit.json", "--set",
                                   "checkpoint.output_dir=" + out.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

}  // namespace

TEST(IntegrationImages, TinyVitTrainsAndReportsAccuracy) {
  const auto dir = fs::temp_directory_path() / "trainer-images-tiny-vit";
  fs::remove_all(dir);
  auto dry = run_trainer(image_args(dir, {"--dry-run"}));
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_TRUE(contains(dry.out, "image classifier")) << dry.out;
  auto run = run_trainer(image_args(dir, {"--set", "training.epochs=4", "--set", "evaluation.every_steps=10"}));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.err, "5 classes")) << run.err;
  EXPECT_TRUE(contains(run.err, "top-1")) << run.err;
  const auto losses = metric_values(dir / "metrics.jsonl", "loss");
  const auto top1 = metric_values(dir / "metrics.jsonl", "eval_top1");
  const auto top5 = metric_values(dir / "metrics.jsonl", "eval_top5");
  const auto images = metric_values(dir / "metrics.jsonl", "eval_images");
  ASSERT_EQ(losses.size(), 32u);  // 4 epochs of 120 images in batches of 16
  ASSERT_EQ(top1.size(), 4u);     // steps 10, 20, 30 and the last
  EXPECT_EQ(images.back(), 40);
  EXPECT_EQ(top5.back(), 1.0);    // 5 classes: the top 5 hold every label
  EXPECT_LT((losses[29] + losses[30] + losses[31]) / 3, (losses[0] + losses[1] + losses[2]) / 3);
  for (const char* file : {"config.json", "model.safetensors", "preprocessor_config.json"})
    EXPECT_TRUE(fs::exists(dir / "final" / file)) << file;
  EXPECT_TRUE(fs::exists(dir / "checkpoint-32" / "COMPLETE"));
  // The saved classifier predicts with its classes.
  auto predict = run_trainer({"predict", "--model", (dir / "final").string(), "--image",
                              "data/demo/images/validation/circle-red/circle-red-0000.jpg"});
  EXPECT_EQ(predict.exit_code, 0) << predict.err;
  EXPECT_TRUE(contains(predict.out, "circle-red")) << predict.out;
  fs::remove_all(dir);
}

// A bad image in the training data stops with `file: what` (exit 3), or with data.on_bad_record=skip is counted,
// named in the summary, and left out.
TEST(IntegrationImages, BadImagesStopOrAreSkippedAndCounted) {
  const auto dir = fs::temp_directory_path() / "trainer-images-bad";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "bad.jpg") << "not an image";
  {
    std::ofstream listing(dir / "train.jsonl");
    const std::string root = std::string(TRAINER_SOURCE_DIR) + "/data/demo/images/";
    std::ifstream demo(root + "train.jsonl");
    for (std::string line; std::getline(demo, line);) {
      auto record = nlohmann::json::parse(line);
      record["image"] = root + record["image"].get<std::string>();
      listing << record.dump() << "\n";
    }
    listing << nlohmann::json{{"image", "bad.jpg"}, {"label", "circle-red"}}.dump() << "\n";
  }
  const std::vector<std::string> common = {"--set", "data.train_files=[\"" + (dir / "train.jsonl").string() + "\"]",
                                           "--set", "data.shuffle=false", "--set", "training.epochs=1",
                                           "--set", "evaluation.every_steps=0"};
  auto stop = run_trainer(image_args(dir / "run-error", common));
  EXPECT_EQ(stop.exit_code, 3) << stop.err;
  EXPECT_TRUE(contains(stop.err, (dir / "bad.jpg").string() + ": not a JPEG, PNG or WebP image")) << stop.err;
  auto with_skip = common;
  with_skip.insert(with_skip.end(), {"--set", "data.on_bad_record=skip"});
  auto skip = run_trainer(image_args(dir / "run-skip", with_skip));
  ASSERT_EQ(skip.exit_code, 0) << skip.err;
  EXPECT_TRUE(contains(skip.out, "bad records skipped 1")) << skip.out;
  EXPECT_TRUE(contains(skip.out, "bad.jpg: not a JPEG")) << skip.out;
  fs::remove_all(dir);
}

// training.linear_probe=true: between two checkpoints only the head's tensors change.
TEST(IntegrationImages, LinearProbeTrainsOnlyTheHead) {
  const auto dir = fs::temp_directory_path() / "trainer-images-probe";
  fs::remove_all(dir);
  auto run = run_trainer(image_args(dir, {"--set", "training.linear_probe=true", "--set", "training.max_steps=3",
                                          "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep_last=5", "--set",
                                          "evaluation.every_steps=0"}));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_TRUE(contains(run.err, "linear probe")) << run.err;
  const auto a = tensors_of(dir / "checkpoint-1" / "model.safetensors");
  const auto b = tensors_of(dir / "checkpoint-3" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  int changed = 0;
  for (const auto& [name, t] : a) {
    const bool same = at::equal(t, b.at(name));
    EXPECT_EQ(same, !name.starts_with("classifier.")) << name;
    changed += !same;
  }
  EXPECT_EQ(changed, 2);  // classifier.weight, classifier.bias
  fs::remove_all(dir);
}

// inspect and plan know image classifiers: parameters, fixed memory by mode, activations per image, what fits.
TEST(IntegrationImages, InspectAndPlanDescribeAnImageClassifier) {
  auto inspect = run_trainer({"inspect", "configs/models/tiny-vit"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  for (const char* text : {"image classifier", "32 x 32 pixels, 17 tokens per image", "parameters", "head",
                           "linear probe", "Activations per image"})
    EXPECT_TRUE(contains(inspect.out, text)) << text << "\n" << inspect.out;
  auto plan = run_trainer({"plan", "--config", "configs/tiny-vit.json"});
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  for (const char* text : {"full fine-tune", "activations per image", "largest micro-batch"})
    EXPECT_TRUE(contains(plan.out, text)) << text << "\n" << plan.out;
  auto probe = run_trainer({"plan", "--config", "configs/tiny-vit.json", "--set", "training.linear_probe=true"});
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  EXPECT_TRUE(contains(probe.out, "linear probe")) << probe.out;
}

// Six steps at micro-batch 16, once without a limit and once under a CPU budget that fits 8 images per
// micro-batch but not 16, with regrowth after 2 steps: the micro-batch falls at step 1, grows back and falls again
// mid-run. Both reach the same weights (fp32, dropout on: masks are keyed by image, not by split; lr 1e-4 keeps
// AdamW from amplifying summation-order noise).
TEST(IntegrationImages, OutOfMemoryMidRunReachesTheSameWeights) {
  const auto dir = fs::temp_directory_path() / "trainer-images-oom";
  fs::remove_all(dir);
  const std::vector<std::string> common = {"--set", "training.max_steps=6", "--set", "training.micro_batch_size=16",
                                           "--set", "optimizer.lr=1e-4", "--set", "evaluation.every_steps=0",
                                           "--set", "data.validation_files=[]", "--set", "checkpoint.every_steps=0"};
  auto with = [&](const std::string& name, std::vector<std::string> extra) {
    auto args = image_args(dir / name, common);
    args.insert(args.end(), extra.begin(), extra.end());
    return run_trainer(args);
  };
  // The peak of one step at micro-batch 8 and 16, measured by the same binary.
  auto peak = [&](const std::string& micro) {
    auto r = with("peak-" + micro, {"--set", "training.max_steps=1", "--set", "training.micro_batch_size=" + micro});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return metric_values(dir / ("peak-" + micro) / "metrics.jsonl", "memory_peak").at(0);
  };
  const double eight = peak("8"), sixteen = peak("16");
  ASSERT_LT(eight, sixteen);
  auto free_run = with("free", {});
  ASSERT_EQ(free_run.exit_code, 0) << free_run.err;
  const auto limit = static_cast<int64_t>((eight + sixteen) / 2);
  auto constrained = with("constrained", {"--set", "memory.limit=" + std::to_string(limit), "--set",
                                          "memory.regrow_after_steps=2"});
  ASSERT_EQ(constrained.exit_code, 0) << constrained.err;
  const auto micro = metric_values(dir / "constrained" / "metrics.jsonl", "micro_batch");
  const auto retries = metric_values(dir / "constrained" / "metrics.jsonl", "oom_retries");
  ASSERT_EQ(micro.size(), 6u);
  EXPECT_EQ(micro[0], 8) << constrained.err;
  int64_t later_retries = 0;
  for (std::size_t i = 1; i < retries.size(); ++i) later_retries += static_cast<int64_t>(retries[i]);
  EXPECT_GE(later_retries, 1) << "regrowth must run out of memory again mid-run\n" << constrained.err;
  EXPECT_LT(max_difference(dir / "free" / "final" / "model.safetensors",
                           dir / "constrained" / "final" / "model.safetensors"),
            1e-5);
  fs::remove_all(dir);
}

// An uninterrupted run of 12 steps, and one resumed from its checkpoint-6: the same weights, bit for bit, and the
// same losses at steps 7..12 (same images in the same order with the same dropout).
TEST(IntegrationImages, ResumeContinuesExactly) {
  const auto straight = fs::temp_directory_path() / "trainer-images-straight";
  const auto resumed = fs::temp_directory_path() / "trainer-images-resumed";
  fs::remove_all(straight);
  fs::remove_all(resumed);
  const std::vector<std::string> common = {"--set", "training.max_steps=12", "--set", "checkpoint.every_steps=6",
                                           "--set", "evaluation.every_steps=0", "--set", "training.micro_batch_size=8"};
  auto first = run_trainer(image_args(straight, common));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  fs::create_directories(resumed);
  fs::copy(straight / "checkpoint-6", resumed / "checkpoint-6", fs::copy_options::recursive);
  auto args = image_args(resumed, common);
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
  // A setting that would make it another run (the shuffle order and augmentation come from the seed) is refused.
  auto other = image_args(fs::temp_directory_path() / "trainer-images-other-seed", common);
  other.insert(other.end(), {"--set", "training.seed=2", "--resume-from", (straight / "checkpoint-6").string()});
  auto refused = run_trainer(other);
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_TRUE(contains(refused.err, "training.seed")) << refused.err;
  fs::remove_all(fs::temp_directory_path() / "trainer-images-other-seed");
  fs::remove_all(straight);
  fs::remove_all(resumed);
}

// SIGTERM mid-run (a preempted job): the step finishes, a checkpoint is written, exit 0; --resume continues to the
// end, and the weights equal an uninterrupted run's, bit for bit (augmentation and dropout keyed, data cursor,
// optimizer state and schedule restored).
TEST(IntegrationImages, KilledAndResumedRunEndsWithTheUninterruptedWeights) {
  const auto straight = fs::temp_directory_path() / "trainer-images-signal-straight";
  const auto stopped = fs::temp_directory_path() / "trainer-images-signal-stopped";
  fs::remove_all(straight);
  fs::remove_all(stopped);
  const std::vector<std::string> common = {"--set", "training.max_steps=600", "--set", "training.micro_batch_size=8",
                                           "--set", "evaluation.every_steps=0", "--set", "checkpoint.every_steps=0"};
  auto term = run_trainer(image_args(stopped, common), "timeout --preserve-status -s TERM 3");
  ASSERT_EQ(term.exit_code, 0) << term.err;
  ASSERT_TRUE(contains(term.out, "Stopped by SIGTERM")) << "the run ended before the signal: make it longer\n"
                                                         << term.out;
  auto args = image_args(stopped, common);
  args.push_back("--resume");
  auto resumed = run_trainer(args);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(contains(resumed.err, "resuming from")) << resumed.err;
  auto whole = run_trainer(image_args(straight, common));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  EXPECT_TRUE(read_text(straight / "final" / "model.safetensors") == read_text(stopped / "final" / "model.safetensors"))
      << "the stopped and resumed run's weights differ from the uninterrupted run's";
  fs::remove_all(straight);
  fs::remove_all(stopped);
}

}  // namespace trainer::test

namespace trainer::test {
namespace {

// The run-safety promises hold for image runs as for text: one run per output directory (this test process holds
// the directory's lock, as a running job would), and a resume on other training images is refused (exit 3) unless
// --allow-data-change, which continues when the classes are the same.
TEST(IntegrationImages, OneRunPerOutputDirectoryAndResumeChecksTheImages) {
  TempDir dir;
  const auto images = dir.path() / "images";
  fs::copy(fs::path(TRAINER_SOURCE_DIR) / "data/demo/images/train", images, fs::copy_options::recursive);
  const auto run = dir.path() / "run";
  const std::vector<std::string> common = {"--set", "data.train_files=[\"" + images.string() + "\"]", "--set",
                                           "training.max_steps=2", "--set", "checkpoint.every_steps=2", "--set",
                                           "evaluation.every_steps=0"};
  {
    const auto held = RunLock::acquire(run.string());
    const auto refused = run_trainer(image_args(run, common));
    EXPECT_EQ(refused.exit_code, 2) << refused.err;
    EXPECT_TRUE(contains(refused.err, "is in use by another training run")) << refused.err;
  }
  const auto first = run_trainer(image_args(run, common));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  // One image fewer: another epoch order under the same cursor.
  fs::path removed;
  for (const auto& entry : fs::recursive_directory_iterator(images))
    if (entry.is_regular_file()) removed = entry.path();
  fs::remove(removed);
  auto resume = image_args(run, common);
  resume.insert(resume.end(), {"--set", "training.max_steps=4", "--resume"});
  const auto changed = run_trainer(resume);
  EXPECT_EQ(changed.exit_code, 3) << changed.err;
  EXPECT_TRUE(contains(changed.err, "the training images differ from those")) << changed.err;
  EXPECT_TRUE(contains(changed.err, "--allow-data-change")) << changed.err;
  resume.push_back("--allow-data-change");
  const auto allowed = run_trainer(resume);
  EXPECT_EQ(allowed.exit_code, 0) << allowed.err;
  EXPECT_TRUE(fs::exists(run / "checkpoint-4" / "COMPLETE"));
}

}  // namespace
}  // namespace trainer::test
