// The text task (seq2seq and causal language models): see text_task.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/Device.h>

#include "train/engine/task.h"
#include "train/engine/task_kind.h"

namespace trainer {

class LanguageModel;
class DataLoader;

std::unique_ptr<Task> make_text_task(const TaskContext& context);
// The kind (task_kind.h): every config no other kind takes.
TaskKind text_task_kind();
// `trainer train`'s plan lines of a language model's run (text and preference tasks), `unit` naming what the
// effective batch counts ("examples", "pairs").
TrainPlanLines language_model_plan_lines(const Config& config, const TrainOptions& options, int64_t world_size,
                                         const std::string& unit);

struct ValidationLoss {
  double loss = 0;  // mean per target token
  int64_t tokens = 0;
};
// Validation loss in evaluation micro-batches (`micro`: halved on out-of-memory; the training policy is never
// touched). With `loss_chunk_size` > 0 (training's chunked loss is on) the LM head and the loss run over that many
// target tokens at a time, so the full logits never exist; the loss is the same. With `world` each rank evaluates its
// share of every validation batch (the equal-count shares training uses) and the sums are summed over the ranks:
// every rank returns the whole validation set's loss. Every rank must call it (a collective at the end). With fully
// sharded weights (`sync` shards them) every forward is a collective: the ranks agree on the number of micro-batches
// of each try and run empty ones to match.
ValidationLoss validation_loss(LanguageModel& model, DataLoader& loader, EvaluationMicroBatch& micro,
                               const Config& config, const c10::Device& device, int32_t pad_id,
                               int64_t loss_chunk_size = 0, distributed::Communicator* world = nullptr,
                               StepSync* sync = nullptr);

}  // namespace trainer
