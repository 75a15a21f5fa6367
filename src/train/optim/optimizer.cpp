// The optimizer interface, AdamW and the learning-rate schedule (see optimizer.h); Adafactor is in adafactor.cpp.
#include "train/optim/optimizer.h"

#include <algorithm>
#include <map>
#include <cmath>
#include <cstring>
#include <numbers>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include <spdlog/spdlog.h>

#include "quant/blockwise.h"
#include "trainer/errors.h"
#include "util/counter_rng.h"

namespace trainer {
namespace {

// optimizer.state_dtype=int8 (kInt8Block, kInt8MinSize: memory/optimizer_footprint.h): the update works in chunks of
// whole blocks.
constexpr int64_t kInt8Chunk = int64_t{1} << 20;

constexpr int64_t kUpdateChunk = 1 << 22;  // elements per update chunk: 16 MiB of fp32 scratch each

}  // namespace

bool decays_by_default(const std::string& name) {
  return !(name.ends_with(".bias") || name.find("norm") != std::string::npos || name.find("embed") != std::string::npos ||
           name == "shared.weight" || name.find("relative_attention_bias") != std::string::npos);
}

Optimizer::Optimizer(Module& model, const OptimizerConfig& config, uint64_t seed, OptimizerShard shard)
    : shard_(shard), config_(config), seed_(seed) {
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (!p.requires_grad()) return;
    params_.push_back({name, &p, config.decay_norms_biases_embeddings || decays_by_default(name), {}});
  });
  std::map<std::string, std::size_t> by_name;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    rounding_index_.push_back(i);
    rounding_offset_.push_back(0);
    by_name[params_[i].name] = i;
  }
  for (const PiecedParameter& whole : shard.pieced)
    if (const auto it = by_name.find(whole.name); it != by_name.end() && whole.offset >= 0 && whole.key >= 0) {
      rounding_index_[it->second] = static_cast<uint64_t>(whole.key);
      rounding_offset_[it->second] = whole.offset;
    }
  std::vector<int64_t> numels;
  for (const auto& param : params_) numels.push_back(param.param->numel());
  owners_ = shard_owners(numels, std::max(1, shard.world));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = *params_[i].param;
    if (owns(i) && config.bf16_update == Bf16Update::kKahan && p.scalar_type() == at::kBFloat16)
      params_[i].compensation = at::zeros(p.sizes(), p.options());
  }
}

void Optimizer::move_to(const c10::Device& device) {
  auto move = [&](at::Tensor& t) {
    if (t.defined()) t = t.to(device, /*non_blocking=*/false, /*copy=*/true);
  };
  for (auto& param : params_) move(param.compensation);
  move(compensation_scratch_);
  for_each_own_tensor(move);
}

at::Tensor Optimizer::load_master(std::size_t index, const at::Tensor& flat_param, int64_t begin, int64_t n,
                                  at::Tensor scratch) {
  const at::Tensor chunk = flat_param.narrow(0, begin, n);
  if (chunk.scalar_type() == at::kFloat) return chunk;
  at::Tensor master = scratch.narrow(0, 0, n);
  master.copy_(chunk);
  const at::Tensor& compensation = params_[index].compensation;
  if (compensation.defined()) {
    at::Tensor fp32 = compensation_scratch_.narrow(0, 0, n);
    fp32.copy_(compensation.view({-1}).narrow(0, begin, n));
    master.add_(fp32);
  }
  return master;
}

void Optimizer::allocate_compensation_scratch(int64_t chunk) {
  for (const auto& param : params_)
    if (param.compensation.defined()) {
      compensation_scratch_ = at::empty({chunk}, param.compensation.options().dtype(at::kFloat));
      return;
    }
}

void Optimizer::store_master(std::size_t index, at::Tensor& flat_param, int64_t begin, int64_t n,
                             const at::Tensor& master, const at::Tensor& spare) {
  at::Tensor chunk = flat_param.narrow(0, begin, n);
  if (chunk.scalar_type() == at::kFloat) return;  // the master is the parameter
  const at::Tensor& compensation = params_[index].compensation;
  if (compensation.defined()) {
    // Kahan: the weight is the nearest bf16; what that lost (master - weight) is kept for the next update.
    chunk.copy_(master);
    at::Tensor lost = spare.narrow(0, 0, n);
    lost.copy_(chunk);
    at::sub_out(lost, master, lost);
    compensation.view({-1}).narrow(0, begin, n).copy_(lost);
  } else if (config_.bf16_update == Bf16Update::kStochastic && chunk.scalar_type() == at::kBFloat16) {
    stochastic_round_bf16_(chunk, master, counter_key({seed_, static_cast<uint64_t>(step_), rounding_index_[index]}),
                           rounding_offset_[index] + begin);
  } else {
    chunk.copy_(master);
  }
}

void Optimizer::store_bf16_state(at::Tensor& dst, const at::Tensor& src, std::size_t index, uint64_t stream,
                                 int64_t begin) {
  if (config_.bf16_update == Bf16Update::kNearest || dst.scalar_type() != at::kBFloat16) {
    dst.copy_(src);
    return;
  }
  stochastic_round_bf16_(dst, src, counter_key({seed_, static_cast<uint64_t>(step_), rounding_index_[index], stream}),
                         rounding_offset_[index] + begin);
}

double Optimizer::squared_grad_norm() const {
  at::NoGradGuard no_grad;
  // The norm in fp32 over slices of each gradient: temporaries stay at one slice whatever the tensor (a 152k x 3584
  // embedding's gradient squared would be 2 GiB), so clipping cannot run out of memory where the step fit.
  constexpr int64_t kSlice = int64_t{1} << 18;
  double sum_squares = 0.0;
  for (const auto& param : params_) {
    const at::Tensor& g = param.param->grad();
    if (!g.defined()) continue;
    const at::Tensor flat = g.reshape({-1});
    for (int64_t begin = 0; begin < flat.numel(); begin += kSlice) {
      const double norm = at::linalg_vector_norm(flat.narrow(0, begin, std::min(kSlice, flat.numel() - begin)), 2, {},
                                                 false, at::kFloat)
                              .item<double>();
      sum_squares += norm * norm;
    }
  }
  return sum_squares;
}

double Optimizer::clip_to(double norm, double max_norm) {
  at::NoGradGuard no_grad;
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);  // as torch.nn.utils.clip_grad_norm_
    for (auto& param : params_)
      if (param.param->grad().defined()) param.param->mutable_grad().mul_(scale);
  }
  return norm;
}

double Optimizer::clip_grad_norm(double max_norm) { return clip_to(std::sqrt(squared_grad_norm()), max_norm); }

void Optimizer::zero_grad() {
  for (auto& param : params_) param.param->mutable_grad() = at::Tensor();
}

std::vector<at::Tensor> Optimizer::gradients() const {
  std::vector<at::Tensor> grads;
  for (const auto& param : params_)
    if (param.param->grad().defined()) grads.push_back(param.param->grad());
  return grads;
}

int64_t Optimizer::trainable_parameters() const {
  int64_t n = 0;
  for (const auto& param : params_) n += param.param->numel();
  return n;
}

int64_t Optimizer::state_bytes() const {
  int64_t n = own_state_bytes();
  for (const auto& param : params_)
    if (param.compensation.defined()) n += static_cast<int64_t>(param.compensation.nbytes());
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state_tensors() const {
  auto out = own_state();
  for (const auto& param : params_)
    if (param.compensation.defined()) out.emplace_back("kahan_compensation." + param.name, param.compensation);
  return out;
}

void Optimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t steps,
                           const std::string& source) {
  at::NoGradGuard no_grad;
  const std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
  const auto find = [&](const std::string& key, const at::Tensor& slot, bool required) -> const at::Tensor* {
    const auto it = by_name.find(key);
    if (it == by_name.end()) {
      if (!required) return nullptr;
      throw DataError(source + ": no tensor " + key + "; the optimizer state does not match the trainable parameters",
                      "resume from a checkpoint written with the same model, lora and optimizer.name settings, or "
                      "start without --resume");
    }
    if (it->second.sizes() != slot.sizes())
      throw DataError(source + ": " + key + " has shape " + c10::str(it->second.sizes()) + ", the optimizer state has " +
                          c10::str(slot.sizes()),
                      "resume from a checkpoint of the same model and optimizer settings");
    return &it->second;
  };
  const auto own = own_state();
  for (const auto& [key, slot] : own) find(key, slot, true);  // check everything before changing anything
  for (const auto& param : params_)
    if (param.compensation.defined()) find("kahan_compensation." + param.name, param.compensation, false);
  for (const auto& [key, slot] : own) slot.copy_(*find(key, slot, true));
  for (auto& param : params_) {
    if (!param.compensation.defined()) continue;
    // A checkpoint written without Kahan compensation: its weights are exact as they are, zero is the right start.
    if (const at::Tensor* saved = find("kahan_compensation." + param.name, param.compensation, false))
      param.compensation.copy_(*saved);
    else
      param.compensation.zero_();
  }
  step_ = steps;
}

AdamW::AdamW(Module& model, const OptimizerConfig& config, uint64_t seed, bool allow_fused, OptimizerShard shard)
    : Optimizer(model, config, seed, shard) {
  bool bf16_trainable = false;
  for (const auto& param : params_) bf16_trainable = bf16_trainable || param.param->scalar_type() != at::kFloat;
  fused_ = allow_fused && adamw_uses_fused_kernel(config, bf16_trainable);
  int64_t largest = 0;
  exp_avg_.resize(params_.size());
  exp_avg_sq_.resize(params_.size());
  if (config.state_dtype == StateDtype::kInt8) {
    fused_ = false;
    int8_.resize(params_.size());
    int64_t chunk = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!owns(i)) continue;
      const at::Tensor& p = *params_[i].param;
      if (p.scalar_type() != at::kFloat)
        throw UsageError("optimizer.state_dtype=int8: " + params_[i].name + " is " +
                             std::string(c10::toString(p.scalar_type())) + "; 8-bit AdamW updates fp32 parameters",
                         "use precision.mode=bf16-mixed or fp32 with int8 moments, or optimizer.state_dtype=bf16");
      Int8Moments& s = int8_[i];
      const int64_t n = p.numel();
      if (n >= kInt8MinSize) {
        // Zero codes with zero block scales dequantize to 0, as bitsandbytes' fresh buffers do.
        const int64_t blocks = (n + kInt8Block - 1) / kInt8Block;
        s.state1 = at::zeros({n}, p.options().dtype(at::kByte));
        s.state2 = at::zeros({n}, p.options().dtype(at::kByte));
        s.absmax1 = at::zeros({blocks}, p.options());
        s.absmax2 = at::zeros({blocks}, p.options());
        chunk = std::max(chunk, std::min(kInt8Chunk, blocks * kInt8Block));
      } else {
        s.exp_avg = at::zeros({n}, p.options());
        s.exp_avg_sq = at::zeros({n}, p.options());
        chunk = std::max(chunk, n);
      }
      s.step = at::zeros({}, at::TensorOptions().dtype(at::kLong));
    }
    const auto device = params_.empty() ? at::Device(at::kCPU) : params_.front().param->device();
    const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
    const auto table = [&](const std::vector<float>& values) {
      return at::tensor(at::ArrayRef<float>(values), at::TensorOptions().dtype(at::kFloat)).to(device);
    };
    const auto lookup = [&](const std::vector<float>& code) {
      const auto lut = quant::code_lookup_table(code);
      return at::tensor(at::ArrayRef<uint8_t>(lut), at::TensorOptions().dtype(at::kByte)).to(device);
    };
    const auto signed_map = quant::create_dynamic_map(true), unsigned_map = quant::create_dynamic_map(false);
    int8_map1_ = table(signed_map);
    int8_map2_ = table(unsigned_map);
    int8_lut1_ = lookup(signed_map);
    int8_lut2_ = lookup(unsigned_map);
    if (chunk > 0) {
      int8_m_ = at::empty({chunk}, fp32);
      int8_v_ = at::empty({chunk}, fp32);
      int8_tmp_ = at::empty({chunk}, fp32);
      int8_index_ = at::empty({chunk}, fp32.dtype(at::kInt));
      int8_slot_ = at::empty({chunk}, fp32.dtype(at::kDouble));
      int8_inverse_ = at::empty({(chunk + kInt8Block - 1) / kInt8Block}, fp32);
    }
    return;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!owns(i)) continue;  // ZeRO-1: another rank keeps its moments
    const at::Tensor& p = *params_[i].param;
    const auto options = p.options().dtype(config.state_dtype == StateDtype::kBf16 ? at::kBFloat16 : at::kFloat);
    exp_avg_[i] = at::zeros(p.sizes(), options);
    exp_avg_sq_[i] = at::zeros(p.sizes(), options);
    largest = std::max(largest, p.numel());
  }
  const auto device = params_.empty() ? at::Device(at::kCPU) : params_.front().param->device();
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  if (fused_) {
    step_count_ = at::zeros({}, fp32);
    return;  // no scratch: the kernel updates each tensor in place
  }
  const int64_t chunk = std::min(largest, kUpdateChunk);
  scratch_a_ = at::empty({chunk}, fp32);
  scratch_b_ = at::empty({chunk}, fp32);
  if (config.state_dtype == StateDtype::kBf16) {
    scratch_m_ = at::empty({chunk}, fp32);
    scratch_v_ = at::empty({chunk}, fp32);
  }
  eps_ = at::empty({}, fp32);
  decay_ = at::empty({}, fp32);
  allocate_compensation_scratch(chunk);
}

// ATen's fused AdamW (what torch.optim.AdamW(fused=True) runs), once for the decayed parameters and once for the
// others. It reads the step count from state_steps and updates parameters and moments in place, allocating
// nothing on the CPU (tested under a budget of zero spare bytes); on CUDA it launches multi-tensor kernels.
void AdamW::fused_step(double lr) {
  at::NoGradGuard no_grad;
  ++step_;
  step_count_.fill_(static_cast<double>(step_));
  for (const bool decayed : {true, false}) {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& p = *params_[i].param;
      if (!owns(i) || !p.grad().defined() || params_[i].decay != decayed) continue;
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(exp_avg_[i]);
      exp_avg_sqs.push_back(exp_avg_sq_[i]);
      steps.push_back(step_count_);
    }
    if (params.empty()) continue;
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, config_.beta1,
                      config_.beta2, decayed ? config_.weight_decay : 0.0, config_.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  }
}

namespace {

// code[q] * absmax[block] in fp32 (cdequantize_blockwise_cpu_fp32), `index` an int32 scratch of codes' size.
void dequantize_8bit(at::Tensor& out, const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code,
                     at::Tensor& index) {
  const int64_t n = codes.numel(), full = n / kInt8Block, rest = n % kInt8Block;
  index.copy_(codes);
  at::index_select_out(out, code, 0, index);
  if (full > 0) out.narrow(0, 0, full * kInt8Block).view({full, kInt8Block}).mul_(absmax.narrow(0, 0, full).unsqueeze(1));
  if (rest > 0) out.narrow(0, full * kInt8Block, rest).mul_(absmax.narrow(0, full, 1));
}

// Blockwise 8-bit quantization as libbitsandbytes_cpu's cquantize_blockwise_cpu_fp32 computes it: the block's
// absolute maximum, x * (1 / absmax) clamped to [-1, 1], its slot fma((x + 1) * 0.5, 65535, 0.5) truncated, and
// the lookup table's code; all-zero blocks get code 0. The fused multiply-add is exact here on any device: the
// product and sum are exact in fp64 and one rounding to fp32 is the fma's.
void quantize_8bit(const at::Tensor& x, at::Tensor& codes, at::Tensor& absmax, const at::Tensor& lut,
                   at::Tensor& tmp, at::Tensor& slot, at::Tensor& index, at::Tensor& inverse) {
  const int64_t n = x.numel(), full = n / kInt8Block, rest = n % kInt8Block;
  // The whole blocks as rows of 256, and the last partial block.
  const auto rows = [&](const at::Tensor& t) { return t.narrow(0, 0, full * kInt8Block).view({full, kInt8Block}); };
  const auto tail = [&](const at::Tensor& t) { return t.narrow(0, full * kInt8Block, rest); };
  at::abs_out(tmp, x);
  if (full > 0) {
    at::Tensor out = absmax.narrow(0, 0, full);
    at::amax_out(out, rows(tmp), {1});
  }
  if (rest > 0) {
    at::Tensor out = absmax.narrow(0, full, 1);
    at::amax_out(out, tail(tmp), {0}, /*keepdim=*/true);
  }
  at::reciprocal_out(inverse, absmax);
  inverse.masked_fill_(absmax.eq(0), 0.0f);  // an all-zero block: every code 0 below, not 0 * inf
  if (full > 0) {
    at::Tensor out = rows(tmp);
    at::mul_out(out, rows(x), inverse.narrow(0, 0, full).unsqueeze(1));
  }
  if (rest > 0) {
    at::Tensor out = tail(tmp);
    at::mul_out(out, tail(x), inverse.narrow(0, full, 1));
  }
  tmp.clamp_(-1.0, 1.0).add_(1.0).mul_(0.5);
  slot.copy_(tmp);
  slot.mul_(65535.0).add_(0.5);
  tmp.copy_(slot);
  index.copy_(tmp);
  at::index_select_out(codes, lut, 0, index);
  if (full > 0) rows(codes).masked_fill_(absmax.narrow(0, 0, full).eq(0).unsqueeze(1), 0);
  if (rest > 0) tail(codes).masked_fill_(absmax.narrow(0, full, 1).eq(0), 0);
}

}  // namespace

void AdamW::int8_step(double lr) {
  at::NoGradGuard no_grad;
  ++step_;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = *params_[i].param;
    if (!owns(i) || !p.grad().defined()) continue;
    auto* count = int8_[i].step.data_ptr<int64_t>();
    ++*count;
    const at::Tensor param = p.view({-1});
    const at::Tensor grad = p.grad().reshape({-1});
    const int64_t n = p.numel();
    const int64_t chunk = int8_[i].state1.defined() ? int8_m_.numel() / kInt8Block * kInt8Block : n;
    for (int64_t begin = 0; begin < n; begin += chunk)
      int8_update_chunk(i, param, grad, begin, std::min(chunk, n - begin), lr);
  }
}

// One chunk (whole 256-element blocks) of bitsandbytes' CPU AdamW8bit update (backends/cpu/ops.py:
// _optimizer_update_8bit_blockwise_cpu, or _optimizer_update_32bit_cpu for fp32 moments), the same ATen ops in
// the same order, so on the CPU every bit is bitsandbytes'.
void AdamW::int8_update_chunk(std::size_t index, const at::Tensor& param, const at::Tensor& grad, int64_t begin,
                              int64_t n, double lr) {
  Int8Moments& s = int8_[index];
  const double b1 = config_.beta1, b2 = config_.beta2, eps = config_.eps;
  const double wd = params_[index].decay ? config_.weight_decay : 0.0;
  const auto step = static_cast<double>(*s.step.data_ptr<int64_t>());
  const double correction1 = 1.0 - std::pow(b1, step);
  const double correction2 = std::sqrt(1.0 - std::pow(b2, step));
  at::Tensor p = param.narrow(0, begin, n);
  const at::Tensor g = grad.narrow(0, begin, n);
  at::Tensor tmp = int8_tmp_.narrow(0, 0, n);
  if (!s.state1.defined()) {
    at::Tensor m = s.exp_avg.narrow(0, begin, n), v = s.exp_avg_sq.narrow(0, begin, n);
    m.mul_(b1).add_(g, 1.0 - b1);
    v.mul_(b2).addcmul_(g, g, 1.0 - b2);
    if (wd > 0.0) p.mul_(1.0 - lr * wd);
    at::sqrt_out(tmp, v).add_(eps * correction2);
    at::div_out(tmp, m, tmp);
    p.add_(tmp, -lr * correction2 / correction1);
    return;
  }
  const int64_t block0 = begin / kInt8Block, blocks = (n + kInt8Block - 1) / kInt8Block;
  at::Tensor m = int8_m_.narrow(0, 0, n), v = int8_v_.narrow(0, 0, n);
  at::Tensor codes1 = s.state1.narrow(0, begin, n), codes2 = s.state2.narrow(0, begin, n);
  at::Tensor absmax1 = s.absmax1.narrow(0, block0, blocks), absmax2 = s.absmax2.narrow(0, block0, blocks);
  at::Tensor idx = int8_index_.narrow(0, 0, n), slot = int8_slot_.narrow(0, 0, n);
  at::Tensor inverse = int8_inverse_.narrow(0, 0, blocks);
  dequantize_8bit(m, codes1, absmax1, int8_map1_, idx);
  dequantize_8bit(v, codes2, absmax2, int8_map2_, idx);
  m.mul_(b1).add_(g, 1.0 - b1);
  v.mul_(b2).addcmul_(g, g, 1.0 - b2);
  at::sqrt_out(tmp, v).div_(correction2).add_(eps);
  if (wd > 0.0) p.mul_(1.0 - lr * wd);
  p.addcdiv_(m, tmp, -lr / correction1);
  quantize_8bit(m, codes1, absmax1, int8_lut1_, tmp, slot, idx, inverse);
  quantize_8bit(v, codes2, absmax2, int8_lut2_, tmp, slot, idx, inverse);
}

void AdamW::step(double lr) {
  if (fused_) return fused_step(lr);
  if (!int8_.empty()) return int8_step(lr);
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
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = *params_[i].param;
    if (!owns(i) || !p.grad().defined()) continue;
    at::Tensor param = p.view({-1});
    const at::Tensor grad = p.grad().view({-1});
    const at::Tensor m = exp_avg_[i].view({-1}), v = exp_avg_sq_[i].view({-1});
    for (int64_t begin = 0; begin < param.numel(); begin += kUpdateChunk) {
      const int64_t n = std::min(kUpdateChunk, param.numel() - begin);
      at::Tensor m_state = m.narrow(0, begin, n), v_state = v.narrow(0, begin, n);
      // bf16 moments are updated in fp32 copies and rounded back; fp32 moments in place.
      at::Tensor mc = bf16_state ? scratch_m_.narrow(0, 0, n).copy_(m_state) : m_state;
      at::Tensor vc = bf16_state ? scratch_v_.narrow(0, 0, n).copy_(v_state) : v_state;
      at::Tensor a = scratch_a_.narrow(0, 0, n);
      a.copy_(grad.narrow(0, begin, n));  // fp32 whatever the gradient's dtype
      mc.lerp_(a, 1.0 - b1);              // m = b1 m + (1 - b1) g
      at::Tensor b = scratch_b_.narrow(0, 0, n);
      at::mul_out(b, a, a);
      vc.lerp_(b, 1.0 - b2);              // v = b2 v + (1 - b2) g^2
      at::sqrt_out(a, vc).add_(eps_);     // a = sqrt(v) + eps * bias2_sqrt
      const at::Tensor master = load_master(i, param, begin, n, scratch_b_);
      if (params_[i].decay && config_.weight_decay > 0) master.mul_(decay_);
      master.addcdiv_(mc, a, -step_size);
      store_master(i, param, begin, n, master, scratch_a_);
      if (bf16_state) {
        store_bf16_state(m_state, mc, i, 1, begin);
        store_bf16_state(v_state, vc, i, 2, begin);
      }
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::own_state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!owns(i)) continue;
    if (!int8_.empty()) {
      const Int8Moments& m = int8_[i];
      const std::string& name = params_[i].name;
      if (m.state1.defined()) {
        out.emplace_back("adamw8bit.state1." + name, m.state1);
        out.emplace_back("adamw8bit.state2." + name, m.state2);
        out.emplace_back("adamw8bit.absmax1." + name, m.absmax1);
        out.emplace_back("adamw8bit.absmax2." + name, m.absmax2);
      } else {
        out.emplace_back("adamw8bit.exp_avg." + name, m.exp_avg);
        out.emplace_back("adamw8bit.exp_avg_sq." + name, m.exp_avg_sq);
      }
      out.emplace_back("adamw8bit.step." + name, m.step);
      continue;
    }
    out.emplace_back("exp_avg." + params_[i].name, exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + params_[i].name, exp_avg_sq_[i]);
  }
  return out;
}

void AdamW::for_each_own_tensor(const std::function<void(at::Tensor&)>& visit) {
  for (auto& t : exp_avg_) visit(t);
  for (auto& t : exp_avg_sq_) visit(t);
  // int8: every state tensor but the step counts, which stay on the CPU.
  for (auto& m : int8_)
    for (at::Tensor* t : {&m.state1, &m.state2, &m.absmax1, &m.absmax2, &m.exp_avg, &m.exp_avg_sq}) visit(*t);
  for (at::Tensor* t : {&int8_map1_, &int8_map2_, &int8_lut1_, &int8_lut2_, &int8_m_, &int8_v_, &int8_tmp_,
                        &int8_index_, &int8_slot_, &int8_inverse_})
    visit(*t);
  for (at::Tensor* t : {&scratch_a_, &scratch_b_, &scratch_m_, &scratch_v_, &eps_, &decay_, &step_count_}) visit(*t);
}

int64_t AdamW::own_state_bytes() const {
  int64_t n = 0;
  for (const auto& [name, t] : own_state()) n += static_cast<int64_t>(t.nbytes());
  return n;
}

std::unique_ptr<Optimizer> make_optimizer(Module& model, const OptimizerConfig& config, uint64_t seed,
                                          OptimizerShard shard) {
  std::unique_ptr<Optimizer> optimizer;
  if (config.name == OptimizerName::kAdafactor) optimizer = std::make_unique<Adafactor>(model, config, seed, shard);
  else optimizer = std::make_unique<AdamW>(model, config, seed, /*allow_fused=*/true, shard);
  if (config.bf16_update == Bf16Update::kNearest) {
    bool bf16 = config.name == OptimizerName::kAdamW && config.state_dtype == StateDtype::kBf16;
    model.for_each_parameter([&](const std::string&, at::Tensor& p) {
      if (p.requires_grad() && p.scalar_type() == at::kBFloat16) bf16 = true;
    });
    if (bf16)
      spdlog::warn("optimizer.bf16_update=nearest: updates smaller than half a bf16 step of a weight (or moment) are "
                   "rounded away, and such a run learns far less than in fp32; use stochastic (the default) or kahan");
  }
  return optimizer;
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
