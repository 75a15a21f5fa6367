// Pre-tokenized records (input_ids, labels) need no tokenizer: a model directory with only config.json trains,
// padding with the id its config.json / generation_config.json give, to the weights a run with the tokenizer
// reaches; what does need one (text records, sample prompts, generate --prompt) says why; a config without any
// pad or EOS id is an error naming the keys to add.
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/process.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// `name`'s config.json alone (tokenizer files left behind), edited by `edit`.
fs::path model_without_tokenizer(const fs::path& root, const std::string& name,
                                 const std::function<void(nlohmann::json&)>& edit = {}) {
  const fs::path dir = root / (name + "-no-tokenizer");
  fs::create_directories(dir);
  std::ifstream in(std::string(TRAINER_SOURCE_DIR) + "/configs/models/" + name + "/config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  if (edit) edit(config);
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

// Eight records of different lengths; causal: a masked prompt of three tokens; seq2seq: separate labels.
fs::path write_ids(const fs::path& path, bool seq2seq) {
  std::ofstream out(path);
  for (int r = 0; r < 8; ++r) {
    nlohmann::json ids = nlohmann::json::array(), labels = nlohmann::json::array();
    for (int i = 0; i < 6 + 3 * r; ++i) ids.push_back(5 + (r * 37 + i * 11) % 190);
    if (seq2seq) {
      for (int i = 0; i < 3 + r; ++i) labels.push_back(5 + (r * 13 + i * 7) % 190);
    } else {
      labels = ids;
      for (int i = 0; i < 3; ++i) labels[static_cast<std::size_t>(i)] = -100;
    }
    out << nlohmann::json{{"input_ids", ids}, {"labels", labels}}.dump() << "\n";
  }
  return path;
}

std::vector<std::string> run_args(const std::string& config, const fs::path& model, const fs::path& data,
                                  const fs::path& out) {
  return {"--config", config, "--set", "model.path=" + model.string(), "--set",
          "data.train_files=[\"" + data.string() + "\"]", "--set", "data.validation_files=[]", "--set",
          "training.batch_size=4", "--set", "training.micro_batch_size=2", "--set", "training.max_steps=4", "--set",
          "evaluation.every_steps=0", "--set", "evaluation.sample_prompts=[]", "--set",
          "checkpoint.output_dir=" + out.string()};
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

double max_difference(const fs::path& a, const fs::path& b) {
  const auto fa = SafetensorsFile::open(a.string()), fb = SafetensorsFile::open(b.string());
  double worst = 0;
  for (const auto& t : fa.tensors())
    worst = std::max(worst, (fa.load(t.name, at::kFloat) - fb.load(t.name, at::kFloat)).abs().max().item<double>());
  return worst;
}

// Both families train without tokenizer files, to the weights of the same run with the model's tokenizer.
TEST(IntegrationPretokenized, AModelDirectoryWithoutTokenizerFilesTrains) {
  TempDir dir;
  for (const std::string name : {"tiny-qwen2", "tiny-t5"}) {
    SCOPED_TRACE(name);
    const auto data = write_ids(dir.path() / (name + ".jsonl"), name == "tiny-t5");
    const auto bare = model_without_tokenizer(dir.path(), name);
    const std::string config = "configs/" + name + ".json";
    const auto without = run_trainer(run_args(config, bare, data, dir.path() / (name + "-without")));
    ASSERT_EQ(without.exit_code, 0) << without.err;
    EXPECT_TRUE(contains(without.err, "has no tokenizer files: pre-tokenized records (input_ids, labels) only"))
        << without.err;
    const auto with_tokenizer = run_trainer(run_args(
        config, fs::path(TRAINER_SOURCE_DIR) / "configs" / "models" / name, data, dir.path() / (name + "-with")));
    ASSERT_EQ(with_tokenizer.exit_code, 0) << with_tokenizer.err;
    EXPECT_LT(max_difference(dir.path() / (name + "-without") / "final" / "model.safetensors",
                             dir.path() / (name + "-with") / "final" / "model.safetensors"),
              1e-6);
  }
}

// The padding id comes from generation_config.json when config.json has none; with neither a pad nor an EOS id
// anywhere the run stops before training, naming both keys and the file to add one to.
TEST(IntegrationPretokenized, PadAndEosIdsComeFromTheConfigFilesOrTheErrorNamesThem) {
  TempDir dir;
  const auto data = write_ids(dir.path() / "ids.jsonl", false);
  const auto none = model_without_tokenizer(dir.path(), "tiny-qwen2", [](nlohmann::json& c) {
    c.erase("eos_token_id");
    c.erase("bos_token_id");
    c["pad_token_id"] = nullptr;
  });
  const auto r = run_trainer(run_args("configs/tiny-qwen2.json", none, data, dir.path() / "run"));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  for (const char* text : {"has no tokenizer files, and neither config.json nor generation_config.json gives "
                           "\"pad_token_id\" or \"eos_token_id\"",
                           "hint: add \"pad_token_id\": <id> to"})
    EXPECT_TRUE(contains(r.err, text)) << text << "\n" << r.err;
  EXPECT_TRUE(contains(r.err, (none / "config.json").string())) << r.err;

  std::ofstream(none / "generation_config.json") << R"({"pad_token_id": 3, "eos_token_id": [7, 9]})";
  const auto fixed = run_trainer(run_args("configs/tiny-qwen2.json", none, data, dir.path() / "run"));
  EXPECT_EQ(fixed.exit_code, 0) << fixed.err;
  EXPECT_TRUE(contains(fixed.err, "padding id 3 and EOS id 7")) << fixed.err;
}

// What needs a tokenizer says so: text records (training and `trainer data`), evaluation.sample_prompts, and
// `trainer generate --prompt`.
TEST(IntegrationPretokenized, WhatNeedsATokenizerSaysWhy) {
  TempDir dir;
  const auto bare = model_without_tokenizer(dir.path(), "tiny-qwen2");
  const auto ids = write_ids(dir.path() / "ids.jsonl", false);
  const fs::path text = fs::path(TRAINER_SOURCE_DIR) / "data" / "demo" / "recipes-causal.jsonl";
  for (const auto& args : {run_args("configs/tiny-qwen2.json", bare, text, dir.path() / "run"),
                           with({"data"}, run_args("configs/tiny-qwen2.json", bare, text, dir.path() / "run"))}) {
    SCOPED_TRACE(args[0]);
    const auto r = run_trainer(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    for (const std::string& part : {"encoding text needs a tokenizer, and " + bare.string() + " has no tokenizer files",
                                   std::string("hint: set tokenizer.path to the model's tokenizer")})
      EXPECT_TRUE(contains(r.err, part)) << part << "\n" << r.err;
  }
  const auto samples = run_trainer(with(run_args("configs/tiny-qwen2.json", bare, ids, dir.path() / "run"),
                                        {"--set", "evaluation.sample_prompts=[\"Recipe:\"]"}));
  EXPECT_EQ(samples.exit_code, 2) << samples.err;
  EXPECT_TRUE(contains(samples.err, "evaluation.sample_prompts needs a tokenizer")) << samples.err;
  EXPECT_TRUE(contains(samples.err, "evaluation.sample_prompts=[]")) << samples.err;

  const auto generate = run_trainer({"generate", "--model", bare.string(), "--random-init", "--prompt", "Recipe:"});
  EXPECT_EQ(generate.exit_code, 2) << generate.err;
  EXPECT_TRUE(contains(generate.err, "--prompt needs a tokenizer")) << generate.err;
  const auto by_ids = run_trainer({"generate", "--model", bare.string(), "--random-init", "--ids", "5,17,42",
                                   "--max-new-tokens", "3"});
  EXPECT_EQ(by_ids.exit_code, 0) << by_ids.err;
}

}  // namespace
}  // namespace trainer::test
