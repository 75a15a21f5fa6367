// The autograd function around the fused RMSNorm loops: shape and dtype checks, threading over rows, saving what
// backward needs (the input and the rstd of each row).
#include "models/fused_ops.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/fused_kernels.h"

namespace trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> flag([] {
    const char* value = std::getenv("TRAINER_FUSED_KERNELS");
    return !(value && std::strcmp(value, "0") == 0);
  }());
  return flag;
}

bool use_avx2() {
#if defined(TRAINER_KERNELS_AVX2)
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported;
#else
  return false;
#endif
}

bool supported_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

kernels::Elem elem(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? kernels::Elem::kFloat : kernels::Elem::kBFloat16;
}

// About 32K elements per task: small rows are batched, so threads are not woken for a few hundred values.
int64_t grain(int64_t elements_per_item) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, elements_per_item)); }

struct NormTypes {
  bool round_bf16;
  at::ScalarType out;
};

NormTypes norm_types(const at::Tensor& x, const at::Tensor& weight, RmsNormStyle style) {
  if (style == RmsNormStyle::kLlama)
    return {x.scalar_type() == at::kBFloat16, at::promote_types(x.scalar_type(), weight.scalar_type())};
  if (style == RmsNormStyle::kFp32Product) return {false, x.scalar_type()};
  const bool low = weight.scalar_type() == at::kBFloat16;
  return {low, low ? at::kBFloat16 : at::kFloat};
}

// Forward over contiguous x; rstd (rows) fp32 is filled when defined.
at::Tensor norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps, RmsNormStyle style, at::Tensor rstd) {
  const NormTypes types = norm_types(x, weight, style);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(types.out));
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const kernels::RmsNormForward args{x.const_data_ptr(), elem(x), w.const_data_ptr<float>(), out.data_ptr(),
                                     elem(out), rstd.defined() ? rstd.data_ptr<float>() : nullptr, dim,
                                     static_cast<float>(eps), types.round_bf16};
  const bool avx2 = use_avx2();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kernels::kRmsNormScratchRows * dim);
    if (avx2) kernels::AVX2::rms_norm_forward(args, begin, end, scratch.data());
    else kernels::DEFAULT::rms_norm_forward(args, begin, end, scratch.data());
  });
  return out;
}

struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight, double eps,
                            int64_t style) {
    const at::Tensor x = x_in.contiguous();
    const int64_t rows = x.numel() / x.size(-1);
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    at::Tensor out = norm_forward(x, weight, eps, static_cast<RmsNormStyle>(style), rstd);
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["style"] = style;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& rstd = saved[2];
    const auto style = static_cast<RmsNormStyle>(ctx->saved_data["style"].toInt());
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    if (!grad_outputs[0].defined() || !(want_x || want_w)) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const NormTypes types = norm_types(x, weight, style);
    const at::Tensor g = grad_outputs[0].to(types.out).contiguous();
    const at::Tensor w = weight.to(at::kFloat).contiguous();
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    at::Tensor grad_x = want_x ? at::empty(x.sizes(), x.options()) : at::Tensor();
    // One fp32 partial weight gradient per thread, summed at the end (fp32 accumulation whatever the dtypes).
    const int threads = at::get_num_threads();
    at::Tensor partial = want_w ? at::zeros({threads, dim}, x.options().dtype(at::kFloat)) : at::Tensor();
    const kernels::RmsNormBackward args{x.const_data_ptr(), elem(x), w.const_data_ptr<float>(), rstd.const_data_ptr<float>(),
                                        g.const_data_ptr(), elem(g), want_x ? grad_x.data_ptr() : nullptr, nullptr, dim,
                                        types.round_bf16};
    const bool avx2 = use_avx2();
    at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(kernels::kRmsNormScratchRows * dim);
      kernels::RmsNormBackward mine = args;
      if (want_w) mine.grad_weight = partial.data_ptr<float>() + at::get_thread_num() * dim;
      if (avx2) kernels::AVX2::rms_norm_backward(mine, begin, end, scratch.data());
      else kernels::DEFAULT::rms_norm_backward(mine, begin, end, scratch.data());
    });
    at::Tensor grad_w = want_w ? partial.sum(0).to(weight.scalar_type()) : at::Tensor();
    return {grad_x, grad_w, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool fused_kernels_enabled() { return enabled_flag().load(std::memory_order_relaxed); }
void set_fused_kernels_enabled(bool enabled) { enabled_flag().store(enabled, std::memory_order_relaxed); }

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, RmsNormStyle style) {
  if (!fused_kernels_enabled() || !x.device().is_cpu() || !weight.device().is_cpu() || !supported_dtype(x) ||
      !supported_dtype(weight) || x.dim() < 1 || weight.dim() != 1 || x.numel() == 0 || weight.size(0) != x.size(-1))
    return {};
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return RmsNormFunction::apply(x, weight, eps, static_cast<int64_t>(style));
  return norm_forward(x.contiguous(), weight, eps, style, at::Tensor());
}

}  // namespace trainer
