// Data parallelism for one training step (see data_parallel.h).
#include "distributed/data_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

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

StepSync::Outcome DataParallel::agree(bool fit, int64_t largest_part) {
  // One message: per rank a 0/1 "did not fit", then the largest micro-batch; the maximum of each over the ranks.
  const int world = communicator_.world_size();
  std::vector<int64_t> values(static_cast<std::size_t>(world) + 1, 0);
  values[static_cast<std::size_t>(communicator_.rank())] = fit ? 0 : 1;
  values.back() = largest_part;
  const auto agreed = communicator_.all_reduce_max(values);
  Outcome outcome;
  // Not all fit: the attempt is dropped, and the flattening buffer with it (the retry's forward needs the room).
  for (int r = 0; r < world; ++r)
    if (agreed[static_cast<std::size_t>(r)]) scratch_ = at::Tensor();
  outcome.largest_part = agreed.back();
  for (int r = 0; r < world; ++r)
    if (agreed[static_cast<std::size_t>(r)]) {
      outcome.all_fit = false;
      outcome.failed_ranks += (outcome.failed_ranks.empty() ? "" : ", ") + std::to_string(r);
    }
  return outcome;
}

void DataParallel::prepare() {
  at::NoGradGuard no_grad;
  // A rank whose share left a parameter unused (or that had no examples) contributes zeros.
  for (auto& p : parameters_)
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
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

void add_rank_figures(Communicator* world, RunSummary& summary) {
  if (!world) return;
  const auto size = static_cast<std::size_t>(world->world_size());
  const auto rank = static_cast<std::size_t>(world->rank());
  // Read before the collective, so every rank reports its time up to the same point.
  const double seconds = world->communication_seconds();
  std::vector<double> slots(2 * size, 0.0);
  slots[2 * rank] = static_cast<double>(summary.memory_peak);  // exact: peaks are far below 2^53 bytes
  slots[2 * rank + 1] = seconds;
  const auto all = world->all_reduce_sum(slots, "gathering every rank's figures for the summary");
  summary.ranks.resize(size);
  for (std::size_t r = 0; r < size; ++r) summary.ranks[r] = {static_cast<int64_t>(all[2 * r]), all[2 * r + 1]};
  summary.backend = world->backend_name();
}

}  // namespace trainer::distributed
