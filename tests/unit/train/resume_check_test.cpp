// What a resume checks: which setting changes it accepts or refuses, and what counts as changed data.
#include "train/resume_check.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/paths.h"
#include "support/temp_dir.h"
#include "trainer/errors.h"
#include "unit/data/data_test_support.h"

namespace trainer {
namespace {

nlohmann::json as_json(const Config& config) { return nlohmann::json::parse(config_to_json(config)); }

TEST(ResumeCheck, RefusesWhatMakesItAnotherRunAndAcceptsTheRest) {
  for (const char* key : {"model.path", "model.init", "tokenizer.path", "tokenizer.add_eos", "precision.mode",
                          "optimizer.name", "optimizer.state_dtype", "training.batch_size", "training.seed", "lora.r",
                          "lora.alpha", "lora.target_modules", "data.max_length", "data.max_input_length",
                          "data.max_target_length", "data.text_field", "data.on_overlength", "data.shuffle"})
    EXPECT_FALSE(resume_refusal_reason(key).empty()) << key;
  for (const char* key : {"optimizer.lr", "optimizer.weight_decay", "scheduler.name", "scheduler.warmup_steps",
                          "training.max_steps", "training.epochs", "training.micro_batch_size",
                          "training.activation_checkpointing", "evaluation.every_steps", "logging.every_steps",
                          "checkpoint.every_steps", "checkpoint.output_dir", "memory.limit", "device.type",
                          "data.num_workers", "data.train_files", "lora.dropout"})
    EXPECT_TRUE(resume_refusal_reason(key).empty()) << key;
}

// A Hub id resolves to its snapshots/<commit> directory: a branch that moved is named as such, with the way back.
TEST(ResumeCheck, NamesAHubBranchThatMovedToAnotherCommit) {
  const std::string root = "/c/hub/models--org--tiny/snapshots/";
  Config saved;
  saved.model.path = root + std::string(40, 'a');
  Config now = saved;
  now.model.path = root + std::string(40, 'b');
  const auto changes = config_changes(as_json(saved), as_json(now));
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].refused_because.find("org/tiny moved from commit " + std::string(40, 'a')), std::string::npos)
      << changes[0].refused_because;
  EXPECT_NE(changes[0].refused_because.find("model.path=org/tiny@" + std::string(40, 'a')), std::string::npos);
  EXPECT_THROW(check_resume_config(as_json(saved), now, "ckpt", false), UsageError);
}

TEST(ResumeCheck, ListsEveryChangedKeyInConfigOrder) {
  Config saved;
  saved.model.path = "m";
  Config now = saved;
  now.optimizer.lr = 2e-4;
  now.training.max_steps = 30;
  now.precision.mode = PrecisionMode::kBf16;
  const auto changes = config_changes(as_json(saved), as_json(now));
  ASSERT_EQ(changes.size(), 3u);
  EXPECT_EQ(changes[0].key, "training.max_steps");
  EXPECT_EQ(changes[0].before, "0");
  EXPECT_EQ(changes[0].after, "30");
  EXPECT_TRUE(changes[0].refused_because.empty());
  EXPECT_EQ(changes[1].key, "optimizer.lr");
  EXPECT_EQ(changes[2].key, "precision.mode");
  EXPECT_EQ(changes[2].before, "\"fp32\"");
  EXPECT_EQ(changes[2].after, "\"bf16\"");
  EXPECT_FALSE(changes[2].refused_because.empty());
  // A key only one side knows (a config of another trainer release) is not a change.
  auto older = as_json(saved);
  older["optimizer"].erase("state_dtype");
  older["memory"]["retired_key"] = 1;
  now = saved;
  now.optimizer.state_dtype = StateDtype::kBf16;
  EXPECT_TRUE(config_changes(older, as_json(now)).empty());

  // Accepted changes pass; a refused one is a usage error naming key and both values, unless allowed.
  Config accepted = saved;
  accepted.optimizer.lr = 5e-4;
  EXPECT_NO_THROW(check_resume_config(as_json(saved), accepted, "ckpt", false));
  Config refused = accepted;
  refused.training.seed = 7;
  try {
    check_resume_config(as_json(saved), refused, "ckpt", false);
    FAIL() << "a changed seed was accepted";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("training.seed: checkpoint 42, now 7"), std::string::npos) << what;
    EXPECT_EQ(what.find("optimizer.lr:"), std::string::npos) << "accepted keys are not refused: " << what;
    EXPECT_NE(std::string(e.hint()).find("--allow-config-change"), std::string::npos);
  }
  EXPECT_NO_THROW(check_resume_config(as_json(saved), refused, "ckpt", true));
}

nlohmann::json file_entry(const std::string& path, int size, int64_t mtime, int records) {
  return {{"path", path}, {"size", size}, {"mtime_ns", mtime}, {"records", records}};
}

nlohmann::json fingerprint(nlohmann::json files, int train_records, const std::string& tokenizer_hash = "aa") {
  return {{"train_files", std::move(files)},
          {"train_records", train_records},
          {"tokenizer_files", {{{"path", "/m/tokenizer.json"}, {"size", 10}, {"fnv1a64", tokenizer_hash}}}}};
}

TEST(ResumeCheck, NamesWhatChangedInTheData) {
  const auto a = file_entry("/d/a.jsonl", 1000, 1, 10), b = file_entry("/d/b.jsonl", 500, 1, 5);
  const auto saved = fingerprint({a, b}, 15);
  std::vector<std::string> warnings;
  EXPECT_TRUE(data_changes(saved, saved, warnings).empty());
  EXPECT_TRUE(warnings.empty());

  // Records appended to a file: both sizes and record counts are named.
  auto grown = fingerprint({file_entry("/d/a.jsonl", 1500, 2, 15), b}, 20);
  auto changes = data_changes(saved, grown, warnings);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0], "/d/a.jsonl: 10 records (1000 bytes) in the checkpoint, 15 records (1500 bytes) now");

  // A file added, a file gone.
  changes = data_changes(saved, fingerprint({a, file_entry("/d/c.jsonl", 9, 1, 1)}, 11), warnings);
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_NE(changes[0].find("/d/b.jsonl: trained on in the checkpoint (5 records"), std::string::npos) << changes[0];
  EXPECT_NE(changes[1].find("/d/c.jsonl: new among the train files (1 records"), std::string::npos) << changes[1];

  // The same files in another order number the records differently.
  changes = data_changes(saved, fingerprint({b, a}, 15), warnings);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("another order"), std::string::npos);

  // Another validation split over the same files.
  changes = data_changes(saved, fingerprint({a, b}, 13), warnings);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("the training part holds 13 records now, 15 in the checkpoint"), std::string::npos);

  // The tokenizer's bytes changed under the same name.
  changes = data_changes(saved, fingerprint({a, b}, 15, "bb"), warnings);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("/m/tokenizer.json: the tokenizer file changed"), std::string::npos) << changes[0];

  // What leaves the epoch order intact only warns: a touched file of the same size and records, moved files.
  warnings.clear();
  EXPECT_TRUE(data_changes(saved, fingerprint({file_entry("/d/a.jsonl", 1000, 9, 10), b}, 15), warnings).empty());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("/d/a.jsonl was modified"), std::string::npos);
  warnings.clear();
  EXPECT_TRUE(data_changes(saved, fingerprint({file_entry("/e/a.jsonl", 1000, 3, 10), file_entry("/e/b.jsonl", 500, 3, 5)}, 15),
                           warnings).empty());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("another place"), std::string::npos);
}

TEST(ResumeCheck, DataChangeIsADataErrorUnlessAllowedAndOldCheckpointsPass) {
  const auto saved = fingerprint({file_entry("/d/a.jsonl", 1000, 1, 10)}, 10);
  const auto now = fingerprint({file_entry("/d/a.jsonl", 1200, 2, 12)}, 12);
  const nlohmann::json state = {{"step", 4}, {"data_fingerprint", saved}};
  EXPECT_FALSE(check_resume_data(state, saved, "ckpt", false));
  try {
    check_resume_data(state, now, "ckpt", false);
    FAIL() << "changed data was accepted";
  } catch (const DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the data changed since ckpt was written"), std::string::npos) << what;
    EXPECT_NE(what.find("/d/a.jsonl: 10 records (1000 bytes) in the checkpoint, 12 records (1200 bytes) now"),
              std::string::npos) << what;
    EXPECT_NE(std::string(e.hint()).find("--allow-data-change"), std::string::npos);
  }
  EXPECT_TRUE(check_resume_data(state, now, "ckpt", true));
  EXPECT_FALSE(check_resume_data(nlohmann::json{{"step", 4}}, now, "ckpt", false));  // older checkpoint: warns

  // With changed data the loader goes on at the next epoch's start (this one's, at an epoch boundary).
  EXPECT_EQ(new_epoch_cursor({2, 17, 5}), (LoaderCursor{3, 0, 5}));
  EXPECT_EQ(new_epoch_cursor({2, 0, 5}), (LoaderCursor{2, 0, 5}));
}

TEST(ResumeCheck, FingerprintOfRealFilesAndTokenizer) {
  test::TempDir dir;
  test::write_file(dir.file("a.jsonl"), test::seq2seq_lines(12));
  test::write_gzip(dir.file("b.jsonl.gz"), test::seq2seq_lines(5));
  Config config = test::seq2seq_config({dir.file("a.jsonl"), dir.file("b.jsonl.gz")});
  const auto& tokenizer = test::t5_tokenizer();
  const auto fp = data_fingerprint(config, tokenizer);
  ASSERT_EQ(fp["train_files"].size(), 2u);
  EXPECT_EQ(fp["train_files"][0]["path"], dir.file("a.jsonl"));
  EXPECT_EQ(fp["train_files"][0]["records"], 12);
  EXPECT_EQ(fp["train_files"][0]["size"], std::filesystem::file_size(dir.file("a.jsonl")));
  EXPECT_EQ(fp["train_files"][1]["records"], 5);
  EXPECT_EQ(fp["train_records"], 17);
  ASSERT_GE(fp["tokenizer_files"].size(), 1u);
  EXPECT_EQ(fp["tokenizer_files"][0]["path"], test::source_path("configs/models/tiny-t5/spiece.model"));
  EXPECT_EQ(fp["tokenizer_files"][0]["fnv1a64"].get<std::string>().size(), 16u);
  // The same inputs give the same fingerprint; a held-out fraction shrinks the training part only.
  EXPECT_EQ(data_fingerprint(config, tokenizer), fp);
  config.data.validation_fraction = 0.25;
  EXPECT_EQ(data_fingerprint(config, tokenizer)["train_records"], 17 - 4);
  // One more record appended is a change that names the file.
  test::write_file(dir.file("a.jsonl"), test::seq2seq_lines(13));
  config.data.validation_fraction = 0;
  std::vector<std::string> warnings;
  const auto changes = data_changes(fp, data_fingerprint(config, tokenizer), warnings);
  ASSERT_EQ(changes.size(), 1u);  // the file (the training part's size follows from it)
  EXPECT_NE(changes[0].find(dir.file("a.jsonl") + ": 12 records"), std::string::npos) << changes[0];
}

}  // namespace
}  // namespace trainer
