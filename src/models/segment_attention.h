// Attention per example inside packed rows (data.packing, docs/packing.md). A packed row's whole-row attention
// scores every pair of positions in the row and masks the pairs across examples; here each example's queries,
// keys and values are gathered into a batch of segments (grouped by length, each group padded to its longest),
// attended in one call per group, and scattered back, so a packed row pays attention only inside its examples.
// The models (t5.cpp, llama.cpp) plan a layout once per forward and pass it to every layer; the attention maths
// itself (bias, scaling, softmax, dropout) stays in the model and runs on each group.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trainer {

// Segments of similar length, attended together: `count` segments padded to `query_length` queries and
// `key_length` keys. Slot j of segment i is position query_index[i * query_length + j] of the flattened
// (B * Tq) rows (a padding slot repeats the segment's first position; its output is dropped).
struct SegmentGroup {
  int64_t count = 0, query_length = 0, key_length = 0;
  at::Tensor query_index, key_index;  // (count * query_length), (count * key_length) int64
  // (count, 1, Lq, Lk) bool, true = attend: the segment's real keys, causal (and within the sliding window) by
  // position within the segment. A padding query slot sees every real key, so no softmax row is empty.
  at::Tensor allowed;
  at::Tensor rows, segments;  // (count) int64: each segment's row and segment id (keyed dropout finds its example)
};

// How one attention (a query stream over a key stream) runs per segment.
struct SegmentLayout {
  int64_t batch = 0, query_length = 0, key_length = 0;  // B, Tq, Tk of the rows
  std::vector<SegmentGroup> groups;
  at::Tensor output_index;  // (B * Tq) int64: each row position's slot in the groups' outputs; padding: a zero row
  int64_t max_query_length = 0, max_key_length = 0;  // over the groups (T5 slices its position bias to these)
  int64_t pairs = 0;      // query-key pairs the groups score (padding slots included)
  int64_t row_pairs = 0;  // pairs whole-row attention scores: B * Tq * Tk
};

// Which path packed rows take. kAuto (the default) plans per-segment attention when its estimated cost is lower
// than whole-row attention's (see plan_segment_attention); the others force a path (tests, benchmarks).
enum class SegmentAttentionMode { kAuto, kPerExample, kWholeRow };
void set_segment_attention_mode(SegmentAttentionMode mode);  // process-wide
SegmentAttentionMode segment_attention_mode();
// How many times attend_per_segment has run in this process (tests check that a path was taken).
int64_t per_example_attention_calls();

// The layout for queries with segment ids (B, Tq) attending to keys with segment ids (B, Tk) (0 = padding), or
// null when whole-row attention should run instead: in kWholeRow mode; when the rows are not what collate_packed
// makes (a segment not contiguous, a position id that is not the offset within its segment, a query segment
// without keys); or in kAuto mode when per-segment attention is not cheaper. The cost rule, in query-key pairs:
// per-segment = sum over groups of count x Lq x Lk + kGroupOverheadPairs per group + kTokenCostPairs x (B x Tq +
// B x Tk) for the gathers and the scatter; whole-row = B x Tq x Tk + kGroupOverheadPairs. Groups are chosen to
// minimise the per-segment cost (segments sorted by length, an exact partition into runs). Positions (B, T) may
// be undefined (not checked). Segment ids are read on the host.
inline constexpr int64_t kGroupOverheadPairs = 4096;
inline constexpr int64_t kTokenCostPairs = 8;
std::shared_ptr<const SegmentLayout> plan_segment_attention(const at::Tensor& query_segments,
                                                            const at::Tensor& key_segments,
                                                            const at::Tensor& query_positions,
                                                            const at::Tensor& key_positions, bool causal,
                                                            std::optional<int64_t> sliding_window);

// The attention of one group: q (n, H, Lq, d), k and v (n, Hkv, Lk, d), allowed (n, 1, Lq, Lk) bool ->
// (n, H, Lq, dv).
using GroupAttention = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& allowed, const SegmentGroup& group)>;

// q (B, H, Tq, d), k and v (B, Hkv, Tk, d) of packed rows -> the attention output (B, Tq, H * dv), zero at padding
// positions. Each group runs under a dropout context whose rows are the groups' examples, so keyed attention
// dropout draws what it draws over the whole row (element (example, head, query, key), positions within the
// example).
at::Tensor attend_per_segment(const SegmentLayout& layout, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const GroupAttention& attend);

}  // namespace trainer
