// The CUDA-only extras: capping the process's share of a GPU (memory.limit on a GPU) and allocator snapshots for
// pytorch.org/memory_viz (memory.snapshot_on_oom). They live in one file, cuda_extras.cpp, behind the one
// compile-time switch TRAINER_WITH_CUDA (set by cmake/Torch.cmake when the LibTorch found has CUDA); in a CPU build
// the functions say that they are unavailable and the CPU budget allocator plays the GPU's part. The device queries
// that models/ and util/ need (the current stream, flash attention) are in util/cuda_device.h, below them.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace trainer {

// Whether this build has the CUDA extras.
bool cuda_extras_available();

// Caps the caching allocator of `device` at `bytes` (a per-process memory fraction of the device's total), so a
// 24 GB card can be rehearsed on a larger one: past the cap, allocations raise c10::OutOfMemoryError.
// Throws UsageError in a CPU build or for a cap above the device's memory.
void cap_device_memory(const c10::Device& device, int64_t bytes);

// Records every allocation and free with its C++ context from now on (memory.snapshot_on_oom), so a snapshot
// shows how memory was used up to an out-of-memory error.
void start_recording_allocations();

// Writes the allocator's snapshot (with the recorded history) to `path` as the pickle memory_viz opens.
// Returns false in a CPU build or when recording was not started.
bool dump_allocator_snapshot(const std::string& path);

}  // namespace trainer
