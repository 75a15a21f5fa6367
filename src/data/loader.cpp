// The DataLoader: epochs, batches, length grouping, the cursor, counting, and the bad-record policy, over the
// threaded pipeline (see data.h for the contract).
#include <algorithm>
#include <random>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/dataset.h"
#include "data/pipeline.h"
#include "data/record.h"
#include "trainer/data.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

using data::Dataset;

// Batches per length-grouping mega-batch, as transformers' LengthGroupedSampler (mega_batch_mult = 50).
constexpr std::uint64_t kMegaBatchBatches = 50;
constexpr std::uint64_t kGroupSalt = 0x6B0C4ED1B47C4E5Dull;

struct LoaderOptions {
  std::int64_t batch_size = 1;
  bool shuffle = false;
  bool group_by_length = false;
  std::int64_t epochs = 1;  // < 0: without end
  int workers = 0;
  std::uint64_t seed = 0;
  BadRecordPolicy on_bad_record = BadRecordPolicy::kError;
  RecordShare share;  // data parallelism: this rank tokenizes its share of the records
};

class JsonlLoader final : public DataLoader {
 public:
  JsonlLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options, const Tokenizer& tokenizer,
              data::MappingSpec spec, RecordMapper map = {})
      : dataset_(std::move(dataset)),
        options_(options),
        tokenizer_(tokenizer),
        spec_(std::move(spec)),
        map_(std::move(map)) {
    cursor_.seed = options_.seed;
  }

  std::optional<EffectiveBatch> next() override {
    for (;;) {
      if (options_.epochs >= 0 && cursor_.epoch >= options_.epochs) return std::nullopt;
      if (dataset_->size() == 0) return std::nullopt;
      if (cursor_.position >= dataset_->size()) {
        end_epoch();
        continue;
      }
      if (cursor_.position == 0 && !pipeline_ && group_.empty()) examples_at_epoch_start_ = stats_.examples;
      auto batch = options_.group_by_length ? next_grouped() : next_plain();
      if (batch) {
        batch->epoch = cursor_.epoch;
        for (const auto& example : batch->examples) batch->target_tokens += target_tokens(example, spec_.family);
        return batch;
      }
      end_epoch();  // the rest of the epoch held no usable example
    }
  }

  LoaderCursor cursor() const override { return cursor_; }

  void restore(const LoaderCursor& cursor) override {
    pipeline_.reset();
    group_.clear();
    cursor_ = cursor;
  }

  DataStats stats() const override { return stats_; }
  std::uint64_t examples_per_epoch() const override { return dataset_->size(); }

 private:
  // Without an epoch limit (a run by steps), a whole epoch read from its start without one usable example would
  // repeat forever: stop with what was wrong instead. (With a limit, the epochs end and the run says it had none.)
  void end_epoch() {
    if (options_.epochs < 0 && examples_at_epoch_start_ && stats_.examples == *examples_at_epoch_start_ &&
        stats_.records_read > 0) {
      std::string first = stats_.first_problems.empty() ? "" : "; the first: " + stats_.first_problems.front();
      throw DataError("no usable example in a whole epoch of the training data: " +
                          std::to_string(stats_.records_read) + " records read, " +
                          std::to_string(stats_.bad_records_skipped) + " bad records skipped, " +
                          std::to_string(stats_.overlength_skipped) + " over-length records skipped" + first,
                      stats_.overlength_skipped > 0 ? "raise data.max_length: these records do not fit it"
                                                    : "fix the records, or point data.train_files at other files");
    }
    examples_at_epoch_start_.reset();
    start_next_epoch();
  }

  void start_next_epoch() {
    pipeline_.reset();
    group_.clear();
    ++cursor_.epoch;
    cursor_.position = 0;
  }

  void start_pipeline(std::uint64_t slot, std::uint64_t end_slot = UINT64_MAX) {
    const data::MappingSpec* spec = &spec_;
    const Tokenizer* tokenizer = &tokenizer_;
    data::MapFunction map = map_;
    data::MapRowFunction map_row;  // the default mapping reads Parquet/Arrow rows from their values
    if (!map) {
      map = [spec, tokenizer](std::string_view line) { return data::map_record(line, *spec, *tokenizer); };
      map_row = [spec, tokenizer](const data::TableRows& rows, std::uint64_t row, std::string& scratch) {
        return data::map_table_row(rows, row, scratch, *spec, *tokenizer);
      };
    }
    pipeline_ = std::make_unique<data::Pipeline>(
        data::open_epoch(dataset_, options_.shuffle, cursor_.seed, cursor_.epoch, slot, end_slot),
        std::move(map), options_.workers, options_.share, std::move(map_row));
  }

  // The next usable example of the epoch, counting everything on the way; false at the end of the epoch.
  bool next_example(Example& example) {
    data::MappedRecord mapped;
    for (;;) {
      if (!pipeline_->next(mapped)) return false;
      ++stats_.records_read;
      stats_.records_mapped += mapped.mapped_here ? 1 : 0;
      switch (mapped.outcome.kind) {
        case data::OutcomeKind::kExample:
          ++stats_.examples;
          stats_.truncated += mapped.outcome.truncated ? 1 : 0;
          example = std::move(mapped.outcome.example);
          example.source_index = mapped.slot;
          return true;
        case data::OutcomeKind::kBadRecord:
          if (options_.on_bad_record == BadRecordPolicy::kError || mapped.outcome.fatal)
            throw DataError(where(mapped) + ": " + mapped.outcome.problem,
                            !mapped.outcome.hint.empty()
                                ? mapped.outcome.hint
                                : "fix or remove the record, or set data.on_bad_record = \"skip\" to count and skip "
                                  "bad records");
          ++stats_.bad_records_skipped;
          keep_problem(mapped);
          break;
        case data::OutcomeKind::kOverlengthSkipped:
          ++stats_.overlength_skipped;
          keep_problem(mapped);
          break;
      }
    }
  }

  std::string where(const data::MappedRecord& mapped) const {
    const data::FileIndex& file = dataset_->files[mapped.file];
    if (file.table) return data::table_row_location(file, mapped.offset);
    const std::string& path = file.path;
    const std::uint64_t line = mapped.line ? mapped.line : data::line_number_at(path, mapped.offset);
    return path + ":" + std::to_string(line);
  }

  // The first few are shown as they happen as well; the rest are counted (the summaries print the counts).
  void keep_problem(const data::MappedRecord& mapped) {
    if (stats_.first_problems.size() >= DataStats::kProblemsKept) return;
    stats_.first_problems.push_back(where(mapped) + ": " + mapped.outcome.problem);
    spdlog::warn("data: skipped {}{}", stats_.first_problems.back(),
                 stats_.first_problems.size() == DataStats::kProblemsKept ? " (further problems are only counted)" : "");
  }

  // Batches in the epoch's order; the cursor is the slot after the last example handed out.
  std::optional<EffectiveBatch> next_plain() {
    if (!pipeline_) start_pipeline(cursor_.position);
    EffectiveBatch batch;
    Example example;
    while (static_cast<std::int64_t>(batch.examples.size()) < options_.batch_size && next_example(example))
      batch.examples.push_back(std::move(example));
    if (batch.examples.empty()) return std::nullopt;
    cursor_.position = batch.examples.back().source_index + 1;
    return batch;
  }

  // Length grouping: the slots of mega-batch m are [m*M, (m+1)*M), M = 50 batches. Its examples are sorted by
  // length and cut into batches; the batch with the longest example goes first (a memory problem shows at
  // once), the others in a seeded random order. The cursor is m*M + the examples of m handed out so far, so a
  // restore rebuilds mega-batch m and drops the batches already handed out.
  std::optional<EffectiveBatch> next_grouped() {
    const std::uint64_t mega = kMegaBatchBatches * static_cast<std::uint64_t>(options_.batch_size);
    while (group_.empty()) {
      if (cursor_.position >= dataset_->size()) return std::nullopt;
      const std::uint64_t m = cursor_.position / mega;
      std::uint64_t skip = cursor_.position % mega;
      build_group(m, mega);
      group_start_ = m * mega;
      group_handed_ = 0;
      while (skip > 0 && !group_.empty()) {
        const std::uint64_t n = group_.front().examples.size();
        if (n > skip)
          throw DataError("loader cursor " + std::to_string(cursor_.position) +
                              " does not fall between length-grouped batches",
                          "resume with the same data.group_by_length and training.batch_size");
        skip -= n;
        group_handed_ += n;
        group_.erase(group_.begin());
      }
      // A mega-batch already handed out (or with nothing usable in it): on to the next one.
      if (group_.empty()) cursor_.position = std::min(group_start_ + mega, dataset_->size());
    }
    EffectiveBatch batch = std::move(group_.front());
    group_.erase(group_.begin());
    group_handed_ += batch.examples.size();
    cursor_.position = group_.empty() ? std::min(group_start_ + mega, dataset_->size()) : group_start_ + group_handed_;
    return batch;
  }

  void build_group(std::uint64_t m, std::uint64_t mega) {
    start_pipeline(m * mega, (m + 1) * mega);
    std::vector<Example> examples;
    Example example;
    while (next_example(example)) examples.push_back(std::move(example));
    pipeline_.reset();
    auto length = [&](const Example& e) {
      return e.input_ids.size() + (spec_.family == DataFamily::kSeq2Seq ? e.labels.size() : 0) +
             e.rejected_ids.size();
    };
    std::stable_sort(examples.begin(), examples.end(),
                     [&](const Example& a, const Example& b) { return length(a) > length(b); });
    const auto batch_size = static_cast<std::size_t>(options_.batch_size);
    for (std::size_t i = 0; i < examples.size(); i += batch_size) {
      EffectiveBatch batch;
      const std::size_t stop = std::min(examples.size(), i + batch_size);
      batch.examples.assign(std::make_move_iterator(examples.begin() + static_cast<std::ptrdiff_t>(i)),
                            std::make_move_iterator(examples.begin() + static_cast<std::ptrdiff_t>(stop)));
      group_.push_back(std::move(batch));
    }
    if (group_.size() > 2) {
      std::mt19937_64 rng(data::mix_seed(cursor_.seed ^ kGroupSalt, static_cast<std::uint64_t>(cursor_.epoch), m));
      // Fisher-Yates over batches 1.. (batch 0 holds the longest example and stays first).
      for (std::size_t i = group_.size() - 1; i > 1; --i) {
        const std::size_t j = 1 + static_cast<std::size_t>(rng() % i);
        std::swap(group_[i], group_[j]);
      }
    }
  }

  std::shared_ptr<const Dataset> dataset_;
  LoaderOptions options_;
  const Tokenizer& tokenizer_;
  data::MappingSpec spec_;
  RecordMapper map_;  // a task's own mapping; empty: data::map_record
  std::optional<std::int64_t> examples_at_epoch_start_;  // stats_.examples when this epoch began at its first slot
  LoaderCursor cursor_;
  DataStats stats_;
  std::unique_ptr<data::Pipeline> pipeline_;
  std::vector<EffectiveBatch> group_;  // length grouping: the current mega-batch's batches not yet handed out
  std::uint64_t group_start_ = 0, group_handed_ = 0;
};

LoaderOptions base_options(const Config& config) {
  LoaderOptions options;
  options.workers = static_cast<int>(std::max<std::int64_t>(0, config.data.num_workers));
  options.seed = static_cast<std::uint64_t>(config.training.seed);
  options.on_bad_record = config.data.on_bad_record;
  return options;
}

void check_lengths(const data::MappingSpec& spec) {
  const bool seq2seq = spec.family == DataFamily::kSeq2Seq;
  if (seq2seq ? (spec.max_input_length < 1 || spec.max_target_length < 1) : spec.max_length < 2)
    throw DataError(seq2seq ? "data.max_input_length and data.max_target_length must be at least 1"
                            : "data.max_length must be at least 2",
                    "set the maximum lengths in the data section");
}

}  // namespace

int64_t target_tokens(const Example& example, DataFamily family) {
  int64_t count = 0;
  const std::size_t first = family == DataFamily::kCausal ? 1 : 0;
  for (std::size_t i = first; i < example.labels.size(); ++i) count += example.labels[i] != -100 ? 1 : 0;
  return count;
}

nlohmann::json cursor_to_json(const LoaderCursor& cursor) {
  return {{"epoch", cursor.epoch}, {"position", cursor.position}, {"seed", cursor.seed}};
}

LoaderCursor cursor_from_json(const nlohmann::json& json) {
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!json.is_object() || !json.contains(key) || !json[key].is_number_integer() ||
        (json[key].is_number_integer() && json[key].get<std::int64_t>() < 0 && !json[key].is_number_unsigned()))
      throw DataError(std::string("malformed loader cursor: \"") + key + "\" must be a non-negative integer (got " +
                          json.dump() + ")",
                      "the checkpoint's trainer_state is damaged; resume from an earlier checkpoint");
    return json[key];
  };
  LoaderCursor cursor;
  cursor.epoch = field("epoch").get<std::int64_t>();
  cursor.position = field("position").get<std::uint64_t>();
  cursor.seed = field("seed").get<std::uint64_t>();
  return cursor;
}

std::unique_ptr<DataLoader> make_train_loader(const Config& config, const Tokenizer& tokenizer, DataFamily family,
                                              const RecordShare& share) {
  return make_train_loader(config, tokenizer, family, share, {});
}

std::unique_ptr<DataLoader> make_train_loader(const Config& config, const Tokenizer& tokenizer, DataFamily family,
                                              const RecordShare& share, RecordMapper map) {
  const DataConfig& d = config.data;
  if (d.train_files.empty())
    throw DataError("data.train_files is empty", "list the JSONL files (or globs) to train on in data.train_files");
  const auto files = data::expand_globs(d.train_files, "data.train_files");
  const bool split = d.validation_files.empty() && d.validation_fraction > 0;
  auto dataset = data::open_dataset(files, split ? Dataset::Subset::kTrain : Dataset::Subset::kAll,
                                    d.validation_fraction, static_cast<std::uint64_t>(config.training.seed));
  if (dataset->size() == 0)
    throw DataError("data.train_files holds no records (" + std::to_string(dataset->total()) + " in " +
                        std::to_string(files.size()) + " file(s), all held out for validation or blank)",
                    "check the files, or lower data.validation_fraction");
  auto spec = data::mapping_spec(config, family);
  check_lengths(spec);
  LoaderOptions options = base_options(config);
  options.batch_size = std::max<std::int64_t>(1, config.training.batch_size);
  options.shuffle = d.shuffle;
  options.group_by_length = d.group_by_length;
  options.epochs = config.training.max_steps > 0 ? -1 : config.training.epochs;
  options.share = share;
  spdlog::debug("train data: {} records in {} file(s){}", dataset->size(), files.size(),
                dataset->streamed ? " (gzip: streamed through a shuffle buffer)" : "");
  return std::make_unique<JsonlLoader>(std::move(dataset), options, tokenizer, std::move(spec), std::move(map));
}

std::unique_ptr<DataLoader> make_validation_loader(const Config& config, const Tokenizer& tokenizer,
                                                   DataFamily family, int64_t batch_size,
                                                   const RecordShare& share) {
  return make_validation_loader(config, tokenizer, family, batch_size, share, {});
}

std::unique_ptr<DataLoader> make_validation_loader(const Config& config, const Tokenizer& tokenizer,
                                                   DataFamily family, int64_t batch_size, const RecordShare& share,
                                                   RecordMapper map) {
  const DataConfig& d = config.data;
  std::shared_ptr<Dataset> dataset;
  if (!d.validation_files.empty()) {
    dataset = data::open_dataset(data::expand_globs(d.validation_files, "data.validation_files"),
                                 Dataset::Subset::kAll, 0.0, 0);
  } else if (d.validation_fraction > 0 && !d.train_files.empty()) {
    dataset = data::open_dataset(data::expand_globs(d.train_files, "data.train_files"), Dataset::Subset::kHeldOut,
                                 d.validation_fraction, static_cast<std::uint64_t>(config.training.seed));
  }
  if (!dataset || dataset->size() == 0) return nullptr;
  auto spec = data::mapping_spec(config, family);
  check_lengths(spec);
  LoaderOptions options = base_options(config);
  options.batch_size = std::max<std::int64_t>(1, batch_size);
  options.share = share;
  return std::make_unique<JsonlLoader>(std::move(dataset), options, tokenizer, std::move(spec), std::move(map));
}

}  // namespace trainer
