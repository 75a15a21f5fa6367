// DPO's precomputed reference on disk (see reference_store.h).
#include "train/tasks/preference/reference_store.h"

#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "train/resume_check.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

constexpr char kReferenceMagic[8] = {'T', 'R', 'D', 'P', 'O', 'R', 'F', '1'};
constexpr std::size_t kReferenceHeaderBytes = 8 + 8 + 8;  // magic, position after, count
constexpr std::size_t kReferenceEntryBytes = 8 + 8 + 8;   // key, chosen, rejected

void fnv_bytes_into(uint64_t& h, const void* data, std::size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= bytes[i];
    h *= 0x100000001b3ull;
  }
}
void fnv_ids_into(uint64_t& h, const std::vector<int32_t>& ids) {
  const uint64_t n = ids.size();
  fnv_bytes_into(h, &n, sizeof n);
  fnv_bytes_into(h, ids.data(), ids.size() * sizeof(int32_t));
}

template <class T>
void store_put(std::string& out, T value) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}
template <class T>
T store_get(const std::string& in, std::size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}

std::string store_read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read " + path.string(), "check the permissions of checkpoint.output_dir");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

nlohmann::json store_read_json(const fs::path& path) {
  try {
    return nlohmann::json::parse(store_read_all(path));
  } catch (const nlohmann::json::exception& e) {
    throw DataError(path.string() + " is not valid JSON (" + e.what() + ")",
                    "the file was damaged or edited: delete " + path.parent_path().string() +
                        " and the reference log-probabilities are computed again");
  }
}

}  // namespace

uint64_t pair_key(const Example& pair) {
  uint64_t h = 0xcbf29ce484222325ull;
  fnv_ids_into(h, pair.input_ids);
  fnv_ids_into(h, pair.labels);
  fnv_ids_into(h, pair.rejected_ids);
  fnv_ids_into(h, pair.rejected_labels);
  return h;
}

bool ReferenceStore::has_identity() const { return fs::is_regular_file(dir_ / "identity.json"); }
bool ReferenceStore::complete() const { return fs::is_regular_file(dir_ / "complete.json"); }

std::vector<std::string> ReferenceStore::identity_changes(const nlohmann::json& identity) const {
  if (!has_identity()) return {};
  const nlohmann::json saved = store_read_json(dir_ / "identity.json");
  if (saved == identity) return {};
  std::vector<std::string> changes;
  for (const char* data : {"train_data", "validation_data"}) {
    const auto& before = saved.contains(data) ? saved.at(data) : nlohmann::json();
    const auto& now = identity.contains(data) ? identity.at(data) : nlohmann::json();
    if (before == now) continue;
    if (before.is_null() || now.is_null()) {
      changes.push_back(std::string(data) + (before.is_null() ? ": none then, some now" : ": some then, none now"));
      continue;
    }
    std::vector<std::string> warnings;
    try {
      for (auto& line : data_changes(before, now, warnings)) changes.push_back(std::string(data) + ": " + line);
    } catch (const nlohmann::json::exception&) {
      changes.push_back(std::string(data) + ": its fingerprint differs");
    }
    // Touched files (the same size and records) keep an epoch's order but may hold other text: other values.
    for (auto& line : warnings) changes.push_back(std::string(data) + ": " + line);
  }
  const auto& before = saved.value("settings", nlohmann::json::object());
  const auto& now = identity.value("settings", nlohmann::json::object());
  for (const auto& [key, value] : now.items()) {
    const auto old = before.contains(key) ? before.at(key) : nlohmann::json();
    if (old != value) changes.push_back(key + ": " + old.dump() + " then, " + value.dump() + " now");
  }
  if (changes.empty()) changes.push_back("identity.json differs (written by another trainer release)");
  return changes;
}

void ReferenceStore::start(const nlohmann::json& identity) const {
  if (fs::exists(dir_))
    for (const auto& entry : fs::directory_iterator(dir_)) fs::remove_all(entry.path());
  fs::create_directories(dir_);
  write_text_file((dir_ / "identity.json").string(), identity.dump(2) + "\n");
}

fs::path ReferenceStore::chunk_path(const std::string& split, int64_t index) const {
  return dir_ / fmt::format("{}-{:06d}.bin", split, index);
}

ReferenceStore::Progress ReferenceStore::progress(const std::string& split) const {
  Progress out;
  for (;; ++out.chunks) {
    const fs::path path = chunk_path(split, out.chunks);
    if (!fs::is_regular_file(path)) break;
    std::ifstream in(path, std::ios::binary);
    std::string header(kReferenceHeaderBytes, '\0');
    in.read(header.data(), static_cast<std::streamsize>(kReferenceHeaderBytes));
    if (!in || std::memcmp(header.data(), kReferenceMagic, sizeof kReferenceMagic) != 0)
      throw DataError(path.string() + " is not a chunk of DPO's precomputed reference",
                      "delete " + dir_.string() + " and the reference log-probabilities are computed again");
    out.position = store_get<uint64_t>(header, 8);
    out.pairs += static_cast<int64_t>(store_get<uint64_t>(header, 16));
  }
  return out;
}

void ReferenceStore::write_chunk(const std::string& split, int64_t index, uint64_t position_after,
                                 const std::vector<ReferenceEntry>& entries) const {
  std::string bytes(kReferenceMagic, sizeof kReferenceMagic);
  bytes.reserve(kReferenceHeaderBytes + kReferenceEntryBytes * entries.size());
  store_put<uint64_t>(bytes, position_after);
  store_put<uint64_t>(bytes, entries.size());
  for (const ReferenceEntry& entry : entries) {
    store_put<uint64_t>(bytes, entry.key);
    store_put<double>(bytes, entry.logps.chosen);
    store_put<double>(bytes, entry.logps.rejected);
  }
  write_text_file(chunk_path(split, index).string(), bytes);
}

void ReferenceStore::mark_complete(const nlohmann::json& summary) const {
  write_text_file((dir_ / "complete.json").string(), summary.dump(2) + "\n");
}

ReferenceTable ReferenceStore::load(const std::string& split) const {
  ReferenceTable table;
  for (int64_t index = 0;; ++index) {
    const fs::path path = chunk_path(split, index);
    if (!fs::is_regular_file(path)) break;
    const std::string bytes = store_read_all(path);
    const uint64_t count = bytes.size() >= kReferenceHeaderBytes ? store_get<uint64_t>(bytes, 16) : 0;
    const bool whole = bytes.size() >= kReferenceHeaderBytes &&
                       std::memcmp(bytes.data(), kReferenceMagic, sizeof kReferenceMagic) == 0 &&
                       bytes.size() == kReferenceHeaderBytes + count * kReferenceEntryBytes;
    if (!whole)
      throw DataError(path.string() + " is damaged (" + std::to_string(bytes.size()) + " bytes)",
                      "delete " + dir_.string() + " and the reference log-probabilities are computed again");
    for (uint64_t i = 0; i < count; ++i) {
      const std::size_t at = kReferenceHeaderBytes + i * kReferenceEntryBytes;
      table[store_get<uint64_t>(bytes, at)] = {store_get<double>(bytes, at + 8), store_get<double>(bytes, at + 16)};
    }
  }
  return table;
}

}  // namespace trainer
