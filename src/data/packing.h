// Packing (data.packing): the examples of an effective batch share rows up to a capacity instead of each taking a
// padded row of its own. Which examples share a row is a pure function of the effective batch (first fit by
// decreasing length), so the same seed gives the same rows and a resume the same rows again. The rows carry
// segment ids (which example a position belongs to) and position ids (restarting at 0 per example); models
// attend only within a segment and the loss sums per token, so packed training computes what padded training
// computes (docs/packing.md).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "trainer/config.h"
#include "trainer/data.h"

namespace trainer {

// Tokens one row may hold: encoder input and (seq2seq) decoder targets. Causal rows use `input` only.
struct PackCapacity {
  int64_t input = 0;
  int64_t labels = 0;
};

// The capacity of rows at the configured maximum lengths (data.max_length; max_input_length, max_target_length).
PackCapacity pack_capacity(const DataConfig& data, DataFamily family);
// The same, cut to fit a micro-batch token budget (token-budget mode): a row never holds more than `tokens`
// (input + targets), so a smaller budget packs shorter rows. Seq2seq splits the budget in the ratio of the maxima.
PackCapacity pack_capacity_within(PackCapacity capacity, DataFamily family, int64_t tokens);

// One packed row: indices of its examples (in the span given to pack_rows) in increasing order, and the tokens
// it holds in each stream.
struct PackedRow {
  std::vector<int64_t> examples;
  int64_t input = 0;
  int64_t labels = 0;  // seq2seq only
};

// First fit decreasing: examples by decreasing length (input + targets; ties by index), each into the first row
// where it fits in every stream; an example longer than the capacity takes a row alone. Deterministic.
std::vector<PackedRow> pack_rows(std::span<const Example> examples, DataFamily family, PackCapacity capacity);

// (input tokens, target tokens) of each row, as the memory policy's token split counts them (targets 0 for causal:
// a causal row's labels are its inputs).
std::vector<std::pair<int64_t, int64_t>> row_sizes(std::span<const PackedRow> rows, DataFamily family);

// Rows collated into a micro-batch, padded on the right to the longest row. Segment s >= 1 of row b is its s-th
// example; 0 marks padding.
struct PackedBatch {
  at::Tensor input_ids, attention_mask, labels;  // (B, T), (B, T) 0/1, causal (B, T) / seq2seq (B, L)
  at::Tensor segment_ids, position_ids;          // (B, T) int64
  at::Tensor decoder_segment_ids, decoder_position_ids;  // seq2seq (B, L)
  at::Tensor segment_examples;  // (B, S + 1) int64: index in `examples` of segment s (column 0 unused: 0)
  at::Tensor segment_starts, decoder_segment_starts;  // (B, S + 1) int64: first position of segment s (0: 0)
};
// Causal: a segment's first label is set to -100 (in a padded row it is never a target; in a packed row it would
// be the previous example's last prediction). `rows` index into `examples`.
PackedBatch collate_packed(std::span<const Example> examples, std::span<const PackedRow> rows, DataFamily family,
                           int32_t pad_id, const c10::Device& device);

// Real tokens over the capacity of the rows that hold them (rows x capacity), and over the rows' padded size
// (rows x longest row): what `trainer data` reports.
struct PackingFigures {
  int64_t rows = 0;
  int64_t tokens = 0;            // input + target tokens of the examples
  int64_t capacity_tokens = 0;   // rows x (capacity input + capacity labels)
  int64_t padded_tokens = 0;     // rows x (longest row input + longest row labels), per micro-batch of all rows
};
PackingFigures packing_figures(std::span<const Example> examples, DataFamily family, PackCapacity capacity);

}  // namespace trainer
