// Evaluation by generation (train/tasks/text/generation_eval.h) on the tiny models and the demo validation
// recipes: what it scores and writes, the options it takes from generation_config.json and the config, and an
// out-of-memory error under the CPU budget that halves the generation batch and changes no answer.
#include "train/tasks/text/generation_eval.h"

#include <fstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/cpu_budget.h"
#include "models/weights.h"
#include "support/paths.h"
#include "support/temp_dir.h"
#include "train/engine/task.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace {
namespace fs = std::filesystem;

Config tiny_config(const std::string& name) {
  Config c = load_config(test::source_path("configs/" + name + ".json"));
  c.model.path = test::source_path("configs/models/" + name);
  const bool seq2seq = name == "tiny-t5";
  c.data.train_files = {test::source_path(seq2seq ? "data/demo/recipes-seq2seq.jsonl" : "data/demo/recipes-causal.jsonl")};
  c.data.validation_files = {
      test::source_path(seq2seq ? "data/demo/recipes-seq2seq-val.jsonl" : "data/demo/recipes-causal-val.jsonl")};
  c.evaluation.generate = true;
  c.evaluation.generate_examples = 12;
  c.evaluation.generate_max_new_tokens = 8;
  c.evaluation.generate_metrics = {"exact_match", "rouge1", "rougeL", "bleu", "chrf"};
  return c;
}

std::vector<nlohmann::json> read_lines(const fs::path& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

struct TinyEval {
  Config config;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LanguageModel> model;
  explicit TinyEval(const std::string& name) : config(tiny_config(name)) {
    tokenizer = load_tokenizer(config.model.path);
    model = load_model(config.model.path, ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 3);
  }
  GenerationScores run(EvaluationMicroBatch& micro, const fs::path& predictions) {
    const auto family = model->family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
    auto loader = make_validation_loader(config, *tokenizer, family, 16);
    const auto options = evaluation_generate_options(config, model->family(), config.model.path);
    return evaluate_by_generation(*model, *tokenizer, *loader, config, options, micro, nullptr, predictions);
  }
};

}  // namespace

TEST(GenerationEval, ScoresAndWritesEveryAnswerForBothFamilies) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    TinyEval s(name);
    test::TempDir dir;
    EvaluationMicroBatch micro(5, nullptr);
    const auto scores = s.run(micro, predictions_path(dir.path(), 20));
    EXPECT_EQ(scores.examples, 12);
    EXPECT_EQ(scores.skipped, 0);
    for (const char* metric : {"exact_match", "rouge1", "rougeL", "bleu", "chrf"}) EXPECT_TRUE(scores.metrics.count(metric));
    const auto lines = read_lines(dir.path() / "evaluations" / "step-20" / "predictions.jsonl");
    ASSERT_EQ(lines.size(), 12u);
    std::vector<std::string> predictions, references;
    for (std::size_t i = 0; i < lines.size(); ++i) {
      EXPECT_EQ(lines[i]["index"], i);
      EXPECT_FALSE(lines[i]["prompt"].get<std::string>().empty());
      EXPECT_FALSE(lines[i]["reference"].get<std::string>().empty());
      predictions.push_back(lines[i]["prediction"]);
      references.push_back(lines[i]["reference"]);
    }
    // The prompt is the record's input (seq2seq) or prompt (causal), the reference its target or completion.
    const auto prompt = lines[0]["prompt"].get<std::string>();
    EXPECT_TRUE(prompt.find("Write the steps for") != std::string::npos || prompt.find("Recipe:") != std::string::npos)
        << prompt;
    EXPECT_NE(lines[0]["reference"].get<std::string>().find("1."), std::string::npos);
    // A random model's answers are not the references: exact match 0, ROUGE below 1.
    EXPECT_EQ(scores.metrics.at("exact_match"), 0.0);
    EXPECT_LT(scores.metrics.at("rougeL"), 1.0);
  }
}

TEST(GenerationEval, AnOutOfMemoryHalvesTheGenerationBatchAndChangesNoAnswer) {
  install_cpu_budget();
  TinyEval s("tiny-t5");
  s.config.evaluation.generate_num_beams = 2;
  test::TempDir dir;
  EvaluationMicroBatch free_micro(12, nullptr);
  const int64_t base = cpu_memory_stats().allocated;
  reset_cpu_peak();
  const auto free = s.run(free_micro, dir.path() / "free.jsonl");
  const int64_t twelve = cpu_memory_stats().peak - base;
  EXPECT_EQ(free_micro.value(), 12);

  set_cpu_budget_limit(base + twelve / 3);
  EvaluationMicroBatch micro(12, nullptr);
  const auto constrained = s.run(micro, dir.path() / "constrained.jsonl");
  set_cpu_budget_limit(0);
  EXPECT_LT(micro.value(), 12) << "the generation batch shrank";
  EXPECT_GE(micro.value(), 1);
  EXPECT_EQ(constrained.metrics, free.metrics);
  EXPECT_EQ(read_lines(dir.path() / "constrained.jsonl"), read_lines(dir.path() / "free.jsonl"));
}

TEST(GenerationEval, OptionsComeFromGenerationConfigThenTheConfig) {
  test::TempDir dir;
  std::ofstream(dir.path() / "generation_config.json")
      << R"({"num_beams": 4, "max_new_tokens": 40, "no_repeat_ngram_size": 3, "early_stopping": true,
             "do_sample": false, "temperature": 0.7, "top_k": 20})";
  Config config = tiny_config("tiny-t5");
  config.evaluation.generate_max_new_tokens.reset();
  auto options = evaluation_generate_options(config, ModelFamily::kSeq2Seq, dir.path());
  EXPECT_EQ(options.num_beams, 4);
  EXPECT_EQ(options.max_new_tokens, 40);
  EXPECT_EQ(options.no_repeat_ngram_size, 3);
  EXPECT_EQ(options.early_stopping, EarlyStopping::kWhenFull);
  EXPECT_EQ(options.temperature, 0.0) << "do_sample false: no sampling whatever the temperature";

  config.evaluation.generate_num_beams = 1;
  config.evaluation.generate_do_sample = true;
  config.evaluation.generate_early_stopping = GenerateEarlyStopping::kNever;
  options = evaluation_generate_options(config, ModelFamily::kSeq2Seq, dir.path());
  EXPECT_EQ(options.num_beams, 1);
  EXPECT_DOUBLE_EQ(options.temperature, 0.7);
  EXPECT_EQ(options.top_k, 20);
  EXPECT_EQ(options.early_stopping, EarlyStopping::kNever);

  // Without a generation_config.json: the data's target length for seq2seq, 64 for causal models.
  config = tiny_config("tiny-t5");
  config.evaluation.generate_max_new_tokens.reset();
  EXPECT_EQ(evaluation_generate_options(config, ModelFamily::kSeq2Seq, dir.path() / "none").max_new_tokens,
            config.data.max_target_length);
  EXPECT_EQ(evaluation_generate_options(config, ModelFamily::kCausal, dir.path() / "none").max_new_tokens, 64);
}

}  // namespace trainer
