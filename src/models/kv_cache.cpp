#include "models/kv_cache.h"

#include <algorithm>
#include <limits>
#include <numeric>
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

void KvCache::write_rows(const KvCache& part, const at::Tensor& rows, int64_t batch, int64_t end) {
  if (part.layers_.size() != layers_.size())
    throw Error("KvCache::write_rows: a part of " + std::to_string(part.layers_.size()) + " layers into a cache of " +
                std::to_string(layers_.size()));
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const Layer& p = part.layers_[i];
    Layer& l = layers_[i];
    if (!p.keys.defined()) continue;
    if (p.length > end)
      throw Error("KvCache::write_rows: a part of " + std::to_string(p.length) + " positions ending at " +
                  std::to_string(end));
    if (!l.keys.defined()) {
      for (auto [buffer, source] : {std::pair{&l.keys, &p.keys}, std::pair{&l.values, &p.values}}) {
        auto sizes = source->sizes().vec();
        sizes[0] = batch;
        sizes[2] = std::max(end, capacity_);
        *buffer = at::empty(sizes, source->options());
        buffer->narrow(2, 0, end).zero_();
      }
    }
    const int64_t start = end - p.length;
    l.keys.narrow(2, start, p.length).index_copy_(0, rows, p.keys.narrow(2, 0, p.length));
    l.values.narrow(2, start, p.length).index_copy_(0, rows, p.values.narrow(2, 0, p.length));
    l.length = end;
  }
}

std::vector<int64_t> prompt_extents(const at::Tensor& attention_mask, bool left_padded) {
  const at::Tensor mask = attention_mask.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t rows = mask.size(0), width = mask.size(1);
  const int64_t* m = mask.data_ptr<int64_t>();
  std::vector<int64_t> extents;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t first = width, last = -1;
    for (int64_t t = 0; t < width; ++t) {
      if (m[r * width + t] == 0) continue;
      first = std::min(first, t);
      last = t;
    }
    extents.push_back(last < 0 ? 1 : left_padded ? width - first : last + 1);  // an empty row: one position
  }
  return extents;
}

std::vector<PrefillGroup> prefill_groups(const std::vector<int64_t>& extents, int64_t group_cost) {
  const std::size_t n = extents.size();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return extents[static_cast<std::size_t>(a)] > extents[static_cast<std::size_t>(b)];
  });
  // best[j]: the least cost of the first j sorted rows; first[j]: where the last group of that split starts.
  std::vector<int64_t> best(n + 1, 0), first(n + 1, 0);
  for (std::size_t j = 1; j <= n; ++j) {
    best[j] = std::numeric_limits<int64_t>::max();
    for (std::size_t i = 0; i < j; ++i) {  // sorted rows i..j-1 as one group, padded to row i's extent
      const int64_t cost = best[i] + static_cast<int64_t>(j - i) * extents[static_cast<std::size_t>(order[i])] + group_cost;
      if (cost < best[j]) {
        best[j] = cost;
        first[j] = static_cast<int64_t>(i);
      }
    }
  }
  std::vector<PrefillGroup> groups;
  for (std::size_t j = n; j > 0; j = static_cast<std::size_t>(first[j])) {
    PrefillGroup g;
    g.rows.assign(order.begin() + first[j], order.begin() + static_cast<std::ptrdiff_t>(j));
    g.width = extents[static_cast<std::size_t>(g.rows.front())];
    groups.push_back(std::move(g));
  }
  std::reverse(groups.begin(), groups.end());
  return groups;
}

}  // namespace trainer
