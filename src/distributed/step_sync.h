// What data parallelism adds to a training step: the interface the step (train/engine/attempts.h, run_attempts) calls and
// DataParallel (data_parallel.h) implements. It lives here, in the distributed layer below train/, so that
// distributed/ never includes train/ (docs/architecture.md#layers).
#pragma once

#include <cstdint>
#include <span>
#include <vector>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "trainer/data.h"

namespace trainer {

// Another rank ran out of memory during this attempt, learnt inside one of the attempt's collectives (fully sharded
// weights): every rank drops the attempt, this one without announcing it again (StepSync::announce_failure).
class AgreedOutOfMemory : public c10::OutOfMemoryError {
 public:
  explicit AgreedOutOfMemory(const std::string& what)
      : c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, what) {}
};

// What data parallelism adds to a step (implemented in src/distributed/); absent in a single process.
class StepSync {
 public:
  virtual ~StepSync() = default;
  // This rank's examples of the effective batch: [begin, begin + count).
  virtual std::pair<int64_t, int64_t> share(std::span<const Example> examples, bool by_tokens, bool seq2seq) = 0;
  // Called by every rank after each forward/backward attempt, before any gradient is reduced. `fit`: this rank's
  // attempt had no out-of-memory error; `largest_part`: its largest micro-batch. Returns whether every rank fit and
  // the largest micro-batch of any rank, so all ranks take the same decision (shrink, escalate, stop).
  struct Outcome {
    bool all_fit = true;
    int64_t largest_part = 0;
    std::string failed_ranks;  // "1, 2" when not all fit
  };
  virtual Outcome agree(bool fit, int64_t largest_part) = 0;
  // At the end of each forward/backward attempt (inside its out-of-memory handling, so what it allocates is agreed
  // with the attempt): a zero gradient for every trainable parameter this rank's share left without one.
  virtual void prepare() = 0;
  // Sums the trainable parameters' gradients over the ranks (a missing gradient counts as zero) and returns the
  // summed loss of the effective batch. Sharded optimizer state (ZeRO-1): each sum reaches only the parameter's
  // owner, and the other ranks drop that gradient.
  virtual double reduce(double loss_sum) = 0;
  // The squared gradient norm of the whole model from this rank's sum of squares over the gradients it holds.
  virtual double global_squared_norm(double local) = 0;
  // After the optimizer update: sharded, every parameter's new value from its owner.
  virtual void after_update() = 0;
  // Numbers summed over the ranks (every rank calls it with as many): the mixture of experts' routing counts.
  // `what` names them in a timeout's error.
  virtual std::vector<double> sum(const std::vector<double>& values, const char* what) = 0;

  // Overlapping the gradient sum with backward (distributed.overlap_grad_reduce; optional: the defaults do nothing,
  // and reduce() then sums everything after the attempt). At the start of every forward/backward attempt, with
  // whether this attempt may overlap (the same on every rank: false under activation checkpointing).
  virtual void begin_attempt(bool may_overlap) { (void)may_overlap; }
  // Before the attempt's last micro-batch: from here on, each bucket whose gradients are final starts its sum while
  // backward goes on. prepare() then finishes them; agree(false, ...) keeps the ranks' collectives matched.
  virtual void before_last_backward() {}
  // A gradient accumulated outside autograd (the fused loss's untied LM head) is final for this micro-batch.
  virtual void gradient_ready(const at::Tensor& parameter) { (void)parameter; }
  // The LM head's weight is used outside autograd (the fused loss) between these two: with fully sharded weights,
  // before_head gathers it (and gives its gradient a place) when it is a unit of its own, after_head reduces its
  // gradient to the shards and releases it. Every rank calls them as often (empty passes too).
  virtual void before_head(const at::Tensor& weight) { (void)weight; }
  virtual void after_head(const at::Tensor& weight) { (void)weight; }

  // Fully sharded weights (distributed.shard_weights, fully_sharded.h): every block's forward and backward is a
  // collective, so every rank runs as many forward/backward passes as the rank with the most (the others run empty
  // ones): agree_passes returns that number (inside the attempt, where an out-of-memory error may have happened on
  // another rank). announce_failure: this rank caught an out-of-memory error in the attempt; it tells the ranks
  // waiting in the attempt's collectives before the attempt's agree().
  virtual int64_t agree_passes(int64_t mine) { return mine; }
  virtual void announce_failure() {}
  virtual bool shards_weights() const { return false; }
};

}  // namespace trainer
