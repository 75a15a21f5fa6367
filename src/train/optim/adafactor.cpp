// Adafactor (see optimizer.h): transformers.optimization.Adafactor's update, computed chunk by chunk through fixed
// scratch buffers so the step allocates nothing.
//
// Per parameter and step t (transformers' names):
//   lr_t   = relative_step ? min(warmup_init ? 1e-6 t : 1e-2, 1/sqrt(t)) : lr;  x max(eps2, RMS(p)) if scale_parameter
//   beta2t = 1 - t^decay_rate;  s = g^2 + eps1
//   factored (>= 2 dims, as matrices of rows x cols): row = beta2t row + (1 - beta2t) mean_cols(s),
//            col = beta2t col + (1 - beta2t) mean_rows(s);  u = rsqrt(row / mean(row)) rsqrt(col) g
//   unfactored: v = beta2t v + (1 - beta2t) s;  u = rsqrt(v) g
//   u = u / max(1, RMS(u) / clip_threshold) x lr_t;  with beta1: m = beta1 m + (1 - beta1) u, u = m
//   p = p - weight_decay lr_t p - u
// The whole update's RMS is needed before any of it is applied, so the update is computed twice: once for its
// sum of squares, once to apply it (the statistics are already updated; the second pass reads them only).
#include <algorithm>
#include <cmath>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "train/optim/optimizer.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

constexpr int64_t kFactoredChunk = 1 << 22;  // elements per chunk: 16 MiB of fp32 scratch each

// The sum of all elements of `x` as a double, through the 0-dim `sum` (no allocation).
double sum_of(at::Tensor& sum, const at::Tensor& x) {
  at::sum_out(sum, x, at::OptionalIntArrayRef{});
  return sum.item<double>();
}

}  // namespace

Adafactor::Adafactor(Module& model, const OptimizerConfig& config, uint64_t seed, OptimizerShard shard)
    : Optimizer(model, config, seed, shard) {
  // Over sharded weights a piece is stepped as its whole parameter's part: the whole shape decides the factoring.
  std::vector<std::vector<int64_t>> shapes(params_.size());
  std::map<std::string, std::size_t> by_name;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    shapes[i] = params_[i].param->sizes().vec();
    by_name[params_[i].name] = i;
  }
  is_piece_.assign(params_.size(), false);
  int64_t sums = 0;
  int64_t largest_rows = 1, largest_cols = 1;
  auto layout_of = [](const std::vector<int64_t>& sizes) {
    State s;
    s.factored = sizes.size() >= 2;
    int64_t numel = 1;
    for (const int64_t d : sizes) numel *= d;
    if (s.factored) {
      s.cols = sizes.back();
      s.rows = sizes[sizes.size() - 2];
      s.matrices = s.rows * s.cols == 0 ? 0 : numel / (s.rows * s.cols);
    } else {
      s.rows = numel;  // stepped as one column of elements
    }
    return s;
  };
  for (const PiecedParameter& whole : shard_.pieced) {
    Pieced e;
    e.offset = whole.offset;
    e.layout = layout_of(whole.shape);
    e.numel = e.layout.matrices * e.layout.rows * e.layout.cols;
    if (e.layout.factored) {
      e.row_at = sums;
      sums += e.layout.matrices * e.layout.rows;
      e.col_at = sums;
      sums += e.layout.matrices * e.layout.cols;
      largest_rows = std::max(largest_rows, e.layout.rows);
      largest_cols = std::max(largest_cols, e.layout.cols);
    }
    if (whole.offset >= 0) {
      const auto it = by_name.find(whole.name);
      if (it == by_name.end()) throw Error("Adafactor: no piece of " + whole.name + " among the trainable parameters");
      e.index = static_cast<int64_t>(it->second);
      is_piece_[it->second] = true;
      shapes[it->second] = whole.shape;
    }
    pieced_.push_back(std::move(e));
  }
  int64_t largest = 1;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!owns(i)) {  // ZeRO-1: another rank keeps its statistics
      state_.emplace_back();
      continue;
    }
    const at::Tensor& p = *params_[i].param;
    const auto fp32 = p.options().dtype(at::kFloat);
    const c10::IntArrayRef sizes(shapes[i]);
    State s = layout_of(shapes[i]);
    if (s.factored) {
      s.row = at::zeros(sizes.slice(0, sizes.size() - 1), fp32);  // grad_shape[:-1]
      std::vector<int64_t> col_shape(sizes.begin(), sizes.end() - 2);
      col_shape.push_back(s.cols);  // grad_shape[:-2] + grad_shape[-1:]
      s.col = at::zeros(col_shape, fp32);
      largest_rows = std::max(largest_rows, s.rows);
      largest_cols = std::max(largest_cols, s.cols);
    } else {
      s.rows = 1;
      s.sq = at::zeros(p.sizes(), fp32);  // a piece's: as the piece
    }
    if (config.adafactor_beta1) s.exp_avg = at::zeros(p.sizes(), fp32);
    largest = std::max(largest, p.numel());
    state_.push_back(std::move(s));
  }
  const auto device = params_.empty() ? at::Device(at::kCPU) : params_.front().param->device();
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  chunk_ = std::max(std::min(largest, kFactoredChunk), largest_cols);  // at least one whole row
  scratch_a_ = at::empty({chunk_}, fp32);
  scratch_b_ = at::empty({chunk_}, fp32);
  scratch_c_ = at::empty({chunk_}, fp32);
  row_factor_ = at::empty({largest_rows}, fp32);
  col_factor_ = at::empty({largest_cols}, fp32);
  col_sum_ = at::empty({largest_cols}, fp32);
  if (!pieced_.empty()) sums_ = at::zeros({std::max<int64_t>(1, sums)}, fp32);
  sum_ = at::empty({}, fp32);
  scalar_a_ = at::empty({}, fp32);
  scalar_b_ = at::empty({}, fp32);
  scalar_c_ = at::empty({}, fp32);
  allocate_compensation_scratch(chunk_);
}

bool Adafactor::whole_state(const std::string& name) const {
  return !pieced_.empty() && (name.starts_with("exp_avg_sq_row.") || name.starts_with("exp_avg_sq_col."));
}

void Adafactor::factors(const State& s, int64_t m) {
  if (!s.factored) return;
  const at::Tensor row = s.row.view({s.matrices, s.rows}).select(0, m);
  at::sum_out(sum_, row, at::OptionalIntArrayRef{});
  scalar_a_.fill_(1.0 / static_cast<double>(s.rows));
  sum_.mul_(scalar_a_);  // mean(row)
  at::Tensor rf = row_factor_.narrow(0, 0, s.rows);
  at::div_out(rf, row, sum_);
  rf.rsqrt_();
  at::Tensor cf = col_factor_.narrow(0, 0, s.cols);
  at::rsqrt_out(cf, s.col.view({s.matrices, s.cols}).select(0, m));
}

void Adafactor::unscaled_update(const State& s, const at::Tensor& grad, int64_t m, int64_t r0, int64_t n,
                                at::Tensor& out, const at::Tensor& scratch) {
  const int64_t begin = s.factored ? (m * s.rows + r0) * s.cols : r0, count = s.factored ? n * s.cols : n;
  at::Tensor g = grad.narrow(0, begin, count);
  if (g.scalar_type() != at::kFloat) g = scratch.narrow(0, 0, count).copy_(g);  // no converted temporary
  if (s.factored) {
    // transformers: (r_factor x c_factor) * grad, in that order.
    at::Tensor u = out.view({n, s.cols});
    at::mul_out(u, row_factor_.narrow(0, r0, n).unsqueeze(1), col_factor_.narrow(0, 0, s.cols).unsqueeze(0));
    u.mul_(g.view({n, s.cols}));
  } else {
    at::rsqrt_out(out, s.sq.view({-1}).narrow(0, r0, n));
    out.mul_(g);
  }
}

void Adafactor::step(double lr) {
  // As in AdamW: tensor operands are preallocated 0-dim tensors, never plain Scalars (which would be allocated).
  at::NoGradGuard no_grad;
  ++step_;
  const double t = static_cast<double>(step_);
  double relative = lr;
  if (config_.relative_step) relative = std::min(config_.warmup_init ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
  const double beta2t = 1.0 - std::pow(t, config_.decay_rate);
  if (!pieced_.empty()) step_pieced(relative, beta2t);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = *params_[i].param;
    if (is_piece_[i] || !owns(i) || !p.grad().defined() || p.numel() == 0) continue;
    State& s = state_[i];
    at::Tensor param = p.view({-1});
    const at::Tensor grad = p.grad().view({-1});
    const int64_t numel = p.numel();
    // Pieces of the parameter, in element order: (matrix, first row, rows) for factored parameters, (0, first
    // element, elements) otherwise. Each fits a scratch chunk.
    const int64_t per_piece = s.factored ? std::max<int64_t>(1, chunk_ / s.cols) : chunk_;
    const int64_t matrices = s.factored ? s.matrices : 1, length = s.factored ? s.rows : numel;
    const int64_t width = s.factored ? s.cols : 1;
    auto for_each_piece = [&](auto&& body) {
      for (int64_t r0 = 0; r0 < length; r0 += per_piece) body(r0, std::min(per_piece, length - r0));
    };

    double lr_t = relative;
    if (config_.scale_parameter) {
      double squares = 0;
      for (int64_t begin = 0; begin < numel; begin += chunk_) {
        const int64_t n = std::min(chunk_, numel - begin);
        at::Tensor a = scratch_a_.narrow(0, 0, n), b = scratch_b_.narrow(0, 0, n);
        a.copy_(param.narrow(0, begin, n));
        at::mul_out(b, a, a);
        squares += sum_of(sum_, b);
      }
      lr_t *= std::max(config_.adafactor_eps2, std::sqrt(squares / static_cast<double>(numel)));
    }

    // 1. The second-moment statistics.
    scalar_a_.fill_(config_.adafactor_eps1);
    scalar_b_.fill_(beta2t);
    for (int64_t m = 0; m < matrices; ++m) {
      at::Tensor col_sum = s.factored ? col_sum_.narrow(0, 0, s.cols).zero_() : at::Tensor();
      for_each_piece([&](int64_t r0, int64_t n) {
        const int64_t begin = (m * length + r0) * width, count = n * width;
        at::Tensor a = scratch_a_.narrow(0, 0, count), b = scratch_b_.narrow(0, 0, count);
        a.copy_(grad.narrow(0, begin, count));
        at::mul_out(b, a, a);
        b.add_(scalar_a_);  // s = g^2 + eps1
        if (s.factored) {
          const at::Tensor sq = b.view({n, s.cols});
          at::Tensor row_part = row_factor_.narrow(0, r0, n);  // row sums, until the factors are computed
          at::sum_out(row_part, sq, {1});
          at::Tensor col_part = scratch_c_.narrow(0, 0, s.cols);
          at::sum_out(col_part, sq, {0});
          col_sum.add_(col_part);
        } else {
          s.sq.view({-1}).narrow(0, begin, count).mul_(scalar_b_).add_(b, 1.0 - beta2t);
        }
      });
      if (s.factored) {
        s.row.view({s.matrices, s.rows}).select(0, m).mul_(scalar_b_).add_(
            row_factor_.narrow(0, 0, s.rows), (1.0 - beta2t) / static_cast<double>(s.cols));
        s.col.view({s.matrices, s.cols}).select(0, m).mul_(scalar_b_).add_(
            col_sum, (1.0 - beta2t) / static_cast<double>(s.rows));
      }
    }

    // 2. The RMS of the whole unscaled update, then the clipping divisor.
    double squares = 0;
    for (int64_t m = 0; m < matrices; ++m) {
      factors(s, m);
      for_each_piece([&](int64_t r0, int64_t n) {
        at::Tensor a = scratch_a_.narrow(0, 0, n * width), b = scratch_b_.narrow(0, 0, n * width);
        unscaled_update(s, grad, m, r0, n, a, b);
        at::mul_out(b, a, a);
        squares += sum_of(sum_, b);
      });
    }
    const double divisor = std::max(1.0, std::sqrt(squares / static_cast<double>(numel)) / config_.clip_threshold);

    // 3. Apply: u / divisor x lr_t, through the first moment if any, with decoupled weight decay.
    const bool decay = params_[i].decay && config_.weight_decay != 0;
    for (int64_t m = 0; m < matrices; ++m) {
      factors(s, m);
      scalar_a_.fill_(divisor);
      scalar_b_.fill_(lr_t);
      scalar_c_.fill_(config_.beta1);
      for_each_piece([&](int64_t r0, int64_t n) {
        const int64_t begin = (m * length + r0) * width, count = n * width;
        at::Tensor a = scratch_a_.narrow(0, 0, count);
        unscaled_update(s, grad, m, r0, n, a, scratch_b_);
        a.div_(scalar_a_).mul_(scalar_b_);
        at::Tensor update = a;
        if (config_.adafactor_beta1) {
          update = s.exp_avg.view({-1}).narrow(0, begin, count);
          update.mul_(scalar_c_).add_(a, 1.0 - config_.beta1);  // as transformers: mul_ then add_
        }
        const at::Tensor master = load_master(i, param, begin, count, scratch_b_);
        if (decay) master.add_(master, -config_.weight_decay * lr_t);
        master.sub_(update);
        store_master(i, param, begin, count, master, scratch_c_);
      });
    }
  }
}

namespace {

// A piece [offset, offset + n) of a parameter seen as (matrices x rows, cols) rows of elements, in spans that lie in
// one matrix: whole rows (at most max_rows of them), or the part of one row at the piece's ends.
struct Span {
  int64_t matrix, row, rows, col, cols;  // rows [row, row + rows) of `matrix`, columns [col, col + cols)
  int64_t local;                         // where the span starts in the piece
  int64_t count() const { return rows * cols; }
};

template <class F>
void for_each_span(int64_t offset, int64_t n, int64_t rows, int64_t cols, int64_t max_rows, F&& body) {
  const int64_t end = offset + n;
  for (int64_t e = offset; e < end;) {
    const int64_t q = e / cols, c = e % cols, m = q / rows;
    if (c != 0 || end - e < cols) {
      const int64_t length = std::min(cols - c, end - e);
      body(Span{m, q % rows, 1, c, length, e - offset});
      e += length;
    } else {
      const int64_t whole = std::min({(end - e) / cols, (m + 1) * rows - q, max_rows});
      body(Span{m, q % rows, whole, 0, cols, e - offset});
      e += whole * cols;
    }
  }
}

}  // namespace

// Over sharded weights: every rank's pieces' row and column sums of g^2 + eps1 summed over the ranks (one collective),
// the statistics updated from them by every rank holding a piece, then the parameters' and the updates' squares
// summed over the ranks (a second), and the pieces updated. The numbers are the unsharded step's, up to fp32
// summation order.
void Adafactor::step_pieced(double relative, double beta2t) {
  const std::size_t n = pieced_.size();
  std::vector<double> squares(2 * n, 0.0);  // the parameter's, then the unscaled update's
  sums_.zero_();
  scalar_a_.fill_(config_.adafactor_eps1);
  scalar_b_.fill_(beta2t);
  auto grad_chunk = [&](const at::Tensor& grad, const Span& span, const at::Tensor& scratch) {
    at::Tensor g = grad.narrow(0, span.local, span.count());
    if (g.scalar_type() != at::kFloat) g = scratch.narrow(0, 0, span.count()).copy_(g);
    return g;
  };
  auto max_rows = [&](const Pieced& e) {
    return e.layout.factored ? std::max<int64_t>(1, chunk_ / e.layout.cols) : chunk_;
  };
  // Each sharded parameter this rank holds a piece of, with its gradient: body(k, entry, parameter index, the flat
  // piece, its state, the piece's flat gradient).
  auto for_each_held = [&](auto&& body) {
    for (std::size_t k = 0; k < n; ++k) {
      const Pieced& e = pieced_[k];
      if (e.index < 0) continue;
      const auto i = static_cast<std::size_t>(e.index);
      at::Tensor& p = *params_[i].param;
      if (!p.grad().defined()) continue;
      at::Tensor flat = p.view({-1});
      body(k, e, i, flat, state_[i], p.grad().view({-1}));
    }
  };
  // 1. This rank's part of the sums; unfactored statistics (element by element) updated at once.
  for_each_held([&](std::size_t k, const Pieced& e, std::size_t, at::Tensor& param, State& s, const at::Tensor& grad) {
    if (config_.scale_parameter)
      for (int64_t begin = 0; begin < param.numel(); begin += chunk_) {
        const int64_t count = std::min(chunk_, param.numel() - begin);
        at::Tensor a = scratch_a_.narrow(0, 0, count), b = scratch_b_.narrow(0, 0, count);
        a.copy_(param.narrow(0, begin, count));
        at::mul_out(b, a, a);
        squares[k] += sum_of(sum_, b);
      }
    const int64_t rows = e.layout.rows, cols = e.layout.cols;
    for_each_span(e.offset, param.numel(), rows, cols, max_rows(e), [&](const Span& span) {
      at::Tensor a = scratch_a_.narrow(0, 0, span.count()), b = scratch_b_.narrow(0, 0, span.count());
      a.copy_(grad_chunk(grad, span, b));
      at::mul_out(b, a, a);
      b.add_(scalar_a_);  // s = g^2 + eps1
      if (!e.layout.factored) {
        s.sq.view({-1}).narrow(0, span.local, span.count()).mul_(scalar_b_).add_(b, 1.0 - beta2t);
        return;
      }
      const at::Tensor sq = b.view({span.rows, span.cols});
      at::Tensor part = scratch_c_.narrow(0, 0, span.rows);
      at::sum_out(part, sq, {1});
      sums_.narrow(0, e.row_at + span.matrix * rows + span.row, span.rows).add_(part);
      part = scratch_c_.narrow(0, 0, span.cols);
      at::sum_out(part, sq, {0});
      sums_.narrow(0, e.col_at + span.matrix * cols + span.col, span.cols).add_(part);
    });
  });
  shard_.sum_floats(sums_);

  // u of a span into `out`, the factors of its matrix in row_factor_ and col_factor_.
  auto unscaled = [&](const State& s, const at::Tensor& grad, const Span& span, at::Tensor& out) {
    const at::Tensor g = grad_chunk(grad, span, scratch_b_);
    if (s.factored) {
      at::Tensor u = out.view({span.rows, span.cols});
      at::mul_out(u, row_factor_.narrow(0, span.row, span.rows).unsqueeze(1),
                  col_factor_.narrow(0, span.col, span.cols).unsqueeze(0));
      u.mul_(g.view({span.rows, span.cols}));
    } else {
      at::rsqrt_out(out, s.sq.view({-1}).narrow(0, span.local, span.count()));
      out.mul_(g);
    }
  };
  // 2. The factored statistics from the sums, then this rank's part of the squares of the unscaled update.
  for_each_held([&](std::size_t k, const Pieced& e, std::size_t, at::Tensor& param, State& s, const at::Tensor& grad) {
    if (s.factored) {
      const int64_t m = s.matrices;
      scalar_b_.fill_(beta2t);
      s.row.view({m, s.rows}).mul_(scalar_b_).add_(sums_.narrow(0, e.row_at, m * s.rows).view({m, s.rows}),
                                                     (1.0 - beta2t) / static_cast<double>(s.cols));
      s.col.view({m, s.cols}).mul_(scalar_b_).add_(sums_.narrow(0, e.col_at, m * s.cols).view({m, s.cols}),
                                                     (1.0 - beta2t) / static_cast<double>(s.rows));
    }
    int64_t matrix = -1;
    for_each_span(e.offset, param.numel(), e.layout.rows, e.layout.cols, max_rows(e), [&](const Span& span) {
      if (span.matrix != matrix) factors(s, matrix = span.matrix);
      at::Tensor a = scratch_a_.narrow(0, 0, span.count()), c = scratch_c_.narrow(0, 0, span.count());
      unscaled(s, grad, span, a);
      at::mul_out(c, a, a);
      squares[n + k] += sum_of(sum_, c);
    });
  });
  shard_.sum_doubles(squares);

  // 3. Apply: u / divisor x lr_t, through the first moment if any, with decoupled weight decay.
  for_each_held([&](std::size_t k, const Pieced& e, std::size_t i, at::Tensor& param, State& s,
                    const at::Tensor& grad) {
    const auto whole = static_cast<double>(e.numel);
    double lr_t = relative;
    if (config_.scale_parameter) lr_t *= std::max(config_.adafactor_eps2, std::sqrt(squares[k] / whole));
    const double divisor = std::max(1.0, std::sqrt(squares[n + k] / whole) / config_.clip_threshold);
    const bool decay = params_[i].decay && config_.weight_decay != 0;
    int64_t matrix = -1;
    for_each_span(e.offset, param.numel(), e.layout.rows, e.layout.cols, max_rows(e), [&](const Span& span) {
      if (span.matrix != matrix) factors(s, matrix = span.matrix);
      scalar_a_.fill_(divisor);
      scalar_b_.fill_(lr_t);
      scalar_c_.fill_(config_.beta1);
      at::Tensor a = scratch_a_.narrow(0, 0, span.count());
      unscaled(s, grad, span, a);
      a.div_(scalar_a_).mul_(scalar_b_);
      at::Tensor update = a;
      if (config_.adafactor_beta1) {
        update = s.exp_avg.view({-1}).narrow(0, span.local, span.count());
        update.mul_(scalar_c_).add_(a, 1.0 - config_.beta1);  // as transformers: mul_ then add_
      }
      const at::Tensor master = load_master(i, param, span.local, span.count(), scratch_b_);
      if (decay) master.add_(master, -config_.weight_decay * lr_t);
      master.sub_(update);
      store_master(i, param, span.local, span.count(), master, scratch_c_);
    });
  });
}

std::vector<std::pair<std::string, at::Tensor>> Adafactor::own_state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!owns(i)) continue;
    const State& s = state_[i];
    const std::string& name = params_[i].name;
    if (s.factored) {
      out.emplace_back("exp_avg_sq_row." + name, s.row);
      out.emplace_back("exp_avg_sq_col." + name, s.col);
    } else {
      out.emplace_back("exp_avg_sq." + name, s.sq);
    }
    if (s.exp_avg.defined()) out.emplace_back("exp_avg." + name, s.exp_avg);
  }
  return out;
}

void Adafactor::for_each_own_tensor(const std::function<void(at::Tensor&)>& visit) {
  for (auto& s : state_)
    for (at::Tensor* t : {&s.row, &s.col, &s.sq, &s.exp_avg}) visit(*t);
  for (at::Tensor* t : {&scratch_a_, &scratch_b_, &scratch_c_, &row_factor_, &col_factor_, &col_sum_, &sums_, &sum_,
                        &scalar_a_, &scalar_b_, &scalar_c_})
    visit(*t);
}

int64_t Adafactor::own_state_bytes() const {
  int64_t n = 0;
  for (const auto& [name, t] : own_state()) n += static_cast<int64_t>(t.nbytes());
  return n;
}

}  // namespace trainer
