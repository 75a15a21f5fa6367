// Attention per example inside packed rows (see segment_attention.h).
#include "models/segment_attention.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include "models/dropout.h"
#include "trainer/errors.h"
#include "util/cuda_device.h"

namespace trainer {
namespace {

// TRAINER_PACKED_ATTENTION (auto, per-example, whole-row) sets the starting mode: benchmarks compare the paths.
SegmentAttentionMode mode_from_environment() {
  const char* value = std::getenv("TRAINER_PACKED_ATTENTION");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return SegmentAttentionMode::kAuto;
  if (std::strcmp(value, "per-example") == 0) return SegmentAttentionMode::kPerExample;
  if (std::strcmp(value, "whole-row") == 0) return SegmentAttentionMode::kWholeRow;
  throw UsageError(std::string("TRAINER_PACKED_ATTENTION=") + value + " is not a packed-attention path",
                   "use auto (the default), per-example or whole-row, or unset it");
}

std::atomic<SegmentAttentionMode>& current_mode() {
  static std::atomic<SegmentAttentionMode> mode{mode_from_environment()};
  return mode;
}
std::atomic<int64_t> calls{0};
std::atomic<int64_t> varlen_calls{0};

constexpr int64_t kExampleShift = 40;  // dropout.cpp: an example's counters are (example << 40) + [0, 2^40)

struct Run {
  int64_t start = 0, length = 0;
};
using Runs = std::map<std::pair<int64_t, int64_t>, Run>;  // (row, segment id) -> its positions

// The positions of every segment, or nothing when a segment is split or a position id is not the offset within
// its segment (rows collate_packed did not make).
std::optional<Runs> find_runs(const at::Tensor& segments, const at::Tensor& positions) {
  const at::Tensor s = segments.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor p = positions.defined() ? positions.to(at::kCPU, at::kLong).contiguous() : at::Tensor();
  const int64_t b = s.size(0), t = s.size(1);
  const int64_t* sd = s.data_ptr<int64_t>();
  const int64_t* pd = p.defined() ? p.data_ptr<int64_t>() : nullptr;
  Runs runs;
  for (int64_t r = 0; r < b; ++r) {
    Run* current = nullptr;
    for (int64_t i = 0; i < t; ++i) {
      const int64_t id = sd[r * t + i];
      if (id == 0) {
        current = nullptr;
        continue;
      }
      if (current == nullptr || sd[r * t + i - 1] != id) {
        const auto [it, inserted] = runs.emplace(std::make_pair(r, id), Run{i, 0});
        if (!inserted) return std::nullopt;
        current = &it->second;
      }
      if (pd && pd[r * t + i] != current->length) return std::nullopt;
      current->length += 1;
    }
  }
  return runs;
}

struct Segment {
  int64_t row, id, query_start, query_length, key_start, key_length;
};

}  // namespace

void set_segment_attention_mode(SegmentAttentionMode mode) { current_mode().store(mode); }
SegmentAttentionMode segment_attention_mode() { return current_mode().load(); }
int64_t per_example_attention_calls() { return calls.load(); }
int64_t varlen_attention_calls() { return varlen_calls.load(); }

namespace {
bool half_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The dtype the kernel runs in: q's own when it is bf16 or fp16, else autocast's on CUDA, else none.
std::optional<at::ScalarType> varlen_dtype(at::ScalarType t) {
  if (half_precision(t)) return t;
  if (at::autocast::is_autocast_enabled(at::kCUDA) && half_precision(at::autocast::get_autocast_dtype(at::kCUDA)))
    return at::autocast::get_autocast_dtype(at::kCUDA);
  return std::nullopt;
}
}  // namespace

bool varlen_attention_runs(const at::Tensor& x, int64_t head_dim) {
  return segment_attention_mode() == SegmentAttentionMode::kAuto && x.is_cuda() && head_dim % 8 == 0 &&
         head_dim <= 256 && varlen_dtype(x.scalar_type()) && flash_attention_device(x.device());
}

std::shared_ptr<const VarlenLayout> plan_varlen_attention(const at::Tensor& segments, const at::Tensor& positions) {
  const auto runs = find_runs(segments, positions);
  if (!runs || runs->empty()) return nullptr;
  const int64_t b = segments.size(0), t = segments.size(1);
  std::vector<Run> ordered;  // (row * T + start, length), in stream order
  ordered.reserve(runs->size());
  for (const auto& [where, run] : *runs) ordered.push_back({where.first * t + run.start, run.length});
  std::sort(ordered.begin(), ordered.end(), [](const Run& a, const Run& c) { return a.start < c.start; });
  auto layout = std::make_shared<VarlenLayout>();
  layout->batch = b;
  layout->length = t;
  layout->examples = static_cast<int64_t>(ordered.size());
  std::vector<int32_t> cu{0};
  std::vector<int64_t> index;
  for (const Run& r : ordered) {
    layout->total += r.length;
    layout->max_length = std::max(layout->max_length, r.length);
    cu.push_back(static_cast<int32_t>(layout->total));
    for (int64_t j = 0; j < r.length; ++j) index.push_back(r.start + j);
  }
  TORCH_CHECK(layout->total <= std::numeric_limits<int32_t>::max(), "packed rows of ", layout->total,
              " real positions are too many for the varlen kernel's int32 offsets");
  const auto device = segments.device();
  layout->cu_seqlens = at::tensor(cu, at::TensorOptions().dtype(at::kInt)).to(device);
  if (layout->total < b * t) layout->real_index = at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device);
  return layout;
}

at::Tensor attend_varlen(const VarlenLayout& layout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<int64_t> sliding_window, std::optional<double> scale) {
  varlen_calls.fetch_add(1);
  const int64_t b = q.size(0), heads = q.size(1), d = q.size(3), kv_heads = k.size(1);
  TORCH_CHECK(b == layout.batch && q.size(2) == layout.length && k.size(2) == layout.length,
              "varlen attention planned for ", layout.batch, " rows of ", layout.length, ", got q ", q.sizes(),
              " and k ", k.sizes());
  const auto dtype = varlen_dtype(q.scalar_type());
  TORCH_CHECK(dtype, "varlen attention needs bf16 or fp16 (or autocast to one), got ", q.scalar_type());
  // (total, heads, d): the stream of real positions, contiguous as the kernel wants it.
  const auto stream = [&](const at::Tensor& x, int64_t n) {
    at::Tensor flat = x.transpose(1, 2).reshape({b * layout.length, n, d}).to(*dtype);
    return layout.real_index.defined() ? flat.index_select(0, layout.real_index) : flat.contiguous();
  };
  std::optional<int64_t> left, right;
  if (sliding_window) {  // segment_mask: key k is seen by query q when q - W < k <= q
    left = *sliding_window - 1;
    right = 0;
  }
  at::Tensor out = std::get<0>(at::_flash_attention_forward(
      stream(q, heads), stream(k, kv_heads), stream(v, kv_heads), layout.cu_seqlens, layout.cu_seqlens,
      layout.max_length, layout.max_length, /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false,
      scale, left, right));
  out = out.reshape({layout.total, heads * d});
  if (layout.real_index.defined())
    out = at::zeros({b * layout.length, heads * d}, out.options()).index_copy(0, layout.real_index, out);
  return out.view({b, layout.length, heads * d});
}

std::shared_ptr<const SegmentLayout> plan_segment_attention(const at::Tensor& query_segments,
                                                            const at::Tensor& key_segments,
                                                            const at::Tensor& query_positions,
                                                            const at::Tensor& key_positions, bool causal,
                                                            std::optional<int64_t> sliding_window) {
  const SegmentAttentionMode mode = segment_attention_mode();
  if (mode == SegmentAttentionMode::kWholeRow) return nullptr;
  // The cost rule is the CPU's. On an accelerator the groups' many small launches and host-side planning cost
  // more than the pairs they save: qwen2-100m on an H100, bf16-mixed, per-example ran at 0.06x whole-row's
  // tokens/s (scripts/bench/gpu_packing.py, docs/packing.md). kAuto takes whole rows there, before any planning.
  if (mode == SegmentAttentionMode::kAuto && !query_segments.is_cpu()) return nullptr;
  const bool self = query_segments.is_same(key_segments);
  const auto query_runs = find_runs(query_segments, query_positions);
  if (!query_runs || query_runs->empty()) return nullptr;
  std::optional<Runs> key_storage;
  if (!self) {
    key_storage = find_runs(key_segments, key_positions);
    if (!key_storage) return nullptr;
  }
  const Runs& key_runs = self ? *query_runs : *key_storage;

  std::vector<Segment> segments;
  for (const auto& [where, run] : *query_runs) {
    const auto key = key_runs.find(where);
    if (key == key_runs.end()) return nullptr;  // queries with no key: whole-row attention lets them see every key
    segments.push_back({where.first, where.second, run.start, run.length, key->second.start, key->second.length});
  }
  std::sort(segments.begin(), segments.end(), [](const Segment& a, const Segment& b) {
    if (a.query_length != b.query_length) return a.query_length > b.query_length;
    if (a.key_length != b.key_length) return a.key_length > b.key_length;
    return std::make_pair(a.row, a.id) < std::make_pair(b.row, b.id);
  });

  // Exact partition of the sorted segments into runs of consecutive ones: best[j] is the cheapest cost of the
  // first j, cut[j] where its last group starts. A group's query length is its first segment's (sorted).
  const std::size_t n = segments.size();
  std::vector<int64_t> best(n + 1, std::numeric_limits<int64_t>::max()), cut(n + 1, 0), key_max(n + 1, 0);
  best[0] = 0;
  for (std::size_t j = 1; j <= n; ++j) {
    int64_t longest_key = 0;
    for (std::size_t i = j; i-- > 0;) {
      longest_key = std::max(longest_key, segments[i].key_length);
      const int64_t cost = best[i] + static_cast<int64_t>(j - i) * segments[i].query_length * longest_key +
                           kGroupOverheadPairs;
      if (cost < best[j]) {
        best[j] = cost;
        cut[j] = static_cast<int64_t>(i);
        key_max[j] = longest_key;
      }
    }
  }
  const int64_t b = query_segments.size(0), tq = query_segments.size(1), tk = key_segments.size(1);
  const int64_t row_pairs = b * tq * tk;
  const int64_t per_segment_cost = best[n] + kTokenCostPairs * (b * tq + b * tk);
  if (mode == SegmentAttentionMode::kAuto && per_segment_cost >= row_pairs + kGroupOverheadPairs) return nullptr;

  auto layout = std::make_shared<SegmentLayout>();
  layout->batch = b;
  layout->query_length = tq;
  layout->key_length = tk;
  layout->row_pairs = row_pairs;
  std::vector<std::pair<std::size_t, std::size_t>> spans;  // [begin, end) of each group, in sorted order
  for (std::size_t j = n; j > 0; j = static_cast<std::size_t>(cut[j])) spans.emplace_back(cut[j], j);
  std::reverse(spans.begin(), spans.end());

  const auto device = query_segments.device();
  const auto long_cpu = at::TensorOptions().dtype(at::kLong);
  std::vector<int64_t> output(static_cast<std::size_t>(b * tq), -1);
  int64_t slot_base = 0;
  for (const auto& [begin, end] : spans) {
    SegmentGroup g;
    g.count = static_cast<int64_t>(end - begin);
    g.query_length = segments[begin].query_length;
    for (std::size_t i = begin; i < end; ++i) g.key_length = std::max(g.key_length, segments[i].key_length);
    std::vector<int64_t> query_index, key_index, rows, ids, key_lengths, query_lengths;
    for (std::size_t i = begin; i < end; ++i) {
      const Segment& s = segments[i];
      for (int64_t j = 0; j < g.query_length; ++j) {
        query_index.push_back(s.row * tq + s.query_start + (j < s.query_length ? j : 0));
        if (j < s.query_length)
          output[static_cast<std::size_t>(s.row * tq + s.query_start + j)] =
              slot_base + static_cast<int64_t>(i - begin) * g.query_length + j;
      }
      for (int64_t j = 0; j < g.key_length; ++j)
        key_index.push_back(s.row * tk + s.key_start + (j < s.key_length ? j : 0));
      rows.push_back(s.row);
      ids.push_back(s.id);
      key_lengths.push_back(s.key_length);
      query_lengths.push_back(s.query_length);
    }
    const auto to_tensor = [&](const std::vector<int64_t>& v) {
      return at::tensor(v, long_cpu).to(device);
    };
    g.query_index = to_tensor(query_index);
    g.key_index = to_tensor(key_index);
    g.rows = to_tensor(rows);
    g.segments = to_tensor(ids);
    const at::Tensor q = at::arange(g.query_length, long_cpu).view({1, -1, 1});  // (1, Lq, 1)
    const at::Tensor k = at::arange(g.key_length, long_cpu).view({1, 1, -1});    // (1, 1, Lk)
    const at::Tensor real_key = k < at::tensor(key_lengths, long_cpu).view({-1, 1, 1});     // (n, 1, Lk)
    const at::Tensor padding_query = q >= at::tensor(query_lengths, long_cpu).view({-1, 1, 1});  // (n, Lq, 1)
    at::Tensor pattern = at::ones({1, g.query_length, g.key_length}, long_cpu.dtype(at::kBool));
    if (causal) pattern = pattern & (k <= q);
    if (sliding_window) pattern = pattern & (k > q - *sliding_window);
    g.allowed = (real_key & (pattern | padding_query)).unsqueeze(1).to(device);
    layout->max_query_length = std::max(layout->max_query_length, g.query_length);
    layout->max_key_length = std::max(layout->max_key_length, g.key_length);
    layout->pairs += g.count * g.query_length * g.key_length;
    slot_base += g.count * g.query_length;
    layout->groups.push_back(std::move(g));
  }
  for (auto& o : output)
    if (o < 0) o = slot_base;  // padding positions read the zero row after the groups' outputs
  layout->output_index = at::tensor(output, long_cpu).to(device);
  return layout;
}

at::Tensor attend_per_segment(const SegmentLayout& layout, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const GroupAttention& attend) {
  calls.fetch_add(1);
  const int64_t b = q.size(0), heads = q.size(1), d = q.size(3), kv_heads = k.size(1), dv = v.size(3);
  TORCH_CHECK(b == layout.batch && q.size(2) == layout.query_length && k.size(2) == layout.key_length,
              "per-segment attention planned for ", layout.batch, " rows of ", layout.query_length, " x ",
              layout.key_length, ", got q ", q.sizes(), " and k ", k.sizes());
  // (B * T, heads, d): one row per position, so a segment's positions are gathered with one index.
  const at::Tensor queries = q.transpose(1, 2).reshape({b * layout.query_length, heads, d});
  const at::Tensor keys = k.transpose(1, 2).reshape({b * layout.key_length, kv_heads, d});
  const at::Tensor values = v.transpose(1, 2).reshape({b * layout.key_length, kv_heads, dv});
  const auto context = current_dropout_context();
  std::vector<at::Tensor> outputs;
  outputs.reserve(layout.groups.size() + 1);
  for (const SegmentGroup& g : layout.groups) {
    const int64_t n = g.count, lq = g.query_length, lk = g.key_length;
    const at::Tensor qg = queries.index_select(0, g.query_index).view({n, lq, heads, d}).transpose(1, 2);
    const at::Tensor kg = keys.index_select(0, g.key_index).view({n, lk, kv_heads, d}).transpose(1, 2);
    const at::Tensor vg = values.index_select(0, g.key_index).view({n, lk, kv_heads, dv}).transpose(1, 2);
    // Keyed dropout sees one row per segment: its example's counters, positions within the example.
    std::optional<DropoutScope> scope;
    if (context) {
      auto group_context = std::make_shared<DropoutContext>();
      group_context->seed = context->seed;
      group_context->step = context->step;
      if (!context->streams.empty()) {
        const at::Tensor examples = context->streams[0].examples.to(q.device());  // (B, S + 1)
        group_context->rows = examples.reshape({-1})
                                  .index_select(0, g.rows * examples.size(1) + g.segments)
                                  .mul(int64_t{1} << kExampleShift);
      } else {
        group_context->rows = context->rows.to(q.device()).index_select(0, g.rows);
      }
      scope.emplace(std::shared_ptr<const DropoutContext>(std::move(group_context)));
    }
    const at::Tensor out = attend(qg, kg, vg, g.allowed, g);  // (n, H, Lq, dv)
    outputs.push_back(out.transpose(1, 2).reshape({n * lq, heads * dv}));
  }
  outputs.push_back(at::zeros({1, heads * dv}, outputs.front().options()));
  return at::cat(outputs).index_select(0, layout.output_index).view({b, layout.query_length, heads * dv});
}

}  // namespace trainer
