// The CUDA device queries of the lower layers (see cuda_device.h). Besides memory/cuda_extras.cpp, the only file of
// trainer that includes CUDA headers, and only when TRAINER_WITH_CUDA is 1.
#include "util/cuda_device.h"

#include "trainer/errors.h"

#if TRAINER_WITH_CUDA
#include <ATen/DeviceAccelerator.h>
#include <ATen/cuda/CUDAContext.h>
#endif

namespace trainer {

#if TRAINER_WITH_CUDA

bool flash_attention_device(const c10::Device& device) {
  if (!device.is_cuda()) return false;
  const c10::DeviceIndex index = device.has_index() ? device.index() : at::accelerator::getDeviceIndex();
  return at::cuda::getDeviceProperties(index)->major >= 8;
}

void* current_cuda_stream(const c10::Device& device) {
  if (!device.is_cuda()) throw UsageError("no CUDA stream on " + device.str());
  const c10::DeviceIndex index = device.has_index() ? device.index() : at::accelerator::getDeviceIndex();
  return at::cuda::getCurrentCUDAStream(index).stream();
}

#else  // a CPU build of LibTorch: no CUDA headers, no stream, no flash attention

bool flash_attention_device(const c10::Device& /*device*/) { return false; }

void* current_cuda_stream(const c10::Device& device) {
  throw UsageError("no CUDA stream on " + device.str() + ": this trainer is built with a CPU-only LibTorch",
                   "build trainer against a CUDA LibTorch (docs/building.md)");
}

#endif

}  // namespace trainer
