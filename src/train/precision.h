// Precision scopes shared by the training step and activation checkpointing.
#pragma once

#include <optional>

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>

namespace trainer {

enum class PrecisionMode;  // trainer/config.h

// The autocast dtype of the mixed precision modes (bf16-mixed: bf16, fp16-mixed: fp16); none otherwise.
std::optional<at::ScalarType> autocast_dtype(PrecisionMode precision);

// bf16 autocast on `device` for a scope (bf16-mixed), restoring the previous state however the scope ends.
class AutocastScope {
 public:
  AutocastScope(bool enabled, c10::DeviceType device, at::ScalarType dtype = at::kBFloat16)
      : enabled_(enabled), device_(device) {
    if (!enabled_) return;
    was_enabled_ = at::autocast::is_autocast_enabled(device_);
    previous_dtype_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!enabled_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, previous_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
  c10::DeviceType device_;
  bool was_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace trainer
