// Packing (see packing.h).
#include "data/packing.h"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>

namespace trainer {
namespace {

int64_t input_length(const Example& e) { return static_cast<int64_t>(e.input_ids.size()); }
int64_t label_length(const Example& e, DataFamily family) {
  return family == DataFamily::kSeq2Seq ? static_cast<int64_t>(e.labels.size()) : 0;
}

}  // namespace

PackCapacity pack_capacity(const DataConfig& data, DataFamily family) {
  if (family == DataFamily::kSeq2Seq) return {data.max_input_length, data.max_target_length};
  return {data.max_length, 0};
}

PackCapacity pack_capacity_within(PackCapacity capacity, DataFamily family, int64_t tokens) {
  if (tokens <= 0) return capacity;
  if (family == DataFamily::kCausal) return {std::min(capacity.input, tokens), 0};
  const int64_t total = capacity.input + capacity.labels;
  if (total <= tokens) return capacity;
  const int64_t input = std::max<int64_t>(1, capacity.input * tokens / std::max<int64_t>(1, total));
  return {input, std::max<int64_t>(1, tokens - input)};
}

std::vector<PackedRow> pack_rows(std::span<const Example> examples, DataFamily family, PackCapacity capacity) {
  std::vector<int64_t> order(examples.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  auto length = [&](int64_t i) {
    const Example& e = examples[static_cast<std::size_t>(i)];
    return input_length(e) + label_length(e, family);
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return length(a) > length(b); });
  std::vector<PackedRow> rows;
  for (const int64_t i : order) {
    const Example& e = examples[static_cast<std::size_t>(i)];
    const int64_t input = input_length(e), labels = label_length(e, family);
    auto fits = [&](const PackedRow& row) {
      return row.input + input <= capacity.input && (family == DataFamily::kCausal || row.labels + labels <= capacity.labels);
    };
    auto row = std::find_if(rows.begin(), rows.end(), fits);
    if (row == rows.end()) {
      rows.emplace_back();
      row = rows.end() - 1;
    }
    row->examples.push_back(i);
    row->input += input;
    row->labels += labels;
  }
  for (auto& row : rows) std::sort(row.examples.begin(), row.examples.end());
  return rows;
}

std::vector<std::pair<int64_t, int64_t>> row_sizes(std::span<const PackedRow> rows, DataFamily family) {
  std::vector<std::pair<int64_t, int64_t>> sizes;
  sizes.reserve(rows.size());
  for (const auto& row : rows) sizes.emplace_back(row.input, family == DataFamily::kSeq2Seq ? row.labels : 0);
  return sizes;
}

PackedBatch collate_packed(std::span<const Example> examples, std::span<const PackedRow> rows, DataFamily family,
                           int32_t pad_id, const c10::Device& device) {
  const bool seq2seq = family == DataFamily::kSeq2Seq;
  const auto b = static_cast<int64_t>(rows.size());
  int64_t t = 1, l = 1, s = 1;
  for (const auto& row : rows) {  // lengths from the examples themselves
    int64_t input = 0, labels = 0;
    for (const int64_t i : row.examples) {
      input += input_length(examples[static_cast<std::size_t>(i)]);
      labels += static_cast<int64_t>(examples[static_cast<std::size_t>(i)].labels.size());
    }
    t = std::max(t, input);
    l = std::max(l, labels);
    s = std::max(s, static_cast<int64_t>(row.examples.size()));
  }
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  PackedBatch out;
  out.input_ids = at::full({b, t}, pad_id, long_options);
  out.attention_mask = at::zeros({b, t}, long_options);
  out.segment_ids = at::zeros({b, t}, long_options);
  out.position_ids = at::zeros({b, t}, long_options);
  out.labels = at::full({b, seq2seq ? l : t}, -100, long_options);
  out.segment_examples = at::zeros({b, s + 1}, long_options);
  out.segment_starts = at::zeros({b, s + 1}, long_options);
  if (seq2seq) {
    out.decoder_segment_ids = at::zeros({b, l}, long_options);
    out.decoder_position_ids = at::zeros({b, l}, long_options);
    out.decoder_segment_starts = at::zeros({b, s + 1}, long_options);
  }
  auto* ids = out.input_ids.data_ptr<int64_t>();
  auto* mask = out.attention_mask.data_ptr<int64_t>();
  auto* segments = out.segment_ids.data_ptr<int64_t>();
  auto* positions = out.position_ids.data_ptr<int64_t>();
  auto* labels = out.labels.data_ptr<int64_t>();
  auto* segment_examples = out.segment_examples.data_ptr<int64_t>();
  auto* starts = out.segment_starts.data_ptr<int64_t>();
  int64_t* decoder_segments = seq2seq ? out.decoder_segment_ids.data_ptr<int64_t>() : nullptr;
  int64_t* decoder_positions = seq2seq ? out.decoder_position_ids.data_ptr<int64_t>() : nullptr;
  int64_t* decoder_starts = seq2seq ? out.decoder_segment_starts.data_ptr<int64_t>() : nullptr;
  const int64_t label_columns = seq2seq ? l : t;
  for (int64_t r = 0; r < b; ++r) {
    int64_t column = 0, label_column = 0;
    const auto& row = rows[static_cast<std::size_t>(r)];
    for (std::size_t j = 0; j < row.examples.size(); ++j) {
      const int64_t segment = static_cast<int64_t>(j) + 1;
      const Example& e = examples[static_cast<std::size_t>(row.examples[j])];
      segment_examples[r * (s + 1) + segment] = row.examples[j];
      starts[r * (s + 1) + segment] = column;
      for (std::size_t i = 0; i < e.input_ids.size(); ++i) {
        const int64_t cell = r * t + column + static_cast<int64_t>(i);
        ids[cell] = e.input_ids[i];
        mask[cell] = 1;
        segments[cell] = segment;
        positions[cell] = static_cast<int64_t>(i);
        if (!seq2seq) labels[r * label_columns + column + static_cast<int64_t>(i)] = i == 0 ? -100 : e.labels[i];
      }
      column += static_cast<int64_t>(e.input_ids.size());
      if (seq2seq) {
        decoder_starts[r * (s + 1) + segment] = label_column;
        for (std::size_t i = 0; i < e.labels.size(); ++i) {
          const int64_t cell = r * l + label_column + static_cast<int64_t>(i);
          labels[cell] = e.labels[i];
          decoder_segments[cell] = segment;
          decoder_positions[cell] = static_cast<int64_t>(i);
        }
        label_column += static_cast<int64_t>(e.labels.size());
      }
    }
  }
  if (!device.is_cpu()) {
    for (at::Tensor* tensor : {&out.input_ids, &out.attention_mask, &out.labels, &out.segment_ids, &out.position_ids,
                               &out.decoder_segment_ids, &out.decoder_position_ids, &out.segment_examples,
                               &out.segment_starts, &out.decoder_segment_starts})
      if (tensor->defined()) *tensor = tensor->to(device);
  }
  return out;
}

PackingFigures packing_figures(std::span<const Example> examples, DataFamily family, PackCapacity capacity) {
  PackingFigures figures;
  const auto rows = pack_rows(examples, family, capacity);
  int64_t longest_input = 0, longest_labels = 0;
  for (const auto& row : rows) {
    figures.tokens += row.input + (family == DataFamily::kSeq2Seq ? row.labels : 0);
    longest_input = std::max(longest_input, row.input);
    longest_labels = std::max(longest_labels, row.labels);
  }
  figures.rows = static_cast<int64_t>(rows.size());
  const int64_t capacity_labels = family == DataFamily::kSeq2Seq ? capacity.labels : 0;
  figures.capacity_tokens = figures.rows * (capacity.input + capacity_labels);
  figures.padded_tokens = figures.rows * (longest_input + (family == DataFamily::kSeq2Seq ? longest_labels : 0));
  return figures;
}

}  // namespace trainer
