#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/paths.h"
#include "trainer/cli.h"
#include "trainer/config.h"

namespace trainer {
namespace {

// The smallest config that validates.
const char* kMinimal = R"({"model": {"path": "m"}, "data": {"train_files": ["d.jsonl"]}})";

std::vector<ConfigProblem> problems_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(text, "test.json", overrides);
  } catch (const ConfigError& e) {
    return e.problems();
  }
  return {};
}

// The one problem reported for `where`, or a failure.
std::string problem_at(const std::vector<ConfigProblem>& problems, const std::string& where) {
  for (const auto& p : problems)
    if (p.where == where) return p.what;
  std::string all;
  for (const auto& p : problems) all += "\n  " + p.where + ": " + p.what;
  ADD_FAILURE() << "no problem at " << where << "; problems:" << all;
  return {};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(Config, DefaultsComeFromTheStructs) {
  const Config c = parse_config(kMinimal, "test.json");
  EXPECT_EQ(c.model.path, "m");
  EXPECT_EQ(c.training.batch_size, 32);
  EXPECT_TRUE(c.training.micro_batch_size.is_auto);
  EXPECT_EQ(c.memory.shrink_factor, 0.5);
  EXPECT_EQ(c.checkpoint.max_shard_size.bytes, 5'000'000'000u);
  EXPECT_EQ(c.precision.mode, PrecisionMode::kFp32);
}

TEST(Config, ReadsEveryValueType) {
  const Config c = parse_config(R"({
    // comments are allowed
    "model": {"path": "m", "init": "random"},
    "data": {"train_files": "one.jsonl", "validation_fraction": 0.1, "on_bad_record": "skip"},
    "training": {"batch_size": 64, "micro_batch_size": 8, "max_steps": 1e3, "chunked_loss": true},
    "optimizer": {"lr": 3e-4},
    "memory": {"limit": "24GiB", "escalation": ["chunked_loss"]},
    "device": {"type": "cuda:1", "min_free_memory": 1048576}
  })",
                                "test.json");
  EXPECT_EQ(c.model.init, ModelInit::kRandom);
  EXPECT_EQ(c.data.train_files, std::vector<std::string>{"one.jsonl"});  // a single string is a list of one
  EXPECT_EQ(c.data.on_bad_record, BadRecordPolicy::kSkip);
  EXPECT_EQ(c.training.micro_batch_size, MicroBatchSize::fixed(8));
  EXPECT_EQ(c.training.max_steps, 1000);  // an integral float is an integer
  EXPECT_TRUE(c.training.chunked_loss);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.memory.limit.bytes, 24ull << 30);
  EXPECT_EQ(c.memory.escalation, std::vector<std::string>{"chunked_loss"});
  EXPECT_EQ(c.device.type, "cuda:1");
  EXPECT_EQ(c.device.min_free_memory.bytes, 1048576u);
}

// training.objective=dpo: TRL's names and ranges, the loss types trainer implements, one weight per loss type, and a
// dpo section without the objective is a mistake named as such.
TEST(Config, DpoSettingsAreCheckedWithTheKeyAndWhatIsAllowed) {
  const Config c = parse_config(kMinimal, "test.json", {"training.objective=dpo", "dpo.loss_type=[\"sigmoid\",\"sft\"]",
                                                        "dpo.loss_weights=[1, 0.5]"});
  EXPECT_EQ(c.training.objective, TrainingObjective::kDpo);
  EXPECT_EQ(c.dpo.loss_type, (std::vector<std::string>{"sigmoid", "sft"}));
  EXPECT_EQ(c.dpo.loss_weights, (std::vector<double>{1, 0.5}));
  EXPECT_EQ(parse_config(kMinimal, "test.json", {"training.objective=dpo", "dpo.loss_type=ipo"}).dpo.loss_type,
            std::vector<std::string>{"ipo"});  // one name without the list, as TRL takes a string
  const auto problems = problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d.jsonl"], "packing": true},
      "training": {"objective": "dpo"},
      "dpo": {"beta": 0, "loss_type": ["kto"], "loss_weights": [1, 2], "label_smoothing": 0.5}})");
  EXPECT_TRUE(contains(problem_at(problems, "dpo.beta"), "must be > 0"));
  EXPECT_TRUE(contains(problem_at(problems, "dpo.loss_type"), "'kto' is not one of"));
  EXPECT_TRUE(contains(problem_at(problems, "dpo.loss_weights"), "2 weights for 1 loss types"));
  EXPECT_TRUE(contains(problem_at(problems, "dpo.label_smoothing"), "[0, 0.5)"));
  EXPECT_TRUE(contains(problem_at(problems, "data.packing"), "counts preference pairs"));
  EXPECT_TRUE(contains(problem_at(problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d.jsonl"]},
      "dpo": {"beta": 0.2}})"), "dpo"), "applies only with training.objective=dpo"));
}

TEST(Config, SerialisesBackToTheSameConfig) {
  Config c = parse_config(kMinimal, "test.json");
  c.training.micro_batch_size = MicroBatchSize::fixed(4);
  c.training.batch_size = 8;
  c.memory.limit = parse_byte_size("512MiB");
  c.lora.target_modules = {"q", "v"};
  c.scheduler.name = SchedulerName::kCosine;
  c.optimizer.lr = 1.25e-5;
  const std::string text = config_to_json(c);
  EXPECT_EQ(parse_config(text, "roundtrip.json"), c);
  const auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["memory"]["limit"], "512MiB");
  EXPECT_EQ(j["training"]["micro_batch_size"], 4);
  EXPECT_EQ(j["scheduler"]["name"], "cosine");
  // Sections in the order of the structs, so a saved config reads like the reference.
  EXPECT_LT(text.find("\"model\""), text.find("\"training\""));
  EXPECT_LT(text.find("\"training\""), text.find("\"logging\""));
}

TEST(Config, EveryShippedConfigValidates) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(test::source_path("configs"))) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    EXPECT_NO_THROW(load_config(entry.path().string()));
    ++count;
  }
  EXPECT_GE(count, 4) << "tiny-t5, tiny-qwen2, t5xl and qwen2.5-7b-lora at least";
}

TEST(Config, ShippedConfigsSayWhatTheirIssueAsks) {
  const Config t5xl = load_config(test::source_path("configs/t5xl.json"));
  EXPECT_EQ(t5xl.model.path, "google/flan-t5-xl");  // Hub ids (issue 43)
  EXPECT_EQ(load_config(test::source_path("configs/clip-cars.json")).model.path, "openai/clip-vit-base-patch32");
  EXPECT_EQ(t5xl.precision.mode, PrecisionMode::kBf16);
  EXPECT_TRUE(t5xl.training.activation_checkpointing);
  EXPECT_EQ(t5xl.training.batch_size, 128);
  EXPECT_EQ(t5xl.data.max_input_length, 256);
  EXPECT_EQ(t5xl.data.max_target_length, 512);
  EXPECT_TRUE(contains(t5xl.memory.allocator_conf, "expandable_segments:True"));
  const Config qwen = load_config(test::source_path("configs/qwen2.5-7b-lora.json"));
  EXPECT_EQ(qwen.model.path, "Qwen/Qwen2.5-7B-Instruct");
  EXPECT_TRUE(qwen.lora.enabled);
  EXPECT_EQ(qwen.lora.r, 128);
  EXPECT_EQ(qwen.training.batch_size, 16);
  EXPECT_EQ(qwen.data.max_length, 2048);
  const Config qlora = load_config(test::source_path("configs/qwen2.5-7b-qlora.json"));
  EXPECT_EQ(qlora.model.quantize, QuantizeMode::kNf4);
  EXPECT_EQ(qlora.model.quantize_block_size, 64);
  EXPECT_TRUE(qlora.model.double_quant);
  EXPECT_EQ(qlora.lora.r, 128);
  EXPECT_EQ(qlora.lora.target_modules.size(), 7u);
  EXPECT_EQ(qlora.training.batch_size, 16);
  EXPECT_EQ(qlora.data.max_length, 2048);
}

TEST(ConfigErrors, UnknownKeySuggestsTheClosest) {
  const auto problems = problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
                                         "training": {"batchsize": 8}, "trainig": {}})");
  EXPECT_TRUE(contains(problem_at(problems, "training.batchsize"), "did you mean training.batch_size?"));
  EXPECT_TRUE(contains(problem_at(problems, "trainig"), "did you mean training?"));
}

TEST(ConfigErrors, KeyInTheWrongSectionPointsToTheRightOne) {
  const auto problems = problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
                                         "training": {"lr": 0.001}})");
  EXPECT_TRUE(contains(problem_at(problems, "training.lr"), "did you mean optimizer.lr?"));
}

TEST(ConfigErrors, SecretsAreNeverConfigKeys) {
  const auto problems = problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
                                         "logging": {"webhook_url": "https://example.invalid/x"}})");
  EXPECT_TRUE(contains(problem_at(problems, "logging.webhook_url"), "environment"));
}

TEST(ConfigErrors, WrongTypesNameTheKeyAndWhatWasGiven) {
  const auto problems = problems_of(R"({"model": {"path": 3}, "data": {"train_files": ["d", 7]},
      "training": {"batch_size": "64", "micro_batch_size": "eight", "seed": 1.5, "chunked_loss": "yes"},
      "optimizer": {"lr": "3e-4"}, "precision": {"mode": "bf16mixed"}, "memory": {"limit": "24 gigs"},
      "logging": []})");
  EXPECT_TRUE(contains(problem_at(problems, "model.path"), "expected a string, got integer 3"));
  EXPECT_TRUE(contains(problem_at(problems, "data.train_files"), "item 1"));
  EXPECT_TRUE(contains(problem_at(problems, "training.batch_size"), "without quotes: 64"));
  EXPECT_TRUE(contains(problem_at(problems, "training.micro_batch_size"), "\"auto\" or an integer"));
  EXPECT_TRUE(contains(problem_at(problems, "training.seed"), "expected an integer"));
  EXPECT_TRUE(contains(problem_at(problems, "training.chunked_loss"), "true or false"));
  EXPECT_TRUE(contains(problem_at(problems, "optimizer.lr"), "without quotes: 0.0003"));
  EXPECT_TRUE(contains(problem_at(problems, "precision.mode"), "did you mean 'bf16-mixed'?"));
  EXPECT_TRUE(contains(problem_at(problems, "memory.limit"), "unknown unit 'gigs'"));
  EXPECT_TRUE(contains(problem_at(problems, "logging"), "expected an object"));
}

// fp16 weights are refused with the reason and the mode that works; fp16-mixed is a mode (refused for T5 only when
// the model is loaded: IntegrationFp16.T5IsRefusedWithTheReason); its loss-scale keys are checked.
TEST(ConfigErrors, QuantizeNeedsLoraAndABitsandbytesBlockSizeAndInt8IsAdamWs) {
  auto with = [](const std::string& sections) {
    return problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]}, )" + sections + "}");
  };
  const auto full = with(R"("lora": {"enabled": false}, "training": {"batch_size": 4})");
  EXPECT_TRUE(full.empty());
  const auto no_lora = problems_of(R"({"model": {"path": "m", "quantize": "nf4"}, "data": {"train_files": ["d"]}})");
  EXPECT_TRUE(contains(problem_at(no_lora, "model.quantize"), "lora.enabled=true"));
  EXPECT_TRUE(problems_of(R"({"model": {"path": "m", "quantize": "fp4", "quantize_block_size": 128},
                              "data": {"train_files": ["d"]}, "lora": {"enabled": true}})")
                  .empty());
  const auto block = problems_of(R"({"model": {"path": "m", "quantize": "nf4", "quantize_block_size": 100},
                                     "data": {"train_files": ["d"]}, "lora": {"enabled": true}})");
  EXPECT_TRUE(contains(problem_at(block, "model.quantize_block_size"), "got 100"));
  EXPECT_TRUE(contains(problem_at(problems_of(R"({"model": {"path": "m", "quantize": "int4"}, "data": {"train_files": ["d"]}})"),
                                  "model.quantize"),
                       "nf4"));
  EXPECT_TRUE(contains(problem_at(with(R"("optimizer": {"name": "adafactor", "state_dtype": "int8"})"),
                                  "optimizer.state_dtype"),
                       "AdamW"));
  EXPECT_TRUE(contains(problem_at(with(R"("optimizer": {"state_dtype": "int8"}, "precision": {"mode": "bf16"})"),
                                  "optimizer.state_dtype"),
                       "fp32 parameters"));
  EXPECT_TRUE(with(R"("optimizer": {"state_dtype": "int8"}, "precision": {"mode": "bf16-mixed"})").empty());
}

TEST(ConfigErrors, Fp16WeightsAreRefusedWithTheReasonAndFp16MixedIsAMode) {
  auto with_precision = [](const std::string& precision) {
    return problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]}, "precision": )" + precision + "}");
  };
  for (const char* mode : {"fp16", "half", "float16"}) {
    const auto problem = problem_at(with_precision(std::string(R"({"mode": ")") + mode + R"("})"), "precision.mode");
    EXPECT_TRUE(contains(problem, "refused")) << problem;
    EXPECT_TRUE(contains(problem, "'fp16-mixed'")) << problem;
    EXPECT_TRUE(contains(problem, "T5")) << problem;
  }
  EXPECT_TRUE(contains(problem_at(with_precision(R"({"mode": "16-mixed"})"), "precision.mode"), "'fp16-mixed'"));
  EXPECT_TRUE(with_precision(R"({"mode": "fp16-mixed"})").empty());
  const auto bad = with_precision(R"({"mode": "fp16-mixed", "initial_loss_scale": 0, "loss_scale_growth_interval": 0})");
  EXPECT_TRUE(contains(problem_at(bad, "precision.initial_loss_scale"), "positive")) << problem_at(bad, "precision.initial_loss_scale");
  EXPECT_FALSE(problem_at(bad, "precision.loss_scale_growth_interval").empty());
  const auto defaults = Config{}.precision;
  EXPECT_EQ(defaults.initial_loss_scale, 65536.0);
  EXPECT_EQ(defaults.loss_scale_growth_interval, 2000);
}

TEST(ConfigErrors, TokenBudgetModeExcludesAFixedMicroBatchAndAccumulationSteps) {
  const auto problems = problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
      "training": {"batch_size": 8, "micro_batch_size": 4, "gradient_accumulation_steps": 2,
                   "micro_batch_tokens": 4096}})");
  EXPECT_TRUE(contains(problem_at(problems, "training.micro_batch_size"), "token-budget mode"));
  EXPECT_TRUE(contains(problem_at(problems, "training.gradient_accumulation_steps"), "must be 0"));
  EXPECT_TRUE(contains(problem_at(problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
                                                  "training": {"micro_batch_tokens": -1}})"),
                                  "training.micro_batch_tokens"),
                       "must be at least 0"));
}

TEST(Config, MicroBatchTimesAccumulationStepsIsTheBatchWhenNoBatchSizeIsGiven) {
  const auto config = parse_config(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
      "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 16}})", "test.json", {});
  EXPECT_EQ(config.training.batch_size, 64);
  // Given all three, they must agree.
  EXPECT_TRUE(contains(problem_at(problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]},
      "training": {"batch_size": 32, "micro_batch_size": 4, "gradient_accumulation_steps": 16}})"),
                                  "training.batch_size"),
                       "set batch_size to 64"));
}

TEST(ConfigErrors, EveryProblemIsReportedAtOnce) {
  const auto problems = problems_of(R"({"data": {"bogus": 1}, "training": {"batch_size": 0},
                                         "optimizer": {"lr": -1}})");
  // model.path missing, data.train_files missing, unknown data.bogus, batch_size, lr: five at once.
  EXPECT_EQ(problems.size(), 5u);
  try {
    parse_config(R"({"training": {"batch_size": 0}})", "x.json");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "x.json: 3 problems"));
    EXPECT_EQ(e.exit_code(), kExitUsage);
  }
}

TEST(ConfigErrors, SyntaxErrorsGiveLineAndColumn) {
  const auto problems = problems_of("{\n  \"model\": {\"path\": \"m\"},\n  \"data\": {\"train_files\": [\"d\"],}\n}\n");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(problems[0].where.starts_with("test.json:3:")) << problems[0].where;
  EXPECT_TRUE(contains(problems[0].what, "invalid JSON"));
  EXPECT_TRUE(contains(problem_at(problems_of("[1, 2]"), "test.json"), "expected a JSON object"));
}

TEST(ConfigErrors, ValidationChecksRangesAndConsistency) {
  auto with = [](const std::string& sections) {
    return problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"]}, )" + sections + "}");
  };
  EXPECT_TRUE(contains(problem_at(with(R"("training": {"batch_size": 8, "micro_batch_size": 16})"),
                                  "training.micro_batch_size"),
                       "larger than training.batch_size"));
  EXPECT_TRUE(contains(problem_at(with(R"("training": {"batch_size": 32, "micro_batch_size": 4,
                                            "gradient_accumulation_steps": 4})"),
                                  "training.batch_size"),
                       "set batch_size to 16"));
  EXPECT_TRUE(contains(problem_at(with(R"("training": {"max_steps": 0, "epochs": 0})"), "training.max_steps"),
                       "no length"));
  EXPECT_TRUE(contains(problem_at(with(R"("memory": {"shrink_factor": 1.5})"), "memory.shrink_factor"), "(0, 1)"));
  EXPECT_TRUE(contains(problem_at(with(R"("memory": {"escalation": ["activation_checkpoint"]})"),
                                  "memory.escalation[0]"),
                       "did you mean 'activation_checkpointing'?"));
  // The device moves end the ladder.
  EXPECT_TRUE(contains(problem_at(with(R"("memory": {"escalation": ["move_to_cpu", "chunked_loss"]})"),
                                  "memory.escalation[1]"),
                       "comes after the device move 'move_to_cpu'"));
  EXPECT_TRUE(with(R"("memory": {"escalation": ["chunked_loss", "move_to_other_gpu", "move_to_cpu"]})").empty());
  EXPECT_TRUE(contains(problem_at(with(R"("device": {"type": "gpu"})"), "device.type"), "cuda:N"));
  EXPECT_TRUE(contains(problem_at(with(R"("scheduler": {"warmup_steps": 10, "warmup_ratio": 0.1})"),
                                  "scheduler.warmup_ratio"),
                       "not both"));
  EXPECT_TRUE(contains(problem_at(with(R"("optimizer": {"beta2": 1.0})"), "optimizer.beta2"), "[0, 1)"));
  EXPECT_TRUE(contains(problem_at(with(R"("lora": {"enabled": true, "r": 0})"), "lora.r"), "at least 1"));
  // LoRA on the experts has no dropout (PEFT refuses it there), and lora.dropout defaults to 0.05.
  EXPECT_TRUE(contains(problem_at(with(R"("lora": {"enabled": true, "target_parameters": ["down_proj"]})"),
                                  "lora.dropout"),
                       "set lora.dropout=0"));
  EXPECT_TRUE(with(R"("lora": {"enabled": true, "dropout": 0, "target_parameters": ["down_proj"]})").empty());
  EXPECT_TRUE(contains(problem_at(with(R"("checkpoint": {"keep_last": 0})"), "checkpoint.keep_last"), "at least 1"));
  EXPECT_TRUE(problems_of(kMinimal).empty());
}

TEST(ConfigErrors, KeepBestNeedsAValidationLossAtEveryCheckpoint) {
  auto with = [](const std::string& data, const std::string& sections) {
    return problems_of(R"({"model": {"path": "m"}, "data": {"train_files": ["d"])" + data + "}, " + sections + "}");
  };
  const auto misaligned = with(R"(, "validation_files": ["v"])",
                               R"("evaluation": {"every_steps": 20}, "checkpoint": {"every_steps": 30, "keep_best": true})");
  EXPECT_TRUE(contains(problem_at(misaligned, "checkpoint.keep_best"),
                       "checkpoint.every_steps (30) to be a multiple of evaluation.every_steps (20)"));
  const auto no_data = with("", R"("evaluation": {"every_steps": 10}, "checkpoint": {"every_steps": 30, "keep_best": true})");
  EXPECT_TRUE(contains(problem_at(no_data, "checkpoint.keep_best"), "needs validation data"));
  EXPECT_TRUE(with(R"(, "validation_fraction": 0.1)",
                   R"("evaluation": {"every_steps": 10}, "checkpoint": {"every_steps": 30, "keep_best": true})")
                  .empty());
}

TEST(ConfigOverrides, SetKeysWithTypeChecking) {
  const Config c = parse_config(kMinimal, "test.json",
                                {"training.batch_size=64", "training.micro_batch_size=auto", "model.path=123",
                                 "optimizer.lr=2e-5", "memory.limit=8GiB", "logging.level=debug",
                                 "data.train_files=[\"a.jsonl\",\"b.jsonl\"]", "training.chunked_loss=true"});
  EXPECT_EQ(c.training.batch_size, 64);
  EXPECT_TRUE(c.training.micro_batch_size.is_auto);
  EXPECT_EQ(c.model.path, "123");  // a string key takes the text as it is
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-5);
  EXPECT_EQ(c.memory.limit.bytes, 8ull << 30);
  EXPECT_EQ(c.logging.level, LogLevel::kDebug);
  EXPECT_EQ(c.data.train_files, (std::vector<std::string>{"a.jsonl", "b.jsonl"}));
  EXPECT_TRUE(c.training.chunked_loss);
  // A section the file does not have is created.
  EXPECT_EQ(parse_config(kMinimal, "t", {"lora.r=16"}).lora.r, 16);
}

TEST(ConfigOverrides, BadOverridesNameTheFlag) {
  const auto problems = problems_of(kMinimal, {"training.batch_size=many", "training.bach_size=8", "nonsense",
                                               "optimizer=1", "training.micro_batch_size=0"});
  EXPECT_TRUE(contains(problem_at(problems, "--set training.batch_size=many (training.batch_size)"),
                       "expected an integer"));
  EXPECT_TRUE(contains(problem_at(problems, "--set training.bach_size=8 (training.bach_size)"),
                       "did you mean training.batch_size?"));
  EXPECT_TRUE(contains(problem_at(problems, "--set nonsense"), "section.key=value"));
  EXPECT_TRUE(contains(problem_at(problems, "--set optimizer=1"), "section.key"));
  EXPECT_TRUE(contains(problem_at(problems, "--set training.micro_batch_size=0 (training.micro_batch_size)"),
                       "at least 1"));
}

TEST(ConfigTable, ShowsTheChangedKeysWithTheirDefaultAndOrigin) {
  const std::vector<std::string> overrides = {"training.batch_size=64", "optimizer.lr=0.5"};
  const Config c = parse_config(kMinimal, "test.json", overrides);
  const std::string table = format_config_table(c, "test.json", overrides);
  std::map<std::string, std::string> rows;  // key -> its whole line
  std::istringstream lines(table);
  std::string line;
  while (std::getline(lines, line)) rows[line.substr(0, line.find(' '))] = line;
  ASSERT_TRUE(rows.contains("training.batch_size")) << table;
  EXPECT_TRUE(contains(rows["training.batch_size"], "64"));
  EXPECT_TRUE(contains(rows["training.batch_size"], "32")) << "the default beside the value";
  EXPECT_TRUE(rows["training.batch_size"].ends_with("--set"));
  EXPECT_TRUE(rows["optimizer.lr"].ends_with("--set"));
  ASSERT_TRUE(rows.contains("model.path")) << table;
  EXPECT_TRUE(rows["model.path"].ends_with("test.json")) << "from the file";
  // Keys at their default are left out: they are what --print-config and --help-config are for.
  for (const auto& key : config_keys()) {
    if (!rows.contains(key.path)) {
      EXPECT_FALSE(contains(table, key.path + " ")) << key.path;
    }
  }
  EXPECT_FALSE(rows.contains("memory.shrink_factor")) << table;
  EXPECT_EQ(format_config_table(Config{}), "(every key at its default)\n");
}

TEST(ConfigKeys, TheConfigurationReferenceIsTheGeneratedTable) {
  const std::string doc = "docs/configuration.md";
  std::ifstream file(test::source_path(doc));
  ASSERT_TRUE(file) << doc;
  std::stringstream text;
  text << file.rdbuf();
  std::ostringstream table;
  print_config_reference_markdown(table);
  EXPECT_TRUE(contains(text.str(), table.str()))
      << doc << "'s key table is not what `trainer --help-config-markdown` prints now; regenerate it with "
      << "scripts/update-config-reference";
  for (const auto& key : config_keys())
    EXPECT_TRUE(contains(text.str(), "`" + key.path + "`")) << key.path << " is missing from " << doc;
}

}  // namespace trainer
