// Dynamic loss scaling for precision.mode=fp16-mixed, with torch.amp.GradScaler's rules: the loss is multiplied
// by the scale before backward, so small gradients survive fp16's narrow range; before clipping the gradients are
// divided by it again and checked. A step whose gradients hold an inf or NaN (they overflowed fp16) is skipped:
// no optimizer update, the scale is multiplied by the backoff factor (0.5). After growth_interval steps in a row
// without one it is multiplied by the growth factor (2). The arithmetic is ATen's own
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_), as GradScaler's is. An overflow is a normal
// event of fp16 training: it is never an out-of-memory error, and the memory policy never hears of it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

namespace trainer {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16, as torch.amp.GradScaler
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // What the loss is multiplied by before backward.
  double scale() const;
  // Steps in a row without inf/NaN gradients since the scale last changed.
  int64_t growth_tracker() const;
  // Steps skipped for inf/NaN gradients over the whole run (resumes included).
  int64_t skipped_steps() const { return skipped_steps_; }
  // Skipped steps in a row up to now (0 after a step that was taken).
  int64_t consecutive_skips() const { return consecutive_skips_; }

  // Divides every gradient by the scale, in place; true when any of them holds an inf or NaN. The gradients of
  // one device and dtype are checked and unscaled in one ATen call.
  bool unscale_and_check(const std::vector<at::Tensor>& gradients) const;
  // After the step: backoff when `found_inf` (the step is counted as skipped), growth after growth_interval clean
  // steps in a row.
  void update(bool found_inf);

  // For checkpoints: {"scale", "growth_tracker", "skipped_steps"}; restore() takes what state() wrote.
  nlohmann::json state() const;
  void restore(const nlohmann::json& state, const std::string& source);

 private:
  GradScalerOptions options_;
  at::Tensor scale_;           // fp32 scalar on the CPU, as _amp_update_scale_ wants it
  at::Tensor growth_tracker_;  // int32 scalar on the CPU
  int64_t skipped_steps_ = 0;
  int64_t consecutive_skips_ = 0;
};

}  // namespace trainer
