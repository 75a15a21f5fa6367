// Attention per example inside packed rows (models/segment_attention.h) computes what whole-row attention with the
// block-diagonal mask computes: outputs at every real position and the gradients of q, k, v and a relative
// position bias table, within 1e-6 (of each tensor's largest value) in fp32. T5-shaped (additive learned bias, no
// scaling, encoder and causal decoder self-attention, cross-attention between differently long segments) and
// causal-LM-shaped (SDPA with a boolean mask, grouped-query heads, a sliding window), over layouts with a segment
// of one token, a row of one segment, padding, and several length groups.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/layers.h"
#include "models/segment_attention.h"
#include "support/packed_rows.h"

namespace trainer {
namespace {

using test::packed_rows;

struct ForcePerExample {
  ForcePerExample() { set_segment_attention_mode(SegmentAttentionMode::kPerExample); }
  ~ForcePerExample() { set_segment_attention_mode(SegmentAttentionMode::kAuto); }
};

enum class Shape { kT5Encoder, kT5Decoder, kT5Cross, kCausal, kCausalWindow };

struct Case {
  Shape shape;
  std::vector<std::vector<int64_t>> queries, keys;  // keys: cross-attention only
  int64_t tq, tk;
};

// The bias table (H, 2 * span + 1) read at (key position - query position), as T5's relative buckets are a
// function of that difference: (1, H, Lq, Lk) for positions 0.. of both.
at::Tensor relative_bias(const at::Tensor& table, int64_t lq, int64_t lk, int64_t span) {
  const at::Tensor relative = at::arange(lk, at::kLong).unsqueeze(0) - at::arange(lq, at::kLong).unsqueeze(1) + span;
  return table.index_select(1, relative.reshape({-1})).view({table.size(0), lq, lk}).unsqueeze(0);
}

void check(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "shape " << static_cast<int>(c.shape) << ", Tq " << c.tq);
  const bool cross = c.shape == Shape::kT5Cross;
  const bool t5 = c.shape == Shape::kT5Encoder || c.shape == Shape::kT5Decoder || cross;
  const bool causal = c.shape == Shape::kT5Decoder || c.shape == Shape::kCausal || c.shape == Shape::kCausalWindow;
  const std::optional<int64_t> window =
      c.shape == Shape::kCausalWindow ? std::optional<int64_t>(3) : std::nullopt;
  const auto [qs, qp] = packed_rows(c.queries, c.tq);
  const auto [ks_cross, kp_cross] = packed_rows(cross ? c.keys : c.queries, cross ? c.tk : c.tq);
  const at::Tensor ks = cross ? ks_cross : qs, kp = cross ? kp_cross : qp;
  const int64_t b = qs.size(0), tq = qs.size(1), tk = ks.size(1), heads = 4, kv_heads = t5 ? 4 : 2, d = 8;
  const int64_t span = std::max(tq, tk);

  at::manual_seed(11);
  const at::Tensor q0 = at::randn({b, heads, tq, d}), k0 = at::randn({b, kv_heads, tk, d}),
                   v0 = at::randn({b, kv_heads, tk, d}), table0 = at::randn({heads, 2 * span + 1});
  const at::Tensor weight = at::randn({b, tq, heads * d});  // the loss weighs real positions only
  const at::Tensor real = (qs != 0).unsqueeze(-1);

  struct Result {
    at::Tensor out, gq, gk, gv, gtable;
  };
  auto run = [&](bool per_example) {
    const at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
                     v = v0.clone().requires_grad_(true), table = table0.clone().requires_grad_(true);
    // The models' two attention kernels: T5's (additive bias and mask, scale 1) and the causal family's (boolean
    // mask, 1/sqrt(d), grouped-query heads).
    auto kernel = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv, const at::Tensor& allowed,
                      const at::Tensor& bias) {
      if (t5) {
        const at::Tensor full = (bias.defined() ? bias : at::zeros({}, qq.options())) + additive_mask(allowed, at::kFloat);
        // The explicit softmax, as T5Attention computes it with dropout on.
        return at::matmul(at::softmax(at::matmul(qq, kk.transpose(-2, -1)) + full, -1), vv);
      }
      return at::scaled_dot_product_attention(qq, kk, vv, allowed, 0.0, false, std::nullopt, /*enable_gqa=*/true);
    };
    at::Tensor out;
    if (per_example) {
      const ForcePerExample force;
      const auto layout = plan_segment_attention(qs, ks, qp, kp, causal, window);
      EXPECT_TRUE(layout);
      if (!layout) return Result{};
      const at::Tensor bias = t5 && !cross ? relative_bias(table, layout->max_query_length, layout->max_key_length, span)
                                           : at::Tensor();
      const int64_t before = per_example_attention_calls();
      out = attend_per_segment(*layout, q, k, v,
                               [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv,
                                   const at::Tensor& allowed, const SegmentGroup& g) {
                                 return kernel(qq, kk, vv, allowed,
                                               bias.defined() ? bias.narrow(2, 0, g.query_length).narrow(3, 0, g.key_length)
                                                              : at::Tensor());
                               });
      EXPECT_EQ(per_example_attention_calls(), before + 1);
    } else {
      const at::Tensor allowed = segment_mask(qs, ks, qp, kp, causal, window);  // (B, 1, Tq, Tk)
      const at::Tensor bias = t5 && !cross ? relative_bias(table, tq, tk, span) : at::Tensor();
      out = kernel(q, k, v, allowed, bias).transpose(1, 2).reshape({b, tq, heads * d});
    }
    // The table must take part in the graph in every case (a zero gradient where no bias is used).
    (out * weight * real).sum().add(table.sum() * 0).backward();
    return Result{out.detach() * real, q.grad(), k.grad(), v.grad(), table.grad()};
  };
  const Result whole = run(false), segmented = run(true);
  ASSERT_TRUE(segmented.out.defined());
  auto near = [](const at::Tensor& x, const at::Tensor& y, const char* what) {
    // Within 1e-6 of the largest value (values up to ~7 here: a few fp32 ulps; the paths sum in other orders).
    const double difference = (x - y).abs().max().item<double>(), largest = x.abs().max().item<double>();
    EXPECT_LE(difference, 1e-6 * std::max(1.0, largest))
        << what << ": max difference " << difference << " of values up to " << largest;
  };
  near(whole.out, segmented.out, "output");
  near(whole.gq, segmented.gq, "d/dq");
  near(whole.gk, segmented.gk, "d/dk");
  near(whole.gv, segmented.gv, "d/dv");
  near(whole.gtable, segmented.gtable, "d/dbias");
  // The comparison is sensitive: attention that crossed examples would differ by far more.
  EXPECT_GT(whole.out.abs().max().item<double>(), 0.1);
}

const std::vector<std::vector<int64_t>> kMixed = {{3, 1, 5}, {10}, {1}, {2, 2, 2, 2, 1}};

TEST(SegmentAttention, T5EncoderSelfAttentionEqualsTheMaskedRow) {
  check({Shape::kT5Encoder, kMixed, {}, 10, 10});
  check({Shape::kT5Encoder, {{10}}, {}, 10, 10});  // one segment filling the row
}

TEST(SegmentAttention, T5DecoderCausalSelfAttentionEqualsTheMaskedRow) {
  check({Shape::kT5Decoder, kMixed, {}, 10, 10});
  check({Shape::kT5Decoder, {{1, 6}, {7}}, {}, 8, 8});
}

TEST(SegmentAttention, T5CrossAttentionBetweenSegmentsOfDifferentLengthsEqualsTheMaskedRow) {
  // Decoder segments (queries) attend to the encoder segments of the same examples, of other lengths.
  check({Shape::kT5Cross, {{2, 1, 3}, {4}}, {{5, 2, 6}, {9}}, 7, 14});
  check({Shape::kT5Cross, {{1}}, {{1}}, 3, 4});
}

TEST(SegmentAttention, CausalSelfAttentionWithGroupedHeadsAndASlidingWindowEqualsTheMaskedRow) {
  check({Shape::kCausal, kMixed, {}, 10, 10});
  check({Shape::kCausal, {{12}}, {}, 12, 12});
  check({Shape::kCausalWindow, {{7, 1, 4}, {12}}, {}, 12, 12});
}

TEST(SegmentAttention, PlanGroupsByLengthAndChoosesThePathByCost) {
  // Long rows of many short segments: per-segment attention scores far fewer pairs and auto mode takes it.
  const auto [many, many_positions] = packed_rows({{8, 8, 8, 8, 8, 8, 8, 8}, {8, 8, 8, 8, 8, 8, 8, 8}}, 64);
  const auto layout = plan_segment_attention(many, many, many_positions, many_positions, true, std::nullopt);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->pairs, 16 * 8 * 8);
  EXPECT_EQ(layout->row_pairs, 2 * 64 * 64);
  EXPECT_EQ(layout->groups.size(), 1u);
  // One segment per row: whole-row attention is as cheap, auto mode keeps it; forced, per-segment still plans.
  const auto [one, one_positions] = packed_rows({{30}, {30}}, 30);
  EXPECT_FALSE(plan_segment_attention(one, one, one_positions, one_positions, true, std::nullopt));
  {
    const ForcePerExample force;
    EXPECT_TRUE(plan_segment_attention(one, one, one_positions, one_positions, true, std::nullopt));
  }
  // Very different lengths go into different groups when that saves more than a group costs.
  const auto [mixed, mixed_positions] = packed_rows({{200, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}, {200, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}}, 250);
  const auto grouped = plan_segment_attention(mixed, mixed, mixed_positions, mixed_positions, false, std::nullopt);
  ASSERT_TRUE(grouped);
  EXPECT_EQ(grouped->groups.size(), 2u);
  EXPECT_EQ(grouped->pairs, 2 * 200 * 200 + 20 * 4 * 4);
  // Rows collate_packed does not make (a split segment, positions not counting within it) take the row path.
  at::Tensor split = many.clone();
  split[0][9] = 1;
  {
    const ForcePerExample force;
    EXPECT_FALSE(plan_segment_attention(split, split, {}, {}, false, std::nullopt));
    EXPECT_FALSE(plan_segment_attention(many, many, many_positions + 1, many_positions + 1, false, std::nullopt));
    set_segment_attention_mode(SegmentAttentionMode::kWholeRow);
    EXPECT_FALSE(plan_segment_attention(many, many, many_positions, many_positions, true, std::nullopt));
  }
}

// The varlen layout (the CUDA path's stream of real positions): examples in stream order, cumulative lengths,
// the real positions' indices (none when every position is real), the longest example; rows collate_packed does
// not make are refused. On the CPU the path never runs, whatever the tensors.
TEST(SegmentAttention, VarlenLayoutListsTheExamplesInStreamOrder) {
  const auto [segments, positions] = packed_rows({{3, 1, 4}, {6}, {2}}, 8);
  const auto layout = plan_varlen_attention(segments, positions);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->batch, 3);
  EXPECT_EQ(layout->length, 8);
  EXPECT_EQ(layout->examples, 5);
  EXPECT_EQ(layout->total, 16);
  EXPECT_EQ(layout->max_length, 6);
  EXPECT_EQ(layout->cu_seqlens.scalar_type(), at::kInt);
  EXPECT_TRUE(at::equal(layout->cu_seqlens, at::tensor({0, 3, 4, 8, 14, 16}, at::kInt)));
  const std::vector<int64_t> real = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17};
  EXPECT_TRUE(at::equal(layout->real_index, at::tensor(real, at::kLong)));
  const auto [full, full_positions] = packed_rows({{5, 3}, {8}}, 8);
  const auto no_padding = plan_varlen_attention(full, full_positions);
  ASSERT_TRUE(no_padding);
  EXPECT_FALSE(no_padding->real_index.defined());
  at::Tensor split = segments.clone();
  split[0][4] = 1;  // segment 1 of row 0 split in two
  EXPECT_FALSE(plan_varlen_attention(split, {}));
  EXPECT_FALSE(plan_varlen_attention(segments, positions + 1));
  EXPECT_FALSE(varlen_attention_runs(at::zeros({1}, at::kBFloat16), 64));
}

}  // namespace
}  // namespace trainer
