// The end of the memory ladder: when a step does not fit on its device even at the micro-batch floor with every
// in-place escalation used, memory.escalation's device moves carry the whole run to a device with more room and
// the same step runs again there. move_to_other_gpu (device.type=auto) takes the GPU with the most free memory if
// it has more than the current one gives the run; move_to_cpu (device.allow_cpu_fallback=true) takes the CPU.
// What moves: every parameter (weights, LoRA adapters) with its gradient, and the optimizer's state (moments,
// Adafactor statistics, Kahan compensation, scratch buffers). The memory policy's state (micro-batch, escalations)
// is device-free and carries on. memory.limit belongs to the device the run started on: a CPU budget stops
// applying once the run leaves that CPU "device", and a GPU cap stays on the GPU it was set for.
//
// Later, with data parallelism: every rank must agree on a move (as on every out-of-memory outcome) and move
// together, or the ranks stop together.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "trainer/config.h"

namespace trainer {

class Module;
class Optimizer;
class MemoryPolicy;

// Moves every parameter of `modules` (and its gradient) to `device` in place: each parameter keeps its Tensor object
// and gets a copy of its data on the device (Tensor::set_data; a copy even onto the same device), so whatever holds
// it (the layer's slot, a tied head, the optimizer's parameter list) holds the moved one. A tensor shared by two
// modules moves once. Returns the bytes copied.
int64_t move_parameters(const std::vector<Module*>& modules, const c10::Device& device);

// What runs on the device: the model, the LoRA adapters (null without LoRA; they are not in the model's tree), and
// the optimizer over the trainable ones.
struct RunOnDevice {
  Module& model;
  Module* lora;
  Optimizer& optimizer;
};

class DeviceLadder {
 public:
  // `start`: the device the run starts on (the one memory.limit was set for).
  DeviceLadder(const Config& config, const c10::Device& start);

  // After a step (`step`, 1-based) did not fit on `current` at the floor (`why`: the error): makes the first device
  // move of memory.escalation that is not used yet and applies, records it in `policy`, warns loudly, and returns the
  // new device; nothing when none applies (then why_not_moved() says why).
  std::optional<c10::Device> move(int64_t step, const c10::Device& current, RunOnDevice run, MemoryPolicy& policy,
                                  const std::string& why);

  int64_t moves() const { return moves_; }
  // For the memory report when the run stops: each device move of memory.escalation and why it was not made.
  std::string why_not_moved() const;

 private:
  // The accelerator with the most free memory other than `current`, if it has more than `current` gives the run.
  std::optional<std::pair<c10::Device, std::string>> other_gpu(const c10::Device& current, std::string& why_not) const;

  const Config& config_;
  c10::Device start_;
  int64_t moves_ = 0;
  std::vector<std::pair<std::string, std::string>> not_made_;  // escalation, reason (of the last attempt)
};

}  // namespace trainer
