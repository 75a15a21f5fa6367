// Data parallelism for one training step (TrainStep's StepSync): which examples of the effective batch this rank
// trains, the ranks' agreement on out-of-memory errors, and the gradient sum, once per optimizer step.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "distributed/process_group.h"
#include "log/reporter.h"
#include "train/step.h"
#include "trainer/data.h"

namespace trainer::distributed {

// Rank `rank`'s contiguous share [begin, begin + count) of `examples` among `world` ranks: equal example counts
// (the first ranks take one more when it does not divide), or with `by_tokens` cut where the running padded-token
// cost (input + labels lengths) crosses rank/world of the total, so token-budget ranks get balanced work. Shares
// are disjoint, cover every example, and depend only on the batch, never on the memory policy.
std::pair<int64_t, int64_t> share_of(std::span<const Example> examples, int rank, int world, bool by_tokens);

// With data parallelism (`world` not null): every rank's peak memory (summary.memory_peak, this rank's) and seconds
// in collectives so far, in rank order, into summary.ranks, and the backend's name. One collective, so every rank
// calls it at the same point (its run's end).
void add_rank_figures(Communicator* world, RunSummary& summary);

class DataParallel : public StepSync {
 public:
  // `parameters`: the trainable parameters, in the same order on every rank (the optimizer's). `owners`: with
  // sharded optimizer state (ZeRO-1), each parameter's owner rank (Optimizer::owners()); empty when unsharded.
  DataParallel(Communicator& communicator, std::vector<at::Tensor> parameters, int64_t bucket_bytes,
               std::vector<int> owners = {})
      : communicator_(communicator), parameters_(std::move(parameters)), bucket_bytes_(bucket_bytes),
        owners_(std::move(owners)) {}

  std::pair<int64_t, int64_t> share(std::span<const Example> examples, bool by_tokens, bool seq2seq) override;
  Outcome agree(bool fit, int64_t largest_part) override;
  void prepare() override;
  double reduce(double loss_sum) override;
  double global_squared_norm(double local) override;
  void after_update() override;

 private:
  Communicator& communicator_;
  std::vector<at::Tensor> parameters_;
  int64_t bucket_bytes_;
  std::vector<int> owners_;
  at::Tensor scratch_;  // from prepare() to the end of the step's collectives: where buckets are flattened
};

}  // namespace trainer::distributed
