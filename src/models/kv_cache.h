// The key-value cache of incremental decoding (generation): per layer, buffers preallocated for the whole
// generation and written in place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trainer {

// Keys and values (B, H, positions, d) of every attention layer of a stack. Each layer's buffers hold `capacity`
// positions from its first append (the prompt plus the tokens to generate), so a decoding step copies only its
// new positions; concatenating would copy the whole cache at every step. Attention gets views of the filled
// positions.
class KvCache {
 public:
  KvCache(std::size_t layers, int64_t capacity);

  // Writes keys and values (B, H, T, d) of `layer` after its filled positions and returns views (B, H, length, d)
  // of all of them. Runs past the capacity by growing the buffers (to twice the room needed).
  std::pair<at::Tensor, at::Tensor> append(std::size_t layer, const at::Tensor& keys, const at::Tensor& values);

  // Keeps the rows `index` (long, on the cache's device) of every layer, in that order; rows may repeat. Copies
  // the filled positions only, through one spare buffer, so the cache's memory grows by one layer's keys at most.
  void select_rows(const at::Tensor& index);

  // Writes the filled positions of `part`, a cache of the rows `rows` (long, on this cache's device) of a batch of
  // `batch` rows, into those rows, ending at position `end`: how a batch of prompts prefilled in groups of similar
  // length (prefill_groups) becomes one left-padded cache. Positions before a part's start are zeros (the mask
  // hides them; zeros keep them finite). Every part must end at the same `end`; this cache's length becomes `end`.
  void write_rows(const KvCache& part, const at::Tensor& rows, int64_t batch, int64_t end);

  // Filled positions (those of layer 0; every layer has as many after a whole forward pass).
  int64_t length() const { return layers_.empty() ? 0 : layers_.front().length; }

 private:
  struct Layer {
    at::Tensor keys, values;  // (B, H, room, d)
    int64_t length = 0;
  };
  std::vector<Layer> layers_;
  int64_t capacity_;
  at::Tensor spare_;  // a buffer of the layers' shape, the target of the next row selection
};

// Rows of a batch of prompts grouped for a prefill without most of the padding: each prompt spans `extent`
// positions of the padded batch (its tokens and the padding between them; the rest is padding on one side), and a
// group runs padded to its longest extent. Groups are runs of the prompts sorted by extent that minimise the
// padded positions plus `group_cost` positions per group (the fixed cost of a pass, and the smaller products'
// lower speed). One group holds every row when splitting saves nothing.
struct PrefillGroup {
  std::vector<int64_t> rows;  // in the batch, longest extent first
  int64_t width = 0;          // the longest extent of the group
};
// Each row's extent in a padded batch (B, T) of 0/1 attention masks: from its first real position to the end when
// the padding is on the left, from the start to its last real position otherwise.
std::vector<int64_t> prompt_extents(const at::Tensor& attention_mask, bool left_padded);
std::vector<PrefillGroup> prefill_groups(const std::vector<int64_t>& extents, int64_t group_cost = 64);

}  // namespace trainer
