// Keyed dropout (see dropout.h).
#include "models/dropout.h"

#include <atomic>
#include <cstring>
#include <stdexcept>

#include <ATen/ATen.h>

#include "util/counter_rng.h"

namespace trainer {
namespace {

constexpr int64_t kRowShift = 40;  // a row's counters: (example << 40) + [0, 2^40)

thread_local std::shared_ptr<const DropoutContext> current_context;
std::atomic<DropoutSource> source{DropoutSource::kKeyed};

}  // namespace

DropoutScope::DropoutScope(uint64_t seed, int64_t step, int64_t first_example, int64_t count,
                           const c10::Device& device)
    : previous_(current_context) {
  auto context = std::make_shared<DropoutContext>();
  context->seed = seed;
  context->step = step;
  context->rows = at::arange(first_example, first_example + count, at::kLong).mul(int64_t{1} << kRowShift).to(device);
  current_context = std::move(context);
}

DropoutScope::DropoutScope(uint64_t seed, int64_t step, std::vector<PackedDropoutStream> streams)
    : previous_(current_context) {
  auto context = std::make_shared<DropoutContext>();
  context->seed = seed;
  context->step = step;
  context->streams = std::move(streams);
  current_context = std::move(context);
}

DropoutScope::DropoutScope(std::shared_ptr<const DropoutContext> context) : previous_(current_context) {
  current_context = std::move(context);
}

DropoutScope::~DropoutScope() { current_context = std::move(previous_); }

std::shared_ptr<const DropoutContext> current_dropout_context() { return current_context; }

void set_dropout_source(DropoutSource s) { source.store(s); }
DropoutSource dropout_source() { return source.load(); }

at::Tensor Dropout::keep_mask(const at::Tensor& x, bool attention) const {
  return draw(x, attention, [this](uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes,
                                   at::IntArrayRef strides) {
    return counter_keep_mask(key, row_base, sizes, strides, p_);
  });
}

at::Tensor Dropout::uniform(const at::Tensor& x) const {
  return draw(x, false, [](uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides) {
    return counter_bits(key, grid_counters(row_base, sizes, strides)).to(at::kFloat) * (1.0 / 4294967296.0);
  }).view(x.sizes());
}

at::Tensor Dropout::draw(const at::Tensor& x, bool attention, const Draw& draw) const {
  if (!site_) throw std::logic_error("a dropout site has no id: build models with build_model (assign_dropout_sites)");
  const int64_t batch = x.size(0);
  const auto context = current_dropout_context();
  uint64_t seed = 0;
  int64_t step = 0;
  at::Tensor rows;
  if (context && !context->streams.empty()) {
    seed = context->seed;
    step = context->step;
  } else if (context) {
    if (context->rows.size(0) != batch)
      throw std::logic_error("dropout: the context names " + std::to_string(context->rows.size(0)) +
                             " examples, the tensor has " + std::to_string(batch) + " rows");
    seed = context->seed;
    step = context->step;
    rows = context->rows.device() == x.device() ? context->rows : context->rows.to(x.device());
  } else {
    rows = at::arange(batch, x.options().dtype(at::kLong)).mul(int64_t{1} << kRowShift);
  }
  const uint64_t key = counter_key({seed, static_cast<uint64_t>(step), *site_});
  if (context && !context->streams.empty()) return packed_draw(*context, x, attention, key, draw);
  std::vector<int64_t> strides;
  if (attention) {
    TORCH_CHECK(x.dim() == 4, "attention dropout takes (B, H, Tq, Tk), got ", x.sizes());
    TORCH_CHECK(x.size(1) < 256 && x.size(2) < 65536 && x.size(3) < 65536,
                "attention dropout supports up to 255 heads and 65535 positions, got ", x.sizes());
    strides = {int64_t{1} << 32, int64_t{1} << 16, 1};
  } else {
    strides.assign(static_cast<std::size_t>(x.dim() - 1), 1);
    for (int64_t d = x.dim() - 3; d >= 0; --d)
      strides[static_cast<std::size_t>(d)] = strides[static_cast<std::size_t>(d + 1)] * x.size(d + 2);
    TORCH_CHECK(x.dim() < 2 || x.size(1) * strides[0] < (int64_t{1} << kRowShift),
                "dropout: one example of ", x.sizes(), " has more than 2^40 elements");
  }
  return draw(key, rows, x.sizes(), strides);
}

// Packed rows: element (b, t, i_1, ..., i_k) of a hidden-state tensor draws at (example << 40) + p * inner + the
// offset of (i_1, ..., i_k), p its position within the example, as it would in the example's padded row; attention
// element (b, h, q, k) at (example << 40) + h << 32 + p_q << 16 + p_k, p_k = k minus the first key position of
// q's example (keys of other examples are masked: their draw does not matter). One grid row per (b, t) or (b, q).
at::Tensor Dropout::packed_draw(const DropoutContext& context, const at::Tensor& x, bool attention, uint64_t key,
                                const Draw& draw) const {
  const auto stream_at = [&](int index) -> const PackedDropoutStream& {
    if (index >= static_cast<int>(context.streams.size()))
      throw std::logic_error("dropout: the site follows packed stream " + std::to_string(index) + ", the context has " +
                             std::to_string(context.streams.size()));
    return context.streams[static_cast<std::size_t>(index)];
  };
  const PackedDropoutStream& rows = stream_at(query_stream_);
  const int64_t b = x.size(0), t = x.dim() > 1 ? x.size(attention ? 2 : 1) : 0;
  if (x.dim() < 2 || rows.segments.size(0) != b || rows.segments.size(1) != t)
    throw std::logic_error("dropout: packed rows of " + std::to_string(rows.segments.size(0)) + " x " +
                           std::to_string(rows.segments.size(1)) + " positions, the tensor is " +
                           c10::str(x.sizes()));
  const auto device = x.device();
  const at::Tensor example = rows.examples.to(device).gather(1, rows.segments.to(device));  // (B, T)
  const at::Tensor position = rows.positions.to(device);
  const at::Tensor base = example.mul(int64_t{1} << kRowShift);
  if (attention) {
    TORCH_CHECK(x.dim() == 4, "attention dropout takes (B, H, Tq, Tk), got ", x.sizes());
    TORCH_CHECK(x.size(1) < 256 && x.size(2) < 65536 && x.size(3) < 65536,
                "attention dropout supports up to 255 heads and 65535 positions, got ", x.sizes());
    const PackedDropoutStream& keys = stream_at(key_stream_);
    const at::Tensor key_start = keys.starts.to(device).gather(1, rows.segments.to(device));  // (B, Tq)
    const at::Tensor row_base = (base + position.mul(int64_t{1} << 16) - key_start).reshape({-1});
    const at::Tensor mask = draw(key, row_base, {b * t, x.size(1), x.size(3)},
                                 {int64_t{1} << 32, 1});  // (B * Tq, H, Tk)
    return mask.view({b, t, x.size(1), x.size(3)}).permute({0, 2, 1, 3});
  }
  std::vector<int64_t> sizes = {b * t};
  std::vector<int64_t> strides;
  int64_t inner = 1;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    strides.insert(strides.begin(), inner);
    inner *= x.size(d);
  }
  for (int64_t d = 2; d < x.dim(); ++d) sizes.push_back(x.size(d));
  const at::Tensor row_base = (base + position.mul(inner)).reshape({-1});
  return draw(key, row_base, sizes, strides).view(x.sizes());
}

at::Tensor Dropout::forward(const at::Tensor& x, bool training) const {
  if (!training || p_ <= 0) return x;
  if (dropout_source() == DropoutSource::kGlobalGenerator) return at::dropout(x, p_, true);
  if (p_ >= 1) return x.mul(0.0);
  // The bool mask is what backward keeps (one byte per element, as CUDA's fused dropout keeps).
  return at::mul(x, keep_mask(x, false)).mul_(1.0 / (1.0 - p_));
}

at::Tensor Dropout::attention(const at::Tensor& probabilities, bool training) const {
  if (!training || p_ <= 0) return probabilities;
  if (dropout_source() == DropoutSource::kGlobalGenerator) return at::dropout(probabilities, p_, true);
  if (p_ >= 1) return probabilities.mul(0.0);
  return at::mul(probabilities, keep_mask(probabilities, true)).mul_(1.0 / (1.0 - p_));
}

uint64_t dropout_site_id(const std::string& path) {
  uint64_t key = counter_key({0x74756f706f7264ULL /* "dropout" */, path.size()});
  for (std::size_t i = 0; i < path.size(); i += 8) {
    uint64_t chunk = 0;
    std::memcpy(&chunk, path.data() + i, std::min<std::size_t>(8, path.size() - i));
    key = counter_key({key, chunk});
  }
  return key;
}

std::pair<int, int> dropout_streams_for_path(const std::string& path) {
  if (!path.starts_with("decoder.")) return {0, 0};
  if (path.find(".EncDecAttention.k.") != std::string::npos || path.find(".EncDecAttention.v.") != std::string::npos)
    return {0, 0};
  if (path.find(".EncDecAttention.dropout") != std::string::npos) return {1, 0};
  return {1, 1};
}

void assign_dropout_sites(Module& root, const std::string& prefix) {
  root.for_each_module([&](const std::string& name, Module& m) {
    if (auto* dropout = dynamic_cast<Dropout*>(&m)) {
      dropout->set_site(dropout_site_id(prefix + name));
      const auto [query, key] = dropout_streams_for_path(prefix + name);
      dropout->set_streams(query, key);
    }
  });
}

}  // namespace trainer
