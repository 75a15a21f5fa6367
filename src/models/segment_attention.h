// Attention per example inside packed rows (data.packing, docs/packing.md). A packed row's whole-row attention
// scores every pair of positions in the row and masks the pairs across examples; here each example's queries,
// keys and values are gathered into a batch of segments (grouped by length, each group padded to its longest),
// attended in one call per group, and scattered back, so a packed row pays attention only inside its examples.
// The models (t5.cpp, decoder/decoder.cpp) plan a layout once per forward and pass it to every layer; the attention maths
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

// Which path packed rows take. kAuto (the default) takes the varlen path where it runs (varlen_attention_runs),
// else plans per-segment attention when its estimated cost is lower than whole-row attention's (see
// plan_segment_attention); the others force a path (tests, benchmarks). The environment variable
// TRAINER_PACKED_ATTENTION=auto|per-example|whole-row sets the process's starting mode (UsageError otherwise).
enum class SegmentAttentionMode { kAuto, kPerExample, kWholeRow };
void set_segment_attention_mode(SegmentAttentionMode mode);  // process-wide
SegmentAttentionMode segment_attention_mode();
// How many times attend_per_segment has run in this process (tests check that a path was taken).
int64_t per_example_attention_calls();

// The layout for queries with segment ids (B, Tq) attending to keys with segment ids (B, Tk) (0 = padding), or
// null when whole-row attention should run instead: in kWholeRow mode; when the rows are not what collate_packed
// makes (a segment not contiguous, a position id that is not the offset within its segment, a query segment
// without keys); in kAuto mode on any device but the CPU (many small launches cost more there than the pairs
// saved); or in kAuto mode when per-segment attention is not cheaper. The cost rule, in query-key pairs:
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

// Causal self-attention of packed rows on a CUDA card: ATen's variable-length flash attention. The real positions
// of the rows form one stream, each example a run of it (cumulative lengths), so no pair across examples and no
// padding is scored, and no (L x L) mask or score matrix exists. Grouped-query attention runs as such (no repeated
// keys). Taken in kAuto mode where varlen_attention_runs says so; the per-segment and whole-row paths remain for
// everything else (the CPU, fp32, attention dropout, T5's position bias).
struct VarlenLayout {
  int64_t batch = 0, length = 0;  // B, T of the rows
  int64_t total = 0;              // real positions
  int64_t max_length = 0;         // the longest example
  int64_t examples = 0;
  at::Tensor real_index;  // (total) int64: the real positions of the flattened (B * T) rows, in order; undefined
                          // when every position is real
  at::Tensor cu_seqlens;  // (examples + 1) int32: where each example starts in the stream, then `total`
};

// Whether packed causal rows of `x`'s device, with heads of `head_dim`, take the varlen path: kAuto mode, a CUDA
// device flash attention runs on (compute capability 8.0+), head_dim a multiple of 8 up to 256, and bf16 or fp16
// attention (x in that dtype, or autocast on CUDA with it). Attention dropout is the caller's to rule out (the
// kernel's own dropout would not be keyed by example).
bool varlen_attention_runs(const at::Tensor& x, int64_t head_dim);
// Counts attend_varlen calls in this process (tests check that the path was taken).
int64_t varlen_attention_calls();

// The stream of packed rows with segment ids (B, T) (0 = padding) and positions within segments, or null when the
// rows are not what collate_packed makes (see plan_segment_attention). Segment ids are read on the host.
std::shared_ptr<const VarlenLayout> plan_varlen_attention(const at::Tensor& segments, const at::Tensor& positions);

// q (B, H, T, d), k and v (B, Hkv, T, d) -> causal attention within examples, (B, T, H * d), zero at padding
// positions; keys within `sliding_window` positions of the query when given (as segment_mask has it). q, k and v
// in fp32 under autocast are cast to autocast's dtype, as scaled_dot_product_attention would be.
at::Tensor attend_varlen(const VarlenLayout& layout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<int64_t> sliding_window, std::optional<double> scale = std::nullopt);

}  // namespace trainer
