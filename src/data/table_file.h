// Parquet and Arrow IPC files as sources of records: their row groups (Parquet row groups, IPC record batches) and
// each row rendered as one JSON object (column name -> value), which the record mapping reads as it reads a JSONL
// line, so every record kind (text, chat, preference pairs, pre-tokenized ids) and every error policy works the
// same. Arrow's own headers stay in table_file.cpp: this interface is all the rest of trainer sees.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/jsonl.h"

namespace trainer::data {

// A Parquet or Arrow IPC file by its name: .parquet, .arrow (datasets' save_to_disk shards: the IPC stream
// format; pyarrow's files: the IPC file format; the content decides), .feather, .ipc.
bool is_table_path(const std::string& path);

// The rows of each row group, read from the file's metadata (a Parquet footer; an IPC file's footer; for the IPC
// stream format, one pass over the batches' headers of the memory-mapped file). A file Arrow cannot read is a
// DataError naming it.
FileIndex index_table_file(const std::string& path);

// One row group as Arrow read it (columnar, not yet rendered): rows are rendered as JSON objects on demand, by any
// thread (the loader's workers render the rows they map, so the reader thread only decodes).
class TableRows {
 public:
  virtual ~TableRows() = default;
  virtual std::uint64_t size() const = 0;
  // Row `row` of the group as a JSON object. A column of a type no record field can hold is a DataError naming
  // the file, the group and the column.
  virtual void render(std::uint64_t row, std::string& out) const = 0;
  // Row `row` as the JSON value that parsing render()'s text gives (the same numbers, strings, nulls, nesting), built
  // straight from the Arrow values without the text. False (and `out` unspecified) where that could differ: a string
  // that is not valid UTF-8, a column no record field can hold; the caller then takes the text (which names it).
  virtual bool object(std::uint64_t row, nlohmann::json& out) const = 0;
  // Whether the group has a column of this name.
  virtual bool has_column(const std::string& name) const = 0;
};

// One row of an image table (data/image_dataset.h): the image as encoded bytes (datasets' Image feature: a struct
// of bytes and a path; a binary column) or as a file path (the struct's path when its bytes are null; a string
// column), its label (an integer, a ClassLabel's id, or a class name) and, for image-caption pairs, its caption.
struct TableImageRow {
  std::string origin;   // "PATH: row R (row group G)"
  std::string bytes;    // the encoded image; empty when the row names a file
  std::string path;     // the image file as the column holds it (relative paths: to the table's folder)
  std::optional<std::int64_t> label_id;
  std::optional<std::string> label_name;
  std::optional<std::string> caption;
  std::string problem;  // what is wrong with the row (a null image, a null label), empty when it is fine
};

struct TableImages {
  std::vector<std::string> label_names;  // the "label" column's ClassLabel names from the file's datasets features
                                         // (the schema metadata's "huggingface" key); empty when it has none
  std::vector<TableImageRow> rows;
};

// Reads every row's "image", "label" (when `label` or present) and "caption" (when `caption`) columns. A missing
// column, or one of a type that cannot hold its field, is a DataError naming the file and the column; an unreadable
// row group one naming the group. Other columns are not read.
TableImages read_table_images(const std::string& path, bool label, bool caption);

// Reads a table file one row group at a time.
class TableReader {
 public:
  explicit TableReader(const std::string& path);
  ~TableReader();
  TableReader(const TableReader&) = delete;
  TableReader& operator=(const TableReader&) = delete;

  std::size_t groups() const;
  std::uint64_t group_rows(std::size_t group) const;
  // The rows of `group` as JSON objects, rows[i] for its i-th row. A group Arrow cannot read (a truncated or corrupt
  // file), or a column of a type no record field can hold, is a DataError naming the file, the group and the column.
  void read_group(std::size_t group, std::vector<std::string>& rows);
  // The rows of `group`, decoded and checked, rendered later (same errors as read_group, but for a column's type).
  std::shared_ptr<const TableRows> load_group(std::size_t group);

 private:
  friend TableImages read_table_images(const std::string& path, bool label, bool caption);
  TableReader(const std::string& path, bool quiet);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// "PATH: row R (row group G)", where the 0-based row `row` of an indexed table file is, for messages.
std::string table_row_location(const FileIndex& file, std::uint64_t row);

}  // namespace trainer::data
