// Collation: the only part of the data pipeline that needs LibTorch. Pads to the longest sequence of the
// examples given (a micro-batch), never to a configured maximum: padding costs memory and compute.
#include <ATen/ATen.h>

#include "trainer/data.h"

namespace trainer {
namespace {

// (B, T) int64 filled with `pad`, then each row's values; T = the longest row.
at::Tensor pad_rows(std::span<const Example> examples, bool labels, int64_t pad, at::Tensor* mask) {
  std::size_t longest = 0;
  for (const auto& e : examples) longest = std::max(longest, (labels ? e.labels : e.input_ids).size());
  const auto rows = static_cast<int64_t>(examples.size());
  const auto columns = static_cast<int64_t>(longest);
  at::Tensor out = at::full({rows, columns}, pad, at::kLong);
  if (mask) *mask = at::zeros({rows, columns}, at::kLong);
  int64_t* data = out.data_ptr<int64_t>();
  int64_t* mask_data = mask ? mask->data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const auto& ids = labels ? examples[static_cast<std::size_t>(r)].labels : examples[static_cast<std::size_t>(r)].input_ids;
    for (std::size_t c = 0; c < ids.size(); ++c) {
      data[r * columns + static_cast<int64_t>(c)] = ids[c];
      if (mask_data) mask_data[r * columns + static_cast<int64_t>(c)] = 1;
    }
  }
  return out;
}

}  // namespace

CollatedBatch collate(std::span<const Example> examples, int32_t pad_id, const c10::Device& device) {
  CollatedBatch batch;
  batch.input_ids = pad_rows(examples, false, pad_id, &batch.attention_mask);
  batch.labels = pad_rows(examples, true, -100, nullptr);
  if (!device.is_cpu()) {
    batch.input_ids = batch.input_ids.to(device);
    batch.attention_mask = batch.attention_mask.to(device);
    batch.labels = batch.labels.to(device);
  }
  return batch;
}

}  // namespace trainer
