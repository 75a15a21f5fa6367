// Fused linear cross-entropy: the LM head and the token-level cross-entropy over a few trained positions at a
// time, each chunk's logits turned into their own gradient in place (softmax minus one-hot, times the gradient
// scale) and multiplied straight into the gradients of the hidden states and of the head weight. Only one chunk's
// logits exist at a time, no logit gradient beside them, and the logits are never computed twice (no recompute in
// a backward pass). The cross-entropy is computed in fp32 whatever the compute dtype, as the plain loss does.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace trainer {

struct FusedLossResult {
  at::Tensor loss_sum;     // scalar fp32 tensor: the summed token losses (not scaled)
  at::Tensor grad_hidden;  // (N, D) in hidden's dtype: d(loss_sum * grad_scale) / d hidden; zero rows where ignored
};

// hidden (N, D) without autograd history, targets (N) with -100 for positions not trained on, head weight (V, D);
// logits = (hidden * scale) @ weight^T computed in `compute_dtype` (the autocast dtype; by default hidden's).
// When `weight_grad` is defined (V, D), the head weight's gradient times grad_scale is added into it chunk by
// chunk. `chunk_size` trained positions per chunk. `row_weights` (N, fp32), when defined: position i's loss counts
// row_weights[i] times in the gradient (a loss that weighs tokens by what their sequence scored: DPO); loss_sum stays
// the plain sum. `softcap`: the logits are soft-capped, cap * tanh(logits / cap), before the cross-entropy (Gemma 2's
// final_logit_softcapping), and the gradient goes back through the cap.
FusedLossResult fused_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& targets,
                                           const at::Tensor& weight, double scale, double grad_scale,
                                           int64_t chunk_size, std::optional<at::ScalarType> compute_dtype,
                                           at::Tensor weight_grad = {}, const at::Tensor& row_weights = {},
                                           std::optional<double> softcap = std::nullopt);

// The cross-entropy of every position without autograd, `chunk_size` trained positions at a time (the same logits
// as fused_linear_cross_entropy): hidden (..., D), targets (...). Both (N) fp32 over the flattened positions, 0
// where the target is -100: `loss` (minus the target's log-probability) and `mean_logit` (the logits' mean over
// the vocabulary, TRL's logits/* metrics).
struct TokenLosses {
  at::Tensor loss, mean_logit;
};
TokenLosses token_losses(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& weight, double scale,
                         int64_t chunk_size, std::optional<at::ScalarType> compute_dtype,
                         std::optional<double> softcap = std::nullopt);

}  // namespace trainer
