// safetensors reading (mmap + full header validation) and writing (temp file, fsync, rename).
// Format: 8-byte little-endian header length N, N bytes of JSON, then the data; every tensor's data_offsets are
// relative to the end of the header. https://github.com/huggingface/safetensors (the Rust crate is the reference
// for what a reader must reject).
#include "trainer/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include "trainer/errors.h"
#include "util/strings.h"

namespace trainer {

// Both the file format and our memcpy-based reads and writes are little-endian; LibTorch's targets all are.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using Json = nlohmann::ordered_json;  // ordered: written headers keep our layout order, which is easier to read

// The Rust reference rejects headers above 100 MB; a real header is a few hundred bytes per tensor.
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;
// Nesting of a valid header, counted as nlohmann's parser callback does (open containers around a value): the
// numbers inside "shape" and "data_offsets" sit at depth 3 (top-level object, tensor entry, array).
constexpr int kMaxHeaderDepth = 3;

const char* const kReadHint = "the file is truncated, corrupt or not a safetensors file: download or save it again";

DataError file_error(const std::string& path, const std::string& problem, const std::string& hint = kReadHint) {
  return DataError(path + ": " + problem, hint);
}

DataError tensor_error(const std::string& path, const std::string& name, const std::string& problem) {
  return DataError(path + ": tensor " + in_quotes(name) + ": " + problem, kReadHint);
}

std::string system_error_text() { return std::strerror(errno); }

std::string dtype_name_of(at::ScalarType dtype) {
  for (const auto& [name, type] : safetensors_dtypes())
    if (type == dtype) return name;
  return {};
}

// Thrown from inside the JSON parser callback to stop parsing early; turned into a DataError by the caller.
struct HeaderShapeProblem {
  std::string problem;
};

}  // namespace

const std::vector<std::pair<std::string, at::ScalarType>>& safetensors_dtypes() {
  // Every dtype of the format that LibTorch has (the format also has F4/F6 sub-byte types, which it does not).
  static const std::vector<std::pair<std::string, at::ScalarType>> dtypes = {
      {"F64", at::kDouble},
      {"F32", at::kFloat},
      {"F16", at::kHalf},
      {"BF16", at::kBFloat16},
      {"I64", at::kLong},
      {"I32", at::kInt},
      {"I16", at::kShort},
      {"I8", at::kChar},
      {"U64", at::kUInt64},
      {"U32", at::kUInt32},
      {"U16", at::kUInt16},
      {"U8", at::kByte},
      {"BOOL", at::kBool},
      {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2},
      {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
      {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz},
      {"F8_E8M0", at::kFloat8_e8m0fnu},
      {"C64", at::kComplexFloat},
  };
  return dtypes;
}

// ---- reading ---------------------------------------------------------------------------------------------------

// The mapping and the parsed header. Shared by copies of SafetensorsFile and by every tensor view() returns, so
// the bytes stay mapped while anything still points into them.
struct SafetensorsFile::State {
  std::string path;
  const std::byte* base = nullptr;  // the whole file, mapped
  std::size_t file_size = 0;
  std::uint64_t data_start = 0;  // 8 + header length
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::size_t> index;  // name -> position in tensors
  std::map<std::string, std::string> metadata;

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    if (base != nullptr) ::munmap(const_cast<std::byte*>(base), file_size);
  }

  const std::byte* data(const TensorInfo& info) const { return base + data_start + info.begin; }

  // Drops the pages wholly inside the tensor's bytes from resident memory. The mapping is private and never
  // written, so MADV_DONTNEED only forgets clean file pages: a later access reads them from the file again,
  // and a view() over the range stays valid. Best effort: a failure only costs memory.
  void release(const TensorInfo& info) const {
    static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t first = data_start + info.begin;
    const std::uint64_t last = data_start + info.end;
    const std::uint64_t from = (first + page - 1) / page * page;
    const std::uint64_t to = last / page * page;
    if (from < to) ::madvise(const_cast<std::byte*>(base) + from, to - from, MADV_DONTNEED);
  }
};

namespace {

std::uint64_t read_u64_le(const std::byte* p) {
  std::uint64_t value = 0;
  std::memcpy(&value, p, sizeof value);  // the host is little-endian (static_assert above)
  return value;
}

// A non-negative JSON integer that fits `limit`; nullopt for anything else (negative, fraction, string, ...).
std::optional<std::uint64_t> json_unsigned(const Json& value, std::uint64_t limit) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const auto v = value.get<std::uint64_t>();
  if (v > limit) return std::nullopt;
  return v;
}

TensorInfo parse_tensor_entry(const std::string& path, const std::string& name, const Json& entry,
                              std::uint64_t data_size) {
  if (!entry.is_object()) throw tensor_error(path, name, "header entry is not an object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(field)) throw tensor_error(path, name, std::string("header entry has no \"") + field + "\"");

  TensorInfo info;
  info.name = name;
  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) throw tensor_error(path, name, "\"dtype\" is not a string");
  info.dtype_name = dtype.get<std::string>();
  bool known = false;
  std::string names;
  for (const auto& [dtype_name, type] : safetensors_dtypes()) {
    names += (names.empty() ? "" : " ") + dtype_name;
    if (dtype_name == info.dtype_name) info.dtype = type, known = true;
  }
  if (!known) throw tensor_error(path, name, "unknown dtype " + in_quotes(info.dtype_name) + " (supported: " + names + ")");

  const Json& shape = entry["shape"];
  if (!shape.is_array()) throw tensor_error(path, name, "\"shape\" is not an array");
  std::uint64_t numel = 1;
  bool numel_overflows = false;
  for (const Json& dim : shape) {
    const auto d = json_unsigned(dim, static_cast<std::uint64_t>(std::numeric_limits<int64_t>::max()));
    if (!d) throw tensor_error(path, name, "shape " + shape.dump() + " has a dimension that is not a non-negative integer");
    info.shape.push_back(static_cast<int64_t>(*d));
    numel_overflows = numel_overflows || __builtin_mul_overflow(numel, *d, &numel);
  }

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !json_unsigned(offsets[0], UINT64_MAX) ||
      !json_unsigned(offsets[1], UINT64_MAX))
    throw tensor_error(path, name, "\"data_offsets\" " + offsets.dump() + " is not [begin, end] in bytes");
  info.begin = offsets[0].get<std::uint64_t>();
  info.end = offsets[1].get<std::uint64_t>();
  if (info.begin > info.end)
    throw tensor_error(path, name, "data_offsets " + offsets.dump() + " begin after they end");
  if (info.end > data_size)
    throw tensor_error(path, name, "data_offsets " + offsets.dump() + " run past the end of the data (" +
                                       std::to_string(data_size) + " bytes after the header)");

  const auto element_size = static_cast<std::uint64_t>(c10::elementSize(info.dtype));
  std::uint64_t expected_bytes = 0;
  if (numel_overflows || __builtin_mul_overflow(numel, element_size, &expected_bytes) ||
      expected_bytes != info.nbytes())
    throw tensor_error(path, name, "shape " + shape_text(info.shape) + " of " + info.dtype_name + " needs " +
                                       (numel_overflows ? std::string("more than 2^64") : std::to_string(numel)) +
                                       " x " + std::to_string(element_size) + " bytes but data_offsets " +
                                       offsets.dump() + " hold " + std::to_string(info.nbytes()));
  return info;
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError("cannot open " + path + ": " + system_error_text(), "check the path and permissions");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(path + " is not a regular file", "a safetensors path names a file");
  }
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    throw file_error(path, "file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  }
  void* mapped = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps its own reference to the file
  if (mapped == MAP_FAILED) throw DataError("cannot map " + path + ": " + std::strerror(map_errno));

  auto state = std::make_shared<State>();
  state->path = path;
  state->base = static_cast<const std::byte*>(mapped);
  state->file_size = file_size;

  const std::uint64_t header_size = read_u64_le(state->base);
  if (header_size > kMaxHeaderBytes)
    throw file_error(path, "header length " + std::to_string(header_size) + " is absurdly large (the limit is " +
                               std::to_string(kMaxHeaderBytes) + " bytes)");
  if (header_size > file_size - 8)
    throw file_error(path, "header length " + std::to_string(header_size) + " runs past the end of the file (" +
                               std::to_string(file_size) + " bytes)");
  state->data_start = 8 + header_size;
  const std::uint64_t data_size = file_size - state->data_start;

  // Parse the header. The callback rejects duplicate top-level names (JSON would keep only the last, silently)
  // and nesting deeper than a valid header has, before a hostile file can build a huge tree.
  const auto* header = reinterpret_cast<const char*>(state->base + 8);
  std::set<std::string> seen;
  Json json;
  try {
    json = Json::parse(header, header + header_size, [&](int depth, Json::parse_event_t event, Json& parsed) {
      if (depth > kMaxHeaderDepth) throw HeaderShapeProblem{"header JSON is nested deeper than a safetensors header"};
      if (event == Json::parse_event_t::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second)
        throw HeaderShapeProblem{"header names " + in_quotes(parsed.get<std::string>()) + " twice"};
      return true;
    });
  } catch (const Json::parse_error& e) {
    throw file_error(path, std::string("header is not valid JSON: ") + e.what());
  } catch (const HeaderShapeProblem& e) {
    throw file_error(path, e.problem);
  }
  if (!json.is_object()) throw file_error(path, "header is not a JSON object");

  std::vector<TensorInfo> tensors;
  for (const auto& [key, value] : json.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) throw file_error(path, "\"__metadata__\" is not an object of strings");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string())
          throw file_error(path, "metadata " + in_quotes(meta_key) + " is " + meta_value.dump() + ", not a string");
        state->metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    tensors.push_back(parse_tensor_entry(path, key, value, data_size));
  }

  // File order: by position of the data. Then no two non-empty byte ranges may overlap (an empty tensor takes
  // no bytes, so it cannot overlap anything).
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) { return a.begin < b.begin; });
  const TensorInfo* previous = nullptr;
  for (const auto& info : tensors) {
    if (info.nbytes() == 0) continue;
    if (previous != nullptr && info.begin < previous->end)
      throw file_error(path, "tensors " + in_quotes(previous->name) + " (bytes " + std::to_string(previous->begin) +
                                 "-" + std::to_string(previous->end) + ") and " + in_quotes(info.name) + " (bytes " +
                                 std::to_string(info.begin) + "-" + std::to_string(info.end) + ") overlap");
    previous = &info;
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) state->index[tensors[i].name] = i;
  state->tensors = std::move(tensors);
  return SafetensorsFile(std::move(state));
}

const std::string& SafetensorsFile::path() const { return state_->path; }
const std::vector<TensorInfo>& SafetensorsFile::tensors() const { return state_->tensors; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return state_->metadata; }

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = state_->index.find(name);
  return it == state_->index.end() ? nullptr : &state_->tensors[it->second];
}

const TensorInfo& SafetensorsFile::info_or_throw(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr)
    throw DataError(state_->path + ": no tensor " + in_quotes(name),
                    "the checkpoint does not match the model: is it the right model directory?");
  return *info;
}

at::Tensor SafetensorsFile::view(const std::string& name) const {
  const TensorInfo& info = info_or_throw(name);
  const auto options = at::TensorOptions().dtype(info.dtype).device(at::kCPU);
  const std::byte* data = state_->data(info);
  if (info.nbytes() == 0) return at::empty(info.shape, options);
  if (reinterpret_cast<std::uintptr_t>(data) % c10::elementSize(info.dtype) != 0) {
    at::Tensor copy = at::empty(info.shape, options);
    std::memcpy(copy.data_ptr(), data, info.nbytes());
    return copy;
  }
  // The deleter owns a reference to the mapping: the tensor keeps the bytes mapped.
  return at::from_blob(const_cast<std::byte*>(data), info.shape, [keep = state_](void*) {}, options);
}

at::Tensor SafetensorsFile::load(const std::string& name, std::optional<at::ScalarType> dtype) const {
  const TensorInfo& info = info_or_throw(name);
  const at::ScalarType target = dtype.value_or(info.dtype);
  at::Tensor out = at::empty(info.shape, at::TensorOptions().dtype(target).device(at::kCPU));
  if (info.nbytes() == 0) return out;
  const std::byte* data = state_->data(info);
  if (target == info.dtype) {
    std::memcpy(out.data_ptr(), data, info.nbytes());
  } else {
    // Convert straight from the mapped bytes into `out`: no intermediate copy in the file's dtype (unless the
    // bytes are misaligned for their type, which ATen kernels do not allow).
    const auto options = at::TensorOptions().dtype(info.dtype).device(at::kCPU);
    at::Tensor source;
    if (reinterpret_cast<std::uintptr_t>(data) % c10::elementSize(info.dtype) == 0) {
      source = at::from_blob(const_cast<std::byte*>(data), info.shape, options);
    } else {
      source = at::empty(info.shape, options);
      std::memcpy(source.data_ptr(), data, info.nbytes());
    }
    try {
      out.copy_(source);
    } catch (const c10::Error& e) {
      throw DataError(state_->path + ": tensor " + in_quotes(name) + ": cannot convert " + info.dtype_name + " to " +
                      std::string(c10::toString(target)) + ": " + e.what_without_backtrace());
    }
  }
  state_->release(info);
  return out;
}

// ---- writing ---------------------------------------------------------------------------------------------------

namespace {

// Writes all of `size` bytes (write() may write fewer, or be interrupted).
void write_all(int fd, const void* data, std::size_t size, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, std::min<std::size_t>(size, 1u << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw DataError("cannot write " + path + ": " + system_error_text(), "is the disk full?");
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

// Makes a rename durable: the new directory entry must reach the disk too.
void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some filesystems do not allow opening directories
  ::fsync(fd);
  ::close(fd);
}

// Removes the temporary file unless the write was committed.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw DataError("cannot create " + path_ + ": " + system_error_text(), "check the directory");
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  // fsync, close and rename over `final_path`.
  void commit(const std::string& final_path) {
    if (::fsync(fd_) != 0) throw DataError("cannot sync " + path_ + ": " + system_error_text());
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw DataError("cannot write " + path_ + ": " + system_error_text(), "is the disk full?");
    if (::rename(path_.c_str(), final_path.c_str()) != 0)
      throw DataError("cannot rename " + path_ + " to " + final_path + ": " + system_error_text());
    committed_ = true;
    const auto parent = std::filesystem::path(final_path).parent_path().string();
    fsync_directory(parent.empty() ? "." : parent);
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Layout by decreasing element size, stable otherwise: every offset is then a multiple of the element size
  // of the tensor placed there (all sizes are powers of two), so readers can view the bytes in place.
  std::vector<std::size_t> order(tensors.size());
  std::set<std::string> names;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    order[i] = i;
    if (name == "__metadata__") throw DataError(path + ": \"__metadata__\" cannot be a tensor name");
    if (!names.insert(name).second) throw DataError(path + ": tensor " + in_quotes(name) + " is given twice");
    if (!tensor.defined()) throw DataError(path + ": tensor " + in_quotes(name) + " is undefined");
    if (dtype_name_of(tensor.scalar_type()).empty())
      throw DataError(path + ": tensor " + in_quotes(name) + " has dtype " +
                      std::string(c10::toString(tensor.scalar_type())) + ", which safetensors cannot hold");
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return tensors[a].second.element_size() > tensors[b].second.element_size();
  });

  Json meta = Json::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
  meta["format"] = "pt";  // transformers refuses safetensors without it; our tensors are torch tensors
  Json header = Json::object();
  header["__metadata__"] = std::move(meta);
  std::uint64_t offset = 0;
  for (const std::size_t i : order) {
    const auto& [name, tensor] = tensors[i];
    const auto nbytes = static_cast<std::uint64_t>(tensor.numel()) * tensor.element_size();
    header[name] = {{"dtype", dtype_name_of(tensor.scalar_type())},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const Json::type_error& e) {  // names and metadata must be valid UTF-8
    throw DataError(path + ": tensor names and metadata must be UTF-8: " + e.what());
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // so the data starts 8-byte aligned

  TempFile file(path + ".tmp");
  const std::uint64_t header_size = header_text.size();
  write_all(file.fd(), &header_size, sizeof header_size, path);
  write_all(file.fd(), header_text.data(), header_text.size(), path);
  for (const std::size_t i : order) {
    // One tensor at a time on the CPU, so a GPU state dict never needs a second full copy in host memory.
    const at::Tensor cpu = tensors[i].second.to(at::kCPU).resolve_conj().resolve_neg().contiguous();
    write_all(file.fd(), cpu.const_data_ptr(), cpu.numel() * cpu.element_size(), path);
  }
  file.commit(path);
}

void write_text_file(const std::string& path, const std::string& text) {
  TempFile file(path + ".tmp");
  write_all(file.fd(), text.data(), text.size(), path);
  file.commit(path);
}

}  // namespace trainer
