// DPO's precomputed reference (dpo.precompute_reference=true) on disk: checkpoint.output_dir/dpo-reference holds the
// reference's summed log-probabilities of every train and validation pair, written by one pass before training:
//   identity.json        what the values depend on (the data fingerprints, the reference and the settings that
//                        decide the pairs' tokens); another identity means other values;
//   train-000000.bin ... one file per chunk of the pass, written whole (a temporary file renamed), each with the
//                        loader position after its last record, so a pass killed at any moment goes on after the
//                        last finished chunk;
//   validation-000000.bin ...
//   complete.json        written last: the pass is done and the values are only read from then on.
// A pair is found by its key, a hash of its tokens (pair_key), so the order the loader hands pairs out in (shuffle,
// epochs, length grouping, ranks) does not matter. No LibTorch.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/data.h"

namespace trainer {

// A pair's key: FNV-1a (64 bits) over its two sequences' ids and labels with their lengths.
uint64_t pair_key(const Example& pair);

struct ReferenceLogps {
  double chosen = 0, rejected = 0;
};
struct ReferenceEntry {
  uint64_t key = 0;
  ReferenceLogps logps;
};
using ReferenceTable = std::unordered_map<uint64_t, ReferenceLogps>;

class ReferenceStore {
 public:
  static constexpr const char* kDirName = "dpo-reference";
  explicit ReferenceStore(std::filesystem::path dir) : dir_(std::move(dir)) {}
  const std::filesystem::path& dir() const { return dir_; }

  // What differs between identity.json and `identity`, one line each; empty when they are equal or there is no
  // identity.json (nothing computed yet).
  std::vector<std::string> identity_changes(const nlohmann::json& identity) const;
  bool has_identity() const;
  bool complete() const;
  // Starts over: removes what the directory holds and writes identity.json.
  void start(const nlohmann::json& identity) const;

  // The finished chunks of `split` ("train", "validation"): how many (files split-000000.bin on, without a gap),
  // the loader position after the last one's last record and the pairs they hold.
  struct Progress {
    int64_t chunks = 0;
    uint64_t position = 0;
    int64_t pairs = 0;
  };
  Progress progress(const std::string& split) const;
  void write_chunk(const std::string& split, int64_t index, uint64_t position_after,
                   const std::vector<ReferenceEntry>& entries) const;
  void mark_complete(const nlohmann::json& summary) const;
  // Every value of `split`'s finished chunks.
  ReferenceTable load(const std::string& split) const;

 private:
  std::filesystem::path chunk_path(const std::string& split, int64_t index) const;
  std::filesystem::path dir_;
};

}  // namespace trainer
