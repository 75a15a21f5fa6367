// The text task's step: one effective batch of examples, split into micro-batches (or packed rows) by the memory
// policy, gradients accumulated with the loss normalised by the effective batch's target tokens, run in the engine's
// attempt loop (train/engine/attempts.h), which retries the same batch after an out-of-memory error.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "data/packing.h"
#include "memory/policy.h"
#include "models/model.h"
#include "train/engine/attempts.h"
#include "train/optim/grad_scaler.h"
#include "train/optim/optimizer.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/errors.h"

namespace trainer {

struct StepOptions {
  c10::Device device{c10::kCPU};
  int32_t pad_id = 0;
  PrecisionMode precision = PrecisionMode::kFp32;
  double max_grad_norm = 1.0;
  int64_t max_retries = 8;
  // The chunk size is the policy's (training.loss_chunk_size, lowered by escalation). The trainer copies
  // training.chunked_loss (on by default); false here is the plain loss that tests compare it with.
  bool chunked_loss = false;
  uint64_t seed = 0;  // training.seed: with the step and each example's index, what its dropout masks are drawn for
  // data.packing: examples share rows of this capacity (cut to the token budget in token-budget mode) and the
  // policy's micro-batch counts rows (data/packing.h).
  bool packing = false;
  PackCapacity pack_capacity;
  StepSync* sync = nullptr;  // data parallelism: this rank trains its share, gradients are summed over the ranks
  GradScaler* scaler = nullptr;  // precision.mode=fp16-mixed: dynamic loss scaling
};

class TrainStep {
 public:
  TrainStep(LanguageModel& model, Optimizer& optimizer, MemoryPolicy& policy, StepOptions options)
      : model_(model), optimizer_(optimizer), policy_(policy), options_(std::move(options)) {}

  StepResult run(const EffectiveBatch& batch, int64_t step, double lr);

  // The summed loss of some examples, with gradients (scaled by 1/normaliser) accumulated into the parameters.
  double forward_backward(std::span<const Example> examples, double normaliser);
  // The same for a collated batch (padded or packed rows).
  double forward_backward(const Batch& batch, double normaliser);
  // Packed rows of `examples` (this rank's share of the effective batch, starting at `first_example` in it: an
  // example's place in the effective batch keys its dropout masks at `step`).
  double forward_backward_packed(std::span<const Example> examples, std::span<const PackedRow> rows, int64_t step,
                                 double normaliser, int64_t first_example = 0);
  // The rows this step packs an effective batch into at the policy's current micro-batch.
  std::vector<PackedRow> pack(std::span<const Example> examples) const;

  bool chunked_loss() const { return options_.chunked_loss; }
  int64_t loss_chunk_size() const { return policy_.loss_chunk_size(); }
  void set_chunked_loss(bool on) { options_.chunked_loss = on; }
  // Where the next micro-batches are collated and run: after the run moved (train/device_move.h).
  void set_device(const c10::Device& device) { options_.device = device; }

 private:
  // The autocast dtype of the mixed precision modes (bf16-mixed, fp16-mixed); none otherwise.
  std::optional<at::ScalarType> autocast_dtype() const;
  // What the loss is multiplied by before backward: the loss scale with fp16-mixed, else 1.
  double loss_scale() const { return options_.scaler ? options_.scaler->scale() : 1.0; }
  // At the floor: applies the policy's next escalation that changes something; false when none is left.
  bool escalate(int64_t step);
  // One attempt over this rank's share `examples` (starting at `share_begin` of the effective batch).
  void attempt(std::span<const Example> examples, int64_t share_begin, int64_t step, double normaliser,
               AttemptOutcome& outcome);
  // The mixture of experts' load-balancing loss: the effective batch's routing counted over this attempt's `parts`
  // micro-batches (counts_of(i): one's counts) and the ranks before the first backward, given to the model; false
  // (and outcome.dropped) when a rank ran out of memory counting. Nothing without the loss. `passes`: the agreed
  // number of passes under fully sharded weights (the rank's missing ones run as empty counting forwards).
  bool count_routing(std::size_t parts, std::size_t passes, AttemptOutcome& outcome,
                     const std::function<std::vector<double>(std::size_t)>& counts_of);
  std::vector<double> routing_counts(const Batch& batch);
  // Fully sharded weights: every rank runs as many forward/backward passes as the rank with the most (each block's
  // pass is a collective); this rank's `mine` is agreed at the start of the attempt, and the passes it lacks are
  // empty ones (one padding token, no target, a zero gradient), run after its own.
  std::size_t agreed_passes(std::size_t mine);
  void empty_passes(std::size_t count, int64_t step);
  // The router's statistics of the step (mixtures of experts with the load-balancing loss) into its metrics.
  void add_routing_metrics(StepResult& result);
  friend class TextStepWork;

  LanguageModel& model_;
  Optimizer& optimizer_;
  MemoryPolicy& policy_;
  StepOptions options_;
};

}  // namespace trainer
