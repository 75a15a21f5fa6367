// Dropout that is a function of the example, not of the split (ARCHITECTURE.md). Every mask element comes from
// counter-based random bits (util/counter_rng.h) keyed by (training.seed, optimizer step, call site), at a
// counter made of the example's index in the effective batch and the element's position. So no micro-batch split,
// out-of-memory retry, activation checkpointing recomputation or resume changes a mask, and it matches nothing
// drawn from LibTorch's global generator.
//
// Models stay maths-only: they hold a Dropout module per call site and call it. The training step says, from
// outside, which examples the rows of the next forward are (DropoutScope); activation checkpointing carries that
// context into its recomputation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "models/module.h"

namespace trainer {

// One sequence of packed rows (data.packing) as dropout sees it: per position its segment (0: padding) and its
// position within the segment; per segment (column s of (B, S + 1)) its example's index in the effective batch and
// its first position in the row. T5 has two: stream 0 the encoder's (and a causal model's only one), stream 1 the
// decoder's.
struct PackedDropoutStream {
  at::Tensor segments, positions;  // (B, T) int64
  at::Tensor examples, starts;     // (B, S + 1) int64
};

// What the masks of one micro-batch's forward are drawn for.
struct DropoutContext {
  uint64_t seed = 0;
  int64_t step = 0;
  at::Tensor rows;  // int64 (B): counter base of each row of the micro-batch, (index in the effective batch) << 40
  // Packed rows instead of one example per row: an element draws at the counter it has in its example's own
  // padded row (example << 40, its position within the example), so packing changes no mask.
  std::vector<PackedDropoutStream> streams;
};

// Makes a context current on this thread until the scope ends; the previous one is current again after it.
class DropoutScope {
 public:
  // Rows are examples first_example, first_example + 1, ... of the effective batch; `rows` lives on `device`.
  DropoutScope(uint64_t seed, int64_t step, int64_t first_example, int64_t count, const c10::Device& device);
  // Packed rows: `streams` as PackedDropoutStream describes (on the device of the tensors).
  DropoutScope(uint64_t seed, int64_t step, std::vector<PackedDropoutStream> streams);
  explicit DropoutScope(std::shared_ptr<const DropoutContext> context);
  ~DropoutScope();
  DropoutScope(const DropoutScope&) = delete;
  DropoutScope& operator=(const DropoutScope&) = delete;

 private:
  std::shared_ptr<const DropoutContext> previous_;
};

// The context of this thread, or null. A forward in training mode with none (a test, the micro-batch probe)
// draws as if row b were example b of step 0 with seed 0.
std::shared_ptr<const DropoutContext> current_dropout_context();

// Where masks come from. kGlobalGenerator is the behaviour before keyed masks (at::dropout, SDPA's dropout_p, in
// micro-batch order from LibTorch's generator: a different split gives different masks); it is kept only as the
// baseline of scripts/bench/dropout.py. Process-wide.
enum class DropoutSource { kKeyed, kGlobalGenerator };
void set_dropout_source(DropoutSource source);
DropoutSource dropout_source();

// One dropout call site: p, and an id that is part of every key it draws with. The id comes from the site's
// module path (assign_dropout_sites), so it is the same in every run of the same architecture, whatever the
// order or number of forward passes.
class Dropout : public Module {
 public:
  explicit Dropout(double p) : p_(p) {}

  // x (B, ...), row b one example; in training, each element is zeroed with probability p and the rest scaled by
  // 1 / (1 - p). Element (b, i_1, ..., i_k) draws at counter rows[b] + its offset in a contiguous (i_1, ..., i_k)
  // layout, which does not depend on the padded length (dimension 1).
  at::Tensor forward(const at::Tensor& x, bool training) const;
  // Attention probabilities (B, H, Tq, Tk): counter rows[b] + h << 32 + q << 16 + k (H < 256, Tq and Tk < 65536),
  // independent of the padded lengths.
  at::Tensor attention(const at::Tensor& probabilities, bool training) const;

  // Whether the model must compute attention probabilities itself and call attention(): keyed dropout in
  // training. Otherwise it may use scaled_dot_product_attention with dropout_p = sdpa_p(training).
  bool explicit_attention(bool training) const { return training && p_ > 0 && dropout_source() == DropoutSource::kKeyed; }
  double sdpa_p(bool training) const {
    return training && dropout_source() == DropoutSource::kGlobalGenerator ? p_ : 0.0;
  }

  double p() const { return p_; }

  // x's shape of fp32 uniforms in [0, 1), drawn at the counters of forward()'s masks (keyed by the site, the
  // step and each element's example and place in it, so no split changes them): Mixtral's router jitter.
  at::Tensor uniform(const at::Tensor& x) const;
  void set_site(uint64_t site) { site_ = site; }
  std::optional<uint64_t> site() const { return site_; }
  // Which packed stream the rows (queries) and, for attention, the keys of this site follow (0 unless a model
  // with two sequences says otherwise: dropout_streams_for_path).
  void set_streams(int query, int key) {
    query_stream_ = query;
    key_stream_ = key;
  }

 private:
  // What is drawn over a grid of counters (grid_counters' arguments, with the site's key): a keep-mask, or uniforms.
  using Draw = std::function<at::Tensor(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes,
                                        at::IntArrayRef strides)>;
  at::Tensor keep_mask(const at::Tensor& x, bool attention) const;
  at::Tensor draw(const at::Tensor& x, bool attention, const Draw& draw) const;
  at::Tensor packed_draw(const DropoutContext& context, const at::Tensor& x, bool attention, uint64_t key,
                         const Draw& draw) const;
  double p_;
  std::optional<uint64_t> site_;
  int query_stream_ = 0, key_stream_ = 0;
};

// The packed streams of the site at this module path: T5's decoder (paths "decoder.") is stream 1, except the
// inputs of its cross-attention's key and value projections (encoder states, stream 0: LoRA's dropout there), and
// its cross-attention probabilities have decoder queries and encoder keys. Everything else is stream 0.
std::pair<int, int> dropout_streams_for_path(const std::string& path);

// The id of the dropout site at this module path (a pure function of the string).
uint64_t dropout_site_id(const std::string& path);
// Gives every Dropout below `root` the id of its path (prefix + dotted name).
void assign_dropout_sites(Module& root, const std::string& prefix = "");

}  // namespace trainer
