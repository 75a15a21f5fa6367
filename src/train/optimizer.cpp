// AdamW and the learning-rate schedule (see optimizer.h).
#include "train/optimizer.h"

#include <algorithm>
#include <map>
#include <cmath>
#include <numbers>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include "trainer/errors.h"

namespace trainer {
namespace {

constexpr int64_t kChunk = 1 << 22;  // elements per update chunk: 16 MiB of fp32 scratch each

}  // namespace

bool decays_by_default(const std::string& name) {
  return !(name.ends_with(".bias") || name.find("norm") != std::string::npos || name.find("embed") != std::string::npos ||
           name == "shared.weight" || name.find("relative_attention_bias") != std::string::npos);
}

AdamW::AdamW(Module& model, const OptimizerConfig& config) : config_(config) {
  int64_t largest = 0;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (!p.requires_grad()) return;
    const auto options = p.options().dtype(config.state_dtype == StateDtype::kBf16 ? at::kBFloat16 : at::kFloat);
    slots_.push_back({name, &p, at::zeros(p.sizes(), options), at::zeros(p.sizes(), options),
                      config.decay_norms_biases_embeddings || decays_by_default(name)});
    largest = std::max(largest, p.numel());
  });
  const auto device = slots_.empty() ? at::Device(at::kCPU) : slots_.front().param->device();
  const int64_t chunk = std::min(largest, kChunk);
  scratch_a_ = at::empty({chunk}, at::TensorOptions().dtype(at::kFloat).device(device));
  scratch_b_ = at::empty({chunk}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (config.state_dtype == StateDtype::kBf16) {
    scratch_m_ = at::empty({chunk}, at::TensorOptions().dtype(at::kFloat).device(device));
    scratch_v_ = at::empty({chunk}, at::TensorOptions().dtype(at::kFloat).device(device));
  }
  eps_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
  decay_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device));
}

void AdamW::step(double lr) {
  // Only tensor-tensor and Scalar-argument kernels below: a plain Scalar operand (x.mul_(0.9)) is wrapped into a
  // freshly allocated tensor, which could run out of memory half way through the parameters.
  at::NoGradGuard no_grad;
  ++step_;
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(step_));
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(step_)));
  // p -= lr / bias1 * m / (sqrt(v) / bias2_sqrt + eps)  ==  p -= (lr * bias2_sqrt / bias1) * m / (sqrt(v) + eps * bias2_sqrt)
  const double step_size = lr * bias2_sqrt / bias1;
  eps_.fill_(config_.eps * bias2_sqrt);
  decay_.fill_(1.0 - lr * config_.weight_decay);
  const bool bf16_state = config_.state_dtype == StateDtype::kBf16;
  for (auto& slot : slots_) {
    at::Tensor& p = *slot.param;
    if (!p.grad().defined()) continue;
    const at::Tensor param = p.view({-1}), grad = p.grad().view({-1});
    const at::Tensor m = slot.exp_avg.view({-1}), v = slot.exp_avg_sq.view({-1});
    const bool fp32 = p.scalar_type() == at::kFloat;
    for (int64_t begin = 0; begin < param.numel(); begin += kChunk) {
      const int64_t n = std::min(kChunk, param.numel() - begin);
      at::Tensor pc = param.narrow(0, begin, n), m_state = m.narrow(0, begin, n), v_state = v.narrow(0, begin, n);
      // bf16 moments are updated in fp32 copies and rounded back; fp32 moments in place.
      at::Tensor mc = bf16_state ? scratch_m_.narrow(0, 0, n).copy_(m_state) : m_state;
      at::Tensor vc = bf16_state ? scratch_v_.narrow(0, 0, n).copy_(v_state) : v_state;
      at::Tensor a = scratch_a_.narrow(0, 0, n), b = scratch_b_.narrow(0, 0, n);
      a.copy_(grad.narrow(0, begin, n));  // fp32 whatever the gradient's dtype
      mc.lerp_(a, 1.0 - b1);              // m = b1 m + (1 - b1) g
      at::mul_out(b, a, a);
      vc.lerp_(b, 1.0 - b2);              // v = b2 v + (1 - b2) g^2
      at::sqrt_out(a, vc).add_(eps_);     // a = sqrt(v) + eps * bias2_sqrt
      at::Tensor master = fp32 ? pc : b.copy_(pc);
      if (slot.decay && config_.weight_decay > 0) master.mul_(decay_);
      master.addcdiv_(mc, a, -step_size);
      if (!fp32) pc.copy_(master);
      if (bf16_state) {
        m_state.copy_(mc);
        v_state.copy_(vc);
      }
    }
  }
}

double AdamW::clip_grad_norm(double max_norm) {
  at::NoGradGuard no_grad;
  // The norm in fp32 over slices of each gradient: temporaries stay at one slice whatever the tensor (a 152k x 3584
  // embedding's gradient squared would be 2 GiB), so clipping cannot run out of memory where the step fit.
  constexpr int64_t kSlice = int64_t{1} << 18;
  double sum_squares = 0.0;
  for (auto& slot : slots_) {
    const at::Tensor& g = slot.param->grad();
    if (!g.defined()) continue;
    const at::Tensor flat = g.reshape({-1});
    for (int64_t begin = 0; begin < flat.numel(); begin += kSlice) {
      const double norm = at::linalg_vector_norm(flat.narrow(0, begin, std::min(kSlice, flat.numel() - begin)), 2, {},
                                                 false, at::kFloat)
                              .item<double>();
      sum_squares += norm * norm;
    }
  }
  const double norm = std::sqrt(sum_squares);
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);  // as torch.nn.utils.clip_grad_norm_
    for (auto& slot : slots_)
      if (slot.param->grad().defined()) slot.param->mutable_grad().mul_(scale);
  }
  return norm;
}

void AdamW::zero_grad() {
  for (auto& slot : slots_) slot.param->mutable_grad() = at::Tensor();
}

int64_t AdamW::trainable_parameters() const {
  int64_t n = 0;
  for (const auto& slot : slots_) n += slot.param->numel();
  return n;
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (const auto& slot : slots_) n += 2 * slot.exp_avg.numel() * static_cast<int64_t>(slot.exp_avg.element_size());
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& slot : slots_) {
    out.emplace_back("exp_avg." + slot.name, slot.exp_avg);
    out.emplace_back("exp_avg_sq." + slot.name, slot.exp_avg_sq);
  }
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t steps,
                       const std::string& source) {
  at::NoGradGuard no_grad;
  const std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
  const auto find = [&](const std::string& key, const at::Tensor& slot) -> const at::Tensor& {
    const auto it = by_name.find(key);
    if (it == by_name.end())
      throw DataError(source + ": no tensor " + key + "; the optimizer state does not match the trainable parameters",
                      "resume from a checkpoint written with the same model and lora settings, or start without --resume");
    if (it->second.sizes() != slot.sizes())
      throw DataError(source + ": " + key + " has shape " + c10::str(it->second.sizes()) + ", the parameter has " +
                          c10::str(slot.sizes()),
                      "resume from a checkpoint of the same model");
    return it->second;
  };
  for (const auto& slot : slots_) {  // check everything before changing anything
    find("exp_avg." + slot.name, slot.exp_avg);
    find("exp_avg_sq." + slot.name, slot.exp_avg_sq);
  }
  for (auto& slot : slots_) {
    slot.exp_avg.copy_(find("exp_avg." + slot.name, slot.exp_avg));
    slot.exp_avg_sq.copy_(find("exp_avg_sq." + slot.name, slot.exp_avg_sq));
  }
  step_ = steps;
}

double scheduled_lr(const SchedulerConfig& s, double peak_lr, int64_t step, int64_t total) {
  int64_t warmup = s.warmup_steps;
  if (warmup == 0 && s.warmup_ratio > 0) warmup = static_cast<int64_t>(std::ceil(s.warmup_ratio * static_cast<double>(total)));
  // Step t (0-based) uses the rate for t + 1 steps done: warmup reaches the peak at its last step, as HF does.
  if (warmup > 0 && step < warmup) return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double floor = peak_lr * s.min_lr_ratio;
  if (s.name == SchedulerName::kConstant || total <= warmup) return peak_lr;
  const double progress = std::clamp(static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup)), 0.0, 1.0);
  if (s.name == SchedulerName::kLinear) return floor + (peak_lr - floor) * (1.0 - progress);
  return floor + (peak_lr - floor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace trainer
