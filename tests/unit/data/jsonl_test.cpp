// JSONL files: the offset index and its cache, gzip reading, line numbers, and the on-demand permutation.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "data/jsonl.h"
#include "data/permutation.h"
#include "trainer/errors.h"
#include "unit/data/data_test_support.h"

namespace trainer::data {
namespace {

using test::TempDir;
using test::write_file;

TEST(JsonlIndex, OffsetsOfNonBlankLinesOnly) {
  TempDir dir;
  const std::string path = dir.file("a.jsonl");
  write_file(path, "{\"a\":1}\n\n  \r\n{\"a\":2}\r\n{\"a\":3}");  // blank lines, CRLF, no final newline
  const FileIndex index = index_file(path);
  EXPECT_EQ(index.records, 3u);
  EXPECT_EQ(index.offsets, (std::vector<uint64_t>{0, 13, 22}));
  RandomAccessFile file(path);
  std::string record;
  file.read_record(index.offsets[1], index.offsets[2], record);
  EXPECT_EQ(record, "{\"a\":2}");
  file.read_record(index.offsets[2], index.file_size, record);
  EXPECT_EQ(record, "{\"a\":3}");
  EXPECT_EQ(line_number_at(path, 13), 4u);
}

TEST(JsonlIndex, CacheIsWrittenAndRebuiltWhenTheFileChanges) {
  TempDir dir;
  const std::string path = dir.file("a.jsonl");
  write_file(path, "{\"a\":1}\n{\"a\":2}\n");
  EXPECT_EQ(index_file(path).records, 2u);
  ASSERT_TRUE(std::filesystem::exists(index_cache_path(path)));
  const auto cached_time = std::filesystem::last_write_time(index_cache_path(path));
  EXPECT_EQ(index_file(path).records, 2u);  // from the cache: not rewritten
  EXPECT_EQ(std::filesystem::last_write_time(index_cache_path(path)), cached_time);

  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  write_file(path, "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n");
  const FileIndex rebuilt = index_file(path);
  EXPECT_EQ(rebuilt.records, 3u);
  EXPECT_EQ(rebuilt.offsets.back(), 16u);
  // New content and time: rebuilt again.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  write_file(path, "{\"b\":1}\n\n{\"b\":22}\n{\"c\":3}");
  EXPECT_EQ(index_file(path).offsets, (std::vector<uint64_t>{0, 9, 18}));
}

TEST(JsonlIndex, UnwritableDirectoryKeepsTheIndexInMemory) {
  TempDir dir;
  const std::string path = dir.file("a.jsonl");
  write_file(path, "{\"a\":1}\n");
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  const bool writable_anyway = ::access(dir.path().c_str(), W_OK) == 0;  // root ignores permissions
  EXPECT_EQ(index_file(path).records, 1u);
  if (!writable_anyway) {
    EXPECT_FALSE(std::filesystem::exists(index_cache_path(path)));
  }
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all);
}

TEST(JsonlGzip, ReadsTheSameRecordsWithLineNumbers) {
  TempDir dir;
  const std::string text = "{\"a\":1}\n\n{\"a\":2}\n" + std::string(3 << 20, 'x') + "\n{\"a\":3}\n";
  test::write_gzip(dir.file("a.jsonl.gz"), text);
  const FileIndex index = index_file(dir.file("a.jsonl.gz"));
  EXPECT_TRUE(index.gzip);
  EXPECT_EQ(index.records, 4u);
  EXPECT_TRUE(index.offsets.empty());
  LineReader reader(dir.file("a.jsonl.gz"));
  std::string record;
  uint64_t line = 0, offset = 0;
  std::vector<uint64_t> lines;
  std::vector<std::size_t> sizes;
  while (reader.next(record, line, offset)) {
    lines.push_back(line);
    sizes.push_back(record.size());
  }
  EXPECT_EQ(lines, (std::vector<uint64_t>{1, 3, 4, 5}));
  EXPECT_EQ(sizes, (std::vector<std::size_t>{7, 7, 3u << 20, 7}));  // a line longer than the read buffer
}

// A .gz file cut short (a copy or download that stopped): the reader hands out every complete line, then says the
// stream ended before its end marker, naming the file and the last complete line, instead of reporting the cut-off
// line as invalid JSON. The index (what `trainer data` and training build first) says the same.
TEST(JsonlGzip, TruncatedStreamIsNamedAsSuch) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "{\"text\": \"record " + std::to_string(i) + " with some words in it\"}\n";
  const std::string whole = dir.file("whole.jsonl.gz"), cut = dir.file("cut.jsonl.gz");
  test::write_gzip(whole, text);
  const std::string bytes = test::read_file(whole);
  write_file(cut, bytes.substr(0, bytes.size() / 2));
  LineReader reader(cut);
  std::string record;
  uint64_t line = 0, offset = 0, last = 0;
  try {
    while (reader.next(record, line, offset)) {
      EXPECT_EQ(record.back(), '}') << "line " << line << " handed out incomplete";
      last = line;
    }
    FAIL() << "a truncated gzip stream was read to its end without an error";
  } catch (const DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(cut + ": the gzip stream ends before its end marker (file truncated?)"), std::string::npos)
        << what;
    EXPECT_NE(what.find("the last complete line is line " + std::to_string(last) + ","), std::string::npos) << what;
    EXPECT_NE(std::string(e.hint()).find("gzip -t"), std::string::npos);
  }
  EXPECT_GT(last, 10u);
  EXPECT_LT(last, 2000u);
  EXPECT_THROW(index_file(cut), DataError);
  // The whole file reads to its end; an empty stream cut inside the header has no complete line to name.
  EXPECT_EQ(index_file(whole).records, 2000u);
  write_file(dir.file("header.jsonl.gz"), bytes.substr(0, 12));
  try {
    index_file(dir.file("header.jsonl.gz"));
    FAIL() << "a gzip file cut inside its first block was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("not one complete line was read"), std::string::npos) << e.what();
  }
}

TEST(DataPermutation, IsASeededBijectionWithAnInverse) {
  for (uint64_t n : {1u, 2u, 3u, 10u, 1000u, 4097u}) {
    const Permutation p(n, 42);
    std::set<uint64_t> seen;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t j = p(i);
      ASSERT_LT(j, n);
      seen.insert(j);
      ASSERT_EQ(p.inverse(j), i);
    }
    EXPECT_EQ(seen.size(), n);
  }
  const Permutation a(1000, 1), b(1000, 2);
  int same = 0, fixed = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same += a(i) == b(i);
    fixed += a(i) == i;
  }
  EXPECT_LT(same, 20);
  EXPECT_LT(fixed, 20);
}

}  // namespace
}  // namespace trainer::data
