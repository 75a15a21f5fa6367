// The end of the memory ladder: moving a run to another device (see device_move.h).
#include "train/device_move.h"

#include <chrono>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include "memory/cpu_budget.h"
#include "memory/policy.h"
#include "models/module.h"
#include "train/optim/optimizer.h"
#include "train/engine/attempts.h"

namespace trainer {

int64_t move_parameters(const std::vector<Module*>& modules, const c10::Device& device) {
  at::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> moved;
  int64_t bytes = 0;
  for (Module* module : modules) {
    if (module == nullptr) continue;
    module->for_each_parameter([&](const std::string&, at::Tensor& p) {
      if (!p.defined() || !moved.insert(p.unsafeGetTensorImpl()).second) return;
      const at::Tensor grad = p.grad();
      if (grad.defined()) p.mutable_grad() = at::Tensor();
      // set_data keeps the Tensor (and its requires_grad) and swaps what it holds, as Module.to() does in PyTorch.
      p.set_data(p.detach().to(device, /*non_blocking=*/false, /*copy=*/true));
      if (grad.defined()) p.mutable_grad() = grad.to(device, /*non_blocking=*/false, /*copy=*/true);
      bytes += static_cast<int64_t>(p.nbytes());
    });
  }
  return bytes;
}

DeviceLadder::DeviceLadder(const Config& config, const c10::Device& start) : config_(config), start_(start) {}

std::optional<std::pair<c10::Device, std::string>> DeviceLadder::other_gpu(const c10::Device& current,
                                                                           std::string& why_not) const {
  if (config_.device.type != "auto") {
    why_not = "device.type=" + config_.device.type + " names the device (only device.type=auto moves between GPUs)";
    return std::nullopt;
  }
  if (current.is_cpu()) {
    why_not = "the run is on the CPU";
    return std::nullopt;
  }
  if (!at::accelerator::getAccelerator(false).has_value() || at::accelerator::deviceCount() < 2) {
    why_not = "no other GPU is visible";
    return std::nullopt;
  }
  // What the current device gives the run: its free memory plus what the run holds (cached included), within
  // memory.limit on the device it was set for.
  const auto current_free = at::accelerator::getMemoryInfo(current.index()).first;
  const auto stats = at::accelerator::getDeviceStats(current.index());
  int64_t room = static_cast<int64_t>(current_free) + stats.reserved_bytes[0].current;
  if (current == start_ && config_.memory.limit.bytes > 0)
    room = std::min(room, static_cast<int64_t>(config_.memory.limit.bytes));
  std::optional<c10::DeviceIndex> best;
  std::size_t best_free = 0, best_total = 0;
  for (c10::DeviceIndex i = 0; i < at::accelerator::deviceCount(); ++i) {
    if (i == current.index()) continue;
    const auto [free, total] = at::accelerator::getMemoryInfo(i);
    if (!best || free > best_free) {
      best = i;
      best_free = free;
      best_total = total;
    }
  }
  at::accelerator::setDeviceIndex(current.index());  // getMemoryInfo may have changed the current one
  const c10::Device device(current.type(), *best);
  if (static_cast<int64_t>(best_free) <= room) {
    why_not = "no other GPU has more free memory than the " + human_bytes(static_cast<double>(room)) + " " +
              current.str() + " gives the run (the most: " + human_bytes(static_cast<double>(best_free)) + " on " +
              device.str() + ")";
    return std::nullopt;
  }
  return std::pair{device, device.str() + " (" + human_bytes(static_cast<double>(best_free)) + " free of " +
                               human_bytes(static_cast<double>(best_total)) + ")"};
}

std::optional<c10::Device> DeviceLadder::move(int64_t step, const c10::Device& current, RunOnDevice run,
                                              MemoryPolicy& policy, const std::string& why) {
  not_made_.clear();
  for (const auto& name : config_.memory.escalation) {
    if (!is_device_escalation(name) || policy.escalated(name)) continue;
    std::optional<c10::Device> target;
    std::string description, why_not;
    if (name == "move_to_other_gpu") {
      if (auto found = other_gpu(current, why_not)) std::tie(target, description) = *found;
    } else if (!config_.device.allow_cpu_fallback) {
      why_not = "device.allow_cpu_fallback=false";
    } else if (current.is_cpu() && cpu_memory_stats().limit == 0) {
      why_not = "the run is on the CPU already, with no memory.limit to lift";
    } else {
      target = c10::Device(c10::kCPU);
      // On a CPU-only machine the CPU under memory.limit stands for a smaller device; the move lifts the limit.
      description = current.is_cpu() ? "the CPU without memory.limit" : "the CPU";
    }
    if (!target) {
      not_made_.emplace_back(name, why_not);
      continue;
    }
    const std::string reason = why.substr(0, why.find('\n')).substr(0, 240);
    spdlog::warn("!!! MOVING THE RUN ({}): step {} does not fit on {} even at the micro-batch floor with every "
                 "escalation used ({}). Moving weights, gradients and optimizer state to {} and running step {} again "
                 "there{}. !!!",
                 name, step, current.str(), reason, description, step,
                 target->is_cpu() ? "; training on the CPU is slow" : "");
    const auto started = std::chrono::steady_clock::now();
    if (target->is_cpu()) set_cpu_budget_limit(0);  // memory.limit was the budget of the device being left
    else at::accelerator::setDeviceIndex(target->index());
    const int64_t weights = move_parameters({&run.model, run.lora}, *target);
    run.optimizer.move_to(*target);
    release_cached_memory();
    ++moves_;
    policy.record_device_move(step, name, current.str() + " -> " + target->str());
    spdlog::warn("moved {} of parameters and {} of optimizer state from {} to {} in {:.2f} s; step {} runs again there",
                 human_bytes(static_cast<double>(weights)), human_bytes(static_cast<double>(run.optimizer.state_bytes())),
                 current.str(), target->str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), step);
    return target;
  }
  return std::nullopt;
}

std::string DeviceLadder::why_not_moved() const {
  std::string out;
  for (const auto& [name, why] : not_made_) out += (out.empty() ? "" : "; ") + name + " not made: " + why;
  return out;
}

}  // namespace trainer
