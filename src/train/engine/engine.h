// The training engine: one loop for every task (text, image classification, contrastive CLIP; engine/task.h).
// set_up() finds and checks the checkpoint to resume from, lets the task open its data and build its model, builds
// the optimizer, the memory policy, data parallelism and loss scaling, restores every piece of a resumed state (RNG
// included) or probes the micro-batch; loop() runs the optimizer steps with the agreed stop on signals, the attempt
// loop's out-of-memory handling, the device ladder's moves, evaluation and periodic checkpoints; finish() writes the
// last checkpoint and the final model and prints the summary. With data parallelism every rank runs the same phases
// and rank 0 alone writes files and reports.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>

#include <c10/core/Device.h>

#include "trainer/config.h"
#include "trainer/device.h"
#include "trainer/run.h"

namespace trainer {

class Optimizer;
class StepSync;
namespace distributed {
class Communicator;
}

// Trains what the config says (its kind, task_kind.h, makes the task) on `device`; returns the exit code. Throws trainer::Error
// (OutOfMemoryAtFloor: exit 4). With options.resume / resume_from / resume_if_present it continues from a checkpoint:
// weights, optimizer state, step, data position, RNG state, loss scale and the memory policy's micro-batch, so the
// run reaches the weights an uninterrupted run would. With `world` this process is one rank of a data-parallel run.
int train(const Config& config, const ResolvedDevice& device, const TrainOptions& options, std::ostream& out,
          distributed::Communicator* world = nullptr);

// micro_batch_size=auto: the largest micro-batch up to `limit` whose worst-case step (`run(n)`: forward and backward
// in micro-batches of n; an out-of-memory error propagates) fits and leaves memory.auto_safety_margin of the capacity
// (memory.limit, or the device's total) free: doubling, then bisecting between the last fit and the first failure.
// 1 with a warning when one example runs but only inside the margin (no smaller micro-batch to choose); 0 when one
// runs out of memory. The optimizer's gradients are zeroed after every try.
// `describe(n)` says what a try ran, for its log line.
// `sync` (fully sharded weights, where every forward and backward is a collective): each try runs as a training
// attempt does (begin_attempt, prepare, an out-of-memory error announced to the ranks inside the collectives) and
// every rank takes each decision together: a try fits when it fit, inside the margin, on every rank.
int64_t probe_micro_batch(const Config& config, const c10::Device& device, int64_t limit, Optimizer& optimizer,
                          const std::function<void(int64_t)>& run,
                          const std::function<std::string(int64_t)>& describe = {}, StepSync* sync = nullptr);

}  // namespace trainer
