// The attempt loop every task's step runs in: one effective batch, forward and backward at the memory policy's
// micro-batch (the task's StepWork), gradients summed over the ranks, then clipping and the optimizer update. On
// c10::OutOfMemoryError anywhere in it, everything of the attempt is dropped, the policy shrinks (or escalates), and
// the same effective batch runs again: the result is the step a run without the error would have taken. It knows no
// task: a task's step (tasks/<kind>/) is a StepWork.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distributed/step_sync.h"
#include "memory/policy.h"
#include "train/optim/grad_scaler.h"
#include "train/optim/optimizer.h"

namespace trainer {

struct StepResult {
  double loss = 0;         // mean loss per target token of the effective batch
  double grad_norm = 0;    // before clipping
  int64_t micro_batch = 0;
  int64_t micro_steps = 0; // forward/backward passes of the successful attempt
  int64_t retries = 0;     // attempts lost to out-of-memory errors
  int64_t counted = 0;     // what the task counts (Counted: target tokens, images, pairs) in the effective batch
  // fp16-mixed: the loss scale this step's backward used (0 without loss scaling), and whether its gradients held
  // an inf or NaN, so that the update was skipped (train/optim/grad_scaler.h).
  double loss_scale = 0;
  bool skipped = false;
  // What the task measured beside the loss ("rewards/chosen", ...): metrics.jsonl and TensorBoard under these names.
  std::vector<std::pair<std::string, double>> metrics;
};

// Releases cached device memory after an out-of-memory error (no-op on the CPU).
void release_cached_memory();

// What one forward/backward attempt over this rank's share of an effective batch did. The task fills in the split
// as soon as it has made it (an out-of-memory error may end the attempt at any point after that), then the loss.
struct AttemptOutcome {
  double loss_sum = 0;        // what the step's loss is made of: loss_sum / AttemptSettings::normaliser
  int64_t largest_part = 0;   // examples in the largest micro-batch (the progress line's micro-batch)
  int64_t micro_steps = 0;    // forward/backward passes
  bool at_floor = false;      // one example per micro-batch: only an escalation can help now
  // The pass stopped because another rank ran out of memory (a task whose pass holds its own collectives: CLIP's
  // gradient caching); the attempt is then an out-of-memory attempt on every rank.
  std::optional<std::string> dropped;
};

// What a task's step plugs into run_attempts: forward and backward over its share of the effective batch at the
// memory policy's current micro-batch, and the escalations that apply to it.
class StepWork {
 public:
  virtual ~StepWork() = default;
  // Forward and backward of every micro-batch of this attempt, gradients accumulated into the parameters.
  virtual void forward_backward(int64_t step, AttemptOutcome& outcome) = 0;
  // At the floor: applies the policy's next escalation that changes something for this task; false when none is left.
  virtual bool escalate(int64_t step) = 0;
  // Data parallelism may overlap the gradient sum with this attempt's backward (not under activation checkpointing).
  virtual bool may_overlap() const { return false; }
  // What the user can change when the ladder is used up.
  virtual std::string floor_hint() const { return ""; }
  // After a successful update (not a skipped fp16 step): what the task clamps or projects (CLIP's logit scale).
  virtual void after_update() {}
};

struct AttemptSettings {
  Optimizer& optimizer;
  MemoryPolicy& policy;
  GradScaler* scaler = nullptr;  // precision.mode=fp16-mixed
  StepSync* sync = nullptr;      // data parallelism
  double max_grad_norm = 1.0;
  int64_t max_retries = 8;
  int64_t step = 0;
  double lr = 0;
  int64_t examples = 0;   // of the effective batch (all ranks), for the memory policy
  double normaliser = 1;  // the step's loss is the ranks' summed loss_sum / normaliser
  int64_t counted = 0;    // StepResult::counted: target tokens, images or pairs of the effective batch
};

// One optimizer step over an effective batch: attempts of `work` until one fits on every rank (on an out-of-memory
// error everything of the attempt is dropped, the policy shrinks or escalates, and the same effective batch runs
// again), then the gradient sum over the ranks, fp16-mixed's unscale and overflow check, clipping and the update.
// Throws OutOfMemoryAtFloor when memory.max_retries or the ladder is used up.
StepResult run_attempts(StepWork& work, const AttemptSettings& settings);

}  // namespace trainer
