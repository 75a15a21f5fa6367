// The CUDA-only extras (see cuda_extras.h). The only file of trainer that includes CUDA headers, and only when
// TRAINER_WITH_CUDA is 1.
#include "memory/cuda_extras.h"

#include <fstream>

#include "trainer/config.h"
#include "trainer/errors.h"

#if TRAINER_WITH_CUDA
#include <ATen/DeviceAccelerator.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace trainer {

#if TRAINER_WITH_CUDA

namespace {
bool recording = false;
}

bool cuda_extras_available() { return true; }

void cap_device_memory(const c10::Device& device, int64_t bytes) {
  if (!device.is_cuda()) throw UsageError("memory.limit: cannot cap " + device.str() + " (not a CUDA device)");
  const c10::DeviceIndex index = device.has_index() ? device.index() : at::accelerator::getDeviceIndex();
  const auto total = at::accelerator::getMemoryInfo(index).second;
  const double fraction = static_cast<double>(bytes) / static_cast<double>(total);
  if (fraction > 1.0)
    throw UsageError("memory.limit " + human_bytes(static_cast<double>(bytes)) + " is more than " + device.str() +
                         " has (" + human_bytes(static_cast<double>(total)) + ")",
                     "lower memory.limit, or set it to 0 to use the whole device");
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, index);
}

void start_recording_allocations() {
  // Allocation and free events with C++ stacks, up to 100k entries (a ring: the newest are kept).
  torch::cuda::_record_memory_history(/*enabled=*/true, /*record_context=*/true, /*trace_alloc_max_entries=*/100000,
                                      /*trace_alloc_record_context=*/true, /*record_cpp_context=*/true);
  recording = true;
}

bool dump_allocator_snapshot(const std::string& path) {
  if (!recording) return false;
  std::ofstream(path, std::ios::binary) << torch::cuda::_memory_snapshot_pickled();
  return true;
}

#else  // a CPU build of LibTorch: no CUDA headers, nothing to cap or record

bool cuda_extras_available() { return false; }

void cap_device_memory(const c10::Device& device, int64_t /*bytes*/) {
  throw UsageError("memory.limit on " + device.str() + " needs a CUDA build of trainer; this one is built with a "
                   "CPU-only LibTorch",
                   "on the CPU, memory.limit is the budget allocator's cap; see docs/building.md");
}

void start_recording_allocations() {}

bool dump_allocator_snapshot(const std::string& /*path*/) { return false; }

#endif

}  // namespace trainer
