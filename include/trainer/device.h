// Choosing the device to run on from device.* in the config, through LibTorch's device-generic accelerator API,
// so the same code runs on the CPU build (CI) and the CUDA build (users).
#pragma once

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

}  // namespace trainer
