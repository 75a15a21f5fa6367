// Record selection and epoch order (see dataset.h).
#include "data/dataset.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "trainer/errors.h"

namespace trainer::data {
namespace {

constexpr std::uint64_t kSplitSalt = 0x5EEDC0DE5911700Dull;
constexpr std::uint64_t kEpochSalt = 0xE90C4E90C4E90C4Eull;
constexpr std::uint64_t kLinesPerBlock = 10000;  // a JSONL file among tables: lines per block

// Indexed files: each record is read at its offset, so any order costs the same.
class IndexedStream final : public RecordStream {
 public:
  IndexedStream(std::shared_ptr<const Dataset> dataset, bool shuffle, std::uint64_t seed, std::int64_t epoch,
                std::uint64_t start_slot)
      : dataset_(std::move(dataset)), shuffle_(shuffle), slot_(start_slot), files_(dataset_->files.size()) {
    if (shuffle_) {
      order_ = Permutation(dataset_->size(), mix_seed(seed, kEpochSalt, static_cast<std::uint64_t>(epoch)));
    } else if (dataset_->subset != Dataset::Subset::kAll) {
      // File order over a subset: walk to the start_slot-th record of the subset.
      std::uint64_t seen = 0;
      while (seen < start_slot && next_g_ < dataset_->total()) seen += dataset_->contains(next_g_++) ? 1 : 0;
    } else {
      next_g_ = start_slot;
    }
  }

  bool next(RawRecord& record) override {
    if (slot_ >= dataset_->size()) return false;
    const std::uint64_t g = record_at_next_slot();
    const std::uint32_t f = dataset_->file_of(g);
    const FileIndex& file = dataset_->files[f];
    const std::uint64_t local = g - dataset_->first[f];
    const std::uint64_t end = local + 1 < file.records ? file.offsets[local + 1] : file.file_size;
    if (!files_[f]) files_[f] = std::make_unique<RandomAccessFile>(file.path);
    record.slot = slot_++;
    record.file = f;
    record.offset = file.offsets[local];
    record.line = 0;
    files_[f]->read_record(record.offset, end, record.text);
    return true;
  }

 private:
  std::uint64_t record_at_next_slot() {
    const Dataset& d = *dataset_;
    if (shuffle_) {
      const std::uint64_t k = order_(slot_);
      switch (d.subset) {
        case Dataset::Subset::kAll: return k;
        case Dataset::Subset::kTrain: return d.split.inverse(d.held_out + k);
        case Dataset::Subset::kHeldOut: return d.split.inverse(k);
      }
    }
    while (!d.contains(next_g_)) ++next_g_;
    return next_g_++;
  }

  std::shared_ptr<const Dataset> dataset_;
  bool shuffle_;
  std::uint64_t slot_;
  Permutation order_;
  std::uint64_t next_g_ = 0;
  std::vector<std::unique_ptr<RandomAccessFile>> files_;
};

// Gzip files: read in order; shuffling draws from a bounded buffer (as tf.data and HF IterableDataset do).
class StreamedStream final : public RecordStream {
 public:
  StreamedStream(std::shared_ptr<const Dataset> dataset, bool shuffle, std::uint64_t seed, std::int64_t epoch,
                 std::uint64_t start_slot)
      : dataset_(std::move(dataset)),
        shuffle_(shuffle),
        rng_(mix_seed(seed, kEpochSalt, static_cast<std::uint64_t>(epoch))),
        start_slot_(start_slot) {}

  bool next(RawRecord& record) override {
    for (;;) {
      if (!draw(record)) return false;
      if (record.slot >= start_slot_) return true;  // earlier slots were handed out before the resume
    }
  }

 private:
  // The next record in the epoch's order, whatever its slot.
  bool draw(RawRecord& record) {
    if (!shuffle_) {
      if (!read_selected(record)) return false;
      record.slot = slot_++;
      return true;
    }
    while (!exhausted_ && buffer_.size() < kShuffleBufferRecords && buffered_bytes_ < kShuffleBufferBytes) {
      RawRecord incoming;
      if (!read_selected(incoming)) {
        exhausted_ = true;
        break;
      }
      buffered_bytes_ += incoming.text.size();
      buffer_.push_back(std::move(incoming));
    }
    if (buffer_.empty()) return false;
    const std::size_t j = static_cast<std::size_t>(rng_() % buffer_.size());
    std::swap(buffer_[j], buffer_.back());
    record = std::move(buffer_.back());
    buffer_.pop_back();
    buffered_bytes_ -= record.text.size();
    record.slot = slot_++;
    return true;
  }

  // The next record of the files in order that belongs to the subset.
  bool read_selected(RawRecord& record) {
    for (;;) {
      if (!reader_) {
        if (file_ >= dataset_->files.size()) return false;
        reader_ = std::make_unique<LineReader>(dataset_->files[file_].path);
      }
      if (!reader_->next(record.text, record.line, record.offset)) {
        reader_.reset();
        ++file_;
        continue;
      }
      const std::uint64_t g = g_++;
      if (!dataset_->contains(g)) continue;
      record.file = static_cast<std::uint32_t>(file_);
      return true;
    }
  }

  std::shared_ptr<const Dataset> dataset_;
  bool shuffle_;
  std::mt19937_64 rng_;
  std::uint64_t start_slot_;
  std::uint64_t slot_ = 0, g_ = 0;
  std::size_t file_ = 0;
  std::unique_ptr<LineReader> reader_;
  std::vector<RawRecord> buffer_;
  std::size_t buffered_bytes_ = 0;
  bool exhausted_ = false;
};

// Parquet and Arrow files: read a row group at a time. The epoch's order is a seeded permutation of the row
// groups of all files, and within each group a seeded permutation of its rows (file order when not shuffling), so
// only one group is in memory and slot k's (file, row group, row) follows from the seed alone: a resumed epoch
// reads from the group of its start slot on, never the earlier ones.
class GroupedStream final : public RecordStream {
 public:
  GroupedStream(std::shared_ptr<const Dataset> dataset, bool shuffle, std::uint64_t seed, std::int64_t epoch,
                std::uint64_t start_slot)
      : dataset_(std::move(dataset)),
        shuffle_(shuffle),
        key_(mix_seed(seed, kEpochSalt, static_cast<std::uint64_t>(epoch))),
        slot_(start_slot) {
    const Dataset& d = *dataset_;
    for (std::uint32_t f = 0; f < d.files.size(); ++f) {
      std::uint64_t g = d.first[f], row = 0;
      for (std::size_t group = 0; group < d.files[f].group_rows.size(); ++group) {
        const std::uint64_t rows = d.files[f].group_rows[group];
        std::uint64_t selected = rows;
        if (d.subset != Dataset::Subset::kAll) {
          selected = 0;
          for (std::uint64_t k = 0; k < rows; ++k) selected += d.contains(g + k) ? 1 : 0;
        }
        blocks_.push_back({f, group, g, row, rows, selected});
        g += rows;
        row += rows;
      }
    }
    if (shuffle_) order_ = Permutation(blocks_.size(), mix_seed(key_, kBlockSalt));
    // The block of the start slot, and how many of its selected rows were handed out before.
    std::uint64_t before = 0;
    for (; next_block_ < blocks_.size(); ++next_block_) {
      const Block& block = blocks_[block_at(next_block_)];
      if (before + block.selected > start_slot) break;
      before += block.selected;
    }
    skip_ = start_slot - before;
  }

  bool next(RawRecord& record) override {
    for (;;) {
      if (!loaded_ || position_ >= group_rows_) {
        if (next_block_ >= blocks_.size()) return false;
        load(block_at(next_block_++));
        continue;
      }
      const std::uint64_t r = shuffle_ ? row_order_(position_) : position_;
      ++position_;
      const Block& block = blocks_[current_];
      if (!dataset_->contains(block.first_g + r)) continue;
      if (skip_ > 0) {
        --skip_;
        continue;
      }
      record.slot = slot_++;
      record.file = block.file;
      record.line = 0;
      if (!lines_block_) {
        record.offset = block.first_row + r;
        record.text.clear();
        record.group = group_;
        record.group_row = r;
      } else {  // a JSONL file's block: the line's text, at its byte offset (as IndexedStream reads it)
        record.offset = dataset_->files[block.file].offsets[block.first_row + r];
        record.text = std::move(lines_[r]);
        record.group.reset();
        record.group_row = 0;
      }
      return true;
    }
  }

 private:
  struct Block {
    std::uint32_t file;
    std::size_t group;
    std::uint64_t first_g;    // global number of its first record
    std::uint64_t first_row;  // its first row in the file
    std::uint64_t rows;
    std::uint64_t selected;  // rows in the dataset's subset
  };
  static constexpr std::uint64_t kBlockSalt = 0xB10C5B10C5B10C5Bull;

  std::size_t block_at(std::size_t k) const { return shuffle_ ? static_cast<std::size_t>(order_(k)) : k; }

  void load(std::size_t b) {
    const Block& block = blocks_[b];
    const FileIndex& file = dataset_->files[block.file];
    lines_block_ = !file.table;
    if (lines_block_) {  // a JSONL file among tables: its block of lines, read by their offsets
      if (!jsonl_ || jsonl_file_ != block.file) {
        jsonl_ = std::make_unique<RandomAccessFile>(file.path);
        jsonl_file_ = block.file;
      }
      group_.reset();
      lines_.resize(static_cast<std::size_t>(block.rows));
      for (std::uint64_t k = 0; k < block.rows; ++k) {
        const std::uint64_t local = block.first_row + k;
        const std::uint64_t end = local + 1 < file.records ? file.offsets[local + 1] : file.file_size;
        jsonl_->read_record(file.offsets[local], end, lines_[static_cast<std::size_t>(k)]);
      }
      group_rows_ = block.rows;
      current_ = b;
      position_ = 0;
      loaded_ = true;
      if (shuffle_) row_order_ = Permutation(group_rows_, mix_seed(key_, kBlockSalt, b));
      return;
    }
    if (!reader_ || reader_file_ != block.file) {
      reader_.reset();  // one file open at a time
      reader_ = std::make_unique<TableReader>(dataset_->files[block.file].path);
      reader_file_ = block.file;
    }
    group_ = reader_->load_group(block.group);
    group_rows_ = group_->size();
    current_ = b;
    position_ = 0;
    loaded_ = true;
    if (shuffle_) row_order_ = Permutation(group_rows_, mix_seed(key_, kBlockSalt, b));
  }

  std::shared_ptr<const Dataset> dataset_;
  bool shuffle_;
  std::uint64_t key_;
  std::uint64_t slot_;
  std::vector<Block> blocks_;
  Permutation order_;
  std::size_t next_block_ = 0;  // position in the block order
  std::uint64_t skip_ = 0;      // selected rows of the first block already handed out before a resume
  std::unique_ptr<TableReader> reader_;
  std::uint32_t reader_file_ = 0;
  std::shared_ptr<const TableRows> group_;  // the loaded row group (shared with the records handed out of it)
  std::unique_ptr<RandomAccessFile> jsonl_;  // a JSONL file among the tables (its blocks of lines)
  std::uint32_t jsonl_file_ = 0;
  std::vector<std::string> lines_;  // the loaded JSONL block's lines
  bool lines_block_ = false;
  std::uint64_t group_rows_ = 0;
  std::size_t current_ = 0;
  std::uint64_t position_ = 0;
  bool loaded_ = false;
  Permutation row_order_;  // shuffling: the order of the loaded group's rows
};

// Ends another stream before a slot (a length-grouping mega-batch reads only its own slots).
class LimitedStream final : public RecordStream {
 public:
  LimitedStream(std::unique_ptr<RecordStream> inner, std::uint64_t end_slot)
      : inner_(std::move(inner)), end_slot_(end_slot) {}
  bool next(RawRecord& record) override { return inner_->next(record) && record.slot < end_slot_; }

 private:
  std::unique_ptr<RecordStream> inner_;
  std::uint64_t end_slot_;
};

}  // namespace

std::uint32_t Dataset::file_of(std::uint64_t g) const {
  const auto it = std::upper_bound(first.begin(), first.end(), g);
  return static_cast<std::uint32_t>(it - first.begin() - 1);
}

std::shared_ptr<Dataset> open_dataset(const std::vector<std::string>& files, Dataset::Subset subset, double fraction,
                                      std::uint64_t split_seed) {
  auto dataset = std::make_shared<Dataset>();
  dataset->first.push_back(0);
  for (const auto& path : files) {
    dataset->files.push_back(is_table_path(path) ? index_table_file(path) : index_file(path));
    dataset->streamed = dataset->streamed || dataset->files.back().gzip;
    dataset->grouped = dataset->grouped || dataset->files.back().table;
    dataset->first.push_back(dataset->first.back() + dataset->files.back().records);
  }
  // JSONL files among Parquet/Arrow files: blocks of lines that are read, and shuffled, as row groups are.
  if (dataset->grouped)
    for (auto& file : dataset->files)
      if (!file.table) {
        if (file.gzip)
          throw DataError(file.path + ": a gzip JSONL file cannot be read in one data set with Parquet/Arrow files",
                          "decompress it (gunzip: plain JSONL files can be), or convert the files to one format");
        file.group_rows.clear();
        for (std::uint64_t r = 0; r < file.records; r += kLinesPerBlock)
          file.group_rows.push_back(std::min(kLinesPerBlock, file.records - r));
      }
  dataset->subset = subset;
  if (subset != Dataset::Subset::kAll) {
    dataset->held_out = static_cast<std::uint64_t>(std::floor(fraction * static_cast<double>(dataset->total())));
    dataset->split = Permutation(dataset->total(), mix_seed(split_seed, kSplitSalt));
  }
  return dataset;
}

std::unique_ptr<RecordStream> open_epoch(std::shared_ptr<const Dataset> dataset, bool shuffle, std::uint64_t seed,
                                         std::int64_t epoch, std::uint64_t start_slot, std::uint64_t end_slot) {
  std::unique_ptr<RecordStream> stream;
  if (dataset->grouped)
    stream = std::make_unique<GroupedStream>(std::move(dataset), shuffle, seed, epoch, start_slot);
  else if (dataset->streamed)
    stream = std::make_unique<StreamedStream>(std::move(dataset), shuffle, seed, epoch, start_slot);
  else
    stream = std::make_unique<IndexedStream>(std::move(dataset), shuffle, seed, epoch, start_slot);
  if (end_slot == UINT64_MAX) return stream;
  return std::make_unique<LimitedStream>(std::move(stream), end_slot);
}

OrderedRecordReader::OrderedRecordReader(const std::string& path) {
  if (is_table_path(path)) table_ = std::make_unique<TableReader>(path);
  else lines_ = std::make_unique<LineReader>(path);
}

OrderedRecordReader::~OrderedRecordReader() = default;

bool OrderedRecordReader::next(std::string& record, std::uint64_t& number) {
  if (lines_) {
    std::uint64_t offset = 0;
    return lines_->next(record, number, offset);
  }
  while (next_row_ >= rows_.size()) {
    if (group_ >= table_->groups()) return false;
    table_->read_group(group_++, rows_);
    next_row_ = 0;
  }
  record = std::move(rows_[next_row_++]);
  number = row_++;
  return true;
}

}  // namespace trainer::data
