// The bodies of trainer's CUDA kernels (src/util/counter_rng_kernels.cuh) run on the CPU over every block and thread
// of their launch: the same bits as the CPU kernels, every element written. What only a card can check (the launch,
// the grid-stride loop) is GpuCounterRng.KernelsGiveTheCpuBits.
#define TRAINER_KERNEL_FUNCTION inline
#include "util/counter_rng_kernels.cuh"

#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "util/counter_rng.h"

namespace trainer {
namespace {

// Every block and thread of the launch, in an order unlike the card's (last block first) with the mask set to `fill`.
at::Tensor emulated_keep_mask(uint64_t key, const at::Tensor& rows, const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& strides, uint32_t threshold, bool fill) {
  const auto launch = cuda_kernels::keep_mask_launch(static_cast<int>(sizes.size()), sizes.data(), strides.data());
  at::Tensor mask = at::full(sizes, fill, at::kBool);
  for (int64_t block = launch.blocks - 1; block >= 0; --block)
    for (int thread = 0; thread < cuda_kernels::kThreads; ++thread)
      cuda_kernels::keep_mask_block(block, thread, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32),
                                    rows.data_ptr<int64_t>(), launch.grid, threshold, launch.chunks_per_line,
                                    mask.data_ptr<bool>());
  return mask;
}

TEST(CounterRngKernels, KeepMaskBlocksGiveTheCpuBitsAndWriteEveryElement) {
  const uint64_t key = counter_key({42, 3, 5});
  const int64_t wrap = int64_t{1} << 32;
  const at::Tensor rows = at::tensor(std::vector<int64_t>{(int64_t{3} << 40) + wrap - 5, int64_t{0}, int64_t{11} << 40},
                                     at::kLong);
  struct Grid {
    std::vector<int64_t> sizes, strides;
  };
  const std::vector<Grid> grids = {
      {{3}, {}},
      {{3, 1}, {1}},
      {{3, 2500}, {1}},                                             // lines of several chunks
      {{3, 7, 129}, {129, 1}},                                      // hidden states (B, T, D)
      {{3, 2, 5, 1030}, {int64_t{1} << 32, int64_t{1} << 16, 1}},   // attention (B, H, Tq, Tk)
      {{3, 2, 3, 4, 5}, {int64_t{1} << 30, 1000, 17, 3}},
      {{3, 2, 1, 2, 1, 2, 1, 3}, {1 << 20, 1 << 17, 1 << 14, 1 << 11, 1 << 8, 1 << 5, 1}},  // eight dimensions
  };
  const double p = 0.1;
  const auto threshold = static_cast<uint32_t>(std::llround(p * 4294967296.0));
  for (const Grid& g : grids) {
    const at::Tensor cpu = counter_keep_mask(key, rows, g.sizes, g.strides, p);
    EXPECT_TRUE(at::equal(emulated_keep_mask(key, rows, g.sizes, g.strides, threshold, false), cpu))
        << "rank " << g.sizes.size();
    EXPECT_TRUE(at::equal(emulated_keep_mask(key, rows, g.sizes, g.strides, threshold, true), cpu))
        << "rank " << g.sizes.size() << ": an element the launch does not write";
  }
}

TEST(CounterRngKernels, StochasticRoundingElementsGiveTheCpuBits) {
  const at::Tensor src = at::randn({40000}, at::kFloat) * 100;
  src[5] = INFINITY;
  src[6] = -INFINITY;
  src[7] = NAN;
  const uint64_t key = counter_key({5, 9, 2});
  const at::Tensor cpu = at::empty({40000}, at::kBFloat16);
  stochastic_round_bf16_(cpu, src, key, 777);
  const float* in = src.data_ptr<float>();
  const auto* expected = reinterpret_cast<const uint16_t*>(cpu.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < src.numel(); ++i) {
    uint32_t u;
    std::memcpy(&u, in + i, sizeof u);
    const uint16_t got = cuda_kernels::stochastic_round_element(u, static_cast<uint32_t>(key),
                                                                static_cast<uint32_t>(key >> 32), 777 + i);
    ASSERT_EQ(got, expected[i]) << "element " << i << " (" << in[i] << ")";
  }
}

}  // namespace
}  // namespace trainer
