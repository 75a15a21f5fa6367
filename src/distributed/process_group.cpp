// The c10d rendezvous and backend (see process_group.h). Compiled with USE_C10D_GLOO and the gloo stand-in headers
// (src/distributed/gloo_standin): the wheel's libtorch_cpu carries the Gloo backend; NCCL only in CUDA builds with
// TRAINER_WITH_NCCL.
#include "distributed/process_group.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if TRAINER_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace trainer::distributed {
namespace {

Getenv or_getenv(const Getenv& get) {
  if (get) return get;
  return [](const char* name) { return std::getenv(name); };
}

// An integer variable in [low, high]; UsageError naming it otherwise.
int integer_variable(const Getenv& get, const char* name, int low, int high, const std::string& hint) {
  const char* text = get(name);
  if (!text || !*text) throw UsageError(std::string(name) + " is not set", hint);
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  if (errno || *end || value < low || value > high)
    throw UsageError(std::string(name) + "=" + text + " is not an integer from " + std::to_string(low) + " to " +
                         std::to_string(high),
                     hint);
  return static_cast<int>(value);
}

const char* kLaunchHint =
    "launch the ranks with torchrun, `trainer launch --nproc-per-node N -- ...`, or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT for every process (docs/distributed.md)";

}  // namespace

std::optional<Environment> environment_from_variables(const Getenv& getenv_) {
  const Getenv get = or_getenv(getenv_);
  const char* world = get("WORLD_SIZE");
  const char* rank = get("RANK");
  if ((!world || !*world) && (!rank || !*rank)) return std::nullopt;
  if (!world || !*world) throw UsageError("RANK is set but WORLD_SIZE is not", kLaunchHint);
  Environment e;
  e.world_size = integer_variable(get, "WORLD_SIZE", 1, 1 << 20, kLaunchHint);
  if (!rank || !*rank) {
    if (e.world_size == 1) return std::nullopt;
    throw UsageError("WORLD_SIZE=" + std::string(world) + " is set but RANK is not", kLaunchHint);
  }
  e.rank = integer_variable(get, "RANK", 0, e.world_size - 1, "RANK must be below WORLD_SIZE");
  if (e.world_size == 1) return std::nullopt;
  const char* local = get("LOCAL_RANK");
  e.local_world_size = e.world_size;
  if (const char* lws = get("LOCAL_WORLD_SIZE"); lws && *lws)
    e.local_world_size = integer_variable(get, "LOCAL_WORLD_SIZE", 1, e.world_size, "at most WORLD_SIZE");
  e.local_rank = local && *local ? integer_variable(get, "LOCAL_RANK", 0, e.local_world_size - 1,
                                                    "LOCAL_RANK must be below LOCAL_WORLD_SIZE (or WORLD_SIZE)")
                                 : e.rank % e.local_world_size;
  const char* addr = get("MASTER_ADDR");
  if (!addr || !*addr) throw UsageError("MASTER_ADDR is not set (WORLD_SIZE=" + std::to_string(e.world_size) + ")",
                                        kLaunchHint);
  e.master_addr = addr;
  e.master_port = integer_variable(get, "MASTER_PORT", 1, 65535, kLaunchHint);
  const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
  e.agent_store = agent && std::string(agent) == "True";
  if (const char* restarts = get("TORCHELASTIC_RESTART_COUNT"); restarts && *restarts) e.restart_count = restarts;
  return e;
}

namespace {

// Signs of life: every rank's own thread adds 1 to the store's "alive/<rank>" every kBeat, on its own connection
// to the store (short timeout), beside whatever the rank's main thread is doing or waiting for. A rank that was
// killed or stopped (SIGSTOP, a debugger, a swapped-out machine) stops counting; a rank blocked in a collective
// keeps counting. After a collective fails, the counters that did not move for kWatch name the culprits.
constexpr auto kBeat = std::chrono::milliseconds(500);
constexpr auto kWatch = std::chrono::milliseconds(3000);
constexpr auto kWatchStoreTimeout = std::chrono::milliseconds(5000);

std::string alive_key(int rank) { return "alive/" + std::to_string(rank); }

}  // namespace

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  c10::Device device{c10::kCPU};
  std::string name;
  // The heartbeat's connection to the store (and the diagnosis's after a failure), with a short timeout.
  c10::intrusive_ptr<c10d::Store> watch_store;
  std::thread heartbeat;
  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;
};

Communicator::Communicator(Environment environment, std::unique_ptr<Impl> impl)
    : environment_(std::move(environment)), impl_(std::move(impl)) {}

Communicator::~Communicator() {
  {
    const std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
}

// Starts the heartbeat thread (see kBeat). It ends quietly when the store goes away (its host left at the end).
void Communicator::start_heartbeat(Impl& impl, const Environment& e) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(e.master_port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = kWatchStoreTimeout;
  impl.watch_store = c10::make_intrusive<c10d::PrefixStore>(
      "trainer/" + e.restart_count, c10::make_intrusive<c10d::TCPStore>(e.master_addr, options));
  impl.heartbeat = std::thread([&impl, key = alive_key(e.rank)] {
    std::unique_lock<std::mutex> lock(impl.mutex);
    while (!impl.stopping) {
      lock.unlock();
      try {
        impl.watch_store->add(key, 1);
      } catch (const std::exception&) {
        return;  // the store is gone: nobody will ask any more
      }
      lock.lock();
      impl.wake.wait_for(lock, kBeat, [&] { return impl.stopping; });
    }
  });
}

std::unique_ptr<Communicator> Communicator::connect(const Environment& e, const c10::Device& device,
                                                    std::chrono::seconds timeout) {
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(e.master_port);
  options.numWorkers = static_cast<std::size_t>(e.world_size);
  options.isServer = e.rank == 0 && !e.agent_store;
  options.waitWorkers = !e.agent_store;
  options.multiTenant = true;
  options.timeout = timeout;
  const std::string where = e.master_addr + ":" + std::to_string(e.master_port);
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>(e.master_addr, options);
  } catch (const c10::Error& error) {
    const std::string what = error.what_without_backtrace();
    if (options.isServer && (what.find("in use") != std::string::npos || what.find("EADDRINUSE") != std::string::npos))
      throw UsageError("MASTER_PORT=" + std::to_string(e.master_port) + ": rank 0 cannot serve the rendezvous on " +
                           where + ", the port is in use: " + what.substr(0, 300),
                       "pick a free port (trainer launch --master-port P, torchrun --master-port P)");
    throw UsageError("rank " + std::to_string(e.rank) + " of " + std::to_string(e.world_size) +
                         ": the rendezvous at MASTER_ADDR:MASTER_PORT=" + where + " failed within " +
                         std::to_string(timeout.count()) + " s (distributed.timeout_s): " + what.substr(0, 300),
                     "start every rank with the same MASTER_ADDR and MASTER_PORT, and rank 0 among them");
  }
  impl->store = c10::make_intrusive<c10d::PrefixStore>("trainer/" + e.restart_count, impl->store);
  try {
    if (device.is_cuda()) {
#if TRAINER_WITH_NCCL
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      impl->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl->store, e.rank, e.world_size, nccl_options);
      impl->name = "nccl";
#else
      throw UsageError("distributed training on " + device.str() + " needs NCCL, and this build of trainer has none",
                       "build trainer against a CUDA LibTorch with NCCL (TRAINER_WITH_NCCL), or run on the CPU");
#endif
    } else {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create_default(timeout);
      impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, e.rank, e.world_size, gloo_options);
      impl->name = "gloo";
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& error) {  // c10::Error, or Gloo's own exceptions
    throw CommunicationError("rank " + std::to_string(e.rank) + ": the " + (device.is_cuda() ? "NCCL" : "Gloo") +
                                 " backend could not connect the ranks: " + std::string(error.what()).substr(0, 400),
                             "on one machine set GLOO_SOCKET_IFNAME=lo; across machines the interface that reaches "
                             "MASTER_ADDR (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)");
  }
  try {
    start_heartbeat(*impl, e);
  } catch (const std::exception& error) {
    throw CommunicationError("rank " + std::to_string(e.rank) + ": cannot open a second connection to the store at " +
                                 where + ": " + std::string(error.what()).substr(0, 300),
                             "start every rank with the same MASTER_ADDR and MASTER_PORT");
  }
  return std::unique_ptr<Communicator>(new Communicator(e, std::move(impl)));
}

std::vector<int> Communicator::unresponsive_ranks(bool& store_unreachable) const {
  store_unreachable = false;
  auto& store = *impl_->watch_store;
  const int world = world_size();
  try {
    std::vector<int64_t> before(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) before[static_cast<std::size_t>(r)] = store.add(alive_key(r), 0);
    std::this_thread::sleep_for(kWatch);
    std::vector<int> silent;
    for (int r = 0; r < world; ++r)
      if (r != rank() && store.add(alive_key(r), 0) == before[static_cast<std::size_t>(r)]) silent.push_back(r);
    return silent;
  } catch (const std::exception&) {
    store_unreachable = true;  // the store's host (rank 0, or torchrun's agent) is gone or stopped
    return environment_.agent_store || rank() == 0 ? std::vector<int>{} : std::vector<int>{0};
  }
}

std::string Communicator::backend_name() const { return impl_->name; }

CommunicationError Communicator::collective_failed(const char* what, const std::string& cause) const {
  // Which rank: those whose heartbeat stopped (killed, stopped, or its machine gone).
  bool store_unreachable = false;
  const auto silent = unresponsive_ranks(store_unreachable);
  std::string culprit;
  if (!silent.empty()) {
    std::string list;
    for (const int r : silent) list += (list.empty() ? "" : ", ") + std::to_string(r);
    culprit = (silent.size() == 1 ? "rank " : "ranks ") + list + " died or hangs (" +
              (store_unreachable ? std::string("the rendezvous store it serves does not answer")
                                 : "no sign of life for " +
                                       std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kWatch).count()) +
                                       " s") +
              ")";
  } else if (store_unreachable) {
    culprit = "the rendezvous store at " + environment_.master_addr + ":" + std::to_string(environment_.master_port) +
              " does not answer (its host died or hangs)";
  } else {
    culprit = "another rank failed, hung past distributed.timeout_s, or runs something else";
  }
  return CommunicationError("rank " + std::to_string(rank()) + ": " + what + " across " +
                                std::to_string(world_size()) + " ranks failed: " + culprit + ": " +
                                cause.substr(0, 400),
                            "the first error of the other ranks names the cause; a resume continues from the last "
                            "complete checkpoint (under torchrun --max-restarts, --resume-if-present does it)");
}

template <class F>
void Communicator::timed(const char* what, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& error) {
    throw collective_failed(what, error.what_without_backtrace());
  } catch (const std::exception& error) {  // Gloo's own (gloo::IoException: a peer closed its connection)
    throw collective_failed(what, error.what());
  }
  communication_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Communicator::broadcast(std::vector<at::Tensor>& tensors) {
  timed("broadcasting the parameters from rank 0", [&] {
    for (auto& tensor : tensors) {
      std::vector<at::Tensor> one{tensor};
      impl_->backend->broadcast(one, c10d::BroadcastOptions{})->wait();
    }
  });
}

namespace {

// `parts` flattened into one 1-D tensor: a slice of `scratch` when it has the dtype and room, else a new tensor.
at::Tensor flatten_into(const std::vector<at::Tensor>& parts, int64_t numel, const at::Tensor& scratch) {
  if (scratch.defined() && scratch.scalar_type() == parts.front().scalar_type() && scratch.numel() >= numel) {
    at::Tensor flat = scratch.narrow(0, 0, numel);
    at::cat_out(flat, parts);
    return flat;
  }
  return at::cat(parts);
}

// Runs `collective(bucket, root)` over buckets of `tensors`: those with one root (roots[i]; all 0 when `roots` is
// empty) and dtype, in order, up to `bucket_bytes` each (a larger tensor alone). A lone contiguous tensor goes as
// it is; several are flattened into one buffer and copied back after (a broadcast's and a reduce's result both
// land in the buffer).
template <class Collective>
void by_root_buckets(const std::vector<at::Tensor>& tensors, const std::vector<int>& roots, int64_t bucket_bytes,
                     int world, const at::Tensor& scratch, Collective&& collective) {
  for (int root = 0; root < (roots.empty() ? 1 : world); ++root) {
    std::vector<std::size_t> mine;
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (roots.empty() || roots[i] == root) mine.push_back(i);
    std::size_t begin = 0;
    while (begin < mine.size()) {
      std::size_t end = begin;
      int64_t bytes = 0, numel = 0;
      const auto dtype = tensors[mine[begin]].scalar_type();
      while (end < mine.size() && tensors[mine[end]].scalar_type() == dtype &&
             (end == begin || bytes + static_cast<int64_t>(tensors[mine[end]].nbytes()) <= bucket_bytes)) {
        bytes += static_cast<int64_t>(tensors[mine[end]].nbytes());
        numel += tensors[mine[end]].numel();
        ++end;
      }
      if (end == begin + 1 && tensors[mine[begin]].is_contiguous()) {
        std::vector<at::Tensor> one{tensors[mine[begin]]};
        collective(one, root);
      } else {
        std::vector<at::Tensor> flat_parts;
        for (std::size_t k = begin; k < end; ++k) flat_parts.push_back(tensors[mine[k]].reshape({-1}));
        std::vector<at::Tensor> bucket{flatten_into(flat_parts, numel, scratch)};
        collective(bucket, root);
        int64_t offset = 0;
        for (std::size_t k = begin; k < end; ++k) {
          at::Tensor t = tensors[mine[k]];  // a handle: copying into it writes the caller's tensor
          t.copy_(bucket[0].narrow(0, offset, t.numel()).view(t.sizes()));
          offset += t.numel();
        }
      }
      begin = end;
    }
  }
}

}  // namespace

void Communicator::all_reduce_sum(const std::vector<at::Tensor>& tensors, int64_t bucket_bytes,
                                  const at::Tensor& scratch) {
  timed("all-reducing the gradients", [&] {
    by_root_buckets(tensors, {}, bucket_bytes, world_size(), scratch, [&](std::vector<at::Tensor>& bucket, int) {
      impl_->backend->allreduce(bucket, c10d::AllreduceOptions{})->wait();
    });
  });
}

void Communicator::reduce_sum_to(const std::vector<at::Tensor>& tensors, const std::vector<int>& roots,
                                 int64_t bucket_bytes, const at::Tensor& scratch) {
  timed("summing the gradients to their owners", [&] {
    by_root_buckets(tensors, roots, bucket_bytes, world_size(), scratch, [&](std::vector<at::Tensor>& bucket, int root) {
      c10d::ReduceOptions options;
      options.rootRank = root;
      impl_->backend->reduce(bucket, options)->wait();
    });
  });
}

void Communicator::broadcast_from(const std::vector<at::Tensor>& tensors, const std::vector<int>& roots,
                                  int64_t bucket_bytes, const at::Tensor& scratch) {
  timed("broadcasting the updated parameters from their owners", [&] {
    by_root_buckets(tensors, roots, bucket_bytes, world_size(), scratch, [&](std::vector<at::Tensor>& bucket, int root) {
      c10d::BroadcastOptions options;
      options.rootRank = root;
      impl_->backend->broadcast(bucket, options)->wait();
    });
  });
}

struct Communicator::Pending {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> tensors;  // kept alive until the collective is waited for
  const char* what = "summing the gradients (overlapped with backward)";
};

std::shared_ptr<Communicator::Pending> Communicator::start_sum(const at::Tensor& flat, int root) {
  auto pending = std::make_shared<Pending>();
  pending->tensors = {flat};
  timed("summing the gradients (overlapped with backward)", [&] {
    if (root < 0) {
      pending->work = impl_->backend->allreduce(pending->tensors, c10d::AllreduceOptions{});
    } else {
      c10d::ReduceOptions options;
      options.rootRank = root;
      pending->work = impl_->backend->reduce(pending->tensors, options);
    }
  });
  return pending;
}

bool Communicator::finished(Pending& pending) {
  bool done = false;
  timed(pending.what, [&] { done = pending.work->isCompleted(); });
  return done;
}

void Communicator::wait(Pending& pending) {
  timed(pending.what, [&] { pending.work->wait(); });
}

std::vector<int64_t> Communicator::all_reduce_max(const std::vector<int64_t>& values) {
  std::vector<at::Tensor> t{at::tensor(values, at::kLong).to(impl_->device)};
  timed("agreeing on the step's outcome", [&] {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    impl_->backend->allreduce(t, options)->wait();
  });
  const at::Tensor cpu = t[0].cpu();
  return {cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel()};
}

void Communicator::all_reduce_max_in_place(at::Tensor& values, const char* what) {
  std::vector<at::Tensor> t{values};
  timed(what, [&] {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    impl_->backend->allreduce(t, options)->wait();
  });
}

void Communicator::all_gather_into(at::Tensor& full, const at::Tensor& shard, const char* what) {
  at::Tensor input = shard;
  timed(what, [&] { impl_->backend->_allgather_base(full, input, c10d::AllgatherOptions{})->wait(); });
}

std::shared_ptr<Communicator::Pending> Communicator::start_all_gather(at::Tensor& full, const at::Tensor& shard,
                                                                    const char* what) {
  auto pending = std::make_shared<Pending>();
  pending->tensors = {full, shard};
  pending->what = what;
  timed(what, [&] { pending->work = impl_->backend->_allgather_base(full, pending->tensors[1], c10d::AllgatherOptions{}); });
  return pending;
}

void Communicator::reduce_scatter_sum(at::Tensor& shard, const at::Tensor& full, const char* what) {
  at::Tensor input = full;
  timed(what, [&] { impl_->backend->_reduce_scatter_base(shard, input, c10d::ReduceScatterOptions{})->wait(); });
}

double Communicator::all_reduce_sum(double value) {
  std::vector<at::Tensor> t{at::tensor({value}, at::kDouble).to(impl_->device)};
  timed("summing the loss", [&] { impl_->backend->allreduce(t, c10d::AllreduceOptions{})->wait(); });
  return t[0].cpu().item<double>();
}

std::vector<double> Communicator::all_reduce_sum(const std::vector<double>& values, const char* what) {
  std::vector<at::Tensor> t{at::tensor(values, at::kDouble).to(impl_->device)};
  timed(what, [&] { impl_->backend->allreduce(t, c10d::AllreduceOptions{})->wait(); });
  const at::Tensor cpu = t[0].cpu();
  return {cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel()};
}

std::vector<std::string> Communicator::all_gather_bytes(const std::string& mine, const char* what) {
  const auto world = static_cast<std::size_t>(world_size());
  std::vector<std::string> out(world);
  timed(what, [&] {
    std::vector<int64_t> sizes(world, 0);
    sizes[static_cast<std::size_t>(rank())] = static_cast<int64_t>(mine.size());
    std::vector<at::Tensor> size_tensor{at::tensor(sizes, at::kLong).to(impl_->device)};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    impl_->backend->allreduce(size_tensor, max)->wait();
    const at::Tensor all_sizes = size_tensor[0].cpu();
    const int64_t* size = all_sizes.data_ptr<int64_t>();
    const int64_t longest = std::max<int64_t>(1, *std::max_element(size, size + world));
    at::Tensor input = at::zeros({longest}, at::kByte);
    std::memcpy(input.data_ptr<uint8_t>(), mine.data(), mine.size());
    std::vector<at::Tensor> inputs{input.to(impl_->device)};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (std::size_t r = 0; r < world; ++r) outputs[0].push_back(at::empty({longest}, inputs[0].options()));
    impl_->backend->allgather(outputs, inputs, c10d::AllgatherOptions{})->wait();
    for (std::size_t r = 0; r < world; ++r) {
      const at::Tensor bytes = outputs[0][r].cpu();
      out[r].assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<std::size_t>(size[r]));
    }
  });
  return out;
}

void Communicator::barrier() {
  timed("waiting for every rank (barrier)", [&] { impl_->backend->barrier(c10d::BarrierOptions{})->wait(); });
}

void Communicator::check_same_config(const std::string& config_json, const std::vector<std::string>& ignored) {
  const std::string key = "config/" + std::to_string(rank());
  std::string differences;
  timed("comparing the configs", [&] {
    impl_->store->set(key, std::vector<uint8_t>(config_json.begin(), config_json.end()));
    const auto first = impl_->store->get("config/0");
    const std::string reference(first.begin(), first.end());
    for (int r = 1; r < world_size(); ++r) {
      const auto other = impl_->store->get("config/" + std::to_string(r));
      const auto keys = differing_keys(reference, std::string(other.begin(), other.end()), ignored);
      if (keys.empty()) continue;
      std::string list;
      for (const auto& k : keys) list += (list.empty() ? "" : ", ") + k;
      differences += "\n  rank " + std::to_string(r) + " differs from rank 0 in: " + list;
    }
    // Nobody leaves (rank 0 hosts the store) before every rank has read what it compares.
    impl_->backend->barrier(c10d::BarrierOptions{})->wait();
  });
  if (!differences.empty())
    throw UsageError("the ranks were started with different configurations:" + differences,
                     "start every rank with the same --config and --set options (per-machine keys that may "
                     "differ: memory.limit, device.*)");
}

std::vector<std::string> differing_keys(const std::string& a_json, const std::string& b_json,
                                        const std::vector<std::string>& ignored) {
  const auto a = nlohmann::json::parse(a_json).flatten();
  const auto b = nlohmann::json::parse(b_json).flatten();
  std::set<std::string> keys;
  auto name = [](const std::string& pointer) {  // "/training/batch_size" -> "training.batch_size"
    std::string out = pointer.substr(1);
    for (auto& c : out)
      if (c == '/') c = '.';
    const auto dot = out.find('.');
    const auto second = dot == std::string::npos ? std::string::npos : out.find('.', dot + 1);
    return second == std::string::npos ? out : out.substr(0, second);  // list items name their key
  };
  auto is_ignored = [&](const std::string& key) {
    for (const auto& i : ignored)
      if (key == i || (i.ends_with(".*") && key.starts_with(i.substr(0, i.size() - 1)))) return true;
    return false;
  };
  for (const auto& [pointer, value] : a.items())
    if (!b.contains(pointer) || b[pointer] != value) keys.insert(name(pointer));
  for (const auto& [pointer, value] : b.items())
    if (!a.contains(pointer)) keys.insert(name(pointer));
  std::vector<std::string> out;
  for (const auto& key : keys)
    if (!is_ignored(key)) out.push_back(key);
  return out;
}

int share_cpu_threads(int local_ranks) {
  if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp && *omp) return 0;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, cores / std::max(1, local_ranks));
  at::set_num_threads(threads);
  return threads;
}

}  // namespace trainer::distributed
