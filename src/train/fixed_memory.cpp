// The error for a budget below the fixed part of a run (see fixed_memory.h).
#include "train/fixed_memory.h"

#include <filesystem>
#include <optional>
#include <vector>

#include <ATen/DeviceAccelerator.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "memory/planner.h"
#include "train/engine/task_kind.h"
#include "trainer/model_dir.h"

namespace trainer {

OutOfMemoryAtFloor fixed_memory_error(const Config& config, const c10::Device& device, const std::string& what,
                                      const c10::OutOfMemoryError& error) {
  std::string message = "out of memory allocating " + what + ": " + error.what_without_backtrace();
  const bool limited = config.memory.limit.bytes > 0;
  double capacity = static_cast<double>(config.memory.limit.bytes);
  if (!limited && !device.is_cpu()) capacity = static_cast<double>(at::accelerator::getMemoryInfo(device.index()).second);
  const std::string budget = limited ? "memory.limit " + format_byte_size(config.memory.limit) : device.str() + " total";
  double fixed = 0;
  try {
    // Counted on the meta device, as `trainer plan` counts them: nothing is allocated for this.
    const auto hf_config = read_json_file((std::filesystem::path(config.model.path) / "config.json").string());
    const auto plan = task_kind(config).fixed_memory(config, hf_config, device, capacity, budget);
    fixed = plan.weights + plan.gradients + plan.optimizer_state;
    auto line = [](const std::string& name, double bytes) { return fmt::format("\n  {:<30}{}", name, human_bytes(bytes)); };
    message += "\nwhat the run needs before its first example (as `trainer plan` counts it):";
    message += line("weights", plan.weights);
    message += line("gradients (during backward)", plan.gradients);
    message += line(config.optimizer.name == OptimizerName::kAdafactor ? "optimizer state (Adafactor)"
                                                                       : "optimizer state (AdamW)",
                    plan.optimizer_state);
    message += line("together", fixed);
    if (capacity > 0) message += line(limited ? "memory.limit" : device.str() + " total", capacity);
    message += fmt::format("\n  {:<30}{} parameters, {} of them trained", "model", plan.parameters,
                           plan.trainable_parameters);
  } catch (const std::exception&) {
    // The figures are a courtesy; the out-of-memory error itself is what is reported.
  }
  std::vector<std::string> s;
  if (fixed > 0)
    s.push_back(fmt::format("{} of at least {} plus room for activations (`trainer plan` with this config "
                            "recommends one)",
                            limited ? "a memory.limit" : "a device", human_bytes(fixed)));
  else
    s.push_back(limited ? "a larger memory.limit (`trainer plan` shows what the run needs)"
                        : "a device with more memory (`trainer plan` shows what the run needs)");
  if (!config.lora.enabled) s.push_back("lora.enabled=true (no gradients or optimizer state for the base weights)");
  else if (!config.lora.base_in_bf16 && config.precision.mode != PrecisionMode::kBf16)
    s.push_back("lora.base_in_bf16=true (halves the frozen base)");
  if (config.precision.mode != PrecisionMode::kBf16) s.push_back("precision.mode=bf16 (bf16 weights and gradients)");
  if (config.optimizer.name == OptimizerName::kAdamW) {
    s.push_back("optimizer.name=adafactor (a few bytes per matrix row and column instead of 8 per parameter)");
    if (config.optimizer.state_dtype == StateDtype::kFp32) s.push_back("optimizer.state_dtype=bf16 (halves the AdamW state)");
  }
  std::string hint;
  for (const auto& item : s) hint += (hint.empty() ? "" : "; ") + item;
  return OutOfMemoryAtFloor(message, hint);
}

}  // namespace trainer
