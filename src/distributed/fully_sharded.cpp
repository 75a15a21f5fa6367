// Fully sharded data parallelism (see fully_sharded.h).
#include "distributed/fully_sharded.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/StorageImpl.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "distributed/data_parallel.h"
#include "models/layers.h"
#include "models/linear4bit.h"
#include "trainer/errors.h"

namespace trainer::distributed {
namespace {

constexpr int64_t kReplicatedBucketBytes = 25'000'000;  // the adapters' gradient sums, bucketed

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A gathered buffer's memory comes and goes with its unit while the parameters keep pointing at the same storage
// (FSDP2's storage resize): the storage's own allocator (the CPU budget's, the device's caching allocator) gives and
// takes the bytes, so an out-of-memory error here is the device's.
void allocate_storage(const at::Tensor& t, std::size_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == bytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

void free_storage(const at::Tensor& t) { allocate_storage(t, 0); }

// Which unit an autograd function stands for, through the autograd context.
struct UnitRef : torch::CustomClassHolder {
  UnitRef(FullySharded* o, std::size_t u) : owner(o), unit(u) {}
  FullySharded* owner;
  std::size_t unit;
};

FullySharded* owner_of(AutogradContext* ctx, std::size_t& unit) {
  auto ref = c10::static_intrusive_pointer_cast<UnitRef>(ctx->saved_data["unit"].toCapsule());
  unit = ref->unit;
  return ref->owner;
}

// On a block's output: its backward is the block's first (gather the weights, give the gradients a place).
struct BeforeBlockBackward : public torch::autograd::Function<BeforeBlockBackward> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<UnitRef> ref, at::Tensor x) {
    ctx->saved_data["unit"] = at::IValue::make_capsule(std::move(ref));
    return {x};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    std::size_t unit = 0;
    owner_of(ctx, unit)->before_backward(unit);
    return {at::Tensor(), grads[0]};
  }
};

// On a block's first input, with a dummy that requires a gradient (so that it runs when nothing before the block
// trains): its backward comes after the block's, every parameter's gradient accumulated (reduce-scatter them).
struct AfterBlockBackward : public torch::autograd::Function<AfterBlockBackward> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<UnitRef> ref, at::Tensor dummy, at::Tensor x) {
    (void)dummy;
    ctx->saved_data["unit"] = at::IValue::make_capsule(std::move(ref));
    return {x};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    std::size_t unit = 0;
    owner_of(ctx, unit)->after_backward(unit);
    return {at::Tensor(), at::Tensor(), grads[0]};
  }
};

// After autograd accumulated a parameter's gradient (an embedding's: nothing of the graph follows its unit).
struct AccumulatedHook final : torch::autograd::PostAccumulateGradHook {
  AccumulatedHook(FullySharded* o, std::size_t u) : owner(o), unit(u) {}
  void operator()(const torch::autograd::Variable&) override { owner->accumulated(unit); }
  FullySharded* owner;
  std::size_t unit;
};

// The optimizer's view of this rank's shards: one parameter per piece, named as the model's parameter.
class PieceModule final : public Module {
 public:
  at::Tensor& add(const std::string& name, at::Tensor values) {
    tensors_.push_back(std::move(values));
    register_parameter(name, &tensors_.back());
    return tensors_.back();
  }
  // A parameter kept whole on every rank (LoRA's adapters), by its owner's slot.
  void add_whole(const std::string& name, at::Tensor* slot) { register_parameter(name, slot); }

 private:
  std::deque<at::Tensor> tensors_;
};

}  // namespace

FullySharded::FullySharded(Communicator& communicator, FullyShardedOptions options)
    : communicator_(communicator), options_(options) {}

FullySharded::~FullySharded() = default;

std::shared_ptr<FullySharded> FullySharded::shard(Communicator& communicator, ShardableModule& model,
                                                  FullyShardedOptions options, const c10::Device& device,
                                                  const std::function<at::Tensor(const std::string&)>& read,
                                                  Module* replicated) {
  std::shared_ptr<FullySharded> sharded(new FullySharded(communicator, options));
  // Parameters the replicated module shares with the model (an image classifier's head, trained in full beside the
  // adapters, registered as the model's own slot) stay whole too: no group holds them.
  std::set<const at::Tensor*> whole;
  if (replicated) replicated->for_each_parameter([&](const std::string&, at::Tensor& p) { whole.insert(&p); });
  sharded->build(model, device, read, whole);
  if (replicated) {
    auto& pieces = static_cast<PieceModule&>(*sharded->pieces_);
    replicated->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (!p.requires_grad()) return;
      sharded->replicated_.push_back(&p);
      pieces.add_whole(name, &p);
    });
  }
  model.set_unit_hooks(sharded);
  return sharded;
}

void FullySharded::build(ShardableModule& model, const c10::Device& device,
                         const std::function<at::Tensor(const std::string&)>& read,
                         const std::set<const at::Tensor*>& whole) {
  at::NoGradGuard no_grad;
  const int world = communicator_.world_size();
  const int rank = communicator_.rank();
  const std::vector<const Module*> blocks = model.blocks();
  if (blocks.empty())
    throw UsageError("distributed.shard_weights: model_type " + model.model_type() + " has no blocks to shard by",
                     "set distributed.shard_weights=false (distributed.shard_optimizer shards the optimizer state)");
  units_.resize(blocks.size() + 1);
  units_[0].name = "the root (what no unit holds: final norm, tied embeddings and head)";
  std::map<const Module*, std::size_t> index;
  for (std::size_t i = 0; i < blocks.size(); ++i) index[blocks[i]] = i + 1;
  model.for_each_module([&](const std::string& name, Module& module) {
    const auto it = index.find(&module);
    if (it == index.end()) return;
    units_[it->second].name = name;
    unit_of_[&module] = it->second;
  });
  // A 4-bit layer's state besides its packed codes (block scales, code tables: QLoRA's base) is data, not a weight:
  // gathered in its own dtype whatever param_dtype.
  std::set<const at::Tensor*> exact, in_place;
  model.for_each_module([&](const std::string&, Module& module) {
    if (const auto* linear = dynamic_cast<const Linear*>(&module))
      if (const QuantState4bit* q = linear->quantized()) {
        exact.insert({&q->absmax, &q->quant_map, &q->nested_absmax, &q->nested_quant_map});
        in_place.insert(&q->state_json);
      }
  });
  const std::vector<std::size_t> units = parameter_units(model);
  std::size_t next = 0;
  model.for_each_parameter([&](const std::string& name, at::Tensor& slot) {
    const std::size_t u = units[next++];
    if (whole.contains(&slot)) return;
    if (in_place.contains(&slot)) {
      units_[u].in_place.emplace_back(name, &slot);
      return;
    }
    auto& groups = units_[u].groups;
    const bool trainable = slot.requires_grad();
    const bool as_stored = exact.contains(&slot);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
      return g.dtype == slot.scalar_type() && g.trainable == trainable && g.as_stored == as_stored;
    });
    if (it == groups.end()) {
      groups.push_back(Group{});
      it = std::prev(groups.end());
      it->dtype = slot.scalar_type();
      it->trainable = trainable;
      it->as_stored = as_stored;
    }
    it->entries.push_back(Entry{name, &slot, slot.sizes().vec(), it->padded, slot.numel()});
    parameter_unit_[name] = {u, &slot};
    it->padded += slot.numel();
  });
  int64_t read_on_demand = 0;  // parameters read from the checkpoint here
  for (auto& unit : units_) {
    for (auto& g : unit.groups) {
      g.padded = (g.padded + world - 1) / world * world;
      g.shard_numel = g.padded / world;
      // fp32 groups are gathered in param_dtype and reduced in reduce_dtype; others (a bf16 base) as they are.
      const bool cast = g.dtype == at::kFloat && !g.as_stored;
      g.compute = cast ? options_.param_dtype : g.dtype;
      g.grad_dtype = cast ? options_.reduce_dtype : g.dtype;
      // The unit's values, whole for a moment (one unit at a time), to cut this rank's shard from.
      at::Tensor whole = at::zeros({g.padded}, at::TensorOptions().dtype(g.dtype).device(device));
      g.full = at::empty({g.padded}, whole.options().dtype(g.compute));
      for (auto& e : g.entries) {
        if (e.slot->is_meta() && !read)
          throw Error("distributed.shard_weights: " + e.name + " has no values (meta) and no reader");
        read_on_demand += e.slot->is_meta() ? 1 : 0;
        whole.narrow(0, e.offset, e.numel).copy_((e.slot->is_meta() ? read(e.name) : *e.slot).reshape({-1}));
        // The model's parameter becomes a leaf over the gathered buffer's storage.
        at::Tensor p = at::empty({0}, g.full.options());
        std::vector<int64_t> strides(e.shape.size(), 1);
        for (std::size_t d = e.shape.size(); d-- > 1;) strides[d - 1] = strides[d] * e.shape[d];
        p.set_(g.full.storage(), e.offset, e.shape, strides);
        p.requires_grad_(g.trainable);
        *e.slot = p;
        unit_of_tensor_[p.unsafeGetTensorImpl()] = static_cast<std::size_t>(&unit - units_.data());
        unit.trainable_entries += g.trainable ? 1 : 0;
      }
      g.shard = whole.narrow(0, static_cast<int64_t>(rank) * g.shard_numel, g.shard_numel).clone();
      if (g.trainable) g.shard_grad = at::zeros_like(g.shard);
      free_storage(g.full);
    }
    for (auto& [name, slot] : unit.in_place)
      if (slot->is_meta()) {
        if (!read) throw Error("distributed.shard_weights: " + name + " has no values (meta) and no reader");
        *slot = read(name).to(device);
        ++read_on_demand;
      }
  }
  status_ = at::zeros({4}, at::TensorOptions().dtype(at::kLong).device(device));
  // A language model's head, pinned with the root for an evaluation unit by unit.
  if (const auto* language = dynamic_cast<const LanguageModel*>(&model))
    if (const auto it = unit_of_tensor_.find(language->lm_head_weight().unsafeGetTensorImpl());
        it != unit_of_tensor_.end())
      head_unit_ = it->second;

  auto pieces = std::make_unique<PieceModule>();
  for (auto& unit : units_)
    for (auto& g : unit.groups) {
      if (!g.trainable) continue;
      const int64_t begin = static_cast<int64_t>(rank) * g.shard_numel;
      for (const auto& e : g.entries) {
        const int64_t lo = std::max(begin, e.offset), hi = std::min(begin + g.shard_numel, e.offset + e.numel);
        if (hi <= lo) continue;
        at::Tensor& piece = pieces->add(e.name, g.shard.narrow(0, lo - begin, hi - lo).detach());
        piece.requires_grad_(true);
      }
    }
  pieces_ = std::move(pieces);
  int64_t shard_bytes = 0, total = 0;
  for (const auto& unit : units_)
    for (const auto& g : unit.groups) {
      shard_bytes += g.shard_numel * static_cast<int64_t>(c10::elementSize(g.dtype));
      for (const auto& e : g.entries) total += e.numel;
    }
  spdlog::info("distributed.shard_weights: {} parameters in {} units over {} ranks; this rank holds {:.1f} MiB of them; "
               "fp32 weights gathered in {}, gradients reduced in {}{}",
               total, units_.size(), world, static_cast<double>(shard_bytes) / (1 << 20),
               c10::toString(options_.param_dtype), c10::toString(options_.reduce_dtype),
               read_on_demand ? fmt::format(" ({} read from the checkpoint unit by unit: the whole model was never "
                                            "in memory)", read_on_demand)
                              : std::string());
}

Module& FullySharded::trainable_pieces() { return *pieces_; }

std::vector<FullySharded::Piece> FullySharded::pieces() {
  std::vector<Piece> out;
  const int64_t rank = communicator_.rank();
  for (auto& unit : units_)
    for (auto& g : unit.groups) {
      const int64_t begin = rank * g.shard_numel;
      for (const auto& e : g.entries) {
        const int64_t lo = std::max(begin, e.offset), hi = std::min(begin + g.shard_numel, e.offset + e.numel);
        if (hi <= lo) continue;
        out.push_back(Piece{e.name, e.shape, lo - e.offset, g.shard.narrow(0, lo - begin, hi - lo)});
      }
    }
  return out;
}

std::vector<FullySharded::Piece> FullySharded::trainable_layout() const {
  std::vector<Piece> out;
  const int64_t rank = communicator_.rank();
  for (const auto& unit : units_)
    for (const auto& g : unit.groups) {
      if (!g.trainable) continue;
      const int64_t begin = rank * g.shard_numel;
      for (const auto& e : g.entries) {
        const int64_t lo = std::max(begin, e.offset), hi = std::min(begin + g.shard_numel, e.offset + e.numel);
        out.push_back(hi > lo ? Piece{e.name, e.shape, lo - e.offset, g.shard.narrow(0, lo - begin, hi - lo)}
                              : Piece{e.name, e.shape, -1, {}});
      }
    }
  return out;
}

int64_t FullySharded::status(const char* what, int64_t value, int64_t gathers) {
  at::NoGradGuard no_grad;
  status_.fill_(0);
  status_[1].fill_(value);
  status_[2].fill_(gathers);
  status_[3].fill_(-gathers);
  communicator_.all_reduce_max_in_place(status_, what);
  const at::Tensor values = status_.device().is_cpu() ? status_ : status_.cpu();
  const int64_t* v = values.data_ptr<int64_t>();
  if (v[0] != 0 && (in_attempt_ || in_evaluation_)) {
    failure_agreed_ = true;
    throw AgreedOutOfMemory("another rank ran out of memory during this attempt (learnt " + std::string(what) + ")");
  }
  // The largest and (negated) the smallest of the ranks' `gathers`: unequal, the ranks were about to gather
  // different units (all-gathers of equal sizes would pair silently). Every rank sees it here and stops.
  if (v[0] == 0 && v[2] != -v[3])
    throw Error("distributed.shard_weights: the ranks disagree on which units to gather (" + std::string(what) +
                "): an error in trainer's step protocol, not in the data or the config",
                "report it with the config; distributed.prefetch=false may avoid it meanwhile");
  return v[1];
}

void FullySharded::announce_failure() {
  if (!in_attempt_ && !in_evaluation_) return;
  // Every rank comes here after an evaluation try that ran out of memory anywhere (an attempt's are agreed in agree).
  if (in_evaluation_) drop_prefetch();
  if (!failure_agreed_) {
    at::NoGradGuard no_grad;
    status_.fill_(0);
    status_[0].fill_(1);
    communicator_.all_reduce_max_in_place(status_, "telling the other ranks of an out-of-memory error");
    failure_agreed_ = true;
  }
  reset();
}

namespace {

// A unit's gathered buffers given memory, and its shards in the compute dtype (what each rank sends).
std::vector<at::Tensor> allocate_gathered(auto& groups) {
  std::vector<at::Tensor> sent;
  for (auto& g : groups) {
    allocate_storage(g.full, static_cast<std::size_t>(g.padded) * c10::elementSize(g.compute));
    sent.push_back(g.compute == g.dtype ? g.shard : g.shard.to(g.compute));
  }
  return sent;
}

}  // namespace

void FullySharded::gather(std::size_t u, int64_t event) {
  Unit& unit = units_[u];
  finish(unit);
  // The unit that followed this event in the last attempt every rank fit, when it is not gathered yet. Not from a
  // unit pinned for an evaluation: its use is no collective, and a pass that computes no loss (a rank's empty one)
  // skips the head, so it may not happen on every rank.
  Unit* next = nullptr;
  if (options_.prefetch && event >= 0 && !all_gathered_ && !unit.pinned && (in_attempt_ || in_evaluation_) &&
      static_cast<std::size_t>(event) < next_.size() && next_[event] >= 0 &&
      static_cast<std::size_t>(next_[event] / 2) != u && !units_[next_[event] / 2].gathered)
    next = &units_[next_[event] / 2];
  if (unit.gathered && !next) return;
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> sent = unit.gathered ? std::vector<at::Tensor>{} : allocate_gathered(unit.groups);
  // The prefetch's memory: a rank that cannot allocate it says so in the status, and every rank skips it.
  std::vector<at::Tensor> prefetched;
  bool short_of_memory = false;
  if (next) {
    try {
      prefetched = allocate_gathered(next->groups);
    } catch (const c10::OutOfMemoryError&) {
      short_of_memory = true;
    }
  }
  // What this rank gathers now, the same on every rank (checked by the status).
  const int64_t gathers = 1 + (unit.gathered ? 0 : static_cast<int64_t>(u) + 1) +
                          (next ? (static_cast<int64_t>(next - units_.data()) + 1) << 20 : 0);
  const bool skip = status(unit.gathered ? "before prefetching a unit's weights" : "before gathering a unit's weights",
                           short_of_memory ? 1 : 0, gathers) != 0;
  if (!unit.gathered) {
    for (std::size_t i = 0; i < unit.groups.size(); ++i)
      communicator_.all_gather_into(unit.groups[i].full, sent[i], "gathering a unit's weights");
    unit.gathered = true;
  }
  if (!next) return;
  if (skip) {
    for (auto& g : next->groups) free_storage(g.full);
    if (!prefetch_skipped_ && communicator_.rank() == 0)
      spdlog::warn("fully sharded: a rank had no memory for the next unit's weights: every rank skipped that "
                   "prefetch and gathers it when it is needed (distributed.prefetch=false saves the memory always)");
    prefetch_skipped_ = true;
    return;
  }
  for (std::size_t i = 0; i < next->groups.size(); ++i)
    next->pending.push_back(
        communicator_.start_all_gather(next->groups[i].full, prefetched[i], "gathering the next unit's weights"));
  next->gathered = true;
}

void FullySharded::drop_prefetch() {
  // From now on no unit is prefetched (one more unit gathered is memory a tight budget does not have); the micro-batch
  // shrinks as ever. Every rank calls it at the same point (an agreed out-of-memory error).
  if (!options_.prefetch) return;
  options_.prefetch = false;
  if (communicator_.rank() == 0)
    spdlog::warn("fully sharded: out of memory: prefetch is off for the rest of the run (it holds the next unit's "
                 "weights gathered while one computes)");
}

void FullySharded::finish(Unit& unit) {
  for (auto& pending : unit.pending) communicator_.wait(*pending);
  unit.pending.clear();
}

void FullySharded::note(std::size_t u, bool backward) {
  if (!in_attempt_ || !options_.prefetch) return;
  const int64_t event = 2 * static_cast<int64_t>(u) + (backward ? 1 : 0);
  if (last_event_ >= 0 && static_cast<std::size_t>(last_event_ / 2) != u) learning_[last_event_] = event;
  last_event_ = event;
}

void FullySharded::release(Unit& unit) {
  if (all_gathered_ || unit.pinned) return;
  finish(unit);
  for (auto& g : unit.groups) free_storage(g.full);
  unit.gathered = false;
}

void FullySharded::link_gradients(Unit& unit) {
  if (unit.backward_ready) return;
  at::NoGradGuard no_grad;
  for (auto& g : unit.groups) {
    if (!g.trainable) continue;
    // Autograd adds each gradient (in the compute dtype) into this buffer of reduce_dtype.
    g.full_grad = at::zeros({g.padded}, g.full.options().dtype(g.grad_dtype));
    for (auto& e : g.entries) e.slot->mutable_grad() = g.full_grad.narrow(0, e.offset, e.numel).view(e.shape);
  }
  unit.backward_ready = true;
}

void FullySharded::reduce_gradients(Unit& unit) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> reduced;
  for (auto& g : unit.groups)
    reduced.push_back(g.trainable && g.full_grad.defined() ? at::empty({g.shard_numel}, g.full_grad.options())
                                                           : at::Tensor());
  status("before reducing a unit's gradients");
  for (std::size_t i = 0; i < unit.groups.size(); ++i) {
    Group& g = unit.groups[i];
    if (!reduced[i].defined()) continue;
    communicator_.reduce_scatter_sum(reduced[i], g.full_grad, "reduce-scattering a unit's gradients");
    g.shard_grad.add_(reduced[i]);
    for (auto& e : g.entries) e.slot->mutable_grad() = at::Tensor();
    g.full_grad = at::Tensor();
  }
  unit.backward_ready = false;
}

void FullySharded::reset() {
  for (auto& unit : units_) {
    finish(unit);  // every rank started it: it completes
    const bool keep = all_gathered_ || unit.pinned;
    for (auto& g : unit.groups) {
      if (!keep) free_storage(g.full);
      g.full_grad = at::Tensor();
      for (auto& e : g.entries) e.slot->mutable_grad() = at::Tensor();
    }
    if (!keep) unit.gathered = false;
    unit.backward_ready = false;
    unit.accumulated = 0;
  }
}

at::Tensor FullySharded::run(const Module& module, const BlockFn& block, const std::vector<at::Tensor>& inputs) {
  const auto it = unit_of_.find(&module);
  if (it == unit_of_.end()) return block(inputs);
  const std::size_t u = it->second;
  Unit& unit = units_[u];
  const bool grad = at::GradMode::is_enabled() && in_attempt_;
  std::vector<at::Tensor> in = inputs;
  if (grad && !at::isFloatingType(inputs[0].scalar_type())) {
    // Ids in (an embedding): no gradient flows past the unit, so its end is the parameters' accumulation.
    if (!unit.watched)
      for (auto& g : unit.groups)
        for (auto& e : g.entries)
          if (g.trainable) torch::autograd::impl::set_post_acc_grad_hooks(*e.slot, std::make_unique<AccumulatedHook>(this, u));
    unit.watched = true;
  } else if (grad) {
    const at::Tensor dummy = at::empty({0}, inputs[0].options().dtype(at::kFloat)).requires_grad_(true);
    in[0] = AfterBlockBackward::apply(c10::make_intrusive<UnitRef>(this, u), dummy, in[0])[0];
  }
  note(u, false);
  gather(u, 2 * static_cast<int64_t>(u));
  at::Tensor out = block(in);
  // Autocast keeps its casts of weights for the whole forward: drop this block's, so that what the block does not
  // save for backward (all of it under activation checkpointing) goes with the block.
  if (at::autocast::is_autocast_enabled(inputs[0].device().type())) at::autocast::clear_cache();
  if (!grad || options_.reshard_after_forward) release(unit);
  if (grad && out.requires_grad()) out = BeforeBlockBackward::apply(c10::make_intrusive<UnitRef>(this, u), out)[0];
  return out;
}

void FullySharded::before_backward(std::size_t u) {
  note(u, true);
  link_gradients(units_[u]);
  gather(u, 2 * static_cast<int64_t>(u) + 1);
}

void FullySharded::after_backward(std::size_t u) {
  Unit& unit = units_[u];
  reduce_gradients(unit);
  release(unit);
}

void FullySharded::accumulated(std::size_t u) {
  Unit& unit = units_[u];
  if (++unit.accumulated < unit.trainable_entries) return;
  unit.accumulated = 0;
  after_backward(u);
}

void FullySharded::before_head(const at::Tensor& weight) {
  const auto it = unit_of_tensor_.find(weight.unsafeGetTensorImpl());
  if (!in_attempt_ || it == unit_of_tensor_.end() || it->second == 0) return;
  note(it->second, false);
  link_gradients(units_[it->second]);
  gather(it->second, 2 * static_cast<int64_t>(it->second));
}

void FullySharded::after_head(const at::Tensor& weight) {
  const auto it = unit_of_tensor_.find(weight.unsafeGetTensorImpl());
  if (!in_attempt_ || it == unit_of_tensor_.end() || it->second == 0) return;
  after_backward(it->second);
}

void FullySharded::gather_all() {
  for (std::size_t u = 0; u < units_.size(); ++u) gather(u);
  all_gathered_ = true;
}

void FullySharded::begin_evaluation() {
  in_evaluation_ = true;
  failure_agreed_ = false;
  for (const std::size_t u : {std::size_t{0}, head_unit_}) {
    gather(u);
    units_[u].pinned = true;
  }
}

void FullySharded::end_evaluation() {
  in_evaluation_ = false;
  for (auto& unit : units_) {
    unit.pinned = false;
    release(unit);
  }
}

void FullySharded::release_all() {
  all_gathered_ = false;
  for (auto& unit : units_) release(unit);
}

at::Tensor FullySharded::gathered(const std::string& name) {
  const auto& [u, slot] = parameter_unit_.at(name);
  if (exported_unit_ != u) {
    // The master values (the shards' dtype, whatever param_dtype gathers for compute), one unit at a time.
    at::NoGradGuard no_grad;
    exported_.clear();
    exported_unit_ = SIZE_MAX;
    for (auto& g : units_[u].groups) exported_.push_back(at::empty({g.padded}, g.shard.options()));
    status("before gathering a unit's weights to write them");
    for (std::size_t i = 0; i < units_[u].groups.size(); ++i)
      communicator_.all_gather_into(exported_[i], units_[u].groups[i].shard, "gathering a unit's weights to write them");
    exported_unit_ = u;
  }
  for (std::size_t i = 0; i < units_[u].groups.size(); ++i)
    for (const auto& e : units_[u].groups[i].entries)
      if (e.slot == slot) return exported_[i].narrow(0, e.offset, e.numel).view(e.shape);
  throw Error("distributed.shard_weights: " + name + " is in no group of its unit");
}

void FullySharded::release_exported() {
  exported_.clear();
  exported_unit_ = SIZE_MAX;
}

std::pair<int64_t, int64_t> FullySharded::share(std::span<const Example> examples, bool by_tokens, bool) {
  return share_of(examples, communicator_.rank(), communicator_.world_size(), by_tokens);
}

void FullySharded::begin_attempt(bool) {
  in_attempt_ = true;
  failure_agreed_ = false;
  reset();
  at::NoGradGuard no_grad;
  for (auto& unit : units_)
    for (auto& g : unit.groups)
      if (g.trainable) g.shard_grad.zero_();
  // The root is gathered for the whole attempt, its gradients accumulated in place over the micro-batches.
  link_gradients(units_[0]);
  gather(0);
  learning_.assign(2 * units_.size(), -1);
  last_event_ = -1;
}

int64_t FullySharded::agree_passes(int64_t mine) { return status("agreeing on the number of micro-batches", mine); }

std::vector<double> FullySharded::sum(const std::vector<double>& values, const char* what) {
  if (in_attempt_) status(what);
  return communicator_.all_reduce_sum(values, what);
}

void FullySharded::prepare() {
  // The root's gradients, reduced once per attempt; its status is the attempt's last (every rank reaches it).
  reduce_gradients(units_[0]);
  for (auto& unit : units_) release(unit);  // the root, and a prefetch this attempt did not use
  // Parameters kept whole on every rank (LoRA's adapters): their gradients summed, as data parallelism sums them.
  at::NoGradGuard no_grad;
  replicated_squares_ = 0;
  if (!replicated_.empty()) {
    std::vector<at::Tensor> grads;
    for (at::Tensor* p : replicated_) {
      if (!p->grad().defined()) p->mutable_grad() = at::zeros_like(*p);
      grads.push_back(p->grad());
    }
    status("before summing the adapters' gradients");
    communicator_.all_reduce_sum(grads, kReplicatedBucketBytes);
    for (const auto& g : grads) replicated_squares_ += g.to(at::kDouble).pow(2).sum().item<double>();
  }
  // The optimizer's pieces take their gradients from the reduced shards.
  const int64_t rank = communicator_.rank();
  std::map<std::string, at::Tensor> grads;
  for (auto& unit : units_)
    for (auto& g : unit.groups) {
      if (!g.trainable) continue;
      const int64_t begin = rank * g.shard_numel;
      for (const auto& e : g.entries) {
        const int64_t lo = std::max(begin, e.offset), hi = std::min(begin + g.shard_numel, e.offset + e.numel);
        if (hi > lo) grads[e.name] = g.shard_grad.narrow(0, lo - begin, hi - lo);
      }
    }
  pieces_->for_each_parameter([&](const std::string& name, at::Tensor& piece) {
    if (const auto it = grads.find(name); it != grads.end()) piece.mutable_grad() = it->second;
  });
  in_attempt_ = false;
}

StepSync::Outcome FullySharded::agree(bool fit, int64_t largest_part) {
  in_attempt_ = false;
  const Outcome outcome = agree_on_attempt(communicator_, fit, largest_part);
  if (!outcome.all_fit) {
    if (!probing_) drop_prefetch();
    reset();
  }
  // Every rank ran the same gathers in an attempt that all fit: the order the next attempts prefetch by.
  else if (!learning_.empty()) {
    const bool first = next_.empty();
    next_ = std::exchange(learning_, {});
    if (first && communicator_.rank() == 0)
      spdlog::info("fully sharded: prefetch: each of {} gathers of a pass starts the next unit's (the order of the "
                   "first step; distributed.prefetch)",
                   std::count_if(next_.begin(), next_.end(), [](int64_t e) { return e >= 0; }));
  }
  return outcome;
}

double FullySharded::reduce(double loss_sum) { return communicator_.all_reduce_sum(loss_sum); }

double FullySharded::global_squared_norm(double local) {
  // Every rank holds the whole adapters' (summed) gradients: counted once, not once per rank.
  return communicator_.all_reduce_sum(local - replicated_squares_) + replicated_squares_;
}

}  // namespace trainer::distributed
