// What a resume checks before it continues a run: that the settings and the data are those the checkpoint was
// trained with. An exact resume replays the rest of the checkpoint's epoch order, a permutation over the records it
// had, with its seed, precision and optimizer state; other data or other settings of that kind would train some
// records twice and others never, or continue a different run under the same name. All of it runs once, at the
// start: nothing here costs time per step.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer {

// ---- settings --------------------------------------------------------------------------------------------------

// One configuration key whose value differs between the checkpoint's stored resolved config and this run's.
struct ConfigChange {
  std::string key;     // "optimizer.lr"
  std::string before;  // the checkpoint's value, as JSON
  std::string after;   // this run's
  std::string refused_because;  // empty: accepted on resume; else why it breaks the run (the model, exactness)
};

// Why a change of `key` cannot continue the checkpoint's run; empty when it can (learning rate, schedule, length,
// logging, evaluation, checkpoint cadence, memory and device settings, ...).
std::string resume_refusal_reason(const std::string& key);

// Every key that differs, in config order; keys that only one side has (a config written by another trainer
// release) are left out.
std::vector<ConfigChange> config_changes(const nlohmann::json& saved_config, const nlohmann::json& current_config);

// Logs one line listing every changed key. Throws UsageError (exit 2) naming the refused ones with both values,
// unless `allow_change` (--allow-config-change), which logs a warning instead.
void check_resume_config(const nlohmann::json& saved_config, const Config& config, const std::string& checkpoint,
                         bool allow_change);

// ---- data --------------------------------------------------------------------------------------------------------

// The data a run trains on, stored in every checkpoint as train_state.json's "data_fingerprint": each resolved
// train file (absolute path, size, modification time, records), the records of the training part (after
// data.validation_fraction), and the tokenizer files (path, size, FNV-1a hash of the bytes). Uses the offset
// index the loader uses (cached beside the data), so it adds no pass over the data.
nlohmann::json data_fingerprint(const Config& config, const Tokenizer& tokenizer);

// What differs between a stored fingerprint and this run's, one line each ("a.jsonl: 100 records (4.1 KiB) in the
// checkpoint, 150 records (6.2 KiB) now"); `warnings` gets changes that leave the epoch order intact (the same
// files moved, or touched with the same size and records).
std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                      std::vector<std::string>& warnings);

// Compares train_state.json's fingerprint with `current`. Returns true when the data changed and `allow_change`
// (--allow-data-change) lets the run continue: the caller then starts a new epoch over the new data from the
// checkpoint's step. Throws DataError (exit 3) naming what changed otherwise. A checkpoint without a fingerprint
// (written before they existed) resumes with a warning.
// `changes`: how the task compares two of its fingerprints (data_changes by default: text data).
using DataChanges = std::function<std::vector<std::string>(const nlohmann::json& saved, const nlohmann::json& current,
                                                           std::vector<std::string>& warnings)>;
bool check_resume_data(const nlohmann::json& train_state, const nlohmann::json& current, const std::string& checkpoint,
                       bool allow_change, const DataChanges& changes = data_changes);

// Where the loader goes on with changed data: the start of the next epoch (of this one, when the checkpoint was
// taken at an epoch's start), same seed.
LoaderCursor new_epoch_cursor(const LoaderCursor& saved);

}  // namespace trainer
