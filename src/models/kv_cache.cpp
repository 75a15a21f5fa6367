#include "models/kv_cache.h"

#include <algorithm>
#include <string>

#include <ATen/ATen.h>

#include "trainer/errors.h"

namespace trainer {

KvCache::KvCache(std::size_t layers, int64_t capacity) : layers_(layers), capacity_(capacity) {}

std::pair<at::Tensor, at::Tensor> KvCache::append(std::size_t layer, const at::Tensor& keys, const at::Tensor& values) {
  if (layer >= layers_.size())
    throw Error("KvCache: layer " + std::to_string(layer) + " of a cache of " + std::to_string(layers_.size()) + " layers");
  Layer& l = layers_[layer];
  const int64_t added = keys.size(2), needed = l.length + added;
  if (!l.keys.defined() || needed > l.keys.size(2)) {
    const int64_t room = l.keys.defined() ? std::max(needed, 2 * l.keys.size(2)) : std::max(needed, capacity_);
    for (auto [buffer, source] : {std::pair{&l.keys, &keys}, std::pair{&l.values, &values}}) {
      auto sizes = source->sizes().vec();
      sizes[2] = room;
      at::Tensor grown = at::empty(sizes, source->options());
      if (buffer->defined()) grown.narrow(2, 0, l.length).copy_(buffer->narrow(2, 0, l.length));
      *buffer = std::move(grown);
    }
  }
  l.keys.narrow(2, l.length, added).copy_(keys);
  l.values.narrow(2, l.length, added).copy_(values);
  l.length = needed;
  return {l.keys.narrow(2, 0, needed), l.values.narrow(2, 0, needed)};
}

void KvCache::select_rows(const at::Tensor& index) {
  const int64_t rows = index.size(0);
  for (Layer& l : layers_) {
    if (!l.keys.defined()) continue;
    for (at::Tensor* buffer : {&l.keys, &l.values}) {
      auto sizes = buffer->sizes().vec();
      sizes[0] = rows;
      if (!spare_.defined() || spare_.sizes() != at::IntArrayRef(sizes) || spare_.dtype() != buffer->dtype() ||
          spare_.device() != buffer->device())
        spare_ = at::empty(sizes, buffer->options());
      at::Tensor filled = spare_.narrow(2, 0, l.length);
      at::index_select_out(filled, buffer->narrow(2, 0, l.length), 0, index);
      std::swap(*buffer, spare_);
    }
  }
  // A spare of the old row count (rows were dropped) would only hold memory.
  if (spare_.defined() && spare_.size(0) != rows) spare_ = at::Tensor();
}

}  // namespace trainer
