// The data pipeline's contract with the training engine: JSONL records become tokenized examples, grouped into
// effective batches of training.batch_size examples whose target-token count is known before any split, and
// collated into padded micro-batches. The loader's position (cursor) is part of every checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "trainer/config.h"
#include "trainer/tokenizer.h"

namespace trainer {

enum class DataFamily { kSeq2Seq, kCausal };

// One tokenized training example.
//   seq2seq: input_ids = encoder input; labels = decoder targets (ending in EOS when add_eos).
//   causal:  input_ids = the whole sequence; labels has the same length, -100 on prompt tokens (the loss
//            skips them), the token id elsewhere. The model shifts: position t predicts labels[t + 1].
//   preference pair (training.objective=dpo): input_ids/labels are prompt + chosen completion, rejected_ids /
//            rejected_labels prompt + rejected completion, labelled like causal examples (the completion only).
struct Example {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;
  uint64_t source_index = 0;  // the record's position in its epoch's order (for the cursor and for tests)
  std::vector<int32_t> rejected_ids;  // a preference pair's second sequence; empty otherwise
  std::vector<int32_t> rejected_labels;
};

// Tokens that count in the loss: seq2seq every label that is not -100; causal labels[1..] that are not -100.
int64_t target_tokens(const Example& example, DataFamily family);

// The examples of one optimizer step, with the token count the loss is normalised by.
struct EffectiveBatch {
  std::vector<Example> examples;
  int64_t target_tokens = 0;  // sum over examples, counted before the memory policy splits the batch
  int64_t epoch = 0;
};

// Counts shown at the end of every epoch and of the run: nothing is dropped silently.
struct DataStats {
  int64_t records_read = 0;
  int64_t examples = 0;
  int64_t bad_records_skipped = 0;  // with data.on_bad_record = skip
  int64_t truncated = 0;            // over-length examples cut to the maximum
  int64_t overlength_skipped = 0;   // with data.on_overlength = skip
  std::vector<std::string> first_problems;  // "file:line: what is wrong", the first kProblemsKept
  static constexpr std::size_t kProblemsKept = 10;  // further problems are only counted
  // Records this process parsed and tokenized itself: records_read in one process; about records_read / N on each
  // of N data-parallel ranks (RecordShare), which get the others' from them.
  int64_t records_mapped = 0;
};

// Where the loader is: serialised into checkpoints; restoring it yields exactly the examples not yet seen.
struct LoaderCursor {
  int64_t epoch = 0;
  uint64_t position = 0;  // examples of this epoch's order already handed out
  uint64_t seed = 0;
  bool operator==(const LoaderCursor&) const = default;
};
nlohmann::json cursor_to_json(const LoaderCursor& cursor);
LoaderCursor cursor_from_json(const nlohmann::json& json);  // throws DataError on a malformed cursor

class DataLoader {
 public:
  virtual ~DataLoader() = default;
  // The next effective batch, or nothing when the configured epochs are done. Throws DataError (file:line)
  // for a bad record when data.on_bad_record = error.
  virtual std::optional<EffectiveBatch> next() = 0;
  virtual LoaderCursor cursor() const = 0;
  virtual void restore(const LoaderCursor& cursor) = 0;
  virtual DataStats stats() const = 0;
  // Examples per epoch (after skips), known once the files are indexed; used for the schedule's length.
  virtual uint64_t examples_per_epoch() const = 0;
};

// Data parallelism for the text loader: rank `rank` of `world` parses and tokenizes only the records at positions
// p % world == rank of the record stream (counted from where the loader's pass starts, which is the same on every
// rank), and `exchange` gives it the rest: a collective that every rank calls once per chunk of records (64), in the
// same order, with its own bytes, and that returns every rank's bytes in rank order. Afterwards every rank holds what
// one process would have mapped, so everything after (the bad-record policy, length grouping, the shares of each
// batch, the global token counts, the cursor) is one process's. A rank whose mapping threw (not bad data: an
// exception) sends the error instead, and every rank throws it. world 1 (the default): no exchange.
struct RecordShare {
  int rank = 0;
  int world = 1;
  std::function<std::vector<std::string>(const std::string& mine)> exchange;
};

// Training data: data.train_files (minus data.validation_fraction), shuffled per epoch (data.shuffle) by
// training.seed, training.batch_size examples per effective batch; the last batch of an epoch may be smaller
// (nothing is dropped). Runs training.epochs epochs, or without end when training.max_steps > 0 (the engine
// stops at the step count).
std::unique_ptr<DataLoader> make_train_loader(const Config& config, const Tokenizer& tokenizer, DataFamily family,
                                              const RecordShare& share = {});
// A task's own record mapping (a preference pair), in place of data/record.h's map_record: `map` is called from
// the worker threads and must be thread-safe; what it returns is a data::Outcome (data/record.h).
namespace data {
struct Outcome;
}
using RecordMapper = std::function<data::Outcome(std::string_view line)>;
std::unique_ptr<DataLoader> make_train_loader(const Config& config, const Tokenizer& tokenizer, DataFamily family,
                                              const RecordShare& share, RecordMapper map);
// Validation data: data.validation_files or the held-out fraction; one pass, in file order, no shuffling;
// `batch_size` examples per batch. Nothing when there is no validation data.
std::unique_ptr<DataLoader> make_validation_loader(const Config& config, const Tokenizer& tokenizer,
                                                   DataFamily family, int64_t batch_size,
                                                   const RecordShare& share = {});
std::unique_ptr<DataLoader> make_validation_loader(const Config& config, const Tokenizer& tokenizer,
                                                   DataFamily family, int64_t batch_size, const RecordShare& share,
                                                   RecordMapper map);

// Pads to the longest sequence of these examples (never to a maximum length): input_ids with pad_id,
// attention_mask 0/1, labels with -100; on `device`.
struct CollatedBatch {
  at::Tensor input_ids, attention_mask, labels;
};
CollatedBatch collate(std::span<const Example> examples, int32_t pad_id, const c10::Device& device);

}  // namespace trainer

namespace trainer {

// `trainer data --dump N [FILE]`: instead of the pass, the first N examples of FILE (default: the first train file)
// as record mapping makes them, one JSON line each.
struct DataCommandOptions {
  int64_t dump = -1;  // < 0: no dump
  std::string dump_file;
  // A task's own record mapping (training.objective=dpo: preference pairs), made once the tokenizer is loaded; the
  // CLI sets it from the task's folder. Empty: data/record.h's mapping.
  std::function<RecordMapper(const Config& config, const Tokenizer& tokenizer)> mapper;
};

// `trainer data`: streams train (and validation) data once through the loader and collation, and prints the
// counts, the first problems and the throughput, and the first chat record with its trained tokens marked. Returns
// the exit code; throws DataError for bad data.
int run_data(const Config& config, std::ostream& out, const DataCommandOptions& options = {});

// `trainer data` for an image task: the training images (augmented when data.augment is on) and the validation
// images, each once, through data.num_workers decoding threads.
int run_image_data(const Config& config, std::ostream& out);

}  // namespace trainer
