// Fully sharded data parallelism (distributed.shard_weights: ZeRO-3, what PyTorch's FSDP2 does as torchtitan applies
// it): every rank keeps 1/N of every parameter, of its gradient and of its optimizer state. The model is cut into
// units: each block (ShardableModule::blocks()) and the root (everything else: embeddings, final norm, head, T5's
// relative attention bias). A unit's parameters of one dtype and trainability are one flat group, padded to a
// multiple of N; rank r holds elements [r * n, (r + 1) * n) of it, the master values the optimizer updates.
//
// The model keeps its parameter tensors, but their storage is the group's gathered buffer, which exists only while
// the unit is gathered: a block is all-gathered just before its forward and released after it (unless
// reshard_after_forward is off), gathered again before its backward, and its gradients (accumulated by autograd into
// a flat buffer of the group) are reduce-scattered to the shards when its backward ends; the root is gathered for a
// whole attempt and reduced at its end. The optimizer steps on this rank's pieces (each parameter's part of the
// shard, under the parameter's name), so AdamW computes the unsharded numbers element by element.
//
// Out of memory is decided together, as everywhere: every collective of an attempt is preceded by a one-number
// status all-reduce, and what can run out of memory happens before it. A rank that ran out of memory takes part in the
// next status with its failure (announce_failure), every other rank learns it there and throws AgreedOutOfMemory, and
// all meet at StepSync::agree with the collectives paired. Every rank runs as many micro-batches as the one with the
// most (agree_passes): the others run empty ones.
//
// Prefetch (FSDP2's): while a unit computes, the next unit's all-gather is in flight. Which unit comes next is
// learnt from the order of the gathers (forward, then backward) in the last attempt every rank fit, so every rank
// prefetches alike; a prefetch whose memory one rank cannot allocate is skipped by every rank (its status says so).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "distributed/process_group.h"
#include "distributed/step_sync.h"
#include "models/model.h"

namespace trainer::distributed {

struct FullyShardedOptions {
  bool reshard_after_forward = true;  // false: a block stays gathered from its forward to its backward
  bool prefetch = true;  // the next unit's gather is issued before this unit computes
  // Mixed precision (FSDP2's MixedPrecisionPolicy): fp32 weights are gathered in param_dtype for compute (the shards,
  // the master values, stay fp32); gradients are accumulated and reduce-scattered in reduce_dtype, then added to the
  // shards' fp32 gradients. kFloat and kFloat: no cast anywhere.
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
};

class FullySharded final : public StepSync, public UnitHooks {
 public:
  // Shards `model` over the ranks; every rank must hold the same values already (rank 0's, broadcast). Installs the
  // unit hooks on the model (which then holds a reference to this object). `replicated`: trainable parameters kept
  // whole on every rank (LoRA's adapters over a sharded frozen base, and what trains in full beside them, such as an
  // image classifier's head, which is also the model's): their gradients are summed over the ranks and they join
  // trainable_pieces().
  // Parameters on the meta device (pretrained weights not read yet) are read through `read` (on the CPU), one at a
  // time as their unit is cut, so that no rank ever holds the whole model; the shards live on `device`.
  static std::shared_ptr<FullySharded> shard(Communicator& communicator, ShardableModule& model,
                                             FullyShardedOptions options, const c10::Device& device,
                                             const std::function<at::Tensor(const std::string&)>& read = {},
                                             Module* replicated = nullptr);
  ~FullySharded() override;

  // This rank's pieces of the trainable parameters, as a module for the optimizer: each piece is named as its
  // parameter and is its part of this rank's shard (flat, fp32 master values when the parameter is fp32); then the
  // replicated parameters, whole.
  Module& trainable_pieces();
  // Every piece of this rank (trainable or not), with where it lies in its flattened parameter: what a sharded
  // checkpoint holds.
  struct Piece {
    std::string name;
    std::vector<int64_t> shape;  // the parameter's
    int64_t offset = 0;          // of the piece in the flattened parameter
    at::Tensor values;           // 1-D, the piece (a view of the shard: writing it changes the master values)
  };
  std::vector<Piece> pieces();
  // Every sharded trainable parameter, the same list in the same order on every rank, with where this rank's piece
  // of it starts (offset; -1 and no values where this rank holds none of it): what an optimizer that sums over
  // whole parameters (Adafactor) steps by.
  std::vector<Piece> trainable_layout() const;

  // Every unit gathered, for what runs outside training attempts with the whole model (evaluation, generation,
  // saving the model): every rank calls gather_all and release_all at the same points.
  void gather_all();
  void release_all();
  // The validation loss unit by unit: the root and the head's unit gathered until end_evaluation, the other units
  // gathered for each forward as in training (every rank must run as many: agree_passes). An out-of-memory error is
  // agreed as in an attempt: begin_evaluation_try before each try, announce_failure on the rank that ran out.
  void begin_evaluation();
  void begin_evaluation_try() { failure_agreed_ = false; }
  void end_evaluation();
  // Parameter `name`'s master values (the shards' dtype, fp32 for fp32 weights whatever param_dtype), its unit
  // gathered into a buffer of its own if it is not the last one asked for: the final model is written one unit at a
  // time (every rank calls it with the same names in the same order; the tensor is valid until the next call for
  // another unit or release_exported).
  at::Tensor gathered(const std::string& name);
  void release_exported();

  // StepSync
  std::pair<int64_t, int64_t> share(std::span<const Example> examples, bool by_tokens, bool seq2seq) override;
  Outcome agree(bool fit, int64_t largest_part) override;
  void prepare() override;
  double reduce(double loss_sum) override;
  double global_squared_norm(double local) override;
  void after_update() override {}
  std::vector<double> sum(const std::vector<double>& values, const char* what) override;
  void begin_attempt(bool may_overlap) override;
  int64_t agree_passes(int64_t mine) override;
  void announce_failure() override;
  bool shards_weights() const override { return true; }
  // micro_batch_size=auto's probe: its agreed out-of-memory errors are what it looks for, and keep prefetch on.
  void set_probing(bool probing) { probing_ = probing; }

  // UnitHooks
  at::Tensor run(const Module& unit, const BlockFn& block, const std::vector<at::Tensor>& inputs) override;

  void before_head(const at::Tensor& weight) override;
  void after_head(const at::Tensor& weight) override;

  // Called from the autograd functions and hooks around each unit (fully_sharded.cpp).
  void before_backward(std::size_t unit);
  void after_backward(std::size_t unit);
  void accumulated(std::size_t unit);

 private:
  struct Entry {
    std::string name;
    at::Tensor* slot;  // the model's parameter (its storage: the group's gathered buffer)
    std::vector<int64_t> shape;
    int64_t offset = 0;  // in the group's flat buffer
    int64_t numel = 0;
  };
  struct Group {
    at::ScalarType dtype = at::kFloat;  // the parameters' and the shard's (the master values)
    at::ScalarType compute = at::kFloat;  // the gathered buffer's: param_dtype for fp32 groups
    at::ScalarType grad_dtype = at::kFloat;  // full_grad's and the reduce-scatter's
    bool trainable = false;
    bool as_stored = false;  // a 4-bit layer's scales and code tables: never cast to param_dtype
    std::vector<Entry> entries;
    int64_t padded = 0;  // a multiple of the world size
    int64_t shard_numel = 0;
    at::Tensor full;        // (padded, compute): allocated only while gathered; the parameters point into it
    at::Tensor shard;       // (shard_numel): this rank's master values
    at::Tensor shard_grad;  // (shard_numel): the reduced gradient of the attempt (trainable groups)
    at::Tensor full_grad;   // (padded, grad_dtype): during a block's backward, where autograd accumulates
  };
  struct Unit {
    std::string name;
    std::vector<Group> groups;
    bool gathered = false;
    bool pinned = false;          // gathered for an evaluation: released by end_evaluation alone
    bool backward_ready = false;  // gradients linked into full_grad
    // A unit whose input is ids (an embedding): its backward ends when each trainable parameter's gradient has
    // accumulated (hooks after autograd's accumulation, installed at its first forward with gradients).
    bool watched = false;
    int64_t trainable_entries = 0, accumulated = 0;
    // A prefetch in flight (gathered is true, the buffers allocated): wait for it before the weights are read or
    // their memory freed (finish).
    std::vector<std::shared_ptr<Communicator::Pending>> pending;
    // Kept whole on every rank, never gathered: a 4-bit layer's quant_state JSON (a few hundred bytes, only ever
    // written, and of a length that depends on the values, so it is read as the unit is cut).
    std::vector<std::pair<std::string, at::Tensor*>> in_place;
  };

  FullySharded(Communicator& communicator, FullyShardedOptions options);
  void build(ShardableModule& model, const c10::Device& device,
             const std::function<at::Tensor(const std::string&)>& read, const std::set<const at::Tensor*>& whole);
  // Unit u gathered for `event` (2u: its forward, 2u + 1: its backward; -1: outside a pass), and the unit that
  // followed that event last time prefetched.
  void gather(std::size_t u, int64_t event = -1);
  void finish(Unit& unit);  // its prefetch waited for
  void drop_prefetch();  // after an agreed out-of-memory error, on every rank
  void note(std::size_t u, bool backward);  // the pass's order of gathers, learnt
  void release(Unit& unit);
  void link_gradients(Unit& unit);    // full_grad allocated, the parameters' .grad() views of it
  void reduce_gradients(Unit& unit);  // full_grad reduce-scattered into shard_grad, then dropped
  // The status all-reduce before each collective: throws AgreedOutOfMemory when a rank announced a failure.
  // `value` travels in the same message (its maximum comes back). `gathers` names what the caller gathers next
  // (0: nothing); ranks that disagree on it throw an Error together instead of pairing different all-gathers.
  int64_t status(const char* what, int64_t value = 0, int64_t gathers = 0);
  void reset();  // after an attempt that did not fit: nothing gathered, no gradient buffers

  Communicator& communicator_;
  FullyShardedOptions options_;
  std::vector<Unit> units_;  // units_[0]: the root
  std::unordered_map<const Module*, std::size_t> unit_of_;
  std::unordered_map<std::string, std::pair<std::size_t, const at::Tensor*>> parameter_unit_;  // name -> unit, slot
  std::unordered_map<const void*, std::size_t> unit_of_tensor_;  // a parameter's TensorImpl -> its unit
  std::unique_ptr<Module> pieces_;
  // gathered(): the unit whose master values are gathered (whole, in the shards' dtype) for writing, and them.
  std::size_t exported_unit_ = SIZE_MAX;
  std::vector<at::Tensor> exported_;
  std::vector<at::Tensor*> replicated_;  // kept whole on every rank (LoRA's adapters)
  double replicated_squares_ = 0;        // their summed gradients' squared norm, after prepare()
  at::Tensor status_;         // int64 (4): preallocated
  bool failure_agreed_ = false;  // this attempt's failure was learnt at a status (nothing to announce)
  bool in_attempt_ = false;
  bool in_evaluation_ = false;
  // Prefetch: next_[event] is the event that followed `event` in the last attempt every rank fit (-1: none);
  // learning_ the current attempt's, committed by agree().
  std::vector<int64_t> next_, learning_;
  int64_t last_event_ = -1;
  bool prefetch_skipped_ = false;  // warned
  std::size_t head_unit_ = 0;  // the unit of the LM head's weight (0: the root)
  bool all_gathered_ = false;  // gather_all: nothing is released until release_all
  bool probing_ = false;
};

}  // namespace trainer::distributed
