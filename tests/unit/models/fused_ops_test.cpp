// The fused RMSNorm against the ATen compositions it replaces (the formulas of transformers' LlamaRMSNorm and
// T5LayerNorm in layers.cpp): values, output dtypes, gradients of input and weight, in fp32 and bf16, threaded,
// generic and AVX2 loops. The model parity tests (tests/parity/test_models.py) run through it as well.
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include "models/fused_kernels.h"
#include "models/fused_ops.h"
#include "models/layers.h"

namespace trainer {
namespace {

struct NormResult {
  at::Tensor y, grad_x, grad_w;
};

// y = norm(x, w), then backward of sum(y * g): the gradients any upstream gradient g produces.
NormResult run_norm(bool fused, RmsNormStyle style, const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& g,
                    bool weight_grad = true) {
  at::Tensor x = x0.detach().clone().requires_grad_(true);
  at::Tensor w = w0.detach().clone().requires_grad_(weight_grad);
  at::Tensor y;
  if (fused) {
    y = fused_rms_norm(x, w, 1e-6, style);
    EXPECT_TRUE(y.defined()) << "the fused path must apply to " << x.scalar_type() << "/" << w.scalar_type();
  } else {
    if (style == RmsNormStyle::kFp32Product) {  // Olmo2RMSNorm as transformers writes it (Gemma's with w = 1 + w)
      const at::Tensor h = x.to(at::kFloat);
      y = (w.to(at::kFloat) * (h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-6))).to(x.scalar_type());
    } else {
      y = style == RmsNormStyle::kT5 ? t5_rms_norm_unfused(x, w, 1e-6) : llama_rms_norm_unfused(x, w, 1e-6);
    }
  }
  (y.to(at::kFloat) * g).sum().backward();
  return {y.detach(), x.grad(), weight_grad ? w.grad() : at::Tensor()};
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
  EXPECT_TRUE(at::allclose(a32, b32, rtol, atol)) << what << ": max abs difference " << (a32 - b32).abs().max().item<double>();
}

class FusedRmsNorm : public ::testing::Test {
 protected:
  void SetUp() override { set_fused_kernels_enabled(true); }
};

}  // namespace

TEST_F(FusedRmsNorm, MatchesTheCompositionInEveryDtypeCombination) {
  at::manual_seed(7);
  // 77 and 1000: widths that are no multiple of the vector length, so the scalar tails run too.
  for (int64_t dim : {77, 1000}) {
    const at::Tensor x = at::randn({3, 5, dim}) * 2.0;
    const at::Tensor w = 1.0 + 0.2 * at::randn({dim});
    const at::Tensor g = at::randn({3, 5, dim});
    for (auto style : {RmsNormStyle::kLlama, RmsNormStyle::kT5, RmsNormStyle::kFp32Product}) {
      for (auto x_type : {at::kFloat, at::kBFloat16}) {
        for (auto w_type : {at::kFloat, at::kBFloat16}) {
          const std::string what = std::string(style == RmsNormStyle::kT5      ? "t5"
                                               : style == RmsNormStyle::kLlama ? "llama"
                                                                               : "fp32-product") + " x " +
                                   c10::toString(x_type) + " w " + c10::toString(w_type) + " dim " + std::to_string(dim);
          const NormResult fused = run_norm(true, style, x.to(x_type), w.to(w_type), g);
          const NormResult plain = run_norm(false, style, x.to(x_type), w.to(w_type), g);
          const bool all_fp32 = x_type == at::kFloat && w_type == at::kFloat;
          // fp32: the same maths up to summation order. bf16: one rounding step of bf16 (2^-8 relative) where
          // the composition rounds an intermediate the fused kernel keeps in fp32; the weight gradient sums 15
          // rows, so its bf16 tolerance is wider.
          expect_close(fused.y, plain.y, all_fp32 ? 1e-6 : 1e-2, all_fp32 ? 1e-6 : 1e-2, what + " values");
          expect_close(fused.grad_x, plain.grad_x, all_fp32 ? 1e-5 : 2e-2, all_fp32 ? 1e-6 : 2e-2, what + " grad x");
          expect_close(fused.grad_w, plain.grad_w, all_fp32 ? 1e-5 : 2e-2, all_fp32 ? 1e-5 : 1.5e-1, what + " grad w");
        }
      }
    }
  }
}

TEST_F(FusedRmsNorm, Bf16GradientsAreAtLeastAsCloseToFp64AsTheComposition) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({64, 256}), w = 1.0 + 0.2 * at::randn({256}), g = at::randn({64, 256});
  const NormResult exact = run_norm(false, RmsNormStyle::kLlama, x.to(at::kDouble), w.to(at::kDouble), g.to(at::kDouble));
  const NormResult fused = run_norm(true, RmsNormStyle::kLlama, x.to(at::kBFloat16), w, g);
  const NormResult plain = run_norm(false, RmsNormStyle::kLlama, x.to(at::kBFloat16), w, g);
  const auto error = [&](const at::Tensor& t) { return (t.to(at::kDouble) - exact.grad_x).abs().mean().item<double>(); };
  EXPECT_LE(error(fused.grad_x), error(plain.grad_x) * 1.05);
}

TEST_F(FusedRmsNorm, FrozenWeightNonContiguousInputAndThreads) {
  at::manual_seed(11);
  const at::Tensor x = at::randn({40, 6, 96}).transpose(0, 1);  // not contiguous
  const at::Tensor w = 1.0 + 0.2 * at::randn({96});
  const at::Tensor g = at::randn({6, 40, 96});
  const NormResult frozen = run_norm(true, RmsNormStyle::kLlama, x, w, g, /*weight_grad=*/false);
  const NormResult plain = run_norm(false, RmsNormStyle::kLlama, x, w, g, /*weight_grad=*/false);
  expect_close(frozen.grad_x, plain.grad_x, 1e-5, 1e-6, "frozen weight grad x");
  // The weight gradient is summed from one fp32 partial per thread.
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const NormResult threaded = run_norm(true, RmsNormStyle::kT5, x, w, g);
  at::set_num_threads(threads);
  const NormResult reference = run_norm(false, RmsNormStyle::kT5, x, w, g);
  expect_close(threaded.grad_w, reference.grad_w, 1e-5, 1e-5, "threaded grad w");
  expect_close(threaded.grad_x, reference.grad_x, 1e-5, 1e-6, "threaded grad x");
}

TEST_F(FusedRmsNorm, WithoutGradientsOnlyTheForwardRuns) {
  const at::Tensor x = at::randn({4, 32}), w = at::rand({32});
  at::NoGradGuard no_grad;
  const at::Tensor y = fused_rms_norm(x, w, 1e-6, RmsNormStyle::kLlama);
  ASSERT_TRUE(y.defined());
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(at::allclose(y, llama_rms_norm_unfused(x, w, 1e-6), 1e-6, 1e-6));
}

TEST_F(FusedRmsNorm, OtherDtypesAndTheSwitchFallBackToTheComposition) {
  const at::Tensor x = at::randn({4, 32}), w = at::rand({32});
  EXPECT_FALSE(fused_rms_norm(x.to(at::kDouble), w.to(at::kDouble), 1e-6, RmsNormStyle::kLlama).defined());
  EXPECT_FALSE(fused_rms_norm(x.to(at::kHalf), w, 1e-6, RmsNormStyle::kLlama).defined());
  EXPECT_FALSE(fused_rms_norm(x, at::rand({16}), 1e-6, RmsNormStyle::kLlama).defined());  // weight of another width
  // layers.cpp's entry points still answer, through the composition.
  EXPECT_TRUE(at::allclose(llama_rms_norm(x.to(at::kDouble), w.to(at::kDouble), 1e-6),
                           llama_rms_norm_unfused(x.to(at::kDouble), w.to(at::kDouble), 1e-6)));
  set_fused_kernels_enabled(false);
  EXPECT_FALSE(fused_rms_norm(x, w, 1e-6, RmsNormStyle::kLlama).defined());
  set_fused_kernels_enabled(true);
  EXPECT_TRUE(fused_rms_norm(x, w, 1e-6, RmsNormStyle::kLlama).defined());
}

#if defined(__x86_64__)
TEST_F(FusedRmsNorm, GenericAndAvx2LoopsAgree) {
  // Both objects are always built; the AVX2 one only runs on a CPU that has AVX2 and FMA.
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) GTEST_SKIP() << "no AVX2 on this CPU";
  at::manual_seed(5);
  const int64_t rows = 5, dim = 203;
  const at::Tensor x = at::randn({rows, dim}).to(at::kBFloat16), w = at::rand({dim}), g = at::randn({rows, dim});
  std::vector<float> scratch(kernels::kRmsNormScratchRows * dim);
  at::Tensor y_generic = at::empty({rows, dim}), y_avx2 = at::empty({rows, dim});
  at::Tensor r_generic = at::empty({rows}), r_avx2 = at::empty({rows});
  kernels::RmsNormForward args{x.const_data_ptr(), kernels::Elem::kBFloat16, w.const_data_ptr<float>(),
                               y_generic.data_ptr(), kernels::Elem::kFloat, r_generic.data_ptr<float>(), dim, 1e-6f, true};
  kernels::DEFAULT::rms_norm_forward(args, 0, rows, scratch.data());
  args.out = y_avx2.data_ptr();
  args.rstd = r_avx2.data_ptr<float>();
  kernels::AVX2::rms_norm_forward(args, 0, rows, scratch.data());
  EXPECT_TRUE(at::allclose(r_generic, r_avx2, 1e-6, 0));
  // bf16 rounding of the normalised row may flip on a last-bit difference of rstd: one bf16 step at most.
  EXPECT_TRUE(at::allclose(y_generic, y_avx2, 1e-2, 1e-6));
  // grad x has x's type (bf16 here).
  at::Tensor gx_generic = at::empty({rows, dim}, at::kBFloat16), gx_avx2 = at::empty({rows, dim}, at::kBFloat16);
  at::Tensor gw_generic = at::zeros({dim}), gw_avx2 = at::zeros({dim});
  kernels::RmsNormBackward back{x.const_data_ptr(), kernels::Elem::kBFloat16, w.const_data_ptr<float>(),
                                r_generic.const_data_ptr<float>(), g.const_data_ptr(), kernels::Elem::kFloat,
                                gx_generic.data_ptr(), gw_generic.data_ptr<float>(), dim, false};
  kernels::DEFAULT::rms_norm_backward(back, 0, rows, scratch.data());
  back.grad_x = gx_avx2.data_ptr();
  back.grad_weight = gw_avx2.data_ptr<float>();
  kernels::AVX2::rms_norm_backward(back, 0, rows, scratch.data());
  // Summation order differs (8 lanes against 1), so a bf16 rounding may flip: one bf16 step at most.
  EXPECT_TRUE(at::allclose(gx_generic.to(at::kFloat), gx_avx2.to(at::kFloat), 1e-2, 1e-6));
  EXPECT_TRUE(at::allclose(gw_generic, gw_avx2, 1e-5, 1e-6));
}
#endif

}  // namespace trainer
