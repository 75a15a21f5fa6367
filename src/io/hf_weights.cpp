// Loading, saving and checking the weights of a Hugging Face model directory (single file or sharded + index).
#include "trainer/hf_weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "trainer/errors.h"
#include "util/strings.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

// Appends at most `limit` lines "  <prefix><item>" and a count of the rest, so that loading a checkpoint of the
// wrong architecture gives a readable message, not thousands of lines.
void append_lines(std::string& message, const std::vector<std::string>& items, const std::string& prefix) {
  constexpr std::size_t limit = 20;
  for (std::size_t i = 0; i < items.size() && i < limit; ++i) message += "\n  " + prefix + items[i];
  if (items.size() > limit) message += "\n  ... and " + std::to_string(items.size() - limit) + " more";
}

StateDict load_sharded(const fs::path& dir, std::optional<at::ScalarType> dtype) {
  const fs::path index_path = dir / kWeightsIndexName;
  const auto weight_map = read_weight_map(index_path);

  // Open every shard (headers only) and compare both ways before loading anything.
  std::map<std::string, std::vector<std::string>> names_by_file;
  for (const auto& [name, file] : weight_map) names_by_file[file].push_back(name);
  std::vector<std::string> missing_files;
  for (const auto& [file, names] : names_by_file)
    if (!fs::exists(dir / file)) missing_files.push_back(file + " (" + std::to_string(names.size()) + " tensors)");
  if (!missing_files.empty()) {
    std::string message = index_path.string() + ": " + std::to_string(missing_files.size()) +
                          " shard files it names are missing:";
    append_lines(message, missing_files, "");
    throw DataError(message, "copy the whole model directory");
  }
  std::vector<SafetensorsFile> shards;
  std::vector<std::string> missing, unexpected;
  for (const auto& [file, names] : names_by_file) {
    shards.push_back(SafetensorsFile::open((dir / file).string()));
    for (const auto& name : names)
      if (shards.back().find(name) == nullptr) missing.push_back(name + " (in " + file + ")");
    for (const auto& info : shards.back().tensors()) {
      const auto it = weight_map.find(info.name);
      if (it == weight_map.end())
        unexpected.push_back(info.name + " (in " + file + ", not in the index)");
      else if (it->second != file)
        unexpected.push_back(info.name + " (in " + file + ", the index says " + it->second + ")");
    }
  }
  if (!missing.empty() || !unexpected.empty()) {
    std::string message = index_path.string() + " does not match its shards: " + std::to_string(missing.size()) +
                          " tensors missing, " + std::to_string(unexpected.size()) + " unexpected";
    append_lines(message, missing, "missing: ");
    append_lines(message, unexpected, "unexpected: ");
    throw DataError(message, "the shards and the index come from different saves: download or save the model again");
  }

  StateDict state;
  for (const auto& shard : shards)
    for (const auto& info : shard.tensors()) state[info.name] = shard.load(info.name, dtype);
  return state;
}

// ---- saving ----------------------------------------------------------------------------------------------------

// transformers' (huggingface_hub's) split: fill shards in order; a tensor that would tip the current shard over
// the limit starts a new one; a tensor larger than the limit gets a shard of its own.
std::vector<NamedTensors> split_into_shards(const NamedTensors& tensors, std::uint64_t max_shard_bytes) {
  std::vector<NamedTensors> shards;
  NamedTensors current;
  std::uint64_t current_bytes = 0;
  for (const auto& entry : tensors) {
    const auto bytes = static_cast<std::uint64_t>(entry.second.numel()) * entry.second.element_size();
    if (max_shard_bytes == 0) {
      current.push_back(entry);
      continue;
    }
    if (bytes > max_shard_bytes) {
      shards.push_back({entry});
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(entry);
    current_bytes += bytes;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  return shards;
}

std::string shard_name(std::size_t k, std::size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k, n);
  return name;
}

// Writes a text file durably under `path` (the caller renames it into place).
void write_text_synced(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw DataError("cannot create " + path.string() + ": " + std::strerror(errno));
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  const int close_rc = ::close(fd);
  if (!ok || close_rc != 0) throw DataError("cannot write " + path.string() + ": " + std::strerror(errno));
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw DataError("cannot rename " + from.string() + " to " + to.string() + ": " + ec.message());
}

void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// model.safetensors or model-DDDDD-of-DDDDD.safetensors: the names a save of ours (or of transformers) owns.
bool is_weight_file_name(const std::string& name) {
  if (name == kWeightsFileName) return true;
  const std::string shape = "model-#####-of-#####.safetensors";
  if (name.size() != shape.size()) return false;
  for (std::size_t i = 0; i < name.size(); ++i)
    if (shape[i] == '#' ? !std::isdigit(static_cast<unsigned char>(name[i])) : name[i] != shape[i]) return false;
  return true;
}

}  // namespace

// The index of a sharded checkpoint: tensor name -> shard file name.
std::map<std::string, std::string> read_weight_map(const std::filesystem::path& index_path) {
  std::ifstream in(index_path);
  if (!in) throw DataError("cannot open " + index_path.string());
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw DataError(index_path.string() + ": invalid JSON: " + e.what(), "download or save the model again");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw DataError(index_path.string() + ": no \"weight_map\" object", "is this a transformers index file?");
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      throw DataError(index_path.string() + ": weight_map[" + in_quotes(name) + "] is not a file name");
    const auto file_name = file.get<std::string>();
    // Shards live next to the index; a path out of the directory is a corrupt or hostile index.
    const fs::path relative(file_name);
    if (file_name.empty() || relative.is_absolute() ||
        std::find(relative.begin(), relative.end(), fs::path("..")) != relative.end())
      throw DataError(index_path.string() + ": weight_map[" + in_quotes(name) + "] = " + in_quotes(file_name) +
                      " is not a file in the model directory");
    weight_map[name] = file_name;
  }
  return weight_map;
}


StateDict load_state_dict(const std::string& dir, std::optional<at::ScalarType> dtype) {
  const fs::path root(dir);
  if (!fs::is_directory(root)) throw DataError("model directory " + dir + " does not exist");
  if (fs::exists(root / kWeightsFileName)) return load_state_dict_files({(root / kWeightsFileName).string()}, dtype);
  if (fs::exists(root / kWeightsIndexName)) return load_sharded(root, dtype);
  throw DataError(dir + " holds no " + kWeightsFileName + " or " + kWeightsIndexName,
                  "convert .bin weights with transformers' save_pretrained(safe_serialization=True)");
}

StateDict load_state_dict_files(const std::vector<std::string>& files, std::optional<at::ScalarType> dtype) {
  std::vector<SafetensorsFile> opened;
  std::map<std::string, std::string> file_of;
  for (const auto& path : files) {
    opened.push_back(SafetensorsFile::open(path));
    for (const auto& info : opened.back().tensors()) {
      const auto [it, inserted] = file_of.emplace(info.name, path);
      if (!inserted)
        throw DataError("tensor " + in_quotes(info.name) + " is in both " + it->second + " and " + path,
                        "these files are not shards of one checkpoint");
    }
  }
  StateDict state;
  for (const auto& file : opened)
    for (const auto& info : file.tensors()) state[info.name] = file.load(info.name, dtype);
  return state;
}

std::vector<std::string> save_state_dict(const std::string& dir, const NamedTensors& tensors,
                                         std::uint64_t max_shard_bytes) {
  return save_state_dict_streamed(dir, tensors, [&](std::size_t i) { return tensors[i].second; }, max_shard_bytes,
                                  /*write=*/true);
}

std::vector<std::string> save_state_dict_streamed(const std::string& dir, const NamedTensors& planned,
                                                  const std::function<at::Tensor(std::size_t)>& fetch,
                                                  std::uint64_t max_shard_bytes, bool write) {
  const fs::path root(dir);
  auto shards = split_into_shards(planned, max_shard_bytes);
  std::map<std::string, std::size_t> index_of;
  for (std::size_t i = 0; i < planned.size(); ++i) index_of[planned[i].first] = i;
  if (!write) {
    for (const auto& shard : shards)
      for (const auto& [name, tensor] : shard) fetch(index_of.at(name));
    return {};
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw DataError("cannot create " + dir + ": " + ec.message());
  const bool sharded = shards.size() > 1;
  std::vector<std::string> names;
  for (std::size_t k = 0; k < shards.size(); ++k)
    names.push_back(sharded ? shard_name(k + 1, shards.size()) : std::string(kWeightsFileName));

  // 1. Every new file, complete and fsynced, under "<name>.new". Nothing the old set uses is touched yet. A file's
  // tensors are fetched when it is written (and dropped after), so what is held is one file's.
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (std::size_t k = 0; k < shards.size(); ++k) {
    NamedTensors values;
    for (const auto& [name, tensor] : shards[k]) values.emplace_back(name, fetch(index_of.at(name)));
    write_safetensors((root / (names[k] + ".new")).string(), values, metadata);
  }
  if (sharded) {
    nlohmann::json index;
    std::uint64_t total_size = 0;
    index["weight_map"] = nlohmann::json::object();
    for (std::size_t k = 0; k < shards.size(); ++k)
      for (const auto& [name, tensor] : shards[k]) {
        index["weight_map"][name] = names[k];
        total_size += static_cast<std::uint64_t>(tensor.numel()) * tensor.element_size();
      }
    index["metadata"] = {{"total_size", total_size}};
    write_text_synced(root / (std::string(kWeightsIndexName) + ".new"), index.dump(2) + "\n");
  }

  // 2. Commit. Loaders take model.safetensors when it exists, else the index.
  const bool old_single = fs::exists(root / kWeightsFileName);
  const bool old_index = fs::exists(root / kWeightsIndexName);
  if (!sharded) {
    rename_or_throw(root / (names[0] + ".new"), root / kWeightsFileName);  // the commit point
  } else {
    bool overwrites_old_shards = false;
    for (const auto& name : names) overwrites_old_shards = overwrites_old_shards || fs::exists(root / name);
    if (overwrites_old_shards && old_index && !old_single)
      fs::remove(root / kWeightsIndexName);  // fail loudly, not mix silently, if we crash in the next loop
    for (const auto& name : names) rename_or_throw(root / (name + ".new"), root / name);
    rename_or_throw(root / (std::string(kWeightsIndexName) + ".new"), root / kWeightsIndexName);
    if (old_single) fs::remove(root / kWeightsFileName);  // the commit point when the old set was one file
  }

  // 3. Remove what the old set had and the new one does not use.
  const std::set<std::string> keep(names.begin(), names.end());
  if (!sharded && old_index) fs::remove(root / kWeightsIndexName);
  for (const auto& entry : fs::directory_iterator(root)) {
    const auto name = entry.path().filename().string();
    if (is_weight_file_name(name) && !keep.count(name)) fs::remove(entry.path());
  }
  fsync_directory(root);
  return names;
}

ShapeMap shapes_of(const StateDict& tensors) {
  ShapeMap shapes;
  for (const auto& [name, tensor] : tensors) shapes[name] = tensor.sizes().vec();
  return shapes;
}

void check_state_dict(const ShapeMap& expected, const ShapeMap& got, const std::string& source) {
  std::vector<std::string> missing, unexpected, wrong_shape;
  for (const auto& [name, shape] : expected) {
    const auto it = got.find(name);
    if (it == got.end())
      missing.push_back(name);
    else if (it->second != shape)
      wrong_shape.push_back(name + ": expected " + shape_text(shape) + ", got " + shape_text(it->second));
  }
  for (const auto& [name, shape] : got)
    if (!expected.count(name)) unexpected.push_back(name);
  if (missing.empty() && unexpected.empty() && wrong_shape.empty()) return;

  std::string message = source + ": the weights do not match the model: " + std::to_string(missing.size()) +
                        " missing, " + std::to_string(unexpected.size()) + " unexpected, " +
                        std::to_string(wrong_shape.size()) + " with the wrong shape";
  append_lines(message, missing, "missing: ");
  append_lines(message, unexpected, "unexpected: ");
  append_lines(message, wrong_shape, "");
  throw DataError(message,
                  "is the checkpoint of the same architecture and size as config.json? (model.path must be the "
                  "directory the weights were saved with)");
}

}  // namespace trainer
