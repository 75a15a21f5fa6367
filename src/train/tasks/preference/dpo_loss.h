// DPO's losses over the pairs' sequence log-probabilities, as TRL's DPOTrainer computes them (dpo.loss_type: sigmoid,
// hinge, ipo, robust, sft; several summed with dpo.loss_weights), written so that an effective batch split into any
// micro-batches gives the same loss and gradients: each pair's term is divided by the pairs of the effective batch,
// and sft's by the chosen completion tokens of the effective batch (TRL: the means over its one batch).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/config.h"

namespace trainer {

// Per pair (k), fp64: the completions' summed log-probabilities under the policy and the reference, and their
// completion token counts (IPO averages per token).
struct PairScores {
  at::Tensor chosen, rejected;          // the policy's; differentiable when the gradient is wanted
  at::Tensor ref_chosen, ref_rejected;
  at::Tensor chosen_tokens, rejected_tokens;
  double logits_chosen = 0, logits_rejected = 0;  // the logits' means over the vocabulary, summed over the tokens
};

// What the effective batch holds: the divisors that make micro-batches exact.
struct PairTotals {
  double pairs = 1;
  double chosen_tokens = 1;
};

// This micro-batch's part of the effective batch's loss (a scalar, fp64).
at::Tensor dpo_loss(const DpoConfig& dpo, const PairScores& scores, const PairTotals& totals);

// The sums behind TRL's metrics (divided by the counts when reported): rewards/*, rewards/accuracies,
// rewards/margins, logps/* over pairs; logits/* over completion tokens.
struct PreferenceSums {
  double pairs = 0;
  double rewards_chosen = 0, rewards_rejected = 0, accuracies = 0, margins = 0;
  double logps_chosen = 0, logps_rejected = 0;
  double logits_chosen = 0, logits_rejected = 0, chosen_tokens = 0, rejected_tokens = 0;
  double loss = 0;  // the loss summed as dpo_loss gives it (already per pair)

  void add(const DpoConfig& dpo, const PairScores& scores);
  PreferenceSums& operator+=(const PreferenceSums& other);
  std::vector<double> to_vector() const;  // for a sum over the ranks
  static PreferenceSums from_vector(const std::vector<double>& v);
  // metrics.jsonl's names and values (TRL's names).
  std::vector<std::pair<std::string, double>> metrics() const;
};

}  // namespace trainer
