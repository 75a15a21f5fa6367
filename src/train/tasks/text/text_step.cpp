// The text task's memory-adaptive step (see text_step.h).
#include "train/tasks/text/text_step.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/autograd.h>

#include "memory/cpu_budget.h"
#include "models/dropout.h"
#include "train/activation_checkpointing.h"
#include "train/fused_loss.h"
#include "train/precision.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

// Examples in the largest micro-batch of a split (what the progress line and metrics call the micro-batch).
int64_t largest_part(const std::vector<std::pair<int64_t, int64_t>>& parts) {
  int64_t largest = 0;
  for (const auto& part : parts) largest = std::max(largest, part.second);
  return largest;
}

}  // namespace

double TrainStep::forward_backward(std::span<const Example> examples, double normaliser) {
  const CollatedBatch collated = collate(examples, options_.pad_id, options_.device);
  return forward_backward(Batch{collated.input_ids, collated.attention_mask, collated.labels, {}}, normaliser);
}

std::vector<PackedRow> TrainStep::pack(std::span<const Example> examples) const {
  const DataFamily family = model_.family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  const PackCapacity capacity = policy_.by_tokens()
                                    ? pack_capacity_within(options_.pack_capacity, family, policy_.micro_batch())
                                    : options_.pack_capacity;
  return pack_rows(examples, family, capacity);
}

double TrainStep::forward_backward_packed(std::span<const Example> examples, std::span<const PackedRow> rows,
                                          int64_t step, double normaliser, int64_t first_example) {
  const DataFamily family = model_.family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  const PackedBatch packed = collate_packed(examples, rows, family, options_.pad_id, options_.device);
  Batch batch{packed.input_ids, packed.attention_mask, packed.labels, {}};
  batch.segment_ids = packed.segment_ids;
  batch.position_ids = packed.position_ids;
  batch.decoder_segment_ids = packed.decoder_segment_ids;
  batch.decoder_position_ids = packed.decoder_position_ids;
  // Each example keeps the dropout masks of its place in the effective batch, wherever its row puts it.
  // (`first_example`: where this rank's share starts in the effective batch, under data parallelism.)
  const at::Tensor segment_examples =
      first_example == 0 ? packed.segment_examples : packed.segment_examples + first_example;
  std::vector<PackedDropoutStream> streams = {
      {packed.segment_ids, packed.position_ids, segment_examples, packed.segment_starts}};
  if (family == DataFamily::kSeq2Seq)
    streams.push_back({packed.decoder_segment_ids, packed.decoder_position_ids, segment_examples,
                       packed.decoder_segment_starts});
  const DropoutScope dropout(options_.seed, step, std::move(streams));
  return forward_backward(batch, normaliser);
}

std::optional<at::ScalarType> autocast_dtype(PrecisionMode precision) {
  if (precision == PrecisionMode::kBf16Mixed) return at::kBFloat16;
  if (precision == PrecisionMode::kFp16Mixed) return at::kHalf;
  return std::nullopt;
}

std::optional<at::ScalarType> TrainStep::autocast_dtype() const { return trainer::autocast_dtype(options_.precision); }

double TrainStep::forward_backward(const Batch& batch, double normaliser) {
  const auto dtype = autocast_dtype();
  // fp16-mixed: the loss (fp32) times the loss scale, so that small gradients stay above fp16's smallest values;
  // run() divides the gradients by it again before clipping.
  const double grad_scale = loss_scale() / normaliser;
  if (!options_.chunked_loss) {
    at::Tensor loss_sum;
    {
      AutocastScope autocast(dtype.has_value(), options_.device.type(), dtype.value_or(at::kBFloat16));
      const LossSum out = forward_loss(model_, batch);
      // A mixture of experts' load-balancing share is a term of the mean: times the normaliser into the sum.
      loss_sum = out.routing_loss.defined() ? out.loss_sum + out.routing_loss * normaliser : out.loss_sum;
    }
    (options_.scaler ? loss_sum * grad_scale : loss_sum / normaliser).backward();
    return loss_sum.item<double>();
  }
  // Chunked loss: the fused linear cross-entropy (train/fused_loss.h) runs the LM head and the loss over
  // loss_chunk_size trained positions at a time, turning each chunk's logits into their gradient in place and
  // accumulating the head weight's gradient at once, so neither the full (tokens x vocabulary) logits nor their
  // gradient ever exist. The gradient reaches the rest of the model through the hidden states in one backward.
  at::Tensor hidden, targets;
  {
    AutocastScope scope(dtype.has_value(), options_.device.type(), dtype.value_or(at::kBFloat16));
    std::tie(hidden, targets) = model_.hidden_and_targets(batch);
  }
  at::Tensor weight = model_.lm_head_weight();
  if (options_.sync) options_.sync->before_head(weight);  // fully sharded: gathered when it is a unit of its own
  at::Tensor weight_grad;
  if (weight.requires_grad()) {
    if (!weight.grad().defined()) weight.mutable_grad() = at::zeros_like(weight);
    weight_grad = weight.grad();
  }
  const auto fused = fused_linear_cross_entropy(hidden.detach().reshape({-1, hidden.size(-1)}), targets,
                                                weight.detach(), model_.lm_head_scale(), grad_scale,
                                                policy_.loss_chunk_size(), dtype, weight_grad, /*row_weights=*/{},
                                                model_.final_logit_softcap());
  // An untied head's gradient is complete now (a tied one still gets the embedding's part from backward).
  if (options_.sync && weight_grad.defined() && !model_.lm_head_tied()) options_.sync->gradient_ready(weight);
  if (options_.sync) options_.sync->after_head(weight);
  const at::Tensor routing = model_.routing_loss();
  if (routing.defined() && routing.requires_grad()) {
    // One backward from both roots: the routers' logits share the graph below the hidden states.
    torch::autograd::backward({hidden, routing},
                              {fused.grad_hidden.reshape(hidden.sizes()), at::full_like(routing, grad_scale * normaliser)});
  } else if (hidden.requires_grad()) {
    hidden.backward(fused.grad_hidden.reshape(hidden.sizes()));
  }
  return fused.loss_sum.item<double>() + (routing.defined() ? routing.item<double>() * normaliser : 0.0);
}

bool TrainStep::escalate(int64_t step) {
  // Steps that are on already (from the config) change nothing: go on to the next instead of spending a retry.
  for (std::string escalation = policy_.next_escalation(step); !escalation.empty();
       escalation = policy_.next_escalation(step)) {
    if (escalation == "activation_checkpointing" && !model_.has_block_runner()) {
      apply_activation_checkpointing(model_);
      return true;
    }
    // chunked_loss matters only where the config turned the default off (it is not in the default ladder).
    if (escalation == "chunked_loss" && !options_.chunked_loss) {
      options_.chunked_loss = true;
      return true;
    }
    if (escalation == "smaller_loss_chunks") {  // the policy has halved its loss_chunk_size
      options_.chunked_loss = true;
      return true;
    }
  }
  return false;
}

// The text task's part of an attempt (StepWork for run_attempts).
class TextStepWork final : public StepWork {
 public:
  TextStepWork(TrainStep& step, std::span<const Example> examples, int64_t share_begin, double normaliser)
      : step_(step), examples_(examples), share_begin_(share_begin), normaliser_(normaliser) {}
  void forward_backward(int64_t step, AttemptOutcome& outcome) override {
    step_.attempt(examples_, share_begin_, step, normaliser_, outcome);
  }
  bool escalate(int64_t step) override { return step_.escalate(step); }
  // Overlap (distributed.overlap_grad_reduce) waits for each gradient's single accumulation; activation
  // checkpointing's recomputation runs nested backward passes, so it sums after backward instead.
  bool may_overlap() const override { return !step_.model_.has_block_runner(); }

 private:
  TrainStep& step_;
  std::span<const Example> examples_;
  int64_t share_begin_;
  double normaliser_;
};

void TrainStep::attempt(std::span<const Example> examples, int64_t share_begin, int64_t step, double normaliser,
                        AttemptOutcome& outcome) {
  const bool seq2seq = model_.family() == ModelFamily::kSeq2Seq;
  // Before the last micro-batch of the attempt: its backward may start the buckets' sums.
  auto last_part = [&](std::size_t index, std::size_t count) {
    if (options_.sync && index + 1 == count) options_.sync->before_last_backward();
  };
  std::vector<std::pair<int64_t, int64_t>> parts;
  if (options_.packing) {
    // Packed rows: the policy splits rows as it splits examples (and in token mode packs shorter rows).
    const std::vector<PackedRow> rows = pack(examples);
    parts = policy_.split_rows(row_sizes(rows, seq2seq ? DataFamily::kSeq2Seq : DataFamily::kCausal));
    outcome.largest_part = largest_part(parts);
    outcome.micro_steps = static_cast<int64_t>(parts.size());
    // At the floor: rows of one example each.
    outcome.at_floor = outcome.largest_part <= 1 &&
                       std::all_of(rows.begin(), rows.end(), [](const PackedRow& row) { return row.examples.size() <= 1; });
    const std::size_t passes = agreed_passes(parts.size());
    if (!count_routing(parts.size(), passes, outcome, [&](std::size_t i) {
          const auto& [begin, count] = parts[i];
          const PackedBatch packed = collate_packed(
              examples, std::span<const PackedRow>(rows).subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)),
              DataFamily::kCausal, options_.pad_id, options_.device);
          const at::Tensor segment_examples =
              share_begin == 0 ? packed.segment_examples : packed.segment_examples + share_begin;
          const DropoutScope dropout(options_.seed, step,
                                     std::vector<PackedDropoutStream>{{packed.segment_ids, packed.position_ids,
                                                                       segment_examples, packed.segment_starts}});
          Batch batch{packed.input_ids, packed.attention_mask, packed.labels, {}};
          batch.segment_ids = packed.segment_ids;
          batch.position_ids = packed.position_ids;
          return routing_counts(batch);
        }))
      return;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto& [begin, count] = parts[i];
      last_part(i, parts.size());
      outcome.loss_sum += forward_backward_packed(
          examples,
          std::span<const PackedRow>(rows).subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)),
          step, normaliser, share_begin);
    }
    empty_passes(passes - parts.size(), step);
    return;
  }
  parts = policy_.split(examples, seq2seq);
  outcome.largest_part = largest_part(parts);
  outcome.micro_steps = static_cast<int64_t>(parts.size());
  outcome.at_floor = outcome.largest_part <= 1;
  const std::size_t passes = agreed_passes(parts.size());
  if (!count_routing(parts.size(), passes, outcome, [&](std::size_t i) {
        const auto& [begin, count] = parts[i];
        const DropoutScope dropout(options_.seed, step, share_begin + begin, count, options_.device);
        const auto part = examples.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count));
        const CollatedBatch collated = collate(part, options_.pad_id, options_.device);
        return routing_counts(Batch{collated.input_ids, collated.attention_mask, collated.labels, {}});
      }))
    return;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const auto& [begin, count] = parts[i];
    last_part(i, parts.size());
    // Dropout masks follow the examples' places in the effective batch, so neither the split nor the ranks change
    // them.
    const DropoutScope dropout(options_.seed, step, share_begin + begin, count, options_.device);
    outcome.loss_sum +=
        forward_backward(examples.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)), normaliser);
  }
  empty_passes(passes - parts.size(), step);
}

std::size_t TrainStep::agreed_passes(std::size_t mine) {
  if (!options_.sync || !options_.sync->shards_weights()) return mine;
  return static_cast<std::size_t>(options_.sync->agree_passes(static_cast<int64_t>(mine)));
}

void TrainStep::empty_passes(std::size_t count, int64_t step) {
  for (std::size_t i = 0; i < count; ++i) {
    const at::Tensor one = at::full({1, 1}, options_.pad_id, at::TensorOptions().dtype(at::kLong).device(options_.device));
    const Batch batch{one, at::ones_like(one), at::full_like(one, -100), {}};
    const DropoutScope dropout(options_.seed, step, 0, 1, options_.device);
    // The same units' collectives as a real pass, in the same order: the head through lm_head (the plain loss) or
    // between before_head and after_head (the fused loss), gradients of zero.
    at::Tensor out;
    {
      const auto dtype = autocast_dtype();
      AutocastScope autocast(dtype.has_value(), options_.device.type(), dtype.value_or(at::kBFloat16));
      out = model_.hidden_and_targets(batch).first;
      if (!options_.chunked_loss) out = model_.lm_head(out);
    }
    if (options_.chunked_loss) {
      const at::Tensor weight = model_.lm_head_weight();
      options_.sync->before_head(weight);
      options_.sync->after_head(weight);
    }
    (out.sum() * 0.0).backward();
  }
}

std::vector<double> TrainStep::routing_counts(const Batch& batch) {
  const auto dtype = autocast_dtype();
  AutocastScope autocast(dtype.has_value(), options_.device.type(), dtype.value_or(at::kBFloat16));
  return model_.routing_counts(batch);
}

bool TrainStep::count_routing(std::size_t parts, std::size_t passes, AttemptOutcome& outcome,
                              const std::function<std::vector<double>(std::size_t)>& counts_of) {
  if (!model_.has_routing_loss()) return true;
  // One micro-batch on one process: its forward counts its own routing, which is the batch's.
  if (parts <= 1 && !options_.sync) {
    model_.set_routing_totals({});
    return true;
  }
  // Otherwise a pass without gradients over every micro-batch counts the effective batch's routing before the
  // first backward (the balancing loss's assignments carry no gradient but must be the whole batch's), summed over
  // the ranks. Every rank takes part in the sum, one that ran out of memory too (its flag, the last number, makes
  // the attempt an out-of-memory attempt on every rank).
  // Fully sharded weights: each counting forward is a collective, so a rank with fewer micro-batches runs forwards
  // of one padding token that count nothing (as many passes as the rank with the most), and an out-of-memory error
  // is the attempt's, agreed through the collectives as any other.
  const bool sharded = options_.sync && options_.sync->shards_weights();
  std::vector<double> totals;
  std::optional<std::string> failed;
  try {
    for (std::size_t i = 0; i < parts; ++i) {
      const auto counts = counts_of(i);
      if (totals.empty()) totals.assign(counts.size(), 0.0);
      for (std::size_t j = 0; j < counts.size(); ++j) totals[j] += counts[j];
    }
    for (std::size_t i = parts; sharded && i < passes; ++i) {
      const at::Tensor one = at::full({1, 1}, options_.pad_id, at::TensorOptions().dtype(at::kLong).device(options_.device));
      (void)routing_counts(Batch{one, at::ones_like(one), at::full_like(one, -100), {}});
    }
  } catch (const c10::OutOfMemoryError& e) {
    if (sharded) throw;
    failed = e.what_without_backtrace();
  }
  if (options_.sync) {
    const std::size_t width = static_cast<std::size_t>(model_.routing_experts()) + 1;
    if (totals.empty()) totals.assign(width, 0.0);  // an empty share, or out of memory
    totals.push_back(failed ? 1.0 : 0.0);
    totals = options_.sync->sum(totals, "the mixture of experts' routing counts");
    const bool any_failed = totals.back() > 0;
    totals.pop_back();
    if (any_failed && !failed) failed = "another rank ran out of memory counting the routing";
  }
  if (failed) {
    model_.set_routing_totals({});
    outcome.dropped = "counting the routing: " + *failed;
    return false;
  }
  model_.set_routing_totals(std::move(totals));
  return true;
}

StepResult TrainStep::run(const EffectiveBatch& batch, int64_t step, double lr) {
  const bool seq2seq = model_.family() == ModelFamily::kSeq2Seq;
  const std::span<const Example> all(batch.examples);
  // Data parallelism: this rank trains its share; the normaliser stays the whole effective batch's target tokens.
  const auto [share_begin, share_count] = options_.sync
                                              ? options_.sync->share(all, policy_.by_tokens(), seq2seq)
                                              : std::pair<int64_t, int64_t>{0, static_cast<int64_t>(all.size())};
  const auto examples = all.subspan(static_cast<std::size_t>(share_begin), static_cast<std::size_t>(share_count));
  const double normaliser = static_cast<double>(std::max<int64_t>(1, batch.target_tokens));
  TextStepWork work(*this, examples, share_begin, normaliser);
  StepResult result = run_attempts(work, {optimizer_, policy_, options_.scaler, options_.sync, options_.max_grad_norm,
                                          options_.max_retries, step, lr, static_cast<int64_t>(all.size()),
                                          normaliser, batch.target_tokens});
  if (model_.has_routing_loss()) add_routing_metrics(result);
  return result;
}

void TrainStep::add_routing_metrics(StepResult& result) {
  // The load-balancing loss of the effective batch (its ranks' shares summed) and how evenly the top-k assignments
  // fell: the busiest and the idlest expert's count over the mean count, and the counts' coefficient of variation.
  const auto summary = model_.routing_summary();
  double loss = summary.balancing_loss;
  if (options_.sync) loss = options_.sync->sum({loss}, "the load-balancing loss")[0];
  result.metrics.emplace_back("router/balancing_loss", loss);
  const auto& counts = summary.assignments;
  if (counts.empty()) return;
  double total = 0, squares = 0;
  for (double c : counts) total += c;
  const double mean = total / static_cast<double>(counts.size());
  if (mean <= 0) return;
  for (double c : counts) squares += (c - mean) * (c - mean);
  result.metrics.emplace_back("router/busiest_expert_load", *std::max_element(counts.begin(), counts.end()) / mean);
  result.metrics.emplace_back("router/idlest_expert_load", *std::min_element(counts.begin(), counts.end()) / mean);
  result.metrics.emplace_back("router/load_cv", std::sqrt(squares / static_cast<double>(counts.size())) / mean);
}

}  // namespace trainer
