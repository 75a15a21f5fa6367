// The attempt loop every task's step runs in (see attempts.h).
#include "train/engine/attempts.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

namespace trainer {
namespace {

// fp16-mixed: this many skipped steps in a row is no calibration of the loss scale any more (from 2^16 it has
// fallen below 2^-4): a warning says what else overflows.
constexpr int64_t kManySkippedSteps = 20;


// After an out-of-memory error in forward/backward (`what`): drops the attempt's gradients and cached memory, then
// shrinks the micro-batch (or, at the floor, takes the next escalation `escalate` applies), so the caller retries the
// same effective batch. Throws OutOfMemoryAtFloor when memory.max_retries or the ladder is used up; `floor_hint`
// says what the user can change then.
void adapt_to_out_of_memory(Optimizer& optimizer, MemoryPolicy& policy, int64_t step, int64_t attempt,
                            int64_t max_retries, bool at_floor, const std::function<bool()>& escalate,
                            const std::string& what, const std::string& floor_hint) {
  optimizer.zero_grad();
  release_cached_memory();
  spdlog::debug("out of memory in forward/backward: {}", what);
  if (attempt + 1 > max_retries)
    throw OutOfMemoryAtFloor("out of memory at step " + std::to_string(step) + " after " +
                                 std::to_string(attempt + 1) + " attempts (memory.max_retries)",
                             "raise memory.max_retries or memory.limit");
  if (policy.shrink(step, "forward/backward", at_floor)) return;
  if (escalate()) return;
  throw OutOfMemoryAtFloor("out of memory in forward/backward at step " + std::to_string(step) + " with micro-batch " +
                               std::to_string(policy.micro_batch()) + " and every escalation used: " +
                               what.substr(0, 300),
                           floor_hint);
}

// After a forward/backward attempt that fit, with the effective batch's gradients accumulated and result.loss set:
// fp16-mixed's unscale and overflow check (an overflow skips the update, backs the scale off and sets
// result.skipped; it is never an out-of-memory error), then the gradient norm, clipping and the optimizer update.
// Returns false when the caller must run the same effective batch again: an out-of-memory error in the optimizer
// step is retried once (`optimizer_retried`), then OutOfMemoryAtFloor is thrown.
bool apply_update(const AttemptSettings& phase, StepResult& result, bool& optimizer_retried) {
  Optimizer& optimizer = phase.optimizer;
  const int64_t step = phase.step;
  if (phase.scaler) {
    // fp16-mixed: the gradients back to their true size, then the overflow check, one decision for every rank.
    // An overflow is no out-of-memory error: the memory policy neither shrinks nor retries; the scale backs off
    // and the effective batch is not trained.
    result.loss_scale = phase.scaler->scale();
    bool overflow = phase.scaler->unscale_and_check(optimizer.gradients());
    // With a sharded optimizer each rank holds only its own parameters' summed gradients: the ranks agree.
    if (phase.sync) overflow = !phase.sync->agree(!overflow, 0).all_fit;
    if (overflow) {
      optimizer.zero_grad();
      phase.scaler->update(/*found_inf=*/true);
      result.skipped = true;
      result.grad_norm = std::numeric_limits<double>::quiet_NaN();
      spdlog::info("step {}: gradients overflowed fp16 (inf/NaN) at loss scale {}: update skipped, loss scale -> {}",
                   step, result.loss_scale, phase.scaler->scale());
      if (phase.scaler->consecutive_skips() == kManySkippedSteps)
        spdlog::warn("fp16-mixed: {} steps in a row skipped for inf/NaN gradients (loss scale now {}): the forward "
                     "pass itself overflows fp16 or the loss is not finite (loss {:g}), which no loss scale fixes. "
                     "Use precision.mode=fp32 (or bf16-mixed on a GPU with bf16)",
                     kManySkippedSteps, phase.scaler->scale(), result.loss);
      phase.policy.step_succeeded(step, phase.examples);  // it fit: the memory policy's step
      return true;
    }
  }
  // What in the optimizer phase allocates (the gradient norm's temporaries) runs first, and with data parallelism
  // the ranks agree on its outcome before any rank changes a gradient or a weight, so an out-of-memory error on one
  // rank is retried (or stops the run) on every rank alike. The update itself allocates nothing (optimizer.h).
  std::optional<std::string> step_out_of_memory;
  double sum_squares = 0;
  try {
    sum_squares = optimizer.squared_grad_norm();
  } catch (const c10::OutOfMemoryError& e) {
    step_out_of_memory = e.what_without_backtrace();
  }
  if (phase.sync) {
    const auto outcome = phase.sync->agree(!step_out_of_memory, 0);
    if (!outcome.all_fit)
      step_out_of_memory = "rank(s) " + outcome.failed_ranks + ": " + step_out_of_memory.value_or("out of memory");
    else
      sum_squares = phase.sync->global_squared_norm(sum_squares);
  }
  if (!step_out_of_memory) {
    try {
      result.grad_norm = optimizer.clip_to(std::sqrt(sum_squares), phase.max_grad_norm);
      optimizer.step(phase.lr);
    } catch (const c10::OutOfMemoryError& e) {
      // Not expected (the update allocates nothing); with data parallelism a rank that got here cannot be told
      // apart from one that updated, so the run stops rather than letting the ranks' weights differ.
      if (phase.sync)
        throw OutOfMemoryAtFloor(std::string("out of memory inside the optimizer update at step ") +
                                     std::to_string(step) + ": " + e.what_without_backtrace(),
                                 "raise memory.limit");
      step_out_of_memory = e.what_without_backtrace();
    }
  }
  if (step_out_of_memory) {
    optimizer.zero_grad();
    release_cached_memory();
    spdlog::debug("out of memory in the optimizer step: {}", *step_out_of_memory);
    // Weights, gradients and optimizer state alone: a smaller micro-batch changes none of them. Once more at the
    // same size (cached or fragmented memory is released now), then stop with what to change.
    if (!optimizer_retried) {
      optimizer_retried = true;
      spdlog::warn("memory: step {}: out of memory in the optimizer step ({}); retrying once at micro-batch {}", step,
                   step_out_of_memory->substr(0, 200), phase.policy.micro_batch());
      return false;
    }
    throw OutOfMemoryAtFloor("out of memory in the optimizer step at step " + std::to_string(step) +
                                 ": the weights, their gradients and the optimizer state do not fit together, "
                                 "and a smaller micro-batch cannot change that",
                             phase.sync ? "raise memory.limit, or set distributed.shard_optimizer=true (each "
                                          "rank keeps 1/N of the optimizer state)"
                                        : "");
  }
  if (phase.sync) phase.sync->after_update();
  if (phase.scaler) phase.scaler->update(/*found_inf=*/false);
  phase.policy.step_succeeded(step, phase.examples);
  return true;
}

}  // namespace

void release_cached_memory() {
  if (at::accelerator::getAccelerator(false).has_value()) at::accelerator::emptyCache();
}

StepResult run_attempts(StepWork& work, const AttemptSettings& s) {
  StepResult result;
  bool optimizer_retried = false;
  for (int64_t attempt = 0;; ++attempt) {
    s.optimizer.zero_grad();
    AttemptOutcome outcome;
    std::optional<std::string> out_of_memory;  // what ran out of memory in this attempt's forward/backward
    bool failed_here = true;  // the out-of-memory error was this rank's (not learnt from another rank)
    try {
      if (s.sync) s.sync->begin_attempt(work.may_overlap());
      work.forward_backward(s.step, outcome);
      if (outcome.dropped) out_of_memory = *outcome.dropped;
      else if (s.sync) s.sync->prepare();
    } catch (const AgreedOutOfMemory& e) {
      out_of_memory = e.what_without_backtrace();
      failed_here = false;
    } catch (const c10::OutOfMemoryError& e) {
      // The attempt's activations were freed while unwinding. No parameter has changed: everything before the
      // update only reads the parameters.
      out_of_memory = e.what_without_backtrace();
    }
    // Fully sharded weights: the ranks still inside the attempt's collectives learn of it now.
    if (out_of_memory && s.sync) s.sync->announce_failure();
    bool at_floor = outcome.at_floor;
    if (s.sync) {
      // Every rank learns whether every rank fit before any gradient is reduced, and all decide alike (shrink,
      // escalate, stop); at the floor is agreed as the largest part is (a rank with an empty share is at the floor).
      const auto agreed = s.sync->agree(!out_of_memory || !failed_here, at_floor ? std::min<int64_t>(outcome.largest_part, 1)
                                                                 : std::max<int64_t>(outcome.largest_part, 2));
      at_floor = agreed.largest_part <= 1;
      if (!agreed.all_fit && !out_of_memory) out_of_memory = "rank(s) " + agreed.failed_ranks + " ran out of memory";
      else if (out_of_memory) *out_of_memory = "rank(s) " + agreed.failed_ranks + ": " + *out_of_memory;
    }
    if (out_of_memory) {
      adapt_to_out_of_memory(s.optimizer, s.policy, s.step, attempt, s.max_retries, at_floor,
                             [&] { return work.escalate(s.step); }, *out_of_memory, work.floor_hint());
      continue;
    }
    const double loss_sum = s.sync ? s.sync->reduce(outcome.loss_sum) : outcome.loss_sum;
    result = StepResult{};
    result.loss = loss_sum / s.normaliser;
    result.micro_batch = outcome.largest_part;
    result.micro_steps = outcome.micro_steps;
    result.retries = attempt;
    result.counted = s.counted;
    if (!apply_update(s, result, optimizer_retried)) continue;
    if (!result.skipped) work.after_update();
    return result;
  }
}

}  // namespace trainer
