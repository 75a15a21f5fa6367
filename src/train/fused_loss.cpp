// Fused linear cross-entropy (see fused_loss.h).
#include "train/fused_loss.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace trainer {

FusedLossResult fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& targets,
                                           const at::Tensor& weight, double scale, double grad_scale,
                                           int64_t chunk_size, std::optional<at::ScalarType> compute_dtype,
                                           at::Tensor weight_grad, const at::Tensor& row_weights,
                                           std::optional<double> softcap) {
  at::NoGradGuard no_grad;
  const at::ScalarType dtype = compute_dtype.value_or(hidden.scalar_type());
  const at::Tensor flat_targets = targets.reshape({-1});
  const at::Tensor rows = (flat_targets != -100).nonzero().reshape({-1});  // only trained positions
  // The head weight in the compute dtype once per call (autocast would cast it once per chunk).
  const at::Tensor w = weight.scalar_type() == dtype ? weight : weight.to(dtype);
  FusedLossResult out;
  out.grad_hidden = at::zeros_like(hidden);
  at::Tensor loss_sum = at::zeros({}, hidden.options().dtype(at::kFloat));
  for (int64_t begin = 0; begin < rows.numel(); begin += chunk_size) {
    const at::Tensor index = rows.narrow(0, begin, std::min(chunk_size, rows.numel() - begin));
    const at::Tensor target = flat_targets.index_select(0, index).unsqueeze(1);  // (n, 1)
    at::Tensor h = hidden.index_select(0, index);                                  // (n, D)
    if (scale != 1.0) h = h * scale;
    h = h.to(dtype);
    // (n, V) logits in fp32; the compute-dtype product is dropped as soon as it is converted.
    at::Tensor x = at::mm(h, w.t()).to(at::kFloat);
    at::Tensor capped;  // tanh(logits / cap) when soft-capped: the cap's derivative is 1 - capped^2
    if (softcap) {
      capped = x.div_(*softcap).tanh_();
      x = capped * *softcap;
    }
    // Cross-entropy per row: log(sum(exp(x - max))) + max - x[target]; x becomes exp(x - max) in place.
    const at::Tensor picked = x.gather(1, target);  // (n, 1)
    const at::Tensor max = std::get<0>(x.max(1, /*keepdim=*/true));
    x.sub_(max).exp_();
    const at::Tensor sum = x.sum(1, /*keepdim=*/true);
    loss_sum.add_((sum.log() + max - picked).sum());
    // d loss / d logits = softmax - one-hot, times grad_scale (and the row's weight), still in place.
    if (row_weights.defined()) {
      const at::Tensor row_scale = row_weights.reshape({-1}).index_select(0, index).unsqueeze(1).to(at::kFloat) *
                                   grad_scale;  // (n, 1)
      x.mul_(sum.reciprocal().mul_(row_scale));
      x.scatter_add_(1, target, -row_scale);
    } else {
      x.mul_(sum.reciprocal().mul_(grad_scale));
      x.scatter_add_(1, target, at::full_like(picked, -grad_scale));
    }
    if (softcap) x.mul_(1 - capped.square());
    capped = at::Tensor();
    const at::Tensor g = x.scalar_type() == dtype ? x : x.to(dtype);
    x = at::Tensor();  // the fp32 gradient is not needed once g holds it in the compute dtype
    at::Tensor grad_h = at::mm(g, w);
    if (scale != 1.0) grad_h.mul_(scale);
    out.grad_hidden.index_copy_(0, index, grad_h.to(hidden.scalar_type()));
    if (weight_grad.defined()) {
      if (weight_grad.scalar_type() == dtype)
        weight_grad.addmm_(g.t(), h);
      else
        weight_grad.add_(at::mm(g.t(), h));
    }
  }
  out.loss_sum = loss_sum;
  return out;
}

TokenLosses token_losses(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& weight, double scale,
                         int64_t chunk_size, std::optional<at::ScalarType> compute_dtype,
                         std::optional<double> softcap) {
  at::NoGradGuard no_grad;
  const at::ScalarType dtype = compute_dtype.value_or(hidden.scalar_type());
  const at::Tensor flat_targets = targets.reshape({-1});
  const at::Tensor flat_hidden = hidden.reshape({-1, hidden.size(-1)});
  const at::Tensor rows = (flat_targets != -100).nonzero().reshape({-1});
  const at::Tensor w = weight.scalar_type() == dtype ? weight : weight.to(dtype);
  TokenLosses out;
  out.loss = at::zeros({flat_targets.numel()}, hidden.options().dtype(at::kFloat));
  out.mean_logit = at::zeros_like(out.loss);
  for (int64_t begin = 0; begin < rows.numel(); begin += chunk_size) {
    const at::Tensor index = rows.narrow(0, begin, std::min(chunk_size, rows.numel() - begin));
    const at::Tensor target = flat_targets.index_select(0, index).unsqueeze(1);
    at::Tensor h = flat_hidden.index_select(0, index);
    if (scale != 1.0) h = h * scale;
    at::Tensor x = at::mm(h.to(dtype), w.t()).to(at::kFloat);  // (n, V)
    if (softcap) x = at::tanh(x / *softcap) * *softcap;
    out.mean_logit.index_copy_(0, index, x.mean(1));
    out.loss.index_copy_(0, index, (at::logsumexp(x, {1}) - x.gather(1, target).squeeze(1)));
  }
  return out;
}

}  // namespace trainer
