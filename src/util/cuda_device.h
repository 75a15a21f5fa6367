// What the lower layers ask of a CUDA device: the raw handle of its current stream (for trainer's own kernels and
// other libraries' kernels, bitsandbytes') and whether ATen's flash attention runs on it. Like memory/cuda_extras.h,
// behind the one compile-time switch TRAINER_WITH_CUDA: in a CPU build the stream is refused and flash attention
// is never available. Here, below models/ and util's counter_rng, because they call it (docs/architecture.md#layers).
#pragma once

#include <c10/core/Device.h>

namespace trainer {

// Whether ATen's flash-attention kernels run on `device`: a CUDA device of compute capability 8.0 or newer
// (Ampere, Ada, Hopper, Blackwell). False in a CPU build and for any other device.
bool flash_attention_device(const c10::Device& device);

// The raw handle (cudaStream_t) of `device`'s current stream, for kernels of other libraries that take one
// (bitsandbytes'). Throws UsageError in a CPU build.
void* current_cuda_stream(const c10::Device& device);

}  // namespace trainer
