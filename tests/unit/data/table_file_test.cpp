// Parquet and Arrow IPC files (data/table_file.h) and their epochs (data/dataset.h): rows as JSON records, row
// groups from the metadata, the seeded group-and-row order, resume from any slot, held-out splits, bad files.
// The files are written here with Arrow's own writers.
#include <gtest/gtest.h>

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/io/memory.h>
#include <arrow/ipc/writer.h>
#include <arrow/json/reader.h>
#include <parquet/arrow/writer.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "data/dataset.h"
#include "data/table_file.h"
#include "support/temp_dir.h"
#include "trainer/errors.h"

namespace trainer::data {
namespace {

using test::TempDir;

// A table from JSON lines, with the types Arrow infers (int64, double, string, bool, lists, structs).
std::shared_ptr<arrow::Table> table_of(const std::string& lines) {
  auto input = std::make_shared<arrow::io::BufferReader>(arrow::Buffer::FromString(lines));
  auto reader = arrow::json::TableReader::Make(arrow::default_memory_pool(), input, arrow::json::ReadOptions::Defaults(),
                                               arrow::json::ParseOptions::Defaults())
                    .ValueOrDie();
  return reader->Read().ValueOrDie();
}

void write_parquet(const std::shared_ptr<arrow::Table>& table, const std::string& path, std::int64_t group_rows) {
  auto out = arrow::io::FileOutputStream::Open(path).ValueOrDie();
  ASSERT_TRUE(parquet::arrow::WriteTable(*table, arrow::default_memory_pool(), out, group_rows).ok());
  ASSERT_TRUE(out->Close().ok());
}

void write_ipc(const std::shared_ptr<arrow::Table>& table, const std::string& path, std::int64_t batch_rows,
               bool stream) {
  auto out = arrow::io::FileOutputStream::Open(path).ValueOrDie();
  auto writer = stream ? arrow::ipc::MakeStreamWriter(out, table->schema()).ValueOrDie()
                       : arrow::ipc::MakeFileWriter(out, table->schema()).ValueOrDie();
  ASSERT_TRUE(writer->WriteTable(*table, batch_rows).ok());
  ASSERT_TRUE(writer->Close().ok());
  ASSERT_TRUE(out->Close().ok());
}

std::string numbered_rows(int n) {
  std::string lines;
  for (int i = 0; i < n; ++i) lines += "{\"i\": " + std::to_string(i) + ", \"text\": \"row " + std::to_string(i) + "\"}\n";
  return lines;
}

TEST(TableFile, RowsAreTheJsonObjectsOfTheirColumns) {
  TempDir dir;
  const std::string lines =
      R"({"n": 3, "x": 0.25, "s": "a \"q\" \\ \n é 🍮", "b": true, "ids": [1, 2], "none": null, )"
      R"("messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
      "\n"
      R"({"n": -4, "x": 1e300, "s": "", "b": false, "ids": [], "none": null, "messages": []})"
      "\n";
  auto table = table_of(lines);
  // float32 and dictionary-encoded columns, as pyarrow and datasets write them
  arrow::FloatBuilder floats;
  ASSERT_TRUE(floats.AppendValues({0.1f, -2.5f}).ok());
  arrow::StringDictionaryBuilder labels;
  ASSERT_TRUE(labels.Append("cat").ok() && labels.Append("dog").ok());
  table = table->AddColumn(table->num_columns(), arrow::field("f", arrow::float32()),
                           std::make_shared<arrow::ChunkedArray>(floats.Finish().ValueOrDie()))
              .ValueOrDie();
  auto dictionary = labels.Finish().ValueOrDie();
  table = table->AddColumn(table->num_columns(), arrow::field("label", dictionary->type()),
                           std::make_shared<arrow::ChunkedArray>(dictionary))
              .ValueOrDie();
  for (const char* name : {"t.parquet", "t.arrow", "t-stream.arrow"}) {
    const std::string path = dir.file(name);
    if (std::string(name) == "t.parquet") write_parquet(table, path, 1);
    else write_ipc(table, path, 1, std::string(name) == "t-stream.arrow");
    TableReader reader(path);
    ASSERT_EQ(reader.groups(), 2u) << name;
    std::vector<std::string> rows, all;
    for (std::size_t g = 0; g < reader.groups(); ++g) {
      reader.read_group(g, rows);
      ASSERT_EQ(rows.size(), reader.group_rows(g));
      all.insert(all.end(), rows.begin(), rows.end());
    }
    ASSERT_EQ(all.size(), 2u);
    auto first = nlohmann::json::parse(all[0]);
    auto second = nlohmann::json::parse(all[1]);
    EXPECT_EQ(first["n"], 3);
    EXPECT_EQ(first["x"], 0.25);
    EXPECT_EQ(first["s"], "a \"q\" \\ \n é 🍮");
    EXPECT_EQ(first["b"], true);
    EXPECT_EQ(first["ids"], nlohmann::json::array({1, 2}));
    EXPECT_TRUE(first["none"].is_null());
    EXPECT_EQ(first["messages"], nlohmann::json::parse(R"([{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}])"));
    EXPECT_EQ(first["f"], static_cast<double>(0.1f)) << name;  // the float32's exact value, as to_pylist gives it
    EXPECT_EQ(first["label"], "cat");
    EXPECT_EQ(second["n"], -4);
    EXPECT_EQ(second["x"], 1e300);
    EXPECT_EQ(second["ids"], nlohmann::json::array());
    EXPECT_EQ(second["label"], "dog");
    EXPECT_EQ(second["f"], -2.5);
  }
}

// Whether two JSON values have the same types throughout (integer, unsigned, real), not only equal values.
bool same_types(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.type() != b.type() || a.size() != b.size()) return false;
  if (a.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it)
      if (!b.contains(it.key()) || !same_types(it.value(), b[it.key()])) return false;
  } else if (a.is_array()) {
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!same_types(a[i], b[i])) return false;
  }
  return true;
}

TEST(TableFile, RowObjectsAreWhatParsingTheRenderedRowsGives) {
  // The loader maps rows from their Arrow values (TableRows::object) instead of rendering and parsing them again:
  // the values and their JSON types must be the parser's (a real that is integral is an integer, -0 too; NaN null).
  TempDir dir;
  const std::string lines =
      R"({"n": 3, "x": 1.0, "s": "a \"q\" \\ \n é 🍮", "b": true, "ids": [1, -2], "none": null, "m": {"k": [0.5]}})"
      "\n"
      R"({"n": -4, "x": -0.0, "s": "", "b": false, "ids": [], "none": null, "m": {"k": []}})"
      "\n"
      R"({"n": 9007199254740993, "x": 1e300, "s": "x", "b": null, "ids": null, "none": null, "m": null})"
      "\n";
  auto table = table_of(lines);
  arrow::FloatBuilder floats;
  ASSERT_TRUE(floats.AppendValues({0.1f, 100000.0f, std::nanf("")}).ok());
  table = table->AddColumn(table->num_columns(), arrow::field("f", arrow::float32()),
                           std::make_shared<arrow::ChunkedArray>(floats.Finish().ValueOrDie()))
              .ValueOrDie();
  for (const char* name : {"o.parquet", "o.arrow"}) {
    const std::string path = dir.file(name);
    if (std::string(name) == "o.parquet") write_parquet(table, path, 2);
    else write_ipc(table, path, 2, false);
    TableReader reader(path);
    std::size_t rows = 0;
    for (std::size_t g = 0; g < reader.groups(); ++g) {
      const auto group = reader.load_group(g);
      EXPECT_TRUE(group->has_column("ids"));
      EXPECT_FALSE(group->has_column("messages"));
      for (std::uint64_t r = 0; r < group->size(); ++r, ++rows) {
        std::string text;
        group->render(r, text);
        nlohmann::json object;
        ASSERT_TRUE(group->object(r, object)) << name << " " << text;
        const auto parsed = nlohmann::json::parse(text);
        EXPECT_EQ(object, parsed) << name << " " << text;
        EXPECT_TRUE(same_types(object, parsed)) << name << " " << text << " vs " << object.dump();
      }
    }
    EXPECT_EQ(rows, 3u);
  }
}

TEST(TableFile, IndexHasEachRowGroupsRows) {
  TempDir dir;
  auto table = table_of(numbered_rows(10));
  write_parquet(table, dir.file("a.parquet"), 4);
  write_ipc(table, dir.file("b.arrow"), 3, /*stream=*/true);
  write_ipc(table, dir.file("c.arrow"), 6, /*stream=*/false);
  EXPECT_EQ(index_table_file(dir.file("a.parquet")).group_rows, (std::vector<std::uint64_t>{4, 4, 2}));
  EXPECT_EQ(index_table_file(dir.file("b.arrow")).group_rows, (std::vector<std::uint64_t>{3, 3, 3, 1}));
  const FileIndex c = index_table_file(dir.file("c.arrow"));
  EXPECT_EQ(c.group_rows, (std::vector<std::uint64_t>{6, 4}));
  EXPECT_EQ(c.records, 10u);
  EXPECT_TRUE(c.table);
  EXPECT_EQ(table_row_location(index_table_file(dir.file("a.parquet")), 9), dir.file("a.parquet") + ": row 9 (row group 2)");
}

// The `i` of every record of an epoch from `start` on.
std::vector<int> epoch_rows(const std::shared_ptr<Dataset>& dataset, bool shuffle, std::int64_t epoch,
                            std::uint64_t start) {
  auto stream = open_epoch(dataset, shuffle, 42, epoch, start);
  std::vector<int> out;
  RawRecord record;
  std::uint64_t slot = start;
  while (stream->next(record)) {
    EXPECT_EQ(record.slot, slot++);
    std::string scratch;
    out.push_back(nlohmann::json::parse(record.json(scratch))["i"].get<int>() + (record.file ? 1000 : 0));
  }
  return out;
}

TEST(TableEpochs, EveryRowOncePerEpochInASeededOrderThatResumesFromAnySlot) {
  TempDir dir;
  write_parquet(table_of(numbered_rows(23)), dir.file("a.parquet"), 4);
  write_ipc(table_of(numbered_rows(7)), dir.file("b.arrow"), 3, /*stream=*/true);
  auto dataset = open_dataset({dir.file("a.parquet"), dir.file("b.arrow")}, Dataset::Subset::kAll, 0.0, 0);
  ASSERT_TRUE(dataset->grouped);
  ASSERT_EQ(dataset->size(), 30u);
  std::vector<int> in_order;
  for (int i = 0; i < 23; ++i) in_order.push_back(i);
  for (int i = 0; i < 7; ++i) in_order.push_back(1000 + i);
  EXPECT_EQ(epoch_rows(dataset, false, 0, 0), in_order);
  const auto first = epoch_rows(dataset, true, 0, 0);
  const auto second = epoch_rows(dataset, true, 1, 0);
  EXPECT_NE(first, in_order);
  EXPECT_NE(first, second);
  EXPECT_EQ(std::multiset<int>(first.begin(), first.end()), std::multiset<int>(in_order.begin(), in_order.end()));
  EXPECT_EQ(std::multiset<int>(second.begin(), second.end()), std::multiset<int>(in_order.begin(), in_order.end()));
  EXPECT_EQ(epoch_rows(dataset, true, 0, 0), first);  // seeded: the same order again
  for (std::uint64_t start = 0; start <= 30; ++start) {
    EXPECT_EQ(epoch_rows(dataset, true, 0, start), std::vector<int>(first.begin() + static_cast<long>(start), first.end()))
        << start;
    EXPECT_EQ(epoch_rows(dataset, false, 0, start),
              std::vector<int>(in_order.begin() + static_cast<long>(start), in_order.end()))
        << start;
  }
}

TEST(TableEpochs, HeldOutSplitIsTheSameChoiceAsForAnyFormatAndResumes) {
  TempDir dir;
  write_parquet(table_of(numbered_rows(40)), dir.file("a.parquet"), 6);
  auto train = open_dataset({dir.file("a.parquet")}, Dataset::Subset::kTrain, 0.25, 9);
  auto held = open_dataset({dir.file("a.parquet")}, Dataset::Subset::kHeldOut, 0.25, 9);
  const auto train_rows = epoch_rows(train, true, 0, 0);
  const auto held_rows = epoch_rows(held, true, 0, 0);
  ASSERT_EQ(train_rows.size(), 30u);
  ASSERT_EQ(held_rows.size(), 10u);
  std::set<int> all(train_rows.begin(), train_rows.end());
  all.insert(held_rows.begin(), held_rows.end());
  EXPECT_EQ(all.size(), 40u);
  for (int g : held_rows) EXPECT_TRUE(held->contains(static_cast<std::uint64_t>(g)));
  for (std::uint64_t start : {1u, 5u, 7u, 29u})
    EXPECT_EQ(epoch_rows(train, true, 0, start),
              std::vector<int>(train_rows.begin() + static_cast<long>(start), train_rows.end()));
}

TEST(TableEpochs, JsonlFilesAmongTablesAreBlocksOfLinesReadAsGroupsAre) {
  // A JSONL file listed with Parquet files: every record once per epoch, the JSONL ones as their lines' text at
  // their byte offsets, in file order without shuffling; resumable from any slot as the table epochs are.
  TempDir dir;
  std::string lines;
  for (int i = 0; i < 5; ++i) lines += "{\"i\": " + std::to_string(100 + i) + "}\n";
  test::write_file(dir.file("a.jsonl"), lines);
  std::string rows;
  for (int i = 0; i < 7; ++i) rows += "{\"i\": " + std::to_string(i) + "}\n";
  write_parquet(table_of(rows), dir.file("b.parquet"), 3);
  const auto dataset = open_dataset({dir.file("a.jsonl"), dir.file("b.parquet")}, Dataset::Subset::kAll, 0.0, 0);
  ASSERT_EQ(dataset->size(), 12u);
  const auto values = [&](bool shuffle, std::uint64_t start) {
    std::vector<int> out;
    auto stream = open_epoch(dataset, shuffle, 7, 0, start);
    RawRecord record;
    std::string scratch;
    while (stream->next(record)) {
      const auto json = nlohmann::json::parse(record.json(scratch));
      if (record.file == 0) EXPECT_EQ(record.offset, static_cast<std::uint64_t>(json["i"].get<int>() - 100) * 11);
      out.push_back(json["i"].get<int>());
    }
    return out;
  };
  EXPECT_EQ(values(false, 0), (std::vector<int>{100, 101, 102, 103, 104, 0, 1, 2, 3, 4, 5, 6}));
  const auto shuffled = values(true, 0);
  auto sorted = shuffled;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 100, 101, 102, 103, 104}));
  EXPECT_NE(shuffled, values(false, 0));
  for (std::uint64_t start : {1u, 5u, 11u})
    EXPECT_EQ(values(true, start), std::vector<int>(shuffled.begin() + static_cast<std::ptrdiff_t>(start), shuffled.end()));
}

TEST(TableFile, BadFilesNameTheFileAndGroup) {
  TempDir dir;
  write_parquet(table_of(numbered_rows(20)), dir.file("a.parquet"), 5);
  std::ifstream in(dir.file("a.parquet"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  test::write_file(dir.file("cut.parquet"), bytes.substr(0, bytes.size() / 2));
  try {
    index_table_file(dir.file("cut.parquet"));
    FAIL() << "a truncated Parquet file was read";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("cut.parquet") + ": not a readable Parquet file"), std::string::npos)
        << e.what();
  }
  write_ipc(table_of(numbered_rows(20)), dir.file("s.arrow"), 5, /*stream=*/true);
  std::ifstream sin(dir.file("s.arrow"), std::ios::binary);
  std::string stream((std::istreambuf_iterator<char>(sin)), {});
  test::write_file(dir.file("cut.arrow"), stream.substr(0, stream.size() * 2 / 3));
  EXPECT_THROW(index_table_file(dir.file("cut.arrow")), DataError);
  // A gzip JSONL file among table files is refused (plain JSONL files are read in blocks of lines: TableEpochs).
  test::write_file(dir.file("a.jsonl.gz"), "not really gzip");
  EXPECT_THROW(open_dataset({dir.file("a.jsonl.gz"), dir.file("a.parquet")}, Dataset::Subset::kAll, 0.0, 0), DataError);
}

}  // namespace
}  // namespace trainer::data
