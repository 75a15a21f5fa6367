// Choosing the device to run on from device.* in the config, through LibTorch's device-generic accelerator API,
// so the same code runs on the CPU build (CI) and the CUDA build (users).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

#include "trainer/config.h"

namespace trainer {

struct ResolvedDevice {
  c10::Device device{c10::kCPU};
  std::string description;  // "cpu", "cuda:0 (NVIDIA ..., 23.1 GiB free of 24 GiB)"
  bool fell_back_to_cpu = false;
};

// The accelerator LibTorch was built with and can see ("cuda", ...), or "none".
std::string accelerator_summary();

// Applies device.type / min_free_memory / wait_for_device / allow_cpu_fallback.
// Throws UsageError when the requested device cannot be had and CPU fallback is not allowed.
ResolvedDevice resolve_device(const DeviceConfig& config);

// Bytes allocated now and at the peak on `device`: the CPU budget allocator's counts on the CPU, the accelerator
// allocator's statistics elsewhere.
struct MemoryNow {
  int64_t allocated = 0, peak = 0;
};
MemoryNow memory_now(const c10::Device& device);
// Starts the peak of memory_now anew.
void reset_peak(const c10::Device& device);

}  // namespace trainer
