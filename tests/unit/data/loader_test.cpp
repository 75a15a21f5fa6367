// The loader: bad-record policy with file:line, counting, determinism across worker counts, seeded shuffling,
// exact resume, length grouping, the validation split, gzip streaming and bounded memory.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"
#include "unit/data/data_test_support.h"

namespace trainer {
namespace {

using test::seq2seq_config;
using test::seq2seq_lines;
using test::t5_tokenizer;
using test::TempDir;
using test::trace;
using test::write_file;

std::set<uint64_t> all_sources(const test::BatchTrace& t) {
  std::set<uint64_t> s;
  for (const auto& b : t.sources) s.insert(b.begin(), b.end());
  return s;
}

TEST(LoaderBadRecords, ErrorPolicyStopsWithFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("train.jsonl");
  write_file(path, seq2seq_lines(5) + "\n{\"input\": \"x\", \"target\": 5}\n" + seq2seq_lines(3));
  Config config = seq2seq_config({path}, 4);
  config.data.shuffle = true;  // found by offset in a shuffled order, still reported at its line
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  try {
    while (loader->next()) {
    }
    FAIL() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()), path + ":7: field \"target\" must be a string, not number");
    EXPECT_NE(e.hint().find("on_bad_record"), std::string::npos);
    EXPECT_EQ(e.exit_code(), kExitData);
  }
}

TEST(LoaderBadRecords, SkipPolicyCountsAndKeepsTheFirstProblems) {
  TempDir dir;
  const std::string path = dir.file("train.jsonl.gz");
  test::write_gzip(path, seq2seq_lines(3) + "not json\n{\"input\": \"x\"}\n" + seq2seq_lines(3) +
                             "{\"input\": \"x\", \"target\": \"\"}\n");
  Config config = seq2seq_config({path}, 2);
  config.data.on_bad_record = BadRecordPolicy::kSkip;
  config.data.shuffle = false;
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  const auto t = trace(*loader);
  const DataStats s = loader->stats();
  EXPECT_EQ(s.records_read, 9);
  EXPECT_EQ(s.examples, 6);
  EXPECT_EQ(s.bad_records_skipped, 3);
  ASSERT_EQ(s.first_problems.size(), 3u);
  EXPECT_EQ(s.first_problems[0].rfind(path + ":4: invalid JSON", 0), 0u) << s.first_problems[0];
  EXPECT_EQ(s.first_problems[1], path + ":5: missing field \"target\"");
  EXPECT_EQ(s.first_problems[2], path + ":9: empty target (field \"target\")");
  EXPECT_EQ(t.sources.size(), 3u);  // 6 examples in batches of 2
}

TEST(LoaderLengths, TruncatedAndSkippedAreCounted) {
  TempDir dir;
  const std::string path = dir.file("train.jsonl");
  write_file(path, seq2seq_lines(14));  // inputs grow with i % 7
  Config config = seq2seq_config({path}, 4);
  config.data.max_input_length = 16;
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  trace(*loader);
  const DataStats truncated = loader->stats();
  EXPECT_GT(truncated.truncated, 0);
  EXPECT_EQ(truncated.examples, 14);
  config.data.on_overlength = OverlengthPolicy::kSkip;
  loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  trace(*loader);
  EXPECT_EQ(loader->stats().overlength_skipped, truncated.truncated);
  EXPECT_EQ(loader->stats().examples, 14 - truncated.truncated);
}

// A run by steps has no epoch limit: an epoch without one usable example would repeat forever (it did, ignoring
// SIGTERM). It stops with the counts and the first problem instead.
TEST(LoaderLengths, AnEpochWithoutOneUsableExampleStopsInsteadOfRepeating) {
  TempDir dir;
  const std::string path = dir.file("train.jsonl");
  write_file(path, seq2seq_lines(6));
  Config config = seq2seq_config({path}, 2);
  config.data.max_input_length = 2;
  config.data.on_overlength = OverlengthPolicy::kSkip;
  config.training.max_steps = 10;  // epochs without end
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  try {
    loader->next();
    FAIL() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("no usable example in a whole epoch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("6 over-length records skipped; the first: " + path), std::string::npos)
        << e.what();
    EXPECT_NE(e.hint().find("data.max_length"), std::string::npos);
  }
}

TEST(LoaderDeterminism, SameBatchesForAnyNumberOfWorkers) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(300));
  write_file(dir.file("b.jsonl"), seq2seq_lines(123, 300));
  for (bool group : {false, true}) {
    Config config = seq2seq_config({dir.file("*.jsonl")}, 8);
    config.data.group_by_length = group;
    config.training.epochs = 2;
    config.data.num_workers = 0;
    auto reference = trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq));
    EXPECT_EQ(all_sources(reference).size(), 423u);
    for (int workers : {1, 4}) {
      config.data.num_workers = workers;
      EXPECT_EQ(trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq)), reference)
          << workers << " workers, group_by_length " << group;
    }
  }
}

// Indexed files (a seeded permutation) and gzip files (a seeded shuffle buffer) alike.
TEST(LoaderShuffle, SeededEveryRecordOncePerEpochAndEpochsDiffer) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(200));
  test::write_gzip(dir.file("a.jsonl.gz"), seq2seq_lines(200));
  for (const char* file : {"a.jsonl", "a.jsonl.gz"}) {
  SCOPED_TRACE(file);
  Config config = seq2seq_config({dir.file(file)}, 10);
  config.training.epochs = 2;
  const auto a = trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq));
  const auto b = trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq));
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.sources.size(), 40u);
  // Epoch 0 and 1 both see all 200 records, in different orders; the ids differ too (slot != record).
  std::vector<std::vector<int32_t>> epoch0, epoch1;
  for (std::size_t i = 0; i < 40; ++i)
    for (const auto& ids : a.ids[i]) (a.epochs[i] == 0 ? epoch0 : epoch1).push_back(ids);
  EXPECT_EQ(epoch0.size(), 200u);
  EXPECT_NE(epoch0, epoch1);
  auto sorted0 = epoch0, sorted1 = epoch1;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  EXPECT_EQ(sorted0, sorted1);
  config.training.seed = 8;
  EXPECT_NE(trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq)).ids, a.ids);
  config.data.shuffle = false;
  const auto in_order = trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq), 1);
  EXPECT_EQ(in_order.sources[0], (std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  std::vector<std::vector<int32_t>> first_ten(epoch0.begin(), epoch0.begin() + 10);
  EXPECT_NE(first_ten, in_order.ids[0]) << "a shuffled epoch does not start in file order";
  }
}

// Takes n batches, saves the cursor (through JSON, as a checkpoint does), and checks a new loader restored
// from it gives exactly the batches the uninterrupted loader gives next.
void expect_exact_resume(const Config& config, std::size_t n) {
  const auto uninterrupted = trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq));
  ASSERT_GT(uninterrupted.sources.size(), n);
  auto first = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  trace(*first, n);
  const nlohmann::json saved = cursor_to_json(first->cursor());
  auto resumed = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  resumed->restore(cursor_from_json(nlohmann::json::parse(saved.dump())));
  const auto rest = trace(*resumed);
  ASSERT_EQ(rest.sources.size(), uninterrupted.sources.size() - n);
  for (std::size_t i = 0; i < rest.sources.size(); ++i) {
    EXPECT_EQ(rest.ids[i], uninterrupted.ids[n + i]) << "batch " << n + i;
    EXPECT_EQ(rest.epochs[i], uninterrupted.epochs[n + i]);
  }
}

TEST(LoaderResume, RestoredCursorYieldsExactlyTheUnseenBatches) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(157) + "{\"bad\": 1}\n" + seq2seq_lines(40, 157));
  test::write_gzip(dir.file("a.jsonl.gz"), seq2seq_lines(157) + "{\"bad\": 1}\n" + seq2seq_lines(40, 157));
  for (const char* file : {"a.jsonl", "a.jsonl.gz"})
    for (bool group : {false, true})
      for (std::size_t n : {1u, 7u, 13u, 26u}) {
        SCOPED_TRACE(std::string(file) + (group ? " grouped" : "") + " after " + std::to_string(n));
        Config config = seq2seq_config({dir.file(file)}, 8);
        config.data.on_bad_record = BadRecordPolicy::kSkip;
        config.data.group_by_length = group;
        config.training.epochs = 2;
        expect_exact_resume(config, n);
      }
}

TEST(LoaderCursor, JsonRoundTripAndMalformedCursor) {
  const LoaderCursor cursor{3, 12345, 42};
  EXPECT_EQ(cursor_from_json(cursor_to_json(cursor)), cursor);
  EXPECT_THROW(cursor_from_json(nlohmann::json::parse(R"({"epoch": 1, "seed": 2})")), DataError);
  EXPECT_THROW(cursor_from_json(nlohmann::json::parse(R"({"epoch": -1, "position": 0, "seed": 2})")), DataError);
  EXPECT_THROW(cursor_from_json(nlohmann::json::parse(R"([1, 2, 3])")), DataError);
}

TEST(LoaderGroupByLength, LongestBatchFirstAndSimilarLengthsTogether) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(400));
  Config config = seq2seq_config({dir.file("a.jsonl")}, 4);
  config.data.group_by_length = true;
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  std::vector<std::vector<std::size_t>> lengths;
  while (auto batch = loader->next()) {
    std::vector<std::size_t> l;
    for (const auto& e : batch->examples) l.push_back(e.input_ids.size() + e.labels.size());
    lengths.push_back(l);
  }
  ASSERT_EQ(lengths.size(), 100u);
  std::size_t longest = 0;
  for (const auto& b : lengths) longest = std::max(longest, *std::max_element(b.begin(), b.end()));
  EXPECT_EQ(lengths[0][0], longest);
  // Within a batch lengths are close (at most one step of ~7 tokens between the record lengths, where a batch
  // straddles two), against ~40 for unsorted batches; across batches the order is shuffled, not sorted.
  std::size_t spread = 0;
  for (const auto& b : lengths) spread = std::max(spread, b.front() - b.back());
  EXPECT_LE(spread, 10u);
  bool sorted = true;
  for (std::size_t i = 2; i < 50; ++i) sorted = sorted && lengths[i - 1][0] >= lengths[i][0];
  EXPECT_FALSE(sorted);
}

TEST(LoaderValidation, HeldOutFractionIsStableAndDisjointFromTrain) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(500));
  Config config = seq2seq_config({dir.file("a.jsonl")}, 16);
  config.data.validation_fraction = 0.1;
  auto train = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  EXPECT_EQ(train->examples_per_epoch(), 450u);
  auto validation = make_validation_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq, 16);
  ASSERT_TRUE(validation);
  EXPECT_EQ(validation->examples_per_epoch(), 50u);
  auto ids_of = [](const test::BatchTrace& t) {
    std::set<std::vector<int32_t>> s;
    for (const auto& b : t.ids) s.insert(b.begin(), b.end());
    return s;
  };
  const auto train_ids = ids_of(trace(*train));
  const auto validation_ids = ids_of(trace(*validation));
  EXPECT_EQ(train_ids.size(), 450u);
  EXPECT_EQ(validation_ids.size(), 50u);
  for (const auto& ids : validation_ids) EXPECT_EQ(train_ids.count(ids), 0u);
  // The same records are held out on every run, with shuffling or without.
  config.data.shuffle = false;
  EXPECT_EQ(ids_of(trace(*make_validation_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq, 16))),
            validation_ids);
  EXPECT_EQ(ids_of(trace(*make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq))), train_ids);
  // Validation files, when given, win over the fraction; and no validation data gives no loader.
  write_file(dir.file("v.jsonl"), seq2seq_lines(3));
  config.data.validation_files = {dir.file("v.jsonl")};
  EXPECT_EQ(make_validation_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq, 16)->examples_per_epoch(), 3u);
  EXPECT_EQ(make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq)->examples_per_epoch(), 500u);
  config.data.validation_files.clear();
  config.data.validation_fraction = 0;
  EXPECT_EQ(make_validation_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq, 16), nullptr);
}

TEST(LoaderFiles, GlobMatchingNothingIsADataError) {
  Config config = seq2seq_config({"/nonexistent/dir/*.jsonl"});
  EXPECT_THROW(make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq), DataError);
}

TEST(LoaderFiles, AGlobOverTheDataDirectoryLeavesTheIndexCachesOut) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(10));
  Config config = seq2seq_config({dir.file("a.jsonl")}, 4);
  make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq)->next();  // writes a.jsonl.idx beside it
  ASSERT_TRUE(std::filesystem::exists(dir.file("a.jsonl") + ".idx"));
  config.data.train_files = {(dir.path() / "*").string()};
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  EXPECT_EQ(loader->examples_per_epoch(), 10u);
  config.data.train_files = {(dir.path() / "*.idx").string()};
  EXPECT_THROW(make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq), DataError);
}

TEST(LoaderTargetTokens, CountedBeforeAnySplit) {
  TempDir dir;
  write_file(dir.file("a.jsonl"), seq2seq_lines(10));
  Config config = seq2seq_config({dir.file("a.jsonl")}, 4);
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  auto batch = loader->next();
  ASSERT_TRUE(batch);
  int64_t expected = 0;
  for (const auto& e : batch->examples) expected += static_cast<int64_t>(e.labels.size());
  EXPECT_EQ(batch->target_tokens, expected);
}

int64_t rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return 0;
}

TEST(LoaderMemory, StreamingALargeFileKeepsResidentMemoryFlat) {
  TempDir dir;
  const std::string path = dir.file("big.jsonl");
  {
    std::ofstream out(path);
    const std::string filler(300, 'x');  // ~360 bytes per record: 72 MB for 200k records
    for (int i = 0; i < 200000; ++i)
      out << R"({"input_ids": [)" << i % 200 << R"(, 2, 3], "labels": [4], "note": ")" << filler << "\"}\n";
  }
  Config config = seq2seq_config({path}, 64);
  auto loader = make_train_loader(config, t5_tokenizer(), DataFamily::kSeq2Seq);
  for (int i = 0; i < 100; ++i) loader->next();
  const int64_t warm = rss_kib();
  int64_t examples = 0;
  while (auto batch = loader->next()) examples += static_cast<int64_t>(batch->examples.size());
  const int64_t growth = rss_kib() - warm;
  EXPECT_EQ(examples, 200000 - 6400);
  EXPECT_LT(growth, 16 * 1024) << "RSS grew " << growth << " KiB while streaming 72 MB";
}

}  // namespace
}  // namespace trainer
