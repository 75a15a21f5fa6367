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

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "train/optim/optimizer.h"

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
  int64_t largest = 1, largest_rows = 1, largest_cols = 1;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!owns(i)) {  // ZeRO-1: another rank keeps its statistics
      state_.emplace_back();
      continue;
    }
    const at::Tensor& p = *params_[i].param;
    const auto fp32 = p.options().dtype(at::kFloat);
    State s;
    const auto sizes = p.sizes();
    s.factored = sizes.size() >= 2;
    if (s.factored) {
      s.cols = sizes.back();
      s.rows = sizes[sizes.size() - 2];
      s.matrices = s.rows * s.cols == 0 ? 0 : p.numel() / (s.rows * s.cols);
      s.row = at::zeros(sizes.slice(0, sizes.size() - 1), fp32);  // grad_shape[:-1]
      std::vector<int64_t> col_shape(sizes.begin(), sizes.end() - 2);
      col_shape.push_back(s.cols);  // grad_shape[:-2] + grad_shape[-1:]
      s.col = at::zeros(col_shape, fp32);
      largest_rows = std::max(largest_rows, s.rows);
      largest_cols = std::max(largest_cols, s.cols);
    } else {
      s.sq = at::zeros(sizes, fp32);
    }
    if (config.adafactor_beta1) s.exp_avg = at::zeros(sizes, fp32);
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
  sum_ = at::empty({}, fp32);
  scalar_a_ = at::empty({}, fp32);
  scalar_b_ = at::empty({}, fp32);
  scalar_c_ = at::empty({}, fp32);
  allocate_compensation_scratch(chunk_);
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
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = *params_[i].param;
    if (!owns(i) || !p.grad().defined() || p.numel() == 0) continue;
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

    // The factors of matrix m: row_factor = rsqrt(row / mean(row)), col_factor = rsqrt(col).
    auto factors = [&](int64_t m) {
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
    };

    // 2. The RMS of the whole unscaled update, then the clipping divisor.
    double squares = 0;
    for (int64_t m = 0; m < matrices; ++m) {
      factors(m);
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
      factors(m);
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
  for (at::Tensor* t : {&scratch_a_, &scratch_b_, &scratch_c_, &row_factor_, &col_factor_, &col_sum_, &sum_, &scalar_a_,
                        &scalar_b_, &scalar_c_})
    visit(*t);
}

int64_t Adafactor::own_state_bytes() const {
  int64_t n = 0;
  for (const auto& [name, t] : own_state()) n += static_cast<int64_t>(t.nbytes());
  return n;
}

}  // namespace trainer
