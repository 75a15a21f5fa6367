// The weights of a Hugging Face model directory: one model.safetensors, or shards model-0000k-of-0000n.safetensors
// with model.safetensors.index.json. Loading, saving (sharded as transformers does) and checking names and
// shapes against what a model expects.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "trainer/safetensors.h"

namespace trainer {

using StateDict = std::map<std::string, at::Tensor>;
using ShapeMap = std::map<std::string, std::vector<int64_t>>;

inline constexpr const char* kWeightsFileName = "model.safetensors";
inline constexpr const char* kWeightsIndexName = "model.safetensors.index.json";
// transformers' default max_shard_size ("5GB").
inline constexpr std::uint64_t kDefaultMaxShardBytes = 5'000'000'000ull;

// Loads every tensor of the model directory `dir` (model.safetensors, else the index and its shards), converted to
// `dtype` when given, one tensor at a time (see SafetensorsFile::load). With an index, first checks that every
// tensor it lists is in its shard and every tensor of a shard is listed for that shard, and throws one DataError
// listing all that is missing or unexpected.
StateDict load_state_dict(const std::string& dir, std::optional<at::ScalarType> dtype = std::nullopt);

// Loads every tensor of the given safetensors files; a name in two files is an error.
StateDict load_state_dict_files(const std::vector<std::string>& files,
                                std::optional<at::ScalarType> dtype = std::nullopt);

// Saves `tensors` into `dir` (created if needed) as transformers does: model.safetensors when the total fits in
// `max_shard_bytes` (0: no limit), otherwise shards model-00001-of-0000n.safetensors filled in the given order
// (a tensor larger than the limit gets a shard of its own) plus model.safetensors.index.json with total_size.
// Weight files of an earlier save that the new set does not use are removed. Returns the weight file names.
//
// Crash safety: every new file is written and fsynced under a temporary name first, then renamed into place in an
// order where a loader (which prefers model.safetensors over the index) sees the old set until the last rename
// and the new set after it. One case cannot be made atomic with fixed file names: resharding over an old set
// with the same shard count, which overwrites files the old index names. There the old index is removed first,
// so a crash in that window leaves a directory that fails to load with a clear error rather than a silent mix
// of old and new shards. Checkpoints get full atomicity from being written to a temporary directory renamed into
// place. Tensors sharing storage (tied weights) are written once per name: drop tied names before saving.
std::vector<std::string> save_state_dict(const std::string& dir, const NamedTensors& tensors,
                                         std::uint64_t max_shard_bytes = kDefaultMaxShardBytes);
// The same files from tensors fetched one file at a time: `planned` gives each tensor's name, shape and dtype (meta
// tensors will do), `fetch(i)` the values of planned[i] (they must stay valid until their file is written: a copy when
// they live in a buffer the next fetch reuses). Every
// tensor is fetched exactly once per file it is written to, in an order that depends on `planned` alone, also when
// `write` is false: every rank of a sharded run calls it so that each gather is a collective of all ranks, and one
// rank writes.
std::vector<std::string> save_state_dict_streamed(const std::string& dir, const NamedTensors& planned,
                                                  const std::function<at::Tensor(std::size_t)>& fetch,
                                                  std::uint64_t max_shard_bytes, bool write);

// The index of a sharded checkpoint (model.safetensors.index.json): tensor name -> shard file name. Throws
// DataError for a malformed index or a shard path that leaves the model directory.
std::map<std::string, std::string> read_weight_map(const std::filesystem::path& index_path);

// Names and shapes of a state dict (or of a model's parameters), for check_state_dict.
ShapeMap shapes_of(const StateDict& tensors);

// Throws one DataError, naming `source` (a model directory or file), that lists every missing tensor, every
// unexpected tensor and every wrong shape ("name: expected [a, b], got [c, d]"); returns when `got` matches.
void check_state_dict(const ShapeMap& expected, const ShapeMap& got, const std::string& source);

}  // namespace trainer
