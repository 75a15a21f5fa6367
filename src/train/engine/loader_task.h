// The data half of a task whose loader hands out effective batches with a cursor (the text DataLoader, the
// ImageLoader): the engine's next_batch / cursor / restore_cursor / data_stats / examples_per_epoch, written once.
#pragma once

#include <memory>
#include <utility>

#include "train/engine/task.h"

namespace trainer {

template <class Loader, class Batch>
class LoaderTask : public Task {
 public:
  using Task::Task;

  uint64_t examples_per_epoch() const override { return loader_->examples_per_epoch(); }
  std::unique_ptr<TaskBatch> next_batch() override {
    auto next = loader_->next();
    if (!next) return nullptr;
    auto loaded = std::make_unique<Loaded>();
    loaded->epoch = next->epoch;
    loaded->batch = std::move(*next);
    return loaded;
  }
  LoaderCursor cursor() const override { return loader_->cursor(); }
  void restore_cursor(const LoaderCursor& cursor) override { loader_->restore(cursor); }
  DataStats data_stats() const override { return loader_->stats(); }

 protected:
  // The loader's batch inside what next_batch handed the engine.
  static Batch& batch_of(TaskBatch& batch) { return static_cast<Loaded&>(batch).batch; }

  std::unique_ptr<Loader> loader_;

 private:
  struct Loaded final : TaskBatch {
    Batch batch;
  };
};

}  // namespace trainer
