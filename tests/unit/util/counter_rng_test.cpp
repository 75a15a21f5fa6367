// Counter-based random bits: one function on the host, the CPU kernels and the tensor ops; the statistics of
// keep-masks; stochastic rounding's neighbours and expectation.
#include "util/counter_rng.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"

namespace trainer {
namespace {

TEST(CounterRng, TensorOpsGiveTheHostBits) {
  const uint64_t key = counter_key({1234, 7, 3});
  const std::vector<int64_t> counters = {0, 1, 2, 65535, 65536, (int64_t{1} << 32) - 1, int64_t{1} << 32,
                                         (int64_t{5} << 40) + 17, (int64_t{1} << 62) + 99, 123456789012345};
  const at::Tensor bits = counter_bits(key, at::tensor(counters, at::kLong));
  for (std::size_t i = 0; i < counters.size(); ++i)
    EXPECT_EQ(bits[static_cast<int64_t>(i)].item<int64_t>(), counter_bits(key, static_cast<uint64_t>(counters[i])))
        << "counter " << counters[i];
}

TEST(CounterRng, KeysDependOnEveryPartAndItsOrder) {
  EXPECT_NE(counter_key({1, 2, 3}), counter_key({1, 2, 4}));
  EXPECT_NE(counter_key({1, 2, 3}), counter_key({3, 2, 1}));
  EXPECT_NE(counter_key({0}), counter_key({0, 0}));
  EXPECT_EQ(counter_key({9, 8}), counter_key({9, 8}));
}

TEST(CounterRng, CpuKeepMaskEqualsTheTensorOps) {
  const uint64_t key = counter_key({42, 1});
  const at::Tensor rows = at::tensor(std::vector<int64_t>{int64_t{3} << 40, int64_t{0}, int64_t{11} << 40}, at::kLong);
  for (const std::vector<int64_t>& sizes : {std::vector<int64_t>{3}, {3, 7}, {3, 4, 5}, {3, 2, 3, 5}}) {
    std::vector<int64_t> strides;
    for (std::size_t d = 1; d < sizes.size(); ++d) strides.push_back(int64_t{1} << (16 * (sizes.size() - 1 - d)));
    const at::Tensor cpu = counter_keep_mask(key, rows, sizes, strides, 0.3);
    const at::Tensor ops = counter_bits(key, grid_counters(rows, sizes, strides)).ge(std::llround(0.3 * 4294967296.0));
    EXPECT_TRUE(at::equal(cpu, ops)) << "sizes of rank " << sizes.size();
  }
}

TEST(CounterRng, CpuKeepMaskLinesOfEveryLengthEqualTheTensorOps) {
  // The CPU kernel takes eight counters at a time where a line's lower halves do not cross a multiple of 2^32, one
  // at a time where they do: lines of 1 to 41 and 1000 elements, strides 1, 3 and 2^16, and rows starting just below
  // a multiple of 2^32 (the line crosses it), at it, and anywhere.
  const uint64_t key = counter_key({7, 99});
  const int64_t wrap = int64_t{1} << 32;
  const at::Tensor rows = at::tensor(std::vector<int64_t>{(int64_t{3} << 40) + wrap - 5, int64_t{0}, wrap,
                                                          (int64_t{11} << 40) + 123456789, 4 * wrap - 1},
                                     at::kLong);
  std::vector<int64_t> lengths(41);
  for (int64_t n = 1; n <= 41; ++n) lengths[static_cast<std::size_t>(n - 1)] = n;
  lengths.push_back(1000);
  for (const int64_t stride : {int64_t{1}, int64_t{3}, int64_t{1} << 16})
    for (const int64_t n : lengths) {
      const std::vector<int64_t> sizes = {rows.size(0), 2, n};
      const std::vector<int64_t> strides = {int64_t{1} << 24, stride};
      const at::Tensor cpu = counter_keep_mask(key, rows, sizes, strides, 0.25);
      const at::Tensor ops =
          counter_bits(key, grid_counters(rows, sizes, strides)).ge(std::llround(0.25 * 4294967296.0));
      ASSERT_TRUE(at::equal(cpu, ops)) << "line of " << n << ", stride " << stride;
    }
}

TEST(CounterRng, MaskOfAnExampleDoesNotDependOnItsBatchOrPadding) {
  // Example 5 alone with 6 positions, and inside a batch padded to 9 positions: its first 6 positions agree.
  const uint64_t key = counter_key({1, 2});
  const auto alone = counter_keep_mask(key, at::tensor({int64_t{5} << 40}, at::kLong), {1, 6, 4}, {4, 1}, 0.5);
  const auto batch =
      counter_keep_mask(key, at::tensor({int64_t{2} << 40, int64_t{5} << 40}, at::kLong), {2, 9, 4}, {4, 1}, 0.5);
  EXPECT_TRUE(at::equal(alone[0], batch[1].narrow(0, 0, 6)));
}

TEST(CounterRng, KeepRateAndIndependence) {
  constexpr int64_t kRows = 64, kCols = 16384;
  constexpr double kP = 0.1;
  const at::Tensor rows = at::arange(kRows, at::kLong).mul_(int64_t{1} << 40);
  const at::Tensor a = counter_keep_mask(counter_key({7, 1, 0}), rows, {kRows, kCols}, {1}, kP).to(at::kDouble);
  const at::Tensor b = counter_keep_mask(counter_key({7, 1, 1}), rows, {kRows, kCols}, {1}, kP).to(at::kDouble);
  const at::Tensor c = counter_keep_mask(counter_key({7, 2, 0}), rows, {kRows, kCols}, {1}, kP).to(at::kDouble);
  const double n = static_cast<double>(kRows * kCols);
  const double q = 1 - kP;
  const double se = std::sqrt(kP * q / n);
  EXPECT_NEAR(a.mean().item<double>(), q, 5 * se);
  // Correlation of two masks: E[xy] - E[x]E[y] has standard error ~ p q / sqrt(n) for independent masks.
  const auto covariance = [&](const at::Tensor& x, const at::Tensor& y) {
    return (x * y).mean().item<double>() - x.mean().item<double>() * y.mean().item<double>();
  };
  const double cov_se = kP * q / std::sqrt(n);
  EXPECT_NEAR(covariance(a, b), 0.0, 5 * cov_se) << "layers";
  EXPECT_NEAR(covariance(a, c), 0.0, 5 * cov_se) << "steps";
  EXPECT_NEAR(covariance(a.narrow(0, 0, kRows / 2), a.narrow(0, kRows / 2, kRows / 2)), 0.0, 5 * cov_se * std::sqrt(2.0))
      << "examples";
  EXPECT_NEAR(covariance(a.narrow(1, 0, kCols - 1), a.narrow(1, 1, kCols - 1)), 0.0, 5 * cov_se) << "neighbours";
  // Rows of one mask are not shifted copies of each other: per-row keep counts vary as a binomial's do.
  const double row_sd = a.mean(1).std().item<double>();
  EXPECT_NEAR(row_sd, std::sqrt(kP * q / kCols), 0.5 * std::sqrt(kP * q / kCols));
}

// What a device without a kernel of its own (and, before its kernel, CUDA) runs: tensor ops in chunks. Chunks of any
// size, rows split along inner dimensions when one row is larger than a chunk, give the CPU kernel's bits.
TEST(CounterRng, KeepMaskOpsInChunksOfAnySizeGiveTheCpuBits) {
  const uint64_t key = counter_key({42, 3, 5});
  const at::Tensor rows = at::tensor(std::vector<int64_t>{int64_t{3} << 40, int64_t{0}, int64_t{11} << 40}, at::kLong);
  struct Grid {
    std::vector<int64_t> sizes, strides;
  };
  const std::vector<Grid> grids = {
      {{3}, {}},
      {{3, 37}, {1}},
      {{3, 4, 33}, {33, 1}},                                          // hidden states (B, T, D)
      {{3, 5, 6, 7}, {int64_t{1} << 32, int64_t{1} << 16, 1}},        // attention (B, H, Tq, Tk)
      {{3, 2, 3, 4, 5}, {int64_t{1} << 30, 1000, 17, 3}},
  };
  for (const Grid& g : grids) {
    const at::Tensor cpu = counter_keep_mask(key, rows, g.sizes, g.strides, 0.3);
    for (const int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{7}, int64_t{64}, int64_t{1000}, int64_t{1} << 22}) {
      const at::Tensor ops = counter_keep_mask_ops(key, rows, g.sizes, g.strides, 0.3, chunk);
      EXPECT_EQ(ops.sizes(), cpu.sizes());
      EXPECT_TRUE(at::equal(ops, cpu)) << "rank " << g.sizes.size() << ", chunks of " << chunk;
    }
  }
}

TEST(CounterRng, StochasticRoundingOpsInChunksGiveTheCpuBits) {
  const at::Tensor src = at::randn({5003}, at::kFloat) * 10;
  const at::Tensor cpu = at::empty({5003}, at::kBFloat16);
  stochastic_round_bf16_(cpu, src, counter_key({8, 1}), 31);
  for (const int64_t chunk : {int64_t{1}, int64_t{999}, int64_t{5003}, int64_t{1} << 22}) {
    const at::Tensor ops = at::empty({5003}, at::kBFloat16);
    stochastic_round_bf16_ops_(ops, src, counter_key({8, 1}), 31, chunk);
    EXPECT_TRUE(at::equal(ops.view(at::kShort), cpu.view(at::kShort))) << "chunks of " << chunk;
  }
}

// The tensor-op mask's int64 temporaries (about 40 bytes an element at once, unchunked) are bounded by the chunk:
// a 32-million-element attention mask (32 MiB of bools, over a gigabyte of temporaries in one piece) is made within
// its own size plus 512 MiB of the CPU budget, which would run out of memory unchunked.
TEST(CounterRng, KeepMaskOpsTemporariesStayWithinTheChunk) {
  install_cpu_budget();
  const at::Tensor rows = at::tensor(std::vector<int64_t>{int64_t{0}, int64_t{1} << 40}, at::kLong);
  const std::vector<int64_t> sizes = {2, 16, 1024, 1024};
  const std::vector<int64_t> strides = {int64_t{1} << 32, int64_t{1} << 16, 1};
  const int64_t base = cpu_memory_stats().allocated;
  set_cpu_budget_limit(base + (int64_t{32} << 20) + (int64_t{512} << 20));
  at::Tensor mask;
  EXPECT_NO_THROW(mask = counter_keep_mask_ops(counter_key({1, 2}), rows, sizes, strides, 0.1));
  set_cpu_budget_limit(0);
  ASSERT_TRUE(mask.defined());
  EXPECT_TRUE(at::equal(mask, counter_keep_mask(counter_key({1, 2}), rows, sizes, strides, 0.1)));
  set_cpu_budget_limit(base + (int64_t{32} << 20) + (int64_t{512} << 20));
  EXPECT_THROW(counter_keep_mask_ops(counter_key({1, 2}), rows, sizes, strides, 0.1, int64_t{1} << 30),
               c10::OutOfMemoryError)
      << "in one piece the temporaries do not fit: the bound above is the chunking's doing";
  set_cpu_budget_limit(0);
}

TEST(CounterRng, StochasticRoundingPicksANeighbourWithoutBias) {
  // Values between bf16 neighbours, negative and positive, tiny and large.
  const std::vector<float> values = {1.0f + 0.3f / 128, -0.05f - 1e-6f, 3.1e-5f, 7.77e20f, -1234.567f, 0.0f, 2.0f};
  constexpr int64_t kDraws = 20000;
  for (const float v : values) {
    const at::Tensor src = at::full({kDraws}, v, at::kFloat);
    const at::Tensor dst = at::empty({kDraws}, at::kBFloat16);
    stochastic_round_bf16_(dst, src, counter_key({3, 1}), 1000);
    const at::Tensor out = dst.to(at::kFloat);
    // Every result is one of the two bf16 values bracketing v.
    const at::Tensor lower = out.le(v), upper = out.ge(v);
    EXPECT_TRUE(at::logical_or(lower, upper).all().item<bool>());
    EXPECT_LE(std::get<0>(at::_unique(out)).numel(), 2) << v;
    const double mean = out.to(at::kDouble).mean().item<double>();
    const double gap = (out.max() - out.min()).item<double>();
    // Bernoulli with probability f between the neighbours: standard error of the mean <= gap / (2 sqrt(n)).
    EXPECT_NEAR(mean, static_cast<double>(v), 5 * std::max(gap, 1e-30) / (2 * std::sqrt(double(kDraws)))) << v;
    if (static_cast<float>(at::BFloat16(v)) == v) {
      EXPECT_TRUE(at::equal(out, src)) << "a bf16 value stays as it is: " << v;
    }
  }
}

TEST(CounterRng, StochasticRoundingCpuEqualsTheTensorOpsAndKeepsNonFinite) {
  const at::Tensor src = at::randn({10007}, at::kFloat) * 100;
  src[5] = INFINITY;
  src[6] = -INFINITY;
  src[7] = NAN;
  const at::Tensor cpu = at::empty({10007}, at::kBFloat16), ops = at::empty({10007}, at::kBFloat16);
  stochastic_round_bf16_(cpu, src, counter_key({5, 9, 2}), 777);
  stochastic_round_bf16_ops_(ops, src, counter_key({5, 9, 2}), 777);
  // Bit for bit, but for the NaN (whose payload each conversion may choose).
  const at::Tensor differ = cpu.view(at::kShort).ne(ops.view(at::kShort)).logical_and_(src.isnan().logical_not()).nonzero();
  EXPECT_EQ(differ.numel(), 0) << differ;
  EXPECT_TRUE(std::isnan(ops[7].item<float>()));
  EXPECT_TRUE(std::isinf(cpu[5].item<float>()) && cpu[5].item<float>() > 0);
  EXPECT_TRUE(std::isinf(cpu[6].item<float>()) && cpu[6].item<float>() < 0);
  EXPECT_TRUE(std::isnan(cpu[7].item<float>()));
  // The counter, not the call, draws the bits: a range starting one later is the same draws shifted by one.
  const at::Tensor same = at::full({4096}, 0.1f, at::kFloat);
  const at::Tensor first = at::empty({4096}, at::kBFloat16), shifted = at::empty({4096}, at::kBFloat16);
  stochastic_round_bf16_(first, same, counter_key({5, 9, 2}), 777);
  stochastic_round_bf16_(shifted, same, counter_key({5, 9, 2}), 778);
  EXPECT_TRUE(at::equal(shifted.narrow(0, 0, 4095).view(at::kShort), first.narrow(0, 1, 4095).view(at::kShort)));
  EXPECT_FALSE(at::equal(shifted.view(at::kShort), first.view(at::kShort)));
}

}  // namespace
}  // namespace trainer
