// LoRA through the real binary: a tiny run trains adapters only, saves them in PEFT's format (checkpoints and
// final), merges them on request, and resumes exactly. PEFT itself loads the result in tests/parity/test_lora.py.
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

// Every linear layer and a higher rate: on the demo's randomly initialised (frozen) base, q and v alone learn
// little in 60 steps.
const std::vector<std::string> kLoraRun = {
    "--config", "configs/tiny-qwen2.json", "--set", "lora.enabled=true", "--set", "lora.r=16", "--set",
    "lora.alpha=32", "--set", "optimizer.lr=1e-2", "--set",
    R"(lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"])"};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream file(path);
  return nlohmann::json::parse(file);
}

}  // namespace

TEST(IntegrationLora, TrainsAdaptersOnlySavesThemForPeftAndMerges) {
  const auto out_dir = fs::temp_directory_path() / "trainer-lora-train";
  fs::remove_all(out_dir);
  auto run = run_trainer(with(kLoraRun, {"--set", "checkpoint.output_dir=" + out_dir.string(), "--merge"}));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("Done: 60 steps"), std::string::npos) << run.out;
  EXPECT_NE(run.err.find("LoRA r=16 alpha=32 (scale 2)"), std::string::npos) << run.err;

  // The loss falls, on the training and on the validation data.
  const auto losses = metric_values(out_dir / "metrics.jsonl", "loss");
  const auto eval_losses = metric_values(out_dir / "metrics.jsonl", "eval_loss");
  ASSERT_EQ(losses.size(), 60u);
  const double first = (losses[0] + losses[1] + losses[2]) / 3, last = (losses[57] + losses[58] + losses[59]) / 3;
  EXPECT_LT(last, first - 0.3) << "loss " << first << " -> " << last;
  ASSERT_EQ(eval_losses.size(), 3u);
  EXPECT_LT(eval_losses.back(), eval_losses.front());

  // final/ is a PEFT adapter on the saved random base, with the tokenizer; no full weights.
  const auto final_dir = out_dir / "final";
  EXPECT_FALSE(fs::exists(final_dir / "model.safetensors"));
  EXPECT_TRUE(fs::exists(final_dir / "tokenizer.json"));
  const auto config = read_json(final_dir / "adapter_config.json");
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["task_type"], "CAUSAL_LM");
  EXPECT_EQ(config["r"], 16);
  EXPECT_EQ(config["base_model_name_or_path"], (out_dir / "base").string());
  EXPECT_TRUE(fs::exists(out_dir / "base" / "model.safetensors"));
  const auto adapter = SafetensorsFile::open((final_dir / "adapter_model.safetensors").string());
  EXPECT_EQ(adapter.tensors().size(), 2u * 7u * 2u);  // A and B, 7 projections, 2 layers
  EXPECT_NE(adapter.find("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"), nullptr);

  // The checkpoint holds the adapter and the adapters' optimizer state only.
  const auto checkpoint = out_dir / "checkpoint-30";
  EXPECT_TRUE(fs::exists(checkpoint / "COMPLETE"));
  EXPECT_TRUE(fs::exists(checkpoint / "adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(checkpoint / "model.safetensors"));
  const auto optimizer = SafetensorsFile::open((checkpoint / "optimizer.safetensors").string());
  EXPECT_EQ(optimizer.tensors().size(), 2u * adapter.tensors().size() + 1u);  // two moments each + the RNG state
  for (const auto& t : optimizer.tensors())
    EXPECT_TRUE(t.name == "rng.cpu" || t.name.find(".lora_") != std::string::npos) << t.name;

  // --merge wrote a full model that generates; `trainer merge` writes the same weights.
  auto sample = run_trainer({"generate", "--model", (out_dir / "final-merged").string(), "--prompt",
                             "Recipe: Golden soup", "--max-new-tokens", "8"});
  EXPECT_EQ(sample.exit_code, 0) << sample.err;
  EXPECT_NE(sample.out.find("text: "), std::string::npos) << sample.out;
  auto merge = run_trainer({"merge", "--adapter", final_dir.string(), "--output", (out_dir / "merged-again").string()});
  ASSERT_EQ(merge.exit_code, 0) << merge.err;
  EXPECT_NE(merge.out.find("Merged 14 LoRA layers"), std::string::npos) << merge.out;
  EXPECT_TRUE(read_text(out_dir / "final-merged" / "model.safetensors") ==
              read_text(out_dir / "merged-again" / "model.safetensors"));
  fs::remove_all(out_dir);
}

// 20 steps straight and 10 + resume + 10 reach identical adapters (and the optimizer state came back too).
TEST(IntegrationLora, ResumeContinuesExactly) {
  const auto straight = fs::temp_directory_path() / "trainer-lora-straight";
  const auto resumed = fs::temp_directory_path() / "trainer-lora-resumed";
  fs::remove_all(straight);
  fs::remove_all(resumed);
  const auto args = with(kLoraRun, {"--set", "training.max_steps=20", "--set", "checkpoint.every_steps=10", "--set",
                                    "evaluation.every_steps=0", "--set", "lora.dropout=0.1"});
  ASSERT_EQ(run_trainer(with(args, {"--set", "checkpoint.output_dir=" + straight.string()})).exit_code, 0);
  fs::create_directories(resumed);
  fs::copy(straight / "checkpoint-10", resumed / "checkpoint-10", fs::copy_options::recursive);
  auto second = run_trainer(with(args, {"--set", "checkpoint.output_dir=" + resumed.string(), "--resume"}));
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(second.err.find("resuming from"), std::string::npos);
  const auto a = read_text(straight / "final" / "adapter_model.safetensors");
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == read_text(resumed / "final" / "adapter_model.safetensors"))
      << "the resumed run's adapters differ from the uninterrupted run's";

  // Other LoRA settings, or a full-model run, cannot continue a LoRA checkpoint: the error says what differs.
  auto other_rank = run_trainer(with(args, {"--set", "checkpoint.output_dir=" + resumed.string(), "--set", "lora.r=8",
                                            "--resume"}));
  EXPECT_EQ(other_rank.exit_code, 3);
  EXPECT_NE(other_rank.err.find("lora.r: checkpoint 16, config 8"), std::string::npos) << other_rank.err;
  // Their own output_dir: a run locks it, and tests run in parallel (the config's default is shared).
  const auto elsewhere = "checkpoint.output_dir=" + (fs::temp_directory_path() / "trainer-lora-full").string();
  auto full = run_trainer({"--config", "configs/tiny-qwen2.json", "--set", elsewhere, "--resume-from",
                           (straight / "checkpoint-10").string()});
  EXPECT_EQ(full.exit_code, 3);
  EXPECT_NE(full.err.find("holds a LoRA adapter"), std::string::npos) << full.err;
  // --merge without LoRA is a usage error.
  auto merge_full = run_trainer({"--config", "configs/tiny-qwen2.json", "--set", elsewhere, "--merge"});
  EXPECT_EQ(merge_full.exit_code, 2);
  EXPECT_NE(merge_full.err.find("lora.enabled"), std::string::npos) << merge_full.err;
  fs::remove_all(straight);
  fs::remove_all(resumed);
  fs::remove_all(fs::temp_directory_path() / "trainer-lora-full");
}

// QLoRA with the 4-bit base dequantized once and kept (memory.dequantized_base) trains the same adapters, bit for
// bit, as dequantizing on every use, holding the copies' bytes more between steps. auto keeps them under the tiny
// config's 2 GiB and turns them off under a memory.limit the plan's peak at data.max_length leaves no room in (the
// demo's short records still fit it), and says so.
TEST(IntegrationLora, QloraWithTheDequantizedBaseKeptTrainsTheSameAdaptersBitForBit) {
  const auto root = fs::temp_directory_path() / "trainer-qlora-dequantized";
  fs::remove_all(root);
  const auto args = with(kLoraRun, {"--set", "model.quantize=nf4", "--set", "training.max_steps=4", "--set",
                                    "training.micro_batch_size=8", "--set", "evaluation.every_steps=0", "--set",
                                    "checkpoint.every_steps=0", "--set", "data.max_length=1024", "--set",
                                    "logging.every_steps=1"});
  auto train = [&](const std::string& name, const std::vector<std::string>& extra) {
    auto run = run_trainer(with(args, with({"--set", "checkpoint.output_dir=" + (root / name).string()}, extra)));
    EXPECT_EQ(run.exit_code, 0) << run.err;
    return run;
  };
  const auto kept = train("auto", {});
  EXPECT_NE(kept.err.find("dequantized once and kept, 288.00 KiB (memory.dequantized_base=auto"), std::string::npos)
      << kept.err;
  const auto per_use = train("per_use", {"--set", "memory.dequantized_base=per_use"});
  EXPECT_NE(per_use.err.find("dequantized on every use (memory.dequantized_base=per_use"), std::string::npos)
      << per_use.err;
  const auto adapter = [&](const std::string& name) { return read_text(root / name / "final" / "adapter_model.safetensors"); };
  ASSERT_FALSE(adapter("per_use").empty());
  EXPECT_TRUE(adapter("auto") == adapter("per_use")) << "the kept copies changed the adapters";
  // 2 layers of q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128, in fp32: 288 KiB held more.
  const double copies = 4.0 * 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3);
  const double held_kept = metric_values(root / "auto" / "metrics.jsonl", "memory_allocated").at(0);
  const double held_per_use = metric_values(root / "per_use" / "metrics.jsonl", "memory_allocated").at(0);
  EXPECT_GE(held_kept - held_per_use, copies);
  EXPECT_LT(held_kept - held_per_use, copies + 64 * 1024);

  // A budget twice the per-use run's measured peak: the short records fit it, the plan's at 1024 tokens do not.
  const double peak = metric_values(root / "per_use" / "metrics.jsonl", "memory_peak").at(0);
  const auto tight = train("tight", {"--set", "memory.limit=" + std::to_string(static_cast<int64_t>(2 * peak))});
  EXPECT_NE(tight.err.find("dequantized on every use (memory.dequantized_base=auto: kept, 288.00 KiB would not fit"),
            std::string::npos)
      << tight.err;
  EXPECT_TRUE(adapter("tight") == adapter("per_use"));
  EXPECT_EQ(metric_values(root / "tight" / "metrics.jsonl", "oom_retries"), (std::vector<double>{0, 0, 0, 0}));
  fs::remove_all(root);
}

// What merge needs and does not find is named, with the way out.
TEST(IntegrationLora, MergeAndGenerateSayWhatIsMissing) {
  const auto dir = fs::temp_directory_path() / "trainer-lora-merge-errors";
  fs::remove_all(dir);
  auto no_adapter = run_trainer({"merge", "--adapter", (dir / "nothing").string(), "--output", (dir / "out").string()});
  EXPECT_EQ(no_adapter.exit_code, 3);
  EXPECT_NE(no_adapter.err.find("adapter_config.json is missing"), std::string::npos) << no_adapter.err;

  // An adapter whose base is not here: the hint says to give --base.
  fs::create_directories(dir / "adapter");
  std::ofstream(dir / "adapter" / "adapter_config.json")
      << R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": "Qwen/Qwen2.5-7B"})";
  auto no_weights = run_trainer({"merge", "--adapter", (dir / "adapter").string(), "--output", (dir / "out").string()});
  EXPECT_EQ(no_weights.exit_code, 3);
  EXPECT_NE(no_weights.err.find("adapter_model.safetensors is missing"), std::string::npos) << no_weights.err;
  write_safetensors((dir / "adapter" / "adapter_model.safetensors").string(),
                    {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", at::zeros({4, 64})},
                     {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", at::zeros({64, 4})}});
  auto no_base = run_trainer({"merge", "--adapter", (dir / "adapter").string(), "--output", (dir / "out").string()});
  EXPECT_EQ(no_base.exit_code, 3);
  EXPECT_NE(no_base.err.find("Qwen/Qwen2.5-7B is not a directory here"), std::string::npos) << no_base.err;
  EXPECT_NE(no_base.err.find("--base"), std::string::npos) << no_base.err;

  // generate on an adapter directory points at merge.
  auto generate = run_trainer({"generate", "--model", (dir / "adapter").string(), "--ids", "5"});
  EXPECT_EQ(generate.exit_code, 3);
  EXPECT_NE(generate.err.find("trainer merge --adapter"), std::string::npos) << generate.err;
  EXPECT_FALSE(fs::exists(dir / "out"));
  fs::remove_all(dir);
}

}  // namespace trainer::test
