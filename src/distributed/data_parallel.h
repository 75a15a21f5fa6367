// Data parallelism for one training step (TrainStep's StepSync): which examples of the effective batch this rank
// trains, the ranks' agreement on out-of-memory errors, and the gradient sum, once per optimizer step.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "distributed/process_group.h"
#include "distributed/step_sync.h"
#include "log/reporter.h"
#include "trainer/data.h"

namespace trainer {
class Module;
}

namespace trainer::distributed {

// Rank `rank`'s contiguous share [begin, begin + count) of `examples` among `world` ranks: equal example counts
// (the first ranks take one more when it does not divide), or with `by_tokens` cut where the running padded-token
// cost (input + labels lengths) crosses rank/world of the total, so token-budget ranks get balanced work. Shares
// are disjoint, cover every example, and depend only on the batch, never on the memory policy.
std::pair<int64_t, int64_t> share_of(std::span<const Example> examples, int rank, int world, bool by_tokens);

// With data parallelism (`world` not null): every rank's peak memory (summary.memory_peak, this rank's), seconds
// in collectives so far and records it tokenized (summary.data.records_mapped), in rank order, into summary.ranks,
// and the backend's name. One collective, so every rank calls it at the same point (its run's end).
void add_rank_figures(Communicator* world, RunSummary& summary);

// The text loader's share of the records for this rank (RecordShare, exchanging through `world`); without `world`,
// none (one process tokenizes everything).
RecordShare record_share(Communicator* world);

// The image loaders' count exchange (ImageShard::gather_kept): every rank calls it once per effective batch with
// the images it kept and gets every rank's count, in rank order; `what` names the collective in errors.
std::function<std::vector<int64_t>(int64_t kept)> kept_counts_exchange(Communicator* world, std::string what);

class DataParallel;

// The agreement after every forward/backward attempt (StepSync::agree): whether every rank fit, which did not, and the
// largest micro-batch of any rank. `late`: this rank saw a gradient change after its overlapped sum started (an error
// on every rank). One collective.
StepSync::Outcome agree_on_attempt(Communicator& communicator, bool fit, int64_t largest_part, bool late = false);

// A run's DataParallel: the parameters of `trainable` that take gradients, in its order (the optimizer's, the same
// on every rank), summed in buckets of `bucket_bytes`; `owners` per parameter when the optimizer state is sharded
// (empty otherwise).
std::unique_ptr<DataParallel> make_data_parallel(Communicator& world, Module& trainable, int64_t bucket_bytes,
                                                 std::vector<int> owners);

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
  std::vector<double> sum(const std::vector<double>& values, const char* what) override {
    return communicator_.all_reduce_sum(values, what);
  }
  void after_update() override;

  // distributed.overlap_grad_reduce: during the last micro-batch's backward each bucket (whole parameters in
  // reverse order, as backward produces them; bucket_bytes each, one dtype and owner) starts its asynchronous sum as
  // soon as all its gradients are final (post-accumulate-grad hooks). Off: everything is summed after backward.
  void set_overlap(bool on) { overlap_enabled_ = on; }
  ~DataParallel() override;
  void begin_attempt(bool may_overlap) override;
  void before_last_backward() override;
  void gradient_ready(const at::Tensor& parameter) override;

 private:
  struct Bucket {
    std::vector<std::size_t> parameters;  // indices into parameters_
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
    int root = -1;  // the owner (sharded optimizer state), -1: every rank
  };
  struct InFlight {
    std::size_t bucket = 0;
    std::shared_ptr<Communicator::Pending> pending;
    at::Tensor flat;
    bool copy_back = false;  // flat is a copy of several gradients (a lone contiguous one is summed in place)
  };
  void build_buckets();                     // once, with the hooks
  void mark_final(std::size_t index);       // a gradient of the armed backward is final
  void launch_ready_buckets();              // in bucket order: every rank starts the same collectives in turn
  void retire(bool wait_all);               // waits for (or polls) the in-flight sums and copies them back
  void abandon_overlap();                   // after an out-of-memory error: the rest of the buckets, content moot


  Communicator& communicator_;
  std::vector<at::Tensor> parameters_;
  int64_t bucket_bytes_;
  std::vector<int> owners_;
  at::Tensor scratch_;  // from prepare() to the end of the step's collectives: where buckets are flattened

  bool overlap_enabled_ = false;
  bool overlap_attempt_ = false;  // this attempt sums its own buckets (from begin_attempt to prepare/agree)
  bool armed_ = false;            // in the attempt's last micro-batch: final gradients start their buckets
  bool overlapped_ = false;       // the gradients are summed already: reduce() has only the loss left
  bool late_ = false;             // a gradient changed after its bucket started: the step cannot be trusted
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;  // per parameter
  std::vector<int64_t> waiting_;        // per bucket: gradients not final yet
  std::vector<char> final_;             // per parameter
  std::size_t next_bucket_ = 0;         // buckets before it have started
  std::deque<InFlight> in_flight_;
  std::unordered_map<const void*, std::size_t> index_of_;  // TensorImpl -> parameter index
  std::mutex mutex_;  // hooks may run on autograd's device threads
};

}  // namespace trainer::distributed
