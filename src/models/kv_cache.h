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

}  // namespace trainer
