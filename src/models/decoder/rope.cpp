// RoPE inverse frequencies by rope type (see rope.h), computed as modeling_rope_utils.py computes them.
#include "models/decoder/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include <ATen/ATen.h>

#include "models/hf_config.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

double required(const RopeSpec& spec, const char* key) {
  if (!hf::find(spec.parameters, key))
    throw UsageError("config.json: " + spec.key + " of rope type \"" + spec.type + "\" has no \"" + key + "\"",
                     "the rope type's parameters are listed in transformers' modeling_rope_utils.py");
  return hf::get_double(spec.parameters, key);
}

at::Tensor factors(const RopeSpec& spec, const char* key, int64_t count) {
  const auto* list = hf::find(spec.parameters, key);
  if (!list || !list->is_array() || static_cast<int64_t>(list->size()) != count)
    throw UsageError("config.json: " + spec.key + "." + key + " must list " + std::to_string(count) +
                         " numbers (half the rotary dimension)",
                     "longrope needs short_factor and long_factor, one factor per rotated pair");
  std::vector<float> values;
  for (const auto& v : *list) {
    if (!v.is_number()) throw UsageError("config.json: " + spec.key + "." + key + " must hold numbers");
    values.push_back(v.get<float>());
  }
  return at::tensor(values, at::kFloat);
}

// base ** (arange(0, dim, 2) / dim) as transformers writes it (the exponent in fp32).
at::Tensor powers(double base, int64_t dim) {
  return at::pow(base, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim));
}

}  // namespace

Rope::Rope(const RopeSpec& spec, int64_t head_dim, int64_t max_position_embeddings)
    : type_(spec.type), spec_(spec), head_dim_(head_dim), max_position_embeddings_(max_position_embeddings) {
  dim_ = static_cast<int64_t>(static_cast<double>(head_dim) * spec.partial_rotary_factor);
  static const std::vector<std::string> kTypes = {"default", "linear", "llama3", "dynamic",
                                                  "yarn",    "longrope", "proportional"};
  if (std::find(kTypes.begin(), kTypes.end(), type_) == kTypes.end())
    throw UsageError("config.json: " + spec.key + ".rope_type \"" + type_ + "\" is not a rope type trainer knows",
                     "supported rope types: default, linear, llama3, dynamic, yarn, longrope, proportional");
  const double original = hf::get_double(spec.parameters, "original_max_position_embeddings",
                                         static_cast<double>(max_position_embeddings));
  if (type_ == "yarn") {
    std::optional<double> factor = hf::find(spec.parameters, "factor")
                                       ? std::optional<double>(hf::get_double(spec.parameters, "factor"))
                                       : std::nullopt;
    const double f = factor.value_or(static_cast<double>(max_position_embeddings) / original);
    auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
    if (hf::find(spec.parameters, "attention_factor")) {
      attention_scaling_ = hf::get_double(spec.parameters, "attention_factor");
    } else {
      const double m = hf::get_double(spec.parameters, "mscale", 0.0);
      const double m_all = hf::get_double(spec.parameters, "mscale_all_dim", 0.0);
      attention_scaling_ = (m != 0.0 && m_all != 0.0) ? mscale(f, m) / mscale(f, m_all) : mscale(f, 1.0);
    }
  } else if (type_ == "longrope") {
    const double f = hf::find(spec.parameters, "factor") ? hf::get_double(spec.parameters, "factor")
                                                          : static_cast<double>(max_position_embeddings) / original;
    if (hf::find(spec.parameters, "attention_factor"))
      attention_scaling_ = hf::get_double(spec.parameters, "attention_factor");
    else
      attention_scaling_ = f <= 1.0 ? 1.0 : std::sqrt(1 + std::log(f) / std::log(original));
  }
  base_ = compute(0);
  rotary_dim_ = 2 * base_.size(0);
}

at::Tensor Rope::inverse_frequencies(int64_t length) const {
  if (type_ == "dynamic" && length > max_position_embeddings_) return compute(length);
  if (type_ == "longrope") {
    const double original = hf::get_double(spec_.parameters, "original_max_position_embeddings",
                                           static_cast<double>(max_position_embeddings_));
    if (static_cast<double>(length) > original) return compute(length);
  }
  return base_;
}

at::Tensor Rope::compute(int64_t length) const {
  const double theta = spec_.theta;
  const int64_t dim = dim_;
  if (type_ == "default") return 1.0 / powers(theta, dim);
  if (type_ == "linear") return 1.0 / powers(theta, dim) / required(spec_, "factor");
  if (type_ == "llama3") {
    const at::Tensor inv = 1.0 / powers(theta, dim);
    const double factor = required(spec_, "factor");
    const double low = required(spec_, "low_freq_factor");
    const double high = required(spec_, "high_freq_factor");
    const double old_context = required(spec_, "original_max_position_embeddings");
    const double low_wavelen = old_context / low, high_wavelen = old_context / high;
    const at::Tensor wavelen = 2 * std::numbers::pi / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / factor, inv);
    const at::Tensor smooth = (old_context / wavelen - low) / (high - low);
    const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    return at::where(medium, smoothed, scaled);
  }
  if (type_ == "dynamic") {
    // NTK scaling of the base once the positions pass max_position_embeddings (at or below it: the default).
    const double factor = required(spec_, "factor");
    const double max_pos = static_cast<double>(max_position_embeddings_);
    const double seq = std::max(static_cast<double>(length), max_pos);
    const double base = theta * std::pow(factor * seq / max_pos - (factor - 1), static_cast<double>(dim) / (dim - 2));
    return 1.0 / powers(base, dim);
  }
  if (type_ == "yarn") {
    const double original = required(spec_, "original_max_position_embeddings");
    const double factor = hf::find(spec_.parameters, "factor")
                              ? hf::get_double(spec_.parameters, "factor")
                              : static_cast<double>(max_position_embeddings_) / original;
    const double beta_fast = hf::get_double(spec_.parameters, "beta_fast", 32.0);
    const double beta_slow = hf::get_double(spec_.parameters, "beta_slow", 1.0);
    const bool truncate = hf::get_bool(spec_.parameters, "truncate", true);
    auto correction_dim = [&](double rotations) {
      return (dim * std::log(original / (rotations * 2 * std::numbers::pi))) / (2 * std::log(theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    const at::Tensor pos_freqs = powers(theta, dim);
    const at::Tensor extrapolation = 1.0 / pos_freqs;
    const at::Tensor interpolation = 1.0 / (factor * pos_freqs);
    const at::Tensor ramp = at::clamp((at::arange(dim / 2, at::kFloat) - low) / (high - low), 0, 1);
    const at::Tensor extrapolation_factor = 1 - ramp;
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  if (type_ == "longrope") {
    const double original = hf::get_double(spec_.parameters, "original_max_position_embeddings",
                                           static_cast<double>(max_position_embeddings_));
    const at::Tensor ext = factors(spec_, static_cast<double>(length) > original ? "long_factor" : "short_factor",
                                   dim / 2);
    return 1.0 / (ext * at::pow(theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim)));
  }
  // proportional (Gemma 4): the first partial_rotary_factor of the pairs rotate with exponents over the whole
  // head_dim, the rest not at all (frequency 0); all divided by factor.
  const int64_t angles = static_cast<int64_t>(spec_.partial_rotary_factor * static_cast<double>(head_dim_)) / 2;
  at::Tensor inv = 1.0 / at::pow(theta, at::arange(0, 2 * angles, 2, at::kLong).to(at::kFloat) /
                                            static_cast<double>(head_dim_));
  const int64_t nope = head_dim_ / 2 - angles;
  if (nope > 0) inv = at::cat({inv, at::zeros({nope}, at::kFloat)});
  return inv / hf::get_double(spec_.parameters, "factor", 1.0);
}

}  // namespace trainer
