// Reading and writing safetensors files: the weight format of Hugging Face model directories and of trainer's
// own checkpoints. Reading memory-maps the file and validates the whole header before any tensor is touched.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

// Tensors in the order they are written; the names must be unique.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// One tensor of a safetensors file as its header describes it.
struct TensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::string dtype_name;      // as written in the file: "BF16", "F32", ...
  std::vector<int64_t> shape;  // [] for a scalar
  std::uint64_t begin = 0;     // byte range [begin, end) relative to the end of the header
  std::uint64_t end = 0;
  std::uint64_t nbytes() const { return end - begin; }
};

// The safetensors dtype names trainer reads and writes, with their LibTorch types.
const std::vector<std::pair<std::string, at::ScalarType>>& safetensors_dtypes();

// A safetensors file opened read-only by memory-mapping (MAP_PRIVATE, PROT_READ). Copies share the mapping,
// which lives as long as the last copy or the last tensor returned by view().
class SafetensorsFile {
 public:
  // Maps `path` and validates its header: sizes, JSON, dtypes, shapes, byte ranges (inside the data, no
  // overlaps, size = numel x element size) and metadata (strings only). Throws DataError naming the file and
  // the tensor.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const;
  // Every tensor, in the order of its data in the file.
  const std::vector<TensorInfo>& tensors() const;
  // nullptr when the file holds no tensor of that name.
  const TensorInfo* find(const std::string& name) const;
  // The "__metadata__" strings (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const;

  // A CPU tensor over the mapped bytes, with no copy; it keeps the mapping alive. The mapping is read-only:
  // never write into the tensor (writing faults). A tensor whose bytes are not aligned to its element size
  // (possible in files from other writers) is returned as a copy instead, since ATen kernels assume alignment.
  at::Tensor view(const std::string& name) const;

  // Copies one tensor into memory from LibTorch's CPU allocator, converting to `dtype` on the way when given,
  // then drops the tensor's pages of the mapping from this process's resident memory. Loading a whole file
  // tensor by tensor therefore peaks at about the loaded bytes plus one tensor, not two copies of the file.
  at::Tensor load(const std::string& name, std::optional<at::ScalarType> dtype = std::nullopt) const;

 private:
  struct State;
  explicit SafetensorsFile(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  const TensorInfo& info_or_throw(const std::string& name) const;
  std::shared_ptr<const State> state_;
};

// Writes `tensors` (any device, dtype in safetensors_dtypes(); made contiguous) to `path` as safetensors:
// header JSON padded with spaces to a multiple of 8, metadata with "format": "pt" (transformers requires it),
// data little-endian in C order. Tensors are laid out by decreasing element size (as the Python package does) so
// that every tensor starts aligned to its element size. The file is written to `path + ".tmp"`, fsynced and
// renamed, so `path` holds either the old file or the whole new one. Throws DataError naming the file and tensor
// for duplicate names, unsupported dtypes and I/O errors.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `text` to `path` as write_safetensors writes: to path.tmp, synced, renamed into place. Throws DataError
// naming the file and the system's reason (a full disk among them); on failure the old file, if any, is intact.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace trainer
