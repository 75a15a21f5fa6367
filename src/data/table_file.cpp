// Parquet and Arrow IPC files read with Apache Arrow's C++ library (see table_file.h). The only file of trainer
// that includes Arrow's headers.
#include "data/table_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <string_view>
#include <type_traits>

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <arrow/util/utf8.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/errors.h"

namespace trainer::data {
namespace {

enum class Format { kParquet, kArrowFile, kArrowStream };

constexpr const char* kCorruptHint =
    "the file is truncated or corrupt (an interrupted download or copy?): fetch or write it again";

bool ends_with(const std::string& text, const char* suffix) {
  const std::size_t n = std::strlen(suffix);
  if (text.size() < n) return false;
  for (std::size_t i = 0; i < n; ++i)
    if (std::tolower(static_cast<unsigned char>(text[text.size() - n + i])) != suffix[i]) return false;
  return true;
}

// By the first bytes: Parquet files start with "PAR1", Arrow IPC files with "ARROW1"; anything else is taken for
// an IPC stream (datasets' data-*.arrow), which Arrow then checks message by message.
Format format_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw DataError(path + ": not a regular file", "name a Parquet or Arrow file, or a folder datasets wrote (DIR, DIR:SPLIT)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot read (" + std::strerror(errno) + ")", "check that the data file exists");
  char magic[6] = {};
  in.read(magic, sizeof magic);
  const std::streamsize n = in.gcount();
  if (n >= 4 && std::memcmp(magic, "PAR1", 4) == 0) return Format::kParquet;
  if (n >= 6 && std::memcmp(magic, "ARROW1", 6) == 0) return Format::kArrowFile;
  if (ends_with(path, ".parquet"))
    throw DataError(path + ": not a Parquet file (it does not start with PAR1)", kCorruptHint);
  return Format::kArrowStream;
}

[[noreturn]] void fail(const std::string& what, const arrow::Status& status) {
  throw DataError(what + ": " + status.message(), kCorruptHint);
}

template <class T>
T value_or_fail(arrow::Result<T> result, const std::string& what) {
  if (!result.ok()) fail(what, result.status());
  return std::move(result).ValueOrDie();
}

// A column whose values no record field can hold (bytes, for now): named in the error.
struct UnsupportedValue {
  std::string type;
};

// Whether values of `type` can be a record field's JSON: not bytes, at any depth (datasets' Image feature is a
// struct of bytes and a path). Columns that cannot are left out of the records (told once per file).
bool renderable(const arrow::DataType& type) {
  switch (type.id()) {
    case arrow::Type::BINARY:
    case arrow::Type::LARGE_BINARY:
    case arrow::Type::BINARY_VIEW:
    case arrow::Type::FIXED_SIZE_BINARY: return false;
    case arrow::Type::DICTIONARY:
      return renderable(*static_cast<const arrow::DictionaryType&>(type).value_type());
    default:
      for (const auto& child : type.fields())
        if (!renderable(*child->type())) return false;
      return true;
  }
}

void tell_left_out_once(const std::string& path, const std::string& columns) {
  static std::mutex mutex;
  static std::set<std::string> told;
  std::lock_guard lock(mutex);
  if (!told.insert(path).second) return;
  spdlog::warn("{}: column(s) {} hold bytes, which no record field reads yet (datasets' Image feature, binary data): "
               "left out of the records", path, columns);
}

// Appends `text` as a JSON string. Arrow strings are UTF-8 already; the record mapping checks that it is valid.
void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  std::size_t plain = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(text.data() + plain, i - plain);
    plain = i + 1;
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default: {
        static constexpr char kHex[] = "0123456789abcdef";
        out += "\\u00";
        out += kHex[c >> 4];
        out += kHex[c & 15];
      }
    }
  }
  out.append(text.data() + plain, text.size() - plain);
  out += '"';
}

template <class Number>
void append_number(std::string& out, Number value) {
  char digits[32];
  out.append(digits, std::to_chars(digits, digits + sizeof digits, value).ptr);
}

void append_real(std::string& out, double value) {
  if (!std::isfinite(value)) {
    out += "null";  // JSON has no NaN or infinity
    return;
  }
  append_number(out, value);
}

void append_value(std::string& out, const arrow::Array& array, std::int64_t i);

template <class ListArray>
void append_list(std::string& out, const ListArray& list, std::int64_t i) {
  const arrow::Array& values = *list.values();
  const std::int64_t begin = list.value_offset(i), length = list.value_length(i);
  out += '[';
  for (std::int64_t k = 0; k < length; ++k) {
    if (k) out += ',';
    append_value(out, values, begin + k);
  }
  out += ']';
}

// One value as JSON: numbers, strings, booleans, null; lists as arrays, structs (and so datasets' conversation
// turns) as objects; dictionary-encoded values as their dictionary's value; other types (dates, decimals) as
// the string Arrow writes for them.
void append_value(std::string& out, const arrow::Array& array, std::int64_t i) {
  if (array.IsNull(i)) {
    out += "null";
    return;
  }
  using arrow::Type;
  switch (array.type_id()) {
    case Type::NA: out += "null"; return;
    case Type::BOOL: out += static_cast<const arrow::BooleanArray&>(array).Value(i) ? "true" : "false"; return;
    case Type::INT8: append_number(out, static_cast<const arrow::Int8Array&>(array).Value(i)); return;
    case Type::INT16: append_number(out, static_cast<const arrow::Int16Array&>(array).Value(i)); return;
    case Type::INT32: append_number(out, static_cast<const arrow::Int32Array&>(array).Value(i)); return;
    case Type::INT64: append_number(out, static_cast<const arrow::Int64Array&>(array).Value(i)); return;
    case Type::UINT8: append_number(out, static_cast<const arrow::UInt8Array&>(array).Value(i)); return;
    case Type::UINT16: append_number(out, static_cast<const arrow::UInt16Array&>(array).Value(i)); return;
    case Type::UINT32: append_number(out, static_cast<const arrow::UInt32Array&>(array).Value(i)); return;
    case Type::UINT64: append_number(out, static_cast<const arrow::UInt64Array&>(array).Value(i)); return;
    // float32 values as the doubles they are (as pyarrow's to_pylist and datasets give them)
    case Type::FLOAT: append_real(out, static_cast<const arrow::FloatArray&>(array).Value(i)); return;
    case Type::DOUBLE: append_real(out, static_cast<const arrow::DoubleArray&>(array).Value(i)); return;
    case Type::STRING: append_json_string(out, static_cast<const arrow::StringArray&>(array).GetView(i)); return;
    case Type::LARGE_STRING:
      append_json_string(out, static_cast<const arrow::LargeStringArray&>(array).GetView(i));
      return;
    case Type::STRING_VIEW:
      append_json_string(out, static_cast<const arrow::StringViewArray&>(array).GetView(i));
      return;
    case Type::LIST: append_list(out, static_cast<const arrow::ListArray&>(array), i); return;
    case Type::MAP: append_list(out, static_cast<const arrow::MapArray&>(array), i); return;
    case Type::LARGE_LIST: append_list(out, static_cast<const arrow::LargeListArray&>(array), i); return;
    case Type::FIXED_SIZE_LIST: append_list(out, static_cast<const arrow::FixedSizeListArray&>(array), i); return;
    case Type::LIST_VIEW: append_list(out, static_cast<const arrow::ListViewArray&>(array), i); return;
    case Type::LARGE_LIST_VIEW: append_list(out, static_cast<const arrow::LargeListViewArray&>(array), i); return;
    case Type::STRUCT: {
      const auto& fields = static_cast<const arrow::StructArray&>(array);
      const auto& type = *array.type();
      out += '{';
      for (int k = 0; k < type.num_fields(); ++k) {
        if (k) out += ',';
        append_json_string(out, type.field(k)->name());
        out += ':';
        append_value(out, *fields.field(k), i);
      }
      out += '}';
      return;
    }
    case Type::DICTIONARY: {
      const auto& dictionary = static_cast<const arrow::DictionaryArray&>(array);
      append_value(out, *dictionary.dictionary(), dictionary.GetValueIndex(i));
      return;
    }
    case Type::BINARY:
    case Type::LARGE_BINARY:
    case Type::BINARY_VIEW:
    case Type::FIXED_SIZE_BINARY: throw UnsupportedValue{array.type()->ToString()};
    default: {
      auto scalar = array.GetScalar(i);
      if (!scalar.ok()) throw UnsupportedValue{array.type()->ToString()};
      append_json_string(out, (*scalar)->ToString());
      return;
    }
  }
}

// A value as nlohmann::json, exactly what json::parse gives for append_value's text (numbers as the parser types
// them: a non-negative integer unsigned, a negative one signed, a real whose shortest text has no '.', 'e' or
// "inf"/"nan" an integer; invalid UTF-8 refused). False where the value cannot be built so (then the text is used).
bool to_json(const arrow::Array& array, std::int64_t i, nlohmann::json& out);

template <class Integer>
void set_integer(nlohmann::json& out, Integer value) {
  if constexpr (std::is_signed_v<Integer>) {
    if (value < 0) {
      out = static_cast<std::int64_t>(value);
      return;
    }
  }
  out = static_cast<std::uint64_t>(value);
}

void set_real(nlohmann::json& out, double value) {
  if (!std::isfinite(value)) {
    out = nullptr;
    return;
  }
  char digits[32];
  const auto end = std::to_chars(digits, digits + sizeof digits, value).ptr;
  if (std::find_if(digits, end, [](char c) { return c == '.' || c == 'e'; }) != end) {
    out = value;
  } else if (digits[0] == '-') {  // "-3", "-0": the parser's integer (to_chars prints every digit of an integral double)
    std::int64_t integer = 0;
    if (std::from_chars(digits, end, integer).ec == std::errc()) out = integer;
    else out = value;
  } else {
    std::uint64_t integer = 0;
    if (std::from_chars(digits, end, integer).ec == std::errc()) out = integer;
    else out = value;
  }
}

bool set_string(nlohmann::json& out, std::string_view text) {
  if (!arrow::util::ValidateUTF8(text)) return false;
  out = std::string(text);
  return true;
}

template <class ListArray>
bool list_to_json(const ListArray& list, std::int64_t i, nlohmann::json& out) {
  const arrow::Array& values = *list.values();
  const std::int64_t begin = list.value_offset(i), length = list.value_length(i);
  out = nlohmann::json::array();
  auto& items = out.get_ref<nlohmann::json::array_t&>();
  items.resize(static_cast<std::size_t>(length));
  for (std::int64_t k = 0; k < length; ++k)
    if (!to_json(values, begin + k, items[static_cast<std::size_t>(k)])) return false;
  return true;
}

bool to_json(const arrow::Array& array, std::int64_t i, nlohmann::json& out) {
  if (array.IsNull(i)) {
    out = nullptr;
    return true;
  }
  using arrow::Type;
  switch (array.type_id()) {
    case Type::NA: out = nullptr; return true;
    case Type::BOOL: out = static_cast<const arrow::BooleanArray&>(array).Value(i); return true;
    case Type::INT8: set_integer(out, static_cast<const arrow::Int8Array&>(array).Value(i)); return true;
    case Type::INT16: set_integer(out, static_cast<const arrow::Int16Array&>(array).Value(i)); return true;
    case Type::INT32: set_integer(out, static_cast<const arrow::Int32Array&>(array).Value(i)); return true;
    case Type::INT64: set_integer(out, static_cast<const arrow::Int64Array&>(array).Value(i)); return true;
    case Type::UINT8: set_integer(out, static_cast<const arrow::UInt8Array&>(array).Value(i)); return true;
    case Type::UINT16: set_integer(out, static_cast<const arrow::UInt16Array&>(array).Value(i)); return true;
    case Type::UINT32: set_integer(out, static_cast<const arrow::UInt32Array&>(array).Value(i)); return true;
    case Type::UINT64: set_integer(out, static_cast<const arrow::UInt64Array&>(array).Value(i)); return true;
    case Type::FLOAT: set_real(out, static_cast<const arrow::FloatArray&>(array).Value(i)); return true;
    case Type::DOUBLE: set_real(out, static_cast<const arrow::DoubleArray&>(array).Value(i)); return true;
    case Type::STRING: return set_string(out, static_cast<const arrow::StringArray&>(array).GetView(i));
    case Type::LARGE_STRING: return set_string(out, static_cast<const arrow::LargeStringArray&>(array).GetView(i));
    case Type::STRING_VIEW: return set_string(out, static_cast<const arrow::StringViewArray&>(array).GetView(i));
    case Type::LIST: return list_to_json(static_cast<const arrow::ListArray&>(array), i, out);
    case Type::MAP: return list_to_json(static_cast<const arrow::MapArray&>(array), i, out);
    case Type::LARGE_LIST: return list_to_json(static_cast<const arrow::LargeListArray&>(array), i, out);
    case Type::FIXED_SIZE_LIST: return list_to_json(static_cast<const arrow::FixedSizeListArray&>(array), i, out);
    case Type::LIST_VIEW: return list_to_json(static_cast<const arrow::ListViewArray&>(array), i, out);
    case Type::LARGE_LIST_VIEW: return list_to_json(static_cast<const arrow::LargeListViewArray&>(array), i, out);
    case Type::STRUCT: {
      const auto& fields = static_cast<const arrow::StructArray&>(array);
      const auto& type = *array.type();
      out = nlohmann::json::object();
      for (int k = 0; k < type.num_fields(); ++k) {
        const std::string& name = type.field(k)->name();
        if (!arrow::util::ValidateUTF8(name)) return false;
        nlohmann::json value;
        if (!to_json(*fields.field(k), i, value)) return false;
        out[name] = std::move(value);  // a repeated name: the last, as the parser keeps it
      }
      return true;
    }
    case Type::DICTIONARY: {
      const auto& dictionary = static_cast<const arrow::DictionaryArray&>(array);
      return to_json(*dictionary.dictionary(), dictionary.GetValueIndex(i), out);
    }
    default: return false;  // bytes (an error in the text path), dates, decimals (Arrow's text): the text path
  }
}

}  // namespace

bool is_table_path(const std::string& path) {
  return ends_with(path, ".parquet") || ends_with(path, ".arrow") || ends_with(path, ".feather") ||
         ends_with(path, ".ipc");
}

struct TableReader::Impl {
  std::string path;
  Format format = Format::kParquet;
  std::shared_ptr<arrow::io::RandomAccessFile> file;
  std::unique_ptr<parquet::arrow::FileReader> parquet;
  std::shared_ptr<arrow::ipc::RecordBatchFileReader> ipc_file;
  std::shared_ptr<arrow::ipc::RecordBatchStreamReader> ipc_stream;
  std::size_t stream_next = 0;  // the stream's next batch
  std::shared_ptr<arrow::Schema> schema;
  std::vector<std::string> keys;  // each column's `"name":`
  std::vector<std::uint64_t> group_rows;
  bool quiet = false;  // no warning about columns of bytes (the image tasks read them)

  void open_stream() {
    if (auto status = file->Seek(0); !status.ok()) fail(path, status);
    ipc_stream = value_or_fail(arrow::ipc::RecordBatchStreamReader::Open(file),
                               path + ": not a readable Arrow IPC stream or file");
    stream_next = 0;
  }

  // The stream's next batch; null at its end.
  std::shared_ptr<arrow::RecordBatch> next_stream_batch() {
    std::shared_ptr<arrow::RecordBatch> batch;
    if (auto status = ipc_stream->ReadNext(&batch); !status.ok())
      fail(path + ": record batch " + std::to_string(stream_next), status);
    if (batch) ++stream_next;
    return batch;
  }

  void open() {
    static std::once_flag utf8;
    std::call_once(utf8, arrow::util::InitializeUTF8);
    format = format_of(path);
    try {
      if (format == Format::kParquet) {
        file = value_or_fail(arrow::io::ReadableFile::Open(path), path + ": cannot open");
        parquet = value_or_fail(parquet::arrow::OpenFile(file, arrow::default_memory_pool()),
                                path + ": not a readable Parquet file");
        if (auto status = parquet->GetSchema(&schema); !status.ok()) fail(path + ": Parquet schema", status);
        const auto metadata = parquet->parquet_reader()->metadata();
        for (int g = 0; g < metadata->num_row_groups(); ++g)
          group_rows.push_back(static_cast<std::uint64_t>(metadata->RowGroup(g)->num_rows()));
      } else {
        // Memory-mapped: IPC batches are read without a copy (as datasets reads its own files).
        file = value_or_fail(arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ), path + ": cannot open");
        if (format == Format::kArrowFile) {
          ipc_file = value_or_fail(arrow::ipc::RecordBatchFileReader::Open(file), path + ": not a readable Arrow IPC file");
          schema = ipc_file->schema();
          for (int g = 0; g < ipc_file->num_record_batches(); ++g) {
            // The footer lists the batches; their row counts are in each batch's header (read, not decoded).
            auto batch = value_or_fail(ipc_file->ReadRecordBatch(g), path + ": record batch " + std::to_string(g));
            group_rows.push_back(static_cast<std::uint64_t>(batch->num_rows()));
          }
        } else {
          open_stream();
          schema = ipc_stream->schema();
          while (auto batch = next_stream_batch()) group_rows.push_back(static_cast<std::uint64_t>(batch->num_rows()));
          ipc_stream.reset();
        }
      }
    } catch (const parquet::ParquetException& e) {
      throw DataError(path + ": not a readable Parquet file: " + e.what(), kCorruptHint);
    }
    std::string left_out;
    for (const auto& field : schema->fields()) {
      std::string key;
      if (renderable(*field->type())) {
        append_json_string(key, field->name());
        key += ':';
      } else {
        left_out += (left_out.empty() ? "\"" : ", \"") + field->name() + "\" (" + field->type()->ToString() + ")";
      }
      keys.push_back(key);  // empty: left out
    }
    if (!left_out.empty() && !quiet) tell_left_out_once(path, left_out);
  }

  std::string group_name(std::size_t g) const {
    return path + ": " + (format == Format::kParquet ? "row group " : "record batch ") + std::to_string(g);
  }

  std::vector<std::shared_ptr<arrow::RecordBatch>> read_batches(std::size_t g) {
    std::vector<std::shared_ptr<arrow::RecordBatch>> batches;
    try {
      if (format == Format::kParquet) {
        auto table = value_or_fail(parquet->ReadRowGroup(static_cast<int>(g)), group_name(g));
        arrow::TableBatchReader reader(*table);
        for (;;) {
          std::shared_ptr<arrow::RecordBatch> batch;
          if (auto status = reader.ReadNext(&batch); !status.ok()) fail(group_name(g), status);
          if (!batch) break;
          batches.push_back(std::move(batch));
        }
      } else if (format == Format::kArrowFile) {
        batches.push_back(value_or_fail(ipc_file->ReadRecordBatch(static_cast<int>(g)), group_name(g)));
      } else {
        if (!ipc_stream || stream_next > g) open_stream();
        std::shared_ptr<arrow::RecordBatch> batch;
        while (stream_next <= g) {
          batch = next_stream_batch();
          if (!batch) throw DataError(group_name(g) + ": the stream ended before it", kCorruptHint);
        }
        batches.push_back(std::move(batch));
      }
    } catch (const parquet::ParquetException& e) {
      throw DataError(group_name(g) + ": " + e.what(), kCorruptHint);
    }
    if (format != Format::kParquet)  // IPC buffers are the file's bytes, not decoded: check them before use
      for (const auto& batch : batches)
        if (auto status = batch->ValidateFull(); !status.ok()) fail(group_name(g), status);
    return batches;
  }
};

TableReader::TableReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->open();
}

TableReader::TableReader(const std::string& path, bool quiet) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->quiet = quiet;
  impl_->open();
}

TableReader::~TableReader() = default;

std::size_t TableReader::groups() const { return impl_->group_rows.size(); }

std::uint64_t TableReader::group_rows(std::size_t group) const { return impl_->group_rows.at(group); }

namespace {

// Boxes every child array once, on the thread that loads the group: Arrow creates a struct's field arrays and a
// dictionary's values on first use, so after this the workers only read.
void box_children(const arrow::Array& array) {
  switch (array.type_id()) {
    case arrow::Type::STRUCT: {
      const auto& fields = static_cast<const arrow::StructArray&>(array);
      for (int k = 0; k < array.type()->num_fields(); ++k) box_children(*fields.field(k));
      return;
    }
    case arrow::Type::LIST: box_children(*static_cast<const arrow::ListArray&>(array).values()); return;
    case arrow::Type::MAP: box_children(*static_cast<const arrow::MapArray&>(array).values()); return;
    case arrow::Type::LARGE_LIST: box_children(*static_cast<const arrow::LargeListArray&>(array).values()); return;
    case arrow::Type::FIXED_SIZE_LIST:
      box_children(*static_cast<const arrow::FixedSizeListArray&>(array).values());
      return;
    case arrow::Type::LIST_VIEW: box_children(*static_cast<const arrow::ListViewArray&>(array).values()); return;
    case arrow::Type::LARGE_LIST_VIEW:
      box_children(*static_cast<const arrow::LargeListViewArray&>(array).values());
      return;
    case arrow::Type::DICTIONARY: box_children(*static_cast<const arrow::DictionaryArray&>(array).dictionary()); return;
    default: return;
  }
}

class LoadedGroup final : public TableRows {
 public:
  LoadedGroup(std::string name, std::shared_ptr<arrow::Schema> schema, std::vector<std::string> keys,
              std::vector<std::shared_ptr<arrow::RecordBatch>> batches)
      : name_(std::move(name)), schema_(std::move(schema)), keys_(std::move(keys)), batches_(std::move(batches)) {
    for (const auto& batch : batches_) {
      starts_.push_back(rows_);
      rows_ += static_cast<std::uint64_t>(batch->num_rows());
      for (const auto& column : batch->columns()) box_children(*column);
    }
  }

  std::uint64_t size() const override { return rows_; }

  bool has_column(const std::string& name) const override { return schema_->GetFieldIndex(name) >= 0; }

  bool object(std::uint64_t row, nlohmann::json& out) const override {
    const std::size_t b =
        static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), row) - starts_.begin() - 1);
    const arrow::RecordBatch& batch = *batches_[b];
    const auto r = static_cast<std::int64_t>(row - starts_[b]);
    out = nlohmann::json::object();
    for (int c = 0; c < batch.num_columns(); ++c) {
      if (keys_[static_cast<std::size_t>(c)].empty()) continue;  // a column of bytes
      const std::string& name = schema_->field(c)->name();
      if (!arrow::util::ValidateUTF8(name)) return false;
      nlohmann::json value;
      if (!to_json(*batch.column(c), r, value)) return false;
      out[name] = std::move(value);
    }
    return true;
  }

  void render(std::uint64_t row, std::string& out) const override {
    const std::size_t b =
        static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), row) - starts_.begin() - 1);
    const arrow::RecordBatch& batch = *batches_[b];
    const auto r = static_cast<std::int64_t>(row - starts_[b]);
    out.clear();
    out += '{';
    bool first = true;
    for (int c = 0; c < batch.num_columns(); ++c) {
      const std::string& key = keys_[static_cast<std::size_t>(c)];
      if (key.empty()) continue;  // a column of bytes
      if (!first) out += ',';
      first = false;
      out += key;
      try {
        append_value(out, *batch.column(c), r);
      } catch (const UnsupportedValue& unsupported) {
        throw DataError(name_ + ", column \"" + schema_->field(c)->name() + "\": values of type " + unsupported.type +
                            " cannot be read as a record field",
                        "drop the column, or cast it to a string or list type");
      }
    }
    out += '}';
  }

 private:
  std::string name_;
  std::shared_ptr<arrow::Schema> schema_;
  std::vector<std::string> keys_;
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches_;
  std::vector<std::uint64_t> starts_;  // each batch's first row in the group
  std::uint64_t rows_ = 0;
};

}  // namespace

std::shared_ptr<const TableRows> TableReader::load_group(std::size_t group) {
  Impl& impl = *impl_;
  auto batches = impl.read_batches(group);
  for (const auto& batch : batches)
    if (!batch->schema()->Equals(*impl.schema, false))
      throw DataError(impl.group_name(group) + ": its columns differ from the file's schema", kCorruptHint);
  auto loaded = std::make_shared<LoadedGroup>(impl.group_name(group), impl.schema, impl.keys, std::move(batches));
  if (loaded->size() != impl.group_rows.at(group))
    throw DataError(impl.group_name(group) + ": " + std::to_string(loaded->size()) +
                        " rows read, the file's metadata says " + std::to_string(impl.group_rows[group]),
                    kCorruptHint);
  return loaded;
}

void TableReader::read_group(std::size_t group, std::vector<std::string>& rows) {
  const auto loaded = load_group(group);
  rows.assign(loaded->size(), {});
  for (std::uint64_t r = 0; r < loaded->size(); ++r) loaded->render(r, rows[r]);
}

FileIndex index_table_file(const std::string& path) {
  TableReader reader(path);
  FileIndex index;
  index.path = path;
  index.table = true;
  for (std::size_t g = 0; g < reader.groups(); ++g) {
    index.group_rows.push_back(reader.group_rows(g));
    index.records += reader.group_rows(g);
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    index.file_size = static_cast<std::uint64_t>(st.st_size);
    index.mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  }
  return index;
}

namespace {

bool is_string_type(const arrow::DataType& type) {
  switch (type.id()) {
    case arrow::Type::STRING:
    case arrow::Type::LARGE_STRING:
    case arrow::Type::STRING_VIEW: return true;
    case arrow::Type::DICTIONARY: return is_string_type(*static_cast<const arrow::DictionaryType&>(type).value_type());
    default: return false;
  }
}

bool is_binary_type(const arrow::DataType& type) {
  switch (type.id()) {
    case arrow::Type::BINARY:
    case arrow::Type::LARGE_BINARY:
    case arrow::Type::BINARY_VIEW:
    case arrow::Type::FIXED_SIZE_BINARY: return true;
    default: return false;
  }
}

bool is_integer_type(const arrow::DataType& type) { return arrow::is_integer(type.id()); }

// The value at `i` of a string or binary array (of any width, or dictionary-encoded); null for a null.
std::optional<std::string_view> text_at(const arrow::Array& array, std::int64_t i) {
  if (array.IsNull(i)) return std::nullopt;
  switch (array.type_id()) {
    case arrow::Type::STRING: return static_cast<const arrow::StringArray&>(array).GetView(i);
    case arrow::Type::LARGE_STRING: return static_cast<const arrow::LargeStringArray&>(array).GetView(i);
    case arrow::Type::STRING_VIEW: return static_cast<const arrow::StringViewArray&>(array).GetView(i);
    case arrow::Type::BINARY: return static_cast<const arrow::BinaryArray&>(array).GetView(i);
    case arrow::Type::LARGE_BINARY: return static_cast<const arrow::LargeBinaryArray&>(array).GetView(i);
    case arrow::Type::BINARY_VIEW: return static_cast<const arrow::BinaryViewArray&>(array).GetView(i);
    case arrow::Type::FIXED_SIZE_BINARY: return static_cast<const arrow::FixedSizeBinaryArray&>(array).GetView(i);
    case arrow::Type::DICTIONARY: {
      const auto& dictionary = static_cast<const arrow::DictionaryArray&>(array);
      return text_at(*dictionary.dictionary(), dictionary.GetValueIndex(i));
    }
    default: return std::nullopt;
  }
}

std::optional<std::int64_t> integer_at(const arrow::Array& array, std::int64_t i) {
  if (array.IsNull(i)) return std::nullopt;
  switch (array.type_id()) {
    case arrow::Type::INT8: return static_cast<const arrow::Int8Array&>(array).Value(i);
    case arrow::Type::INT16: return static_cast<const arrow::Int16Array&>(array).Value(i);
    case arrow::Type::INT32: return static_cast<const arrow::Int32Array&>(array).Value(i);
    case arrow::Type::INT64: return static_cast<const arrow::Int64Array&>(array).Value(i);
    case arrow::Type::UINT8: return static_cast<const arrow::UInt8Array&>(array).Value(i);
    case arrow::Type::UINT16: return static_cast<const arrow::UInt16Array&>(array).Value(i);
    case arrow::Type::UINT32: return static_cast<const arrow::UInt32Array&>(array).Value(i);
    case arrow::Type::UINT64: {
      const std::uint64_t value = static_cast<const arrow::UInt64Array&>(array).Value(i);
      if (value > static_cast<std::uint64_t>(INT64_MAX)) return -1;  // out of every class range
      return static_cast<std::int64_t>(value);
    }
    default: return std::nullopt;
  }
}

// The ClassLabel names of column `column` in datasets' features (the schema metadata's "huggingface" key).
std::vector<std::string> class_label_names(const arrow::Schema& schema, const std::string& column) {
  const auto metadata = schema.metadata();
  if (!metadata) return {};
  const auto found = metadata->Get("huggingface");
  if (!found.ok()) return {};
  const auto info = nlohmann::json::parse(*found, nullptr, /*allow_exceptions=*/false);
  if (!info.is_object()) return {};
  const nlohmann::json* features = nullptr;
  if (info.contains("info") && info["info"].is_object() && info["info"].contains("features"))
    features = &info["info"]["features"];
  if (!features || !features->is_object() || !features->contains(column)) return {};
  const auto& feature = (*features)[column];
  if (!feature.is_object() || feature.value("_type", "") != "ClassLabel" || !feature.contains("names") ||
      !feature["names"].is_array())
    return {};
  std::vector<std::string> names;
  for (const auto& name : feature["names"])
    if (name.is_string()) names.push_back(name.get<std::string>());
  return names;
}

}  // namespace

TableImages read_table_images(const std::string& path, bool label, bool caption) {
  TableReader reader(path, /*quiet=*/true);
  TableReader::Impl& impl = *reader.impl_;
  const arrow::Schema& schema = *impl.schema;
  std::string columns;
  for (const auto& field : schema.fields()) columns += (columns.empty() ? "" : ", ") + field->name();
  const auto column_of = [&](const std::string& name, bool required) {
    const int index = schema.GetFieldIndex(name);
    if (index < 0 && required)
      throw DataError(path + ": has no \"" + name + "\" column (its columns: " + columns + ")",
                      "name the columns image, label" + std::string(caption ? " and caption" : "") +
                          " (datasets: rename_column), as in the JSONL records");
    return index;
  };
  const auto wrong_type = [&](const std::string& name, const std::string& wanted) {
    return DataError(path + ", column \"" + name + "\": values of type " +
                         schema.GetFieldByName(name)->type()->ToString() + ", not " + wanted,
                     "cast the column (datasets: cast_column)");
  };
  const int image = column_of("image", true);
  const int label_column = column_of("label", label);
  const int caption_column = caption ? column_of("caption", true) : -1;
  // The image: datasets' Image feature (a struct of "bytes" and "path"), encoded bytes, or a path.
  const arrow::DataType& image_type = *schema.field(image)->type();
  int bytes_field = -1, path_field = -1;
  if (image_type.id() == arrow::Type::STRUCT) {
    const auto& fields = static_cast<const arrow::StructType&>(image_type);
    bytes_field = fields.GetFieldIndex("bytes");
    path_field = fields.GetFieldIndex("path");
    if ((bytes_field < 0 && path_field < 0) || (bytes_field >= 0 && !is_binary_type(*fields.field(bytes_field)->type())) ||
        (path_field >= 0 && !is_string_type(*fields.field(path_field)->type())))
      throw wrong_type("image", "datasets' Image feature (a struct of bytes and a path), bytes or a path");
  } else if (!is_binary_type(image_type) && !is_string_type(image_type)) {
    throw wrong_type("image", "datasets' Image feature (a struct of bytes and a path), bytes or a path");
  }
  if (label_column >= 0) {
    const auto& type = *schema.field(label_column)->type();
    if (!is_integer_type(type) && !is_string_type(type)) throw wrong_type("label", "a class number or a class name");
  }
  if (caption_column >= 0 && !is_string_type(*schema.field(caption_column)->type()))
    throw wrong_type("caption", "a string");

  TableImages out;
  if (label_column >= 0) out.label_names = class_label_names(schema, "label");
  const bool parquet = impl.format == Format::kParquet;
  std::uint64_t row = 0;
  for (std::size_t g = 0; g < impl.group_rows.size(); ++g) {
    for (const auto& batch : impl.read_batches(g)) {
      if (!batch->schema()->Equals(schema, false))
        throw DataError(impl.group_name(g) + ": its columns differ from the file's schema", kCorruptHint);
      const arrow::Array& images = *batch->column(image);
      const arrow::Array* bytes = nullptr;
      const arrow::Array* paths = nullptr;
      if (bytes_field >= 0) bytes = static_cast<const arrow::StructArray&>(images).field(bytes_field).get();
      if (path_field >= 0) paths = static_cast<const arrow::StructArray&>(images).field(path_field).get();
      if (image_type.id() != arrow::Type::STRUCT) (is_binary_type(image_type) ? bytes : paths) = &images;
      for (std::int64_t r = 0; r < batch->num_rows(); ++r, ++row) {
        TableImageRow item;
        item.origin = path + ": row " + std::to_string(row) + " (" + (parquet ? "row group " : "record batch ") +
                      std::to_string(g) + ")";
        const bool present = !images.IsNull(r);
        if (auto value = present && bytes ? text_at(*bytes, r) : std::nullopt; value) {
          item.bytes.assign(value->data(), value->size());
          if (item.bytes.empty()) item.problem = "column \"image\": empty bytes, not an image";
        } else if (auto name = present && paths ? text_at(*paths, r) : std::nullopt; name && !name->empty()) {
          item.path.assign(name->data(), name->size());
        } else {
          item.problem = "column \"image\": null (neither bytes nor a path)";
        }
        if (label_column >= 0 && item.problem.empty()) {
          const arrow::Array& labels = *batch->column(label_column);
          if (labels.IsNull(r)) {
            if (!caption) item.problem = "column \"label\": null";  // captions: a label is optional
          } else if (auto id = integer_at(labels, r)) {
            if (!out.label_names.empty()) {
              if (*id < 0 || *id >= static_cast<std::int64_t>(out.label_names.size()))
                item.problem = "column \"label\": " + std::to_string(*id) + " is not one of the ClassLabel's " +
                               std::to_string(out.label_names.size()) + " names";
              else
                item.label_name = out.label_names[static_cast<std::size_t>(*id)];
            } else {
              item.label_id = *id;
            }
          } else if (auto text = text_at(labels, r)) {
            item.label_name = std::string(*text);
          }
        }
        if (caption_column >= 0 && item.problem.empty()) {
          const auto text = text_at(*batch->column(caption_column), r);
          if (!text || text->find_first_not_of(" \t\r\n") == std::string_view::npos)
            item.problem = "column \"caption\": needs the text that describes the image (a non-empty string)";
          else
            item.caption = std::string(*text);
        }
        out.rows.push_back(std::move(item));
      }
    }
  }
  return out;
}

std::string table_row_location(const FileIndex& file, std::uint64_t row) {
  std::uint64_t first = 0;
  std::size_t group = 0;
  while (group + 1 < file.group_rows.size() && first + file.group_rows[group] <= row) first += file.group_rows[group++];
  const bool parquet = ends_with(file.path, ".parquet");
  return file.path + ": row " + std::to_string(row) + " (" + (parquet ? "row group " : "record batch ") +
         std::to_string(group) + ")";
}

}  // namespace trainer::data
