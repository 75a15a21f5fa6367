// Device selection over at::accelerator: one source for CPU-only and CUDA builds of LibTorch.
#include <chrono>
#include <optional>
#include <thread>

#include <ATen/DeviceAccelerator.h>
#include <spdlog/spdlog.h>

#include "memory/cpu_budget.h"
#include "memory/cuda_extras.h"
#include "trainer/device.h"

namespace trainer {
namespace {

struct Candidate {
  c10::DeviceIndex index = 0;
  std::size_t free = 0;
  std::size_t total = 0;
};

// The device of `type` with the most free memory that meets the minimum, or nothing.
std::optional<Candidate> best_device(c10::DeviceType type, std::optional<c10::DeviceIndex> only,
                                     std::uint64_t min_free) {
  std::optional<Candidate> best;
  const auto count = at::accelerator::deviceCount();
  for (c10::DeviceIndex i = 0; i < count; ++i) {
    if (only && *only != i) continue;
    at::accelerator::setDeviceIndex(i);
    const auto [free, total] = at::accelerator::getMemoryInfo(i);
    if (free < min_free) continue;
    if (!best || free > best->free) best = Candidate{i, free, total};
  }
  (void)type;
  return best;
}

}  // namespace

std::string accelerator_summary() {
  const auto type = at::accelerator::getAccelerator(false);
  if (!type) return cuda_extras_available() ? "none (a CUDA build of LibTorch, but no CUDA device or driver)"
                                            : "none (CPU build of LibTorch)";
  return c10::DeviceTypeName(*type, /*lower_case=*/true) + " x " + std::to_string(at::accelerator::deviceCount());
}

ResolvedDevice resolve_device(const DeviceConfig& config) {
  if (config.type == "cpu") return {c10::Device(c10::kCPU), "cpu", false};

  const bool wants_accelerator = config.type != "auto";
  std::optional<c10::DeviceIndex> only;
  if (auto colon = config.type.find(':'); colon != std::string::npos)
    only = static_cast<c10::DeviceIndex>(std::stoi(config.type.substr(colon + 1)));

  const auto type = at::accelerator::getAccelerator(false);
  const bool has_cuda = type && *type == c10::kCUDA && at::accelerator::deviceCount() > 0;
  std::string why_not;
  if (!has_cuda) {
    // A CUDA build on a machine without a GPU or driver may report no accelerator at all: say which it is.
    why_not = type || cuda_extras_available() ? "LibTorch sees no CUDA device (no GPU, or no NVIDIA driver)"
                                              : "this trainer is built with a CPU-only LibTorch";
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(config.wait_timeout_s);
    while (true) {
      if (auto found = best_device(*type, only, config.min_free_memory.bytes)) {
        at::accelerator::setDeviceIndex(found->index);  // best_device left the last one it looked at current
        c10::Device device(c10::kCUDA, found->index);
        // Initialise the device's runtime and caching allocator now: LibTorch 2.11 raises "Allocator not
        // initialized for device" from memory statistics and caps asked for before the first allocation.
        (void)at::empty({1}, at::TensorOptions().dtype(at::kByte).device(device));
        return {device,
                device.str() + " (" + human_bytes(static_cast<double>(found->free)) + " free of " +
                    human_bytes(static_cast<double>(found->total)) + ")",
                false};
      }
      if (only && *only >= at::accelerator::deviceCount()) {
        why_not = "there is no device " + config.type + " (" + std::to_string(at::accelerator::deviceCount()) +
                  " visible)";
        break;
      }
      why_not = "no device has " + human_bytes(static_cast<double>(config.min_free_memory.bytes)) + " free";
      if (!config.wait_for_device || std::chrono::steady_clock::now() >= deadline) break;
      spdlog::info("waiting for a device: {}; next look in {:.0f} s", why_not, config.poll_interval_s);
      std::this_thread::sleep_for(std::chrono::duration<double>(config.poll_interval_s));
    }
  }

  if (!wants_accelerator && !has_cuda) return {c10::Device(c10::kCPU), "cpu (no accelerator)", false};
  if (config.allow_cpu_fallback) {
    spdlog::warn("!!! RUNNING ON THE CPU: device.type={} was asked for, but {}. Training will be slow. !!!",
                 config.type, why_not);
    return {c10::Device(c10::kCPU), "cpu (fallback: " + why_not + ")", true};
  }
  const bool cuda_build = type || cuda_extras_available();
  throw UsageError("device.type=" + config.type + " cannot be used: " + why_not,
                   std::string(cuda_build ? "check nvidia-smi and CUDA_VISIBLE_DEVICES, use device.type=cpu"
                                          : "use device.type=cpu, build against the CUDA build of torch "
                                            "(docs/building.md)") +
                       ", or set device.allow_cpu_fallback=true");
}

MemoryNow memory_now(const c10::Device& device) {
  if (device.is_cpu()) {
    const auto stats = cpu_memory_stats();
    return {stats.allocated, stats.peak};
  }
  const auto stats = at::accelerator::getDeviceStats(device.index());
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};
}

void reset_peak(const c10::Device& device) {
  if (device.is_cpu()) reset_cpu_peak();
  else at::accelerator::resetPeakStats(device.index());
}

}  // namespace trainer
