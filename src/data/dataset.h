// Which records a loader reads and in what order: the indexed files, the held-out split (by a seeded
// permutation, so the same records are held out every run), and one epoch's order as a stream of raw records.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/jsonl.h"
#include "data/permutation.h"
#include "data/table_file.h"

namespace trainer::data {

// The records of some files, or a subset of them: all, the training part or the held-out part of a split.
struct Dataset {
  enum class Subset { kAll, kTrain, kHeldOut };

  std::vector<FileIndex> files;
  std::vector<std::uint64_t> first;  // global number of each file's first record; first.back() = total
  bool streamed = false;             // a gzip file is among them: read in order, shuffled through a buffer
  bool grouped = false;              // Parquet/Arrow files: read a row group at a time (then all files are)
  Subset subset = Subset::kAll;
  std::uint64_t held_out = 0;  // records in the held-out part
  Permutation split;           // record g is held out when split(g) < held_out

  std::uint64_t total() const { return first.back(); }
  // Records in this subset: the slots of one epoch.
  std::uint64_t size() const {
    return subset == Subset::kAll ? total() : subset == Subset::kTrain ? total() - held_out : held_out;
  }
  bool contains(std::uint64_t g) const {
    return subset == Subset::kAll || ((split(g) < held_out) == (subset == Subset::kHeldOut));
  }
  // The file of global record g.
  std::uint32_t file_of(std::uint64_t g) const;
};

// Indexes `files` (cached .idx) and selects the subset; `fraction` of the records (rounded down) are held out,
// chosen by `split_seed`.
std::shared_ptr<Dataset> open_dataset(const std::vector<std::string>& files, Dataset::Subset subset, double fraction,
                                      std::uint64_t split_seed);

// One record as read, before it is parsed.
struct RawRecord {
  std::uint64_t slot = 0;    // position in the epoch's order
  std::uint32_t file = 0;    // index into Dataset::files
  std::uint64_t offset = 0;  // byte offset in the (uncompressed) file
  std::uint64_t line = 0;    // 1-based line number; 0 when not known (found from the offset on demand)
  std::string text;
  // Parquet/Arrow records: the row group and the row in it, rendered into JSON text by whoever maps the record
  // (a worker thread), not by the reader; `text` is empty then.
  std::shared_ptr<const TableRows> group;
  std::uint64_t group_row = 0;
  // The record's JSON text: `text`, or the row rendered into `scratch`.
  std::string_view json(std::string& scratch) const {
    if (!group) return text;
    group->render(group_row, scratch);
    return scratch;
  }
};

class RecordStream {
 public:
  virtual ~RecordStream() = default;
  // The next record of the epoch in slot order; false at the end of the epoch.
  virtual bool next(RawRecord& record) = 0;
};

// The streaming shuffle buffer of gzip datasets: at most this many records and this many bytes of them (long
// documents fill it by bytes first), so its memory is bounded whatever the records.
inline constexpr std::size_t kShuffleBufferRecords = 16384;
inline constexpr std::size_t kShuffleBufferBytes = std::size_t{64} << 20;

// The records of `epoch` from `start_slot` on. Parquet/Arrow datasets: a seeded permutation of all files' row
// groups, each group's rows in a seeded permutation of their own (file order when not shuffling); a resumed epoch
// starts reading at its start slot's row group. Indexed datasets: slot k is record order(k), a seeded
// permutation (per seed and epoch) when shuffling, else file order. Streamed datasets: file order through a
// seeded shuffle buffer; starting past slot 0 reads and drops the earlier records (the order is replayed, so
// a resumed epoch continues exactly). The stream ends before `end_slot`.
std::unique_ptr<RecordStream> open_epoch(std::shared_ptr<const Dataset> dataset, bool shuffle, std::uint64_t seed,
                                         std::int64_t epoch, std::uint64_t start_slot,
                                         std::uint64_t end_slot = UINT64_MAX);

// Reads the records of any data file in order (JSONL plain or gzip, Parquet, Arrow), for `trainer data --dump` and
// previews. `number` is the 1-based line of a JSONL record, the 0-based row of a table file's.
class OrderedRecordReader {
 public:
  explicit OrderedRecordReader(const std::string& path);
  ~OrderedRecordReader();
  bool table() const { return table_ != nullptr; }
  bool next(std::string& record, std::uint64_t& number);

 private:
  std::unique_ptr<LineReader> lines_;
  std::unique_ptr<TableReader> table_;
  std::vector<std::string> rows_;
  std::size_t group_ = 0, next_row_ = 0;
  std::uint64_t row_ = 0;
};

}  // namespace trainer::data
