// JSONL files: globs, the cached byte-offset index, and plain/gzip line reading (see jsonl.h).
#include "data/jsonl.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/errors.h"

namespace trainer::data {
namespace {

constexpr std::size_t kBlockBytes = 1 << 20;
constexpr char kIndexMagic[8] = {'T', 'R', 'N', 'I', 'D', 'X', '1', '\0'};

// What the cache is checked against: a file whose size or modification time changed is indexed again.
struct IndexHeader {
  char magic[8];
  std::uint64_t file_size;
  std::int64_t mtime_ns;
  std::uint64_t records;
  std::uint64_t gzip;
};

struct FileStamp {
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
};

FileStamp stamp_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw DataError(path + ": cannot read (" + std::strerror(errno) + ")", "check that the data file exists");
  if (!S_ISREG(st.st_mode))
    throw DataError(path + ": not a regular file",
                    "data files are JSONL (plain or .gz), Parquet or Arrow files, or a folder datasets wrote (DIR, DIR:SPLIT)");
  return {static_cast<std::uint64_t>(st.st_size),
          static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec};
}

int open_or_throw(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(path + ": cannot open (" + std::strerror(errno) + ")", "check the path and permissions");
  return fd;
}

bool read_cached_index(const std::string& cache, const FileStamp& stamp, bool gzip, FileIndex& index) {
  std::ifstream in(cache, std::ios::binary);
  if (!in) return false;
  IndexHeader header{};
  if (!in.read(reinterpret_cast<char*>(&header), sizeof header)) return false;
  if (std::memcmp(header.magic, kIndexMagic, sizeof kIndexMagic) != 0 || header.file_size != stamp.size ||
      header.mtime_ns != stamp.mtime_ns || header.gzip != (gzip ? 1u : 0u) || header.records > stamp.size)
    return false;
  index.records = header.records;
  if (!gzip) {
    index.offsets.resize(header.records);
    if (!in.read(reinterpret_cast<char*>(index.offsets.data()),
                 static_cast<std::streamsize>(header.records * sizeof(std::uint64_t))))
      return false;
  }
  return true;
}

// Best effort: a read-only data directory only costs an index pass per run.
void write_cached_index(const std::string& cache, const FileStamp& stamp, const FileIndex& index) {
  const std::string temporary = cache + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      spdlog::debug("{}: cannot write the index cache; keeping it in memory", cache);
      return;
    }
    IndexHeader header{};
    std::memcpy(header.magic, kIndexMagic, sizeof kIndexMagic);
    header.file_size = stamp.size;
    header.mtime_ns = stamp.mtime_ns;
    header.records = index.records;
    header.gzip = index.gzip ? 1 : 0;
    out.write(reinterpret_cast<const char*>(&header), sizeof header);
    out.write(reinterpret_cast<const char*>(index.offsets.data()),
              static_cast<std::streamsize>(index.offsets.size() * sizeof(std::uint64_t)));
    if (!out.good()) {
      out.close();
      std::filesystem::remove(temporary);
      spdlog::debug("{}: writing the index cache failed; keeping it in memory", cache);
      return;
    }
  }
  if (::rename(temporary.c_str(), cache.c_str()) != 0) std::filesystem::remove(temporary);
}

// One pass over a plain file: the offset of every non-blank line.
void build_plain_index(const std::string& path, FileIndex& index) {
  const int fd = open_or_throw(path);
  std::vector<char> block(kBlockBytes);
  std::uint64_t block_offset = 0, line_start = 0;
  bool line_has_content = false;
  for (;;) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0) {
      ::close(fd);
      throw DataError(path + ": read error (" + std::strerror(errno) + ")");
    }
    if (n == 0) break;
    const char* data = block.data();
    std::size_t pos = 0;
    while (pos < static_cast<std::size_t>(n)) {
      const void* newline = std::memchr(data + pos, '\n', static_cast<std::size_t>(n) - pos);
      const std::size_t segment_end =
          newline ? static_cast<std::size_t>(static_cast<const char*>(newline) - data) : static_cast<std::size_t>(n);
      if (!line_has_content && !is_blank(data + pos, data + segment_end)) line_has_content = true;
      if (!newline) break;
      if (line_has_content) index.offsets.push_back(line_start);
      line_start = block_offset + segment_end + 1;
      line_has_content = false;
      pos = segment_end + 1;
    }
    block_offset += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  if (line_has_content) index.offsets.push_back(line_start);
  index.records = index.offsets.size();
}

void build_gzip_index(const std::string& path, FileIndex& index) {
  LineReader reader(path);
  std::string record;
  std::uint64_t line = 0, offset = 0;
  while (reader.next(record, line, offset)) ++index.records;
}

// The JSON of a datasets folder's metadata file.
nlohmann::json read_json_file(const std::filesystem::path& path, const char* key) {
  std::ifstream in(path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(std::string(key) + ": " + path.string() + " is not valid JSON (" + e.what() + ")",
                    "the folder is not one datasets wrote completely: save it again");
  }
}

// The data files of a folder `datasets` wrote, or nothing when `pattern` names none:
//  - a save_to_disk folder (state.json lists its data-*.arrow shards, Arrow IPC streams);
//  - a DatasetDict folder (dataset_dict.json lists the splits, one save_to_disk folder each), with the split named
//    after a colon: DIR:train;
//  - a datasets cache folder of load_dataset (dataset_info.json lists the splits; NAME-SPLIT.arrow or
//    NAME-SPLIT-0000k-of-0000n.arrow files), with the split after a colon.
std::optional<std::vector<std::string>> saved_dataset_files(const std::string& pattern, const char* key) {
  namespace fs = std::filesystem;
  fs::path dir = pattern;
  std::string split;
  if (!fs::is_directory(dir)) {
    const std::size_t colon = pattern.rfind(':');
    if (colon == std::string::npos || colon == 0 || !fs::is_directory(pattern.substr(0, colon))) return std::nullopt;
    dir = pattern.substr(0, colon);
    split = pattern.substr(colon + 1);
  }
  const std::string name = dir.string();
  const auto split_error = [&](const std::vector<std::string>& splits) {
    std::string listed;
    for (const auto& s : splits) listed += (listed.empty() ? "" : ", ") + s;
    const std::string first = splits.empty() ? "train" : splits.front();
    if (split.empty())
      return DataError(std::string(key) + ": '" + name + "' holds the splits " + listed + ": name one",
                       "write '" + name + ":" + first + "'");
    return DataError(std::string(key) + ": '" + name + "' has no split '" + split + "' (its splits: " + listed + ")",
                     "write '" + name + ":" + first + "'");
  };
  if (fs::exists(dir / "dataset_dict.json")) {
    std::vector<std::string> splits;
    for (const auto& s : read_json_file(dir / "dataset_dict.json", key).value("splits", nlohmann::json::array()))
      if (s.is_string()) splits.push_back(s.get<std::string>());
    if (split.empty() || std::find(splits.begin(), splits.end(), split) == splits.end()) throw split_error(splits);
    dir /= split;
    split.clear();
  }
  if (fs::exists(dir / "state.json")) {
    if (!split.empty())
      throw DataError(std::string(key) + ": '" + name + "' is one split's save_to_disk folder: it has no split '" +
                          split + "'",
                      "name the folder alone");
    std::vector<std::string> files;
    for (const auto& entry : read_json_file(dir / "state.json", key).value("_data_files", nlohmann::json::array())) {
      const fs::path file = dir / entry.value("filename", "");
      if (!fs::is_regular_file(file))
        throw DataError(std::string(key) + ": " + file.string() + ", listed in " + (dir / "state.json").string() +
                            ", is missing",
                        "the folder is not one datasets wrote completely: save it again");
      files.push_back(file.string());
    }
    return files;
  }
  if (fs::exists(dir / "dataset_info.json")) {
    std::vector<std::string> splits;
    const auto info = read_json_file(dir / "dataset_info.json", key);
    if (info.contains("splits") && info["splits"].is_object())
      for (const auto& [s, _] : info["splits"].items()) splits.push_back(s);
    if (split.empty() || std::find(splits.begin(), splits.end(), split) == splits.end()) throw split_error(splits);
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string file = entry.path().filename().string();
      if (!file.ends_with(".arrow")) continue;
      const std::string stem = file.substr(0, file.size() - 6);
      const std::string single = "-" + split, sharded = "-" + split + "-";
      const bool match = stem.ends_with(single) ||
                         (stem.find(sharded) != std::string::npos && stem.find("-of-", stem.find(sharded)) != std::string::npos);
      if (match) files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());
    if (files.empty())
      throw DataError(std::string(key) + ": '" + name + "' lists the split '" + split + "' but holds no .arrow file of it",
                      "load the dataset with datasets once more, or point at its Parquet files");
    return files;
  }
  if (!split.empty())
    throw DataError(std::string(key) + ": '" + name + "' is not a folder datasets wrote (no dataset_dict.json, "
                        "state.json or dataset_info.json)",
                    "name the data files, or a datasets save_to_disk folder");
  return std::nullopt;
}

}  // namespace

std::vector<std::string> expand_globs(const std::vector<std::string>& patterns, const char* key) {
  std::vector<std::string> files;
  for (const auto& pattern : patterns) {
    if (auto saved = saved_dataset_files(pattern, key)) {
      files.insert(files.end(), saved->begin(), saved->end());
      continue;
    }
    glob_t matches{};
    const int rc = ::glob(pattern.c_str(), GLOB_TILDE | GLOB_BRACE, nullptr, &matches);
    std::size_t kept = 0;
    if (rc == 0)
      for (std::size_t i = 0; i < matches.gl_pathc; ++i) {
        const std::string path = matches.gl_pathv[i];
        // Our offset-index cache beside a data file (data/*.jsonl.idx) is not data, whatever the pattern matches.
        if (path.ends_with(".idx") && std::filesystem::is_regular_file(path.substr(0, path.size() - 4))) continue;
        files.push_back(path);
        ++kept;
      }
    ::globfree(&matches);
    if (rc == 0 && kept == 0)
      throw DataError(std::string(key) + ": '" + pattern + "' matches only trainer's index caches (.idx)",
                      "name the data files themselves");
    if (rc != 0)
      throw DataError(std::string(key) + ": no file matches '" + pattern + "'",
                      "check the path (relative paths are taken from the current directory)");
  }
  return files;
}

bool is_gzip_path(const std::string& path) { return path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0; }

bool is_blank(const char* begin, const char* end) {
  for (const char* p = begin; p != end; ++p)
    if (*p != ' ' && *p != '\t' && *p != '\r') return false;
  return true;
}

std::string index_cache_path(const std::string& path) { return path + ".idx"; }

FileIndex index_file(const std::string& path) {
  FileIndex index;
  index.path = path;
  index.gzip = is_gzip_path(path);
  const FileStamp stamp = stamp_of(path);
  index.file_size = stamp.size;
  index.mtime_ns = stamp.mtime_ns;
  const std::string cache = index_cache_path(path);
  if (read_cached_index(cache, stamp, index.gzip, index)) return index;
  index.records = 0;
  index.offsets.clear();
  if (index.gzip)
    build_gzip_index(path, index);
  else
    build_plain_index(path, index);
  index.offsets.shrink_to_fit();
  // A file rewritten while we read it would leave an index that matches neither version: do not cache it.
  const FileStamp after = stamp_of(path);
  if (after.size == stamp.size && after.mtime_ns == stamp.mtime_ns) write_cached_index(cache, stamp, index);
  return index;
}

std::uint64_t line_number_at(const std::string& path, std::uint64_t offset) {
  const int fd = open_or_throw(path);
  std::vector<char> block(kBlockBytes);
  std::uint64_t line = 1, position = 0;
  while (position < offset) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), offset - position));
    const ssize_t n = ::read(fd, block.data(), want);
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) line += block[static_cast<std::size_t>(i)] == '\n';
    position += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  return line;
}

RandomAccessFile::RandomAccessFile(const std::string& path) : path_(path), fd_(open_or_throw(path)) {}

RandomAccessFile::~RandomAccessFile() {
  if (fd_ >= 0) ::close(fd_);
}

void RandomAccessFile::read_record(std::uint64_t offset, std::uint64_t end, std::string& out) const {
  out.resize(static_cast<std::size_t>(end - offset));
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw DataError(path_ + ": cannot read at byte " + std::to_string(offset + done) +
                          (n < 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string(" (file shrank)")),
                      "the file changed while training: its index is rebuilt on the next run");
    done += static_cast<std::size_t>(n);
  }
  const auto newline = out.find('\n');
  if (newline != std::string::npos) out.resize(newline);
  if (!out.empty() && out.back() == '\r') out.pop_back();
}

LineReader::LineReader(const std::string& path) : path_(path), gzip_(is_gzip_path(path)), buffer_(kBlockBytes) {
  if (gzip_) {
    gz_ = ::gzopen(path.c_str(), "rb");
    if (!gz_) throw DataError(path + ": cannot open (" + std::strerror(errno) + ")", "check the path and permissions");
    ::gzbuffer(static_cast<gzFile>(gz_), 256 * 1024);
  } else {
    fd_ = open_or_throw(path);
  }
}

LineReader::~LineReader() {
  if (gz_) ::gzclose(static_cast<gzFile>(gz_));
  if (fd_ >= 0) ::close(fd_);
}

bool LineReader::refill() {
  // Keep the unread tail (a partial line) at the front; grow when one line is longer than the buffer.
  if (begin_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + begin_, end_ - begin_);
    buffer_offset_ += begin_;
    end_ -= begin_;
    begin_ = 0;
  }
  if (end_ == buffer_.size()) buffer_.resize(buffer_.size() * 2);
  const std::size_t room = buffer_.size() - end_;
  long n = 0;
  if (gzip_) {
    n = ::gzread(static_cast<gzFile>(gz_), buffer_.data() + end_, static_cast<unsigned>(room));
    if (n < 0) {
      int code = 0;
      const char* message = ::gzerror(static_cast<gzFile>(gz_), &code);
      throw DataError(path_ + ": corrupt gzip data (" + message + ")", "re-create the .gz file");
    }
    if (n == 0) {
      // zlib hands out what it could decompress and flags a stream that stopped before its end marker (a copy or
      // download cut short) as Z_BUF_ERROR, "unexpected end of file". The partial line in the buffer is where it
      // broke: report the file, not that line as invalid JSON.
      int code = Z_OK;
      ::gzerror(static_cast<gzFile>(gz_), &code);
      if (code == Z_BUF_ERROR)
        throw DataError(path_ + ": the gzip stream ends before its end marker (file truncated?); " +
                            (line_number_ > 0 ? "the last complete line is line " + std::to_string(line_number_)
                                              : std::string("not one complete line was read")) +
                            (end_ > begin_ ? ", followed by " + std::to_string(end_ - begin_) +
                                                 " bytes of a line cut off"
                                           : std::string()),
                        "copy or download the file again (`gzip -t " + path_ + "` checks a .gz file)");
    }
  } else {
    n = ::read(fd_, buffer_.data() + end_, room);
    if (n < 0) throw DataError(path_ + ": read error (" + std::strerror(errno) + ")");
  }
  end_ += static_cast<std::size_t>(n);
  return n > 0;
}

bool LineReader::next(std::string& record, std::uint64_t& line_number, std::uint64_t& offset) {
  for (;;) {
    const char* data = buffer_.data();
    const void* newline = std::memchr(data + begin_, '\n', end_ - begin_);
    if (!newline && !eof_) {
      if (!refill()) eof_ = true;
      continue;
    }
    if (!newline && begin_ == end_) return false;  // end of file, nothing left
    const std::size_t line_end = newline ? static_cast<std::size_t>(static_cast<const char*>(newline) - data) : end_;
    const std::size_t line_begin = begin_;
    begin_ = newline ? line_end + 1 : end_;
    ++line_number_;
    if (is_blank(data + line_begin, data + line_end)) continue;
    std::size_t record_end = line_end;
    if (record_end > line_begin && data[record_end - 1] == '\r') --record_end;
    record.assign(data + line_begin, record_end - line_begin);
    line_number = line_number_;
    offset = buffer_offset_ + line_begin;
    return true;
  }
}

}  // namespace trainer::data
