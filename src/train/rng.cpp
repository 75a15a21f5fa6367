// Generator state of a device (see rng.h), read and written under the generator's mutex.
#include "train/rng.h"

#include <mutex>

#include <ATen/ATen.h>

namespace trainer {
namespace {

at::Generator generator_for(const c10::Device& device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
}

}  // namespace

at::Tensor get_rng_state(const c10::Device& device) {
  at::Generator gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace trainer
