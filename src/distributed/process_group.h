// Data parallelism's connection between the ranks of a run: which rank this process is (from the environment that
// torchrun, Slurm/Kubernetes or `trainer launch` set), the c10d rendezvous (TCPStore) and the collective backend
// (Gloo on the CPU; NCCL in CUDA builds). Without those variables trainer is a single process and none of this
// exists: no store, no threads. The c10d headers stay inside process_group.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "trainer/errors.h"

namespace trainer::distributed {

// What the launcher said about this process.
struct Environment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // ranks on this machine (LOCAL_WORLD_SIZE; else WORLD_SIZE)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;       // torchrun's agent already serves the store on MASTER_PORT
  std::string restart_count = "0";  // TORCHELASTIC_RESTART_COUNT: each restart rendezvouses under its own prefix
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE and
// TORCHELASTIC_RESTART_COUNT through `get` (std::getenv by default). Nothing when neither RANK nor WORLD_SIZE is
// set, or WORLD_SIZE is 1: a single process. Throws UsageError naming the variable for a missing or bad value.
using Getenv = std::function<const char*(const char*)>;
std::optional<Environment> environment_from_variables(const Getenv& get = {});

// A collective that failed or timed out (a rank died, hung or ran another program): exit 1 with the rank's view.
class CommunicationError : public Error {
 public:
  using Error::Error;
};

class Communicator {
 public:
  // The rendezvous and the backend for `device` (Gloo for the CPU; NCCL for CUDA in CUDA builds); every collective
  // and the rendezvous itself give up after `timeout`. Throws UsageError naming MASTER_PORT when the port is taken.
  static std::unique_ptr<Communicator> connect(const Environment& environment, const c10::Device& device,
                                               std::chrono::seconds timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return environment_.rank; }
  int world_size() const { return environment_.world_size; }
  const Environment& environment() const { return environment_; }
  std::string backend_name() const;

  // Rank 0's values into every rank's tensors, in place.
  void broadcast(std::vector<at::Tensor>& tensors);
  // Element-wise sum over the ranks, in place, `bucket_bytes` at a time (tensors of one dtype are flattened together;
  // a lone contiguous tensor goes as it is). `scratch` (1-D, at least bucket_bytes of the tensors' dtype): where
  // buckets are flattened, so the collective allocates nothing; without it each bucket is a new tensor.
  void all_reduce_sum(const std::vector<at::Tensor>& tensors, int64_t bucket_bytes, const at::Tensor& scratch = {});
  // ZeRO-1: tensor i's element-wise sum over the ranks into rank roots[i]'s tensor (the others' are left
  // undefined in value), and tensor i's value from rank roots[i] into every rank's, in place. Tensors with one root
  // and dtype travel together, `bucket_bytes` at a time (`scratch` as for all_reduce_sum).
  void reduce_sum_to(const std::vector<at::Tensor>& tensors, const std::vector<int>& roots, int64_t bucket_bytes,
                     const at::Tensor& scratch = {});
  void broadcast_from(const std::vector<at::Tensor>& tensors, const std::vector<int>& roots, int64_t bucket_bytes,
                      const at::Tensor& scratch = {});
  // Element-wise maximum of a small vector over the ranks.
  std::vector<int64_t> all_reduce_max(const std::vector<int64_t>& values);
  // The same in place, in a tensor allocated once (int64, on the backend's device), so that it allocates nothing:
  // fully sharded runs call it where memory may have run out.
  void all_reduce_max_in_place(at::Tensor& values, const char* what);
  // Fully sharded data parallelism: every rank's `shard` (1-D, contiguous, the same size on every rank) in rank
  // order into `full` (1-D, world_size() times as long); and the element-wise sum of `full` over the ranks, of which
  // this rank gets its slice [rank * n, (rank + 1) * n) in `shard`. `what` names the collective in errors.
  void all_gather_into(at::Tensor& full, const at::Tensor& shard, const char* what);
  void reduce_scatter_sum(at::Tensor& shard, const at::Tensor& full, const char* what);
  // all_gather_into started, not waited for (the next unit's weights gathered while this one computes): wait() for
  // it before `full` is read or freed.
  struct Pending;
  std::shared_ptr<Pending> start_all_gather(at::Tensor& full, const at::Tensor& shard, const char* what);
  double all_reduce_sum(double value);
  // Asynchronous sums (distributed.overlap_grad_reduce): `flat` (1-D, contiguous) summed over the ranks in place,
  // into every rank's tensor (root < 0) or rank `root`'s alone (the others' left undefined in value). Collectives
  // pair up in the order the ranks start them. `finished` does not block; `wait` does (time counted as
  // communication) and throws CommunicationError as the blocking collectives do.
  std::shared_ptr<Pending> start_sum(const at::Tensor& flat, int root);
  bool finished(Pending& pending);
  void wait(Pending& pending);
  // Element-wise sum of a small vector of doubles over the ranks, in one collective; `what` names it in errors.
  std::vector<double> all_reduce_sum(const std::vector<double>& values, const char* what);
  void barrier();
  // Every rank's bytes, in rank order (each rank passes its own; sizes may differ): the record exchange of the
  // text loader (RecordShare). Two collectives: the sizes, then the bytes padded to the largest.
  std::vector<std::string> all_gather_bytes(const std::string& mine, const char* what);

  // Every rank publishes its resolved config (JSON); a rank whose config differs from rank 0's makes every rank
  // throw UsageError naming the keys and ranks. Keys in `ignored` (per-machine settings) may differ.
  void check_same_config(const std::string& config_json, const std::vector<std::string>& ignored);

  // Seconds spent inside collectives so far (waiting on the slowest rank included).
  double communication_seconds() const { return communication_seconds_; }

 private:
  struct Impl;
  Communicator(Environment environment, std::unique_ptr<Impl> impl);
  template <class F>
  void timed(const char* what, F&& f);
  CommunicationError collective_failed(const char* what, const std::string& cause) const;
  // The other ranks whose heartbeat did not move for a few seconds (dead or stopped). `store_unreachable`: the
  // store itself did not answer (then rank 0 is named when it hosts the store).
  std::vector<int> unresponsive_ranks(bool& store_unreachable) const;

  // Every rank's own thread that shows it is alive (see unresponsive_ranks).
  static void start_heartbeat(Impl& impl, const Environment& environment);

  Environment environment_;
  std::unique_ptr<Impl> impl_;
  double communication_seconds_ = 0;
};

// The keys of two JSON configs (flattened "section.key") whose values differ, without those in `ignored`.
std::vector<std::string> differing_keys(const std::string& a_json, const std::string& b_json,
                                        const std::vector<std::string>& ignored);

// LibTorch's intra-op threads for one of `local_ranks` processes on this machine: the cores shared out, unless
// OMP_NUM_THREADS says otherwise. Returns what it set (0: left alone).
int share_cpu_threads(int local_ranks);

}  // namespace trainer::distributed
