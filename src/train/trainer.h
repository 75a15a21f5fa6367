// The training run: tokenizer, model, data, optimizer, memory policy and the loop that wires them, with
// evaluation, metrics and the final save. Small named steps over one explicit state (STYLE.md 5).
#pragma once

#include <iosfwd>

#include "train/optimizer.h"
#include "train/step.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/device.h"
#include "trainer/run.h"

namespace trainer {

namespace distributed {
class Communicator;
}

// Trains as the config says on `device`; returns the exit code. Throws trainer::Error (OutOfMemoryAtFloor: 4).
// With options.resume / resume_from, continues from a checkpoint: weights, optimizer state, step, data position,
// RNG state and the memory policy's micro-batch, so the run reaches the weights an uninterrupted run would.
// With `world` (data parallelism) this process is one rank: it trains its share of every effective batch and rank 0
// alone writes checkpoints, metrics and the final model.
int train(const Config& config, const ResolvedDevice& device, const TrainOptions& options, std::ostream& out,
          distributed::Communicator* world = nullptr);

// The steps of the run, exposed for their tests.

// The largest micro-batch whose forward and backward at maximum lengths fit and leave memory.auto_safety_margin
// of the capacity (memory.limit, or the device's total) free; 0 when not even one fits.
int64_t probe_micro_batch(TrainStep& step, Optimizer& optimizer, const Config& config, DataFamily family,
                          const c10::Device& device);

struct EvalResult {
  double loss = 0;  // mean per target token
  int64_t tokens = 0;
};
// Validation loss with its own micro-batch `micro`: an out-of-memory error halves it (in place) and retries;
// the training policy is never touched. With `loss_chunk_size` > 0 (training's chunked loss is on) the LM head and
// the loss run over that many target tokens at a time, so the full logits never exist; the loss is the same.
// With `world` (data parallelism) each rank evaluates its share of every validation batch (the same equal-count
// shares training uses) and the loss sums and token counts are summed over the ranks: every rank returns the loss of
// the whole validation set, the one process's loss. Every rank must call it (a collective at the end).
EvalResult evaluate(LanguageModel& model, DataLoader& loader, int64_t& micro, const Config& config,
                    const c10::Device& device, int32_t pad_id, int64_t loss_chunk_size = 0,
                    distributed::Communicator* world = nullptr);

}  // namespace trainer
