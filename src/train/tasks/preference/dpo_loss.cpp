// DPO's losses and metrics (see dpo_loss.h). The formulas are TRL's DPOTrainer._compute_loss (trl 1.16).
#include "train/tasks/preference/dpo_loss.h"

#include <cmath>

#include <ATen/ATen.h>

#include "trainer/errors.h"

namespace trainer {

at::Tensor dpo_loss(const DpoConfig& dpo, const PairScores& s, const PairTotals& totals) {
  const at::Tensor chosen_ratio = s.chosen - s.ref_chosen;
  const at::Tensor rejected_ratio = s.rejected - s.ref_rejected;
  const at::Tensor delta = chosen_ratio - rejected_ratio;
  const double beta = dpo.beta, smoothing = dpo.label_smoothing;
  at::Tensor loss = at::zeros({}, s.chosen.options());
  for (std::size_t i = 0; i < dpo.loss_type.size(); ++i) {
    const std::string& type = dpo.loss_type[i];
    const double weight = dpo.loss_weights.empty() ? 1.0 : dpo.loss_weights[i];
    if (type == "sft") {  // the mean NLL of the chosen completions' tokens: -sum(logps) / tokens
      loss = loss - weight * s.chosen.sum() / totals.chosen_tokens;
      continue;
    }
    at::Tensor per_pair;
    if (type == "sigmoid") {
      per_pair = -at::log_sigmoid(beta * delta);
    } else if (type == "hinge") {
      per_pair = at::relu(1 - beta * delta);
    } else if (type == "ipo") {  // log-ratios averaged per completion token, as TRL does
      const at::Tensor ipo_delta =
          chosen_ratio / s.chosen_tokens.clamp_min(1.0) - rejected_ratio / s.rejected_tokens.clamp_min(1.0);
      per_pair = (ipo_delta - 1 / (2 * beta)).pow(2);
    } else if (type == "robust") {
      per_pair = (-(1 - smoothing) * at::log_sigmoid(beta * delta) + smoothing * at::log_sigmoid(-beta * delta)) /
                 (1 - 2 * smoothing);
    } else {
      throw Error("dpo.loss_type " + type + " is not implemented");  // validate() refuses it first
    }
    loss = loss + weight * per_pair.sum() / totals.pairs;
  }
  return loss;
}

void PreferenceSums::add(const DpoConfig& dpo, const PairScores& s) {
  const at::Tensor chosen_rewards = dpo.beta * (s.chosen - s.ref_chosen).detach();
  const at::Tensor rejected_rewards = dpo.beta * (s.rejected - s.ref_rejected).detach();
  pairs += static_cast<double>(s.chosen.numel());
  rewards_chosen += chosen_rewards.sum().item<double>();
  rewards_rejected += rejected_rewards.sum().item<double>();
  accuracies += (chosen_rewards > rejected_rewards).sum().item<double>();
  margins += (chosen_rewards - rejected_rewards).sum().item<double>();
  logps_chosen += s.chosen.detach().sum().item<double>();
  logps_rejected += s.rejected.detach().sum().item<double>();
  logits_chosen += s.logits_chosen;
  logits_rejected += s.logits_rejected;
  chosen_tokens += s.chosen_tokens.sum().item<double>();
  rejected_tokens += s.rejected_tokens.sum().item<double>();
}

PreferenceSums& PreferenceSums::operator+=(const PreferenceSums& other) {
  auto sum = to_vector();
  const auto more = other.to_vector();
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += more[i];
  return *this = from_vector(sum);
}

std::vector<double> PreferenceSums::to_vector() const {
  return {pairs,        rewards_chosen, rewards_rejected, accuracies,      margins,       logps_chosen,
          logps_rejected, logits_chosen, logits_rejected,  chosen_tokens,   rejected_tokens, loss};
}

PreferenceSums PreferenceSums::from_vector(const std::vector<double>& v) {
  PreferenceSums s;
  s.pairs = v.at(0);
  s.rewards_chosen = v.at(1);
  s.rewards_rejected = v.at(2);
  s.accuracies = v.at(3);
  s.margins = v.at(4);
  s.logps_chosen = v.at(5);
  s.logps_rejected = v.at(6);
  s.logits_chosen = v.at(7);
  s.logits_rejected = v.at(8);
  s.chosen_tokens = v.at(9);
  s.rejected_tokens = v.at(10);
  s.loss = v.at(11);
  return s;
}

std::vector<std::pair<std::string, double>> PreferenceSums::metrics() const {
  const double n = pairs > 0 ? pairs : 1;
  return {{"rewards/chosen", rewards_chosen / n},
          {"rewards/rejected", rewards_rejected / n},
          {"rewards/accuracies", accuracies / n},
          {"rewards/margins", margins / n},
          {"logps/chosen", logps_chosen / n},
          {"logps/rejected", logps_rejected / n},
          {"logits/chosen", chosen_tokens > 0 ? logits_chosen / chosen_tokens : 0.0},
          {"logits/rejected", rejected_tokens > 0 ? logits_rejected / rejected_tokens : 0.0}};
}

}  // namespace trainer
