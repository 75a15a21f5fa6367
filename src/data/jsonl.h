// JSONL files on disk: expanding globs, the byte-offset index of each file's records (cached in <file>.idx so
// a shuffled epoch needs no pass over the data), and reading lines from plain and gzip files.
// No LibTorch here: the loader's reader thread uses it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace trainer::data {

// The files the patterns name, each pattern's matches sorted (glob(3)); a pattern matching nothing is a
// DataError naming `key`.
std::vector<std::string> expand_globs(const std::vector<std::string>& patterns, const char* key);

bool is_gzip_path(const std::string& path);

// A record is a line with anything but spaces, tabs and carriage returns; blank lines are not records.
bool is_blank(const char* begin, const char* end);

// The records of one file. Plain files: the byte offset where each record starts. Gzip files cannot be read at
// an offset, so only their record count is kept.
struct FileIndex {
  std::string path;
  bool gzip = false;
  std::uint64_t records = 0;
  std::uint64_t file_size = 0;
  std::int64_t mtime_ns = 0;  // modification time when indexed
  std::vector<std::uint64_t> offsets;  // plain files: one per record
  // Parquet and Arrow files (data/table_file.h): records are rows, read a row group (an IPC record batch) at a
  // time; the rows of each group, in file order. A record's "offset" is its 0-based row in the file.
  bool table = false;
  std::vector<std::uint64_t> group_rows;
};

// Where the index of `path` is cached.
std::string index_cache_path(const std::string& path);

// The index of `path`: read from the cache when it was built for this file's size and modification time,
// else built by one pass over the file and written beside it (atomically). When the directory is not writable
// the index is kept in memory only.
FileIndex index_file(const std::string& path);

// The 1-based line number of the byte at `offset` of a plain file. Counts newlines from the start: called only
// to word an error message, so the index does not have to carry line numbers.
std::uint64_t line_number_at(const std::string& path, std::uint64_t offset);

// Reads single records of a plain file by offset (pread: no shared file position, no mapping that would show as
// resident memory).
class RandomAccessFile {
 public:
  explicit RandomAccessFile(const std::string& path);
  ~RandomAccessFile();
  RandomAccessFile(const RandomAccessFile&) = delete;
  RandomAccessFile& operator=(const RandomAccessFile&) = delete;
  // The record starting at `offset`: bytes up to the first newline before `end` (the next record's offset, or
  // the file size), without the newline or a trailing carriage return.
  void read_record(std::uint64_t offset, std::uint64_t end, std::string& out) const;

 private:
  std::string path_;
  int fd_ = -1;
};

// Reads the records of a plain or gzip file in order, in bounded memory.
class LineReader {
 public:
  explicit LineReader(const std::string& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;
  // The next record (blank lines are passed over), its 1-based line number and byte offset in the
  // (uncompressed) text. False at the end of the file.
  bool next(std::string& record, std::uint64_t& line_number, std::uint64_t& offset);

 private:
  // Fills buffer_ with the next block; false at the end of the file.
  bool refill();

  std::string path_;
  bool gzip_ = false;
  int fd_ = -1;
  void* gz_ = nullptr;  // gzFile, kept opaque so zlib.h stays in the .cpp
  std::vector<char> buffer_;
  std::size_t begin_ = 0, end_ = 0;  // unread bytes of buffer_
  std::uint64_t buffer_offset_ = 0;  // file offset of buffer_[0]
  std::uint64_t line_number_ = 0;
  bool eof_ = false;
};

}  // namespace trainer::data
