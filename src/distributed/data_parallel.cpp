// Data parallelism for one training step (see data_parallel.h).
#include "distributed/data_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "models/module.h"
#include "trainer/errors.h"

namespace trainer::distributed {

std::pair<int64_t, int64_t> share_of(std::span<const Example> examples, int rank, int world, bool by_tokens) {
  const auto n = static_cast<int64_t>(examples.size());
  if (!by_tokens) {
    // Equal counts; the remainder goes to the first ranks.
    const int64_t base = n / world, extra = n % world;
    auto begin_of = [&](int r) { return r * base + std::min<int64_t>(r, extra); };
    return {begin_of(rank), begin_of(rank + 1) - begin_of(rank)};
  }
  std::vector<int64_t> cumulative(static_cast<std::size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const auto& e = examples[static_cast<std::size_t>(i)];
    cumulative[static_cast<std::size_t>(i) + 1] =
        cumulative[static_cast<std::size_t>(i)] + static_cast<int64_t>(e.input_ids.size() + e.labels.size());
  }
  const int64_t total = cumulative.back();
  // Rank r starts at the first example whose running cost reaches r/world of the total (never before the previous
  // rank's start, so shares stay contiguous and disjoint).
  auto begin_of = [&](int r) -> int64_t {
    if (r <= 0) return 0;
    if (r >= world) return n;
    const int64_t target = (total * r + world / 2) / world;
    int64_t i = 0;
    while (i < n && cumulative[static_cast<std::size_t>(i)] < target) ++i;
    return i;
  };
  const int64_t begin = begin_of(rank), end = std::max(begin, begin_of(rank + 1));
  return {begin, end - begin};
}

std::pair<int64_t, int64_t> DataParallel::share(std::span<const Example> examples, bool by_tokens, bool) {
  return share_of(examples, communicator_.rank(), communicator_.world_size(), by_tokens);
}

StepSync::Outcome agree_on_attempt(Communicator& communicator, bool fit, int64_t largest_part, bool late) {
  // One message: per rank a 0/1 "did not fit", then the largest micro-batch, then whether a gradient changed after
  // its overlapped sum started; the maximum of each over the ranks.
  const int world = communicator.world_size();
  std::vector<int64_t> values(static_cast<std::size_t>(world) + 2, 0);
  values[static_cast<std::size_t>(communicator.rank())] = fit ? 0 : 1;
  values[static_cast<std::size_t>(world)] = largest_part;
  values.back() = late ? 1 : 0;
  const auto agreed = communicator.all_reduce_max(values);
  if (agreed.back())
    throw Error("a gradient changed after its overlapped all-reduce had started (a parameter accumulated twice in "
                "one backward), so the ranks' gradient sums cannot be trusted",
                "set distributed.overlap_grad_reduce=false (sums after backward) and report this model");
  StepSync::Outcome outcome;
  outcome.largest_part = agreed[static_cast<std::size_t>(world)];
  for (int r = 0; r < world; ++r)
    if (agreed[static_cast<std::size_t>(r)]) {
      outcome.all_fit = false;
      outcome.failed_ranks += (outcome.failed_ranks.empty() ? "" : ", ") + std::to_string(r);
    }
  return outcome;
}

StepSync::Outcome DataParallel::agree(bool fit, int64_t largest_part) {
  // An overlapped attempt that did not reach prepare()'s end (out of memory): first this rank's part in the
  // buckets the other ranks may have started, so the collectives stay paired.
  if (overlap_attempt_) abandon_overlap();
  const bool late = late_;
  late_ = false;
  const Outcome outcome = agree_on_attempt(communicator_, fit, largest_part, late);
  // Not all fit: the attempt is dropped, and the flattening buffer with it (the retry's forward needs the room).
  if (!outcome.all_fit) scratch_ = at::Tensor();
  return outcome;
}

void DataParallel::prepare() {
  at::NoGradGuard no_grad;
  // A rank whose share left a parameter unused (or that had no examples) contributes zeros.
  for (auto& p : parameters_)
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
  if (overlap_attempt_) {
    // Overlapped: the buckets whose gradients backward left alone (unused parameters, ones accumulated outside
    // autograd, an empty share) start now, and every sum ends here, inside the attempt.
    const std::size_t during_backward = next_bucket_;
    armed_ = true;
    for (std::size_t i = 0; i < parameters_.size(); ++i)
      if (!final_[i]) mark_final(i);
    retire(/*wait_all=*/true);
    spdlog::debug("data parallelism: {} of {} gradient buckets started their sum during backward", during_backward,
                  buckets_.size());
    overlap_attempt_ = armed_ = false;
    overlapped_ = true;
    if (owners_.empty()) return;  // sharded: after_update's broadcast still wants the buffer below
  }
  // The buffer buckets are flattened into, allocated here (inside the attempt whose out-of-memory errors the ranks
  // agree on) rather than inside a collective, where one rank's error would leave the others waiting.
  if (!scratch_.defined() && !parameters_.empty()) {
    const auto dtype = parameters_.front().scalar_type();
    int64_t numel = 0;
    for (const auto& p : parameters_)
      if (p.scalar_type() == dtype) numel += p.numel();
    const int64_t per_bucket = std::max<int64_t>(1, bucket_bytes_ / static_cast<int64_t>(c10::elementSize(dtype)));
    scratch_ = at::empty({std::min(numel, per_bucket)}, parameters_.front().options());
  }
}

double DataParallel::reduce(double loss_sum) {
  at::NoGradGuard no_grad;
  if (overlapped_) {
    // Summed during backward: sharded, the non-owners drop what they do not own, as below.
    overlapped_ = false;
    if (!owners_.empty())
      for (std::size_t i = 0; i < parameters_.size(); ++i)
        if (owners_[i] != communicator_.rank()) parameters_[i].mutable_grad() = at::Tensor();
    return communicator_.all_reduce_sum(loss_sum);
  }
  prepare();
  std::vector<at::Tensor> grads;
  grads.reserve(parameters_.size());
  for (auto& p : parameters_) grads.push_back(p.grad());
  if (owners_.empty()) {
    communicator_.all_reduce_sum(grads, bucket_bytes_, scratch_);
    scratch_ = at::Tensor();
  } else {
    // ZeRO-1: each parameter's sum goes to its owner alone (a c10d reduce per bucket of one owner's gradients:
    // whole parameters make this the natural collective; Gloo's reduce_scatter would need equal flat ranges).
    // The other ranks free that gradient: neither their norm nor their update reads it.
    communicator_.reduce_sum_to(grads, owners_, bucket_bytes_, scratch_);
    for (std::size_t i = 0; i < parameters_.size(); ++i)
      if (owners_[i] != communicator_.rank()) parameters_[i].mutable_grad() = at::Tensor();
  }
  return communicator_.all_reduce_sum(loss_sum);
}

double DataParallel::global_squared_norm(double local) {
  // Unsharded, every rank holds every summed gradient; sharded, each holds its own parameters' ones.
  return owners_.empty() ? local : communicator_.all_reduce_sum(local);
}

void DataParallel::after_update() {
  if (owners_.empty()) return;
  at::NoGradGuard no_grad;
  communicator_.broadcast_from(parameters_, owners_, bucket_bytes_, scratch_);
  scratch_ = at::Tensor();
}

namespace {

// Calls back when autograd has accumulated a parameter's gradient (once per backward for a leaf).
class FinalGradientHook : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit FinalGradientHook(std::function<void()> on_final) : on_final_(std::move(on_final)) {}
  void operator()(const torch::autograd::Variable&) override { on_final_(); }

 private:
  std::function<void()> on_final_;
};

}  // namespace

DataParallel::~DataParallel() {
  if (buckets_.empty()) return;
  for (auto& p : parameters_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void DataParallel::build_buckets() {
  // Reverse parameter order (backward produces the last layers' gradients first); a bucket holds one dtype and one
  // owner, up to bucket_bytes (a larger parameter alone). The same on every rank: the parameters are.
  bucket_of_.assign(parameters_.size(), 0);
  for (std::size_t k = parameters_.size(); k-- > 0;) {
    const at::Tensor& p = parameters_[k];
    const int root = owners_.empty() ? -1 : owners_[k];
    const auto bytes = static_cast<int64_t>(p.nbytes());
    if (buckets_.empty() || buckets_.back().dtype != p.scalar_type() || buckets_.back().root != root ||
        (buckets_.back().numel * static_cast<int64_t>(c10::elementSize(p.scalar_type())) + bytes > bucket_bytes_))
      buckets_.push_back(Bucket{{}, 0, p.scalar_type(), root});
    buckets_.back().parameters.push_back(k);
    buckets_.back().numel += p.numel();
    bucket_of_[k] = buckets_.size() - 1;
  }
  for (std::size_t k = 0; k < parameters_.size(); ++k) {
    index_of_[parameters_[k].unsafeGetTensorImpl()] = k;
    torch::autograd::impl::set_post_acc_grad_hooks(
        parameters_[k], std::make_unique<FinalGradientHook>([this, k] {
          const std::lock_guard<std::mutex> lock(mutex_);
          mark_final(k);
        }));
  }
}

void DataParallel::begin_attempt(bool may_overlap) {
  overlapped_ = armed_ = false;
  overlap_attempt_ = overlap_enabled_ && may_overlap && !parameters_.empty();
  if (!overlap_attempt_) return;
  if (buckets_.empty()) build_buckets();
  waiting_.assign(buckets_.size(), 0);
  for (std::size_t b = 0; b < buckets_.size(); ++b) waiting_[b] = static_cast<int64_t>(buckets_[b].parameters.size());
  final_.assign(parameters_.size(), 0);
  next_bucket_ = 0;
  in_flight_.clear();
}

void DataParallel::before_last_backward() {
  if (overlap_attempt_) armed_ = true;
}

void DataParallel::gradient_ready(const at::Tensor& parameter) {
  if (!armed_) return;
  const auto found = index_of_.find(parameter.unsafeGetTensorImpl());
  if (found == index_of_.end()) return;  // frozen (LoRA's base)
  const std::lock_guard<std::mutex> lock(mutex_);
  mark_final(found->second);
}

void DataParallel::mark_final(std::size_t index) {
  if (!armed_) return;  // an earlier micro-batch: more is to come
  if (final_[index]) {
    // Accumulated again: harmless while its bucket waits, wrong once the bucket's sum has started.
    if (bucket_of_[index] < next_bucket_) late_ = true;
    return;
  }
  final_[index] = 1;
  --waiting_[bucket_of_[index]];
  launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  at::NoGradGuard no_grad;
  // Finished sums go back first, so the copies in flight stay few.
  retire(/*wait_all=*/false);
  while (next_bucket_ < buckets_.size() && waiting_[next_bucket_] == 0) {
    const Bucket& bucket = buckets_[next_bucket_];
    InFlight flight;
    flight.bucket = next_bucket_;
    const at::Tensor& first = parameters_[bucket.parameters.front()].grad();
    if (bucket.parameters.size() == 1 && first.is_contiguous()) {
      flight.flat = first.view({-1});  // summed in place
    } else {
      std::vector<at::Tensor> parts;
      for (const auto k : bucket.parameters) parts.push_back(parameters_[k].grad().reshape({-1}));
      flight.flat = at::cat(parts);  // may run out of memory: then agree() issues this bucket with the rest
      flight.copy_back = true;
    }
    flight.pending = communicator_.start_sum(flight.flat, bucket.root);
    in_flight_.push_back(std::move(flight));
    ++next_bucket_;
  }
}

void DataParallel::retire(bool wait_all) {
  at::NoGradGuard no_grad;
  while (!in_flight_.empty()) {
    InFlight& flight = in_flight_.front();
    if (wait_all)
      communicator_.wait(*flight.pending);
    else if (!communicator_.finished(*flight.pending))
      return;
    else
      communicator_.wait(*flight.pending);  // done: rethrows a failure
    const Bucket& bucket = buckets_[flight.bucket];
    if (flight.copy_back && (bucket.root < 0 || bucket.root == communicator_.rank())) {
      int64_t offset = 0;
      for (const auto k : bucket.parameters) {
        at::Tensor grad = parameters_[k].grad();
        grad.copy_(flight.flat.narrow(0, offset, grad.numel()).view(grad.sizes()));
        offset += grad.numel();
      }
    }
    in_flight_.pop_front();
  }
}

void DataParallel::abandon_overlap() {
  // This rank ran out of memory somewhere in the attempt; the others may have started any of the buckets. Every
  // bucket this rank has not started goes now, one at a time, from a buffer of its size (its content is moot: the
  // attempt is dropped on every rank). Unwinding freed the attempt's activations, so the room is there.
  overlap_attempt_ = armed_ = false;
  at::NoGradGuard no_grad;
  for (auto& flight : in_flight_) communicator_.wait(*flight.pending);
  in_flight_.clear();
  for (; next_bucket_ < buckets_.size(); ++next_bucket_) {
    const Bucket& bucket = buckets_[next_bucket_];
    at::Tensor filler;
    try {
      filler = at::zeros({bucket.numel}, parameters_.front().options().dtype(bucket.dtype));
    } catch (const c10::OutOfMemoryError& e) {
      throw OutOfMemoryAtFloor("rank " + std::to_string(communicator_.rank()) +
                                   ": out of memory even for one gradient bucket after an out-of-memory error, so "
                                   "this rank cannot keep the overlapped gradient sums paired: " +
                                   std::string(e.what_without_backtrace()).substr(0, 200),
                               "raise memory.limit, lower distributed.bucket_size, or set "
                               "distributed.overlap_grad_reduce=false");
    }
    auto pending = communicator_.start_sum(filler, bucket.root);
    communicator_.wait(*pending);
  }
}

void add_rank_figures(Communicator* world, RunSummary& summary) {
  if (!world) return;
  const auto size = static_cast<std::size_t>(world->world_size());
  const auto rank = static_cast<std::size_t>(world->rank());
  // Read before the collective, so every rank reports its time up to the same point.
  const double seconds = world->communication_seconds();
  std::vector<double> slots(3 * size, 0.0);
  slots[3 * rank] = static_cast<double>(summary.memory_peak);  // exact: peaks are far below 2^53 bytes
  slots[3 * rank + 1] = seconds;
  slots[3 * rank + 2] = static_cast<double>(summary.data.records_mapped);
  const auto all = world->all_reduce_sum(slots, "gathering every rank's figures for the summary");
  summary.ranks.resize(size);
  for (std::size_t r = 0; r < size; ++r)
    summary.ranks[r] = {static_cast<int64_t>(all[3 * r]), all[3 * r + 1], static_cast<int64_t>(all[3 * r + 2])};
  summary.backend = world->backend_name();
}

std::function<std::vector<int64_t>(int64_t kept)> kept_counts_exchange(Communicator* world, std::string what) {
  return [world, what = std::move(what)](int64_t kept) {
    std::vector<double> counts(static_cast<std::size_t>(world->world_size()), 0.0);
    counts[static_cast<std::size_t>(world->rank())] = static_cast<double>(kept);
    counts = world->all_reduce_sum(counts, what.c_str());
    std::vector<int64_t> out;
    for (const double c : counts) out.push_back(static_cast<int64_t>(std::llround(c)));
    return out;
  };
}

std::unique_ptr<DataParallel> make_data_parallel(Communicator& world, Module& trainable, int64_t bucket_bytes,
                                                 std::vector<int> owners) {
  std::vector<at::Tensor> parameters;
  trainable.for_each_parameter([&](const std::string&, at::Tensor& p) {
    if (p.requires_grad()) parameters.push_back(p);
  });
  return std::make_unique<DataParallel>(world, std::move(parameters), bucket_bytes, std::move(owners));
}

RecordShare record_share(Communicator* world) {
  if (!world) return {};
  return {world->rank(), world->world_size(), [world](const std::string& mine) {
            return world->all_gather_bytes(mine, "exchanging the ranks' tokenized records");
          }};
}

}  // namespace trainer::distributed
