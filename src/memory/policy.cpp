// The memory policy (see policy.h).
#include "memory/policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

namespace trainer {

MemoryPolicy::MemoryPolicy(const MemoryConfig& memory, const TrainingConfig& training)
    : memory_(memory),
      by_tokens_(training.micro_batch_tokens > 0),
      micro_batch_(by_tokens_ ? training.micro_batch_tokens
                   : training.micro_batch_size.is_auto ? training.batch_size
                                                       : training.micro_batch_size.value),
      largest_ok_(std::numeric_limits<int64_t>::max()),
      loss_chunk_size_(training.loss_chunk_size) {}

void MemoryPolicy::set_micro_batch(int64_t n, int64_t step, const std::string& reason) {
  if (n == micro_batch_) return;
  adaptations_.push_back({step, micro_batch_, n, reason});
  spdlog::warn("memory: step {}: micro-batch {} -> {}{} ({})", step, micro_batch_, n, by_tokens_ ? " tokens" : "",
               reason);
  micro_batch_ = n;
}

std::vector<std::pair<int64_t, int64_t>> MemoryPolicy::split(std::span<const Example> examples, bool seq2seq) const {
  return by_tokens_ ? split_tokens(examples, micro_batch_, seq2seq)
                    : split_counts(static_cast<int64_t>(examples.size()), micro_batch_);
}

std::vector<std::pair<int64_t, int64_t>> MemoryPolicy::split_rows(std::span<const std::pair<int64_t, int64_t>> sizes) const {
  return by_tokens_ ? split_token_sizes(sizes, micro_batch_) : split_counts(static_cast<int64_t>(sizes.size()), micro_batch_);
}

bool MemoryPolicy::shrink(int64_t step, const std::string& where, bool single_examples) {
  stable_steps_ = 0;
  largest_ok_ = std::min(largest_ok_, micro_batch_ - 1);
  const int64_t floor = by_tokens_ ? 1 : memory_.min_micro_batch_size;
  if (memory_.on_oom == OomPolicy::kFail || micro_batch_ <= floor || (by_tokens_ && single_examples)) return false;
  const auto smaller = std::max<int64_t>(
      floor,
      std::min<int64_t>(micro_batch_ - 1, static_cast<int64_t>(std::floor(static_cast<double>(micro_batch_) * memory_.shrink_factor))));
  set_micro_batch(smaller, step, "out of memory in " + where);
  return true;
}

std::string MemoryPolicy::next_escalation(int64_t step) {
  if (memory_.on_oom == OomPolicy::kFail) return {};
  for (const auto& candidate : memory_.escalation) {
    if (candidate == "smaller_loss_chunks" && loss_chunk_size_ > kMinLossChunkSize) {
      // Halving the chunk changes no result (each token's loss and gradient are the same in any chunk).
      const int64_t smaller = std::max(kMinLossChunkSize, loss_chunk_size_ / 2);
      if (std::find(escalated_.begin(), escalated_.end(), candidate) == escalated_.end())
        escalated_.push_back(candidate);
      adaptations_.push_back({step, micro_batch_, micro_batch_,
                              "escalate: loss_chunk_size " + std::to_string(loss_chunk_size_) + " -> " +
                                  std::to_string(smaller)});
      spdlog::warn("memory: step {}: micro-batch at its floor ({}); loss_chunk_size {} -> {}", step, micro_batch_,
                   loss_chunk_size_, smaller);
      loss_chunk_size_ = smaller;
      return candidate;
    }
    if (candidate == "smaller_loss_chunks") continue;  // at its minimum
    if (is_device_escalation(candidate)) continue;     // the trainer's, once these are used (device_move.h)
    if (std::find(escalated_.begin(), escalated_.end(), candidate) != escalated_.end()) continue;
    escalated_.push_back(candidate);
    adaptations_.push_back({step, micro_batch_, micro_batch_, "escalate: turn on " + candidate});
    spdlog::warn("memory: step {}: micro-batch at its floor ({}); turning on {}", step, micro_batch_, candidate);
    return candidate;
  }
  return {};
}

void MemoryPolicy::record_device_move(int64_t step, const std::string& escalation, const std::string& what) {
  if (!escalated(escalation)) escalated_.push_back(escalation);
  adaptations_.push_back({step, micro_batch_, micro_batch_, "escalate: " + escalation + " (" + what + ")"});
}

bool MemoryPolicy::escalated(const std::string& escalation) const {
  return std::find(escalated_.begin(), escalated_.end(), escalation) != escalated_.end();
}

bool is_device_escalation(const std::string& escalation) {
  return std::find_if(std::begin(kDeviceEscalationSteps), std::end(kDeviceEscalationSteps),
                      [&](const char* s) { return escalation == s; }) != std::end(kDeviceEscalationSteps);
}

void MemoryPolicy::step_succeeded(int64_t step, int64_t batch_size) {
  ++stable_steps_;
  if (memory_.regrow_after_steps <= 0 || stable_steps_ < memory_.regrow_after_steps) return;
  stable_steps_ = 0;
  // Grow by the inverse of the shrink factor, but never back to a size that has run out of memory.
  const auto larger = std::min({by_tokens_ ? std::numeric_limits<int64_t>::max() : batch_size, largest_ok_,
                                static_cast<int64_t>(std::ceil(static_cast<double>(micro_batch_) / memory_.shrink_factor))});
  if (larger > micro_batch_)
    set_micro_batch(larger, step, "regrow after " + std::to_string(memory_.regrow_after_steps) + " stable steps");
}

nlohmann::json MemoryPolicy::state() const {
  nlohmann::json adaptations = nlohmann::json::array();
  for (const auto& a : adaptations_)
    adaptations.push_back({{"step", a.step}, {"old", a.old_micro_batch}, {"new", a.new_micro_batch}, {"reason", a.reason}});
  return {{"micro_batch", micro_batch_},
          {"unit", by_tokens_ ? "tokens" : "examples"},
          {"largest_ok", largest_ok_ == std::numeric_limits<int64_t>::max() ? -1 : largest_ok_},
          {"escalated", escalated_},
          {"loss_chunk_size", loss_chunk_size_},
          {"adaptations", adaptations}};
}

void MemoryPolicy::restore(const nlohmann::json& state) {
  const bool saved_by_tokens = state.value("unit", std::string("examples")) == "tokens";
  if (saved_by_tokens == by_tokens_) {
    micro_batch_ = state.at("micro_batch").get<int64_t>();
    const auto largest = state.at("largest_ok").get<int64_t>();
    largest_ok_ = largest < 0 ? std::numeric_limits<int64_t>::max() : largest;
  } else {
    spdlog::warn("memory: the checkpoint's micro-batch counts {}, this run counts {}: starting from the config's",
                 saved_by_tokens ? "tokens" : "examples", by_tokens_ ? "tokens" : "examples");
  }
  escalated_.clear();
  for (const auto& e : state.at("escalated").get<std::vector<std::string>>())
    if (!is_device_escalation(e)) escalated_.push_back(e);
  loss_chunk_size_ = std::min(loss_chunk_size_, state.value("loss_chunk_size", loss_chunk_size_));
  adaptations_.clear();
  for (const auto& a : state.at("adaptations"))
    adaptations_.push_back({a.at("step").get<int64_t>(), a.at("old").get<int64_t>(), a.at("new").get<int64_t>(),
                            a.at("reason").get<std::string>()});
}

std::vector<std::pair<int64_t, int64_t>> split_tokens(std::span<const Example> examples, int64_t tokens, bool seq2seq) {
  // Collation pads inputs to the longest input and (seq2seq) labels to the longest labels of the micro-batch.
  std::vector<std::pair<int64_t, int64_t>> sizes;
  sizes.reserve(examples.size());
  for (const auto& e : examples)
    sizes.emplace_back(static_cast<int64_t>(e.input_ids.size()), seq2seq ? static_cast<int64_t>(e.labels.size()) : 0);
  return split_token_sizes(sizes, tokens);
}

std::vector<std::pair<int64_t, int64_t>> split_token_sizes(std::span<const std::pair<int64_t, int64_t>> sizes,
                                                           int64_t tokens) {
  auto input = [&](int64_t i) { return sizes[static_cast<std::size_t>(i)].first; };
  auto labels = [&](int64_t i) { return sizes[static_cast<std::size_t>(i)].second; };
  std::vector<std::pair<int64_t, int64_t>> parts;
  const auto n = static_cast<int64_t>(sizes.size());
  for (int64_t begin = 0; begin < n;) {
    int64_t count = 1, longest_input = input(begin), longest_labels = labels(begin);
    while (begin + count < n) {
      const int64_t next_input = std::max(longest_input, input(begin + count));
      const int64_t next_labels = std::max(longest_labels, labels(begin + count));
      if ((count + 1) * (next_input + next_labels) > tokens) break;
      longest_input = next_input;
      longest_labels = next_labels;
      ++count;
    }
    parts.emplace_back(begin, count);
    begin += count;
  }
  return parts;
}

std::vector<std::pair<int64_t, int64_t>> split_counts(int64_t count, int64_t micro) {
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (int64_t begin = 0; begin < count; begin += micro) parts.emplace_back(begin, std::min(micro, count - begin));
  return parts;
}

int64_t largest_that_fits(int64_t limit, const std::function<bool(int64_t)>& fits) {
  int64_t good = 0, bad = limit + 1;
  for (int64_t n = 1;; n = std::min(2 * n, limit)) {
    if (!fits(n)) {
      bad = n;
      break;
    }
    good = n;
    if (n == limit) break;
  }
  while (bad - good > 1) {
    const int64_t mid = (good + bad) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace trainer
