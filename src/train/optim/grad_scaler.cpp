// Dynamic loss scaling for fp16-mixed (see grad_scaler.h).
#include "train/optim/grad_scaler.h"

#include <cmath>
#include <map>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "trainer/errors.h"

namespace trainer {

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options),
      scale_(at::full({}, options.init_scale, at::TensorOptions().dtype(at::kFloat))),
      growth_tracker_(at::zeros({}, at::TensorOptions().dtype(at::kInt))) {}

double GradScaler::scale() const { return scale_.item<double>(); }

int64_t GradScaler::growth_tracker() const { return growth_tracker_.item<int64_t>(); }

bool GradScaler::unscale_and_check(const std::vector<at::Tensor>& gradients) const {
  at::NoGradGuard no_grad;
  // As GradScaler: the reciprocal in double, then fp32.
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  // One fused call per (device, dtype), as the kernel requires.
  std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, at::ScalarType>, std::vector<at::Tensor>> groups;
  for (const auto& g : gradients)
    if (g.defined()) groups[{g.device().type(), g.device().index(), g.scalar_type()}].push_back(g);
  bool found = false;
  for (auto& [key, group] : groups) {
    const c10::Device device(std::get<0>(key), std::get<1>(key));
    at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale.to(device));
    if (found_inf.item<float>() != 0.0f) found = true;
  }
  return found;
}

void GradScaler::update(bool found_inf) {
  const at::Tensor found = at::full({}, found_inf ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat));
  at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor, options_.backoff_factor,
                         options_.growth_interval);
  if (found_inf) {
    ++skipped_steps_;
    ++consecutive_skips_;
  } else {
    consecutive_skips_ = 0;
  }
}

nlohmann::json GradScaler::state() const {
  return {{"scale", scale()}, {"growth_tracker", growth_tracker()}, {"skipped_steps", skipped_steps_}};
}

void GradScaler::restore(const nlohmann::json& state, const std::string& source) {
  try {
    const double scale = state.at("scale").get<double>();
    const int64_t tracker = state.at("growth_tracker").get<int64_t>();
    const int64_t skipped = state.value("skipped_steps", int64_t{0});
    if (!(scale > 0) || !std::isfinite(scale) || tracker < 0 || skipped < 0)
      throw DataError(source + ": loss_scaler holds scale " + std::to_string(scale) + ", growth_tracker " +
                          std::to_string(tracker) + ", skipped_steps " + std::to_string(skipped) +
                          ", not a state trainer writes",
                      "resume from another checkpoint");
    scale_.fill_(scale);
    growth_tracker_.fill_(tracker);
    skipped_steps_ = skipped;
    consecutive_skips_ = 0;
  } catch (const nlohmann::json::exception& e) {
    throw DataError(source + ": loss_scaler: " + e.what(), "resume from another checkpoint");
  }
}

}  // namespace trainer
