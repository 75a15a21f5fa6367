// The CPU budget allocator raises the same c10::OutOfMemoryError a GPU would, and recovers when memory is freed.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "memory/cpu_budget.h"
#include "models/model.h"
#include "models/weights.h"
#include "support/paths.h"

namespace trainer {
namespace {

// Restores "no limit" however a test ends.
struct BudgetScope {
  explicit BudgetScope(int64_t limit) {
    install_cpu_budget();
    set_cpu_budget_limit(limit);
  }
  ~BudgetScope() { set_cpu_budget_limit(0); }
};

}  // namespace

TEST(CpuBudget, CountsLiveBytesAndPeak) {
  BudgetScope scope(0);
  const auto before = cpu_memory_stats().allocated;
  reset_cpu_peak();
  {
    at::Tensor t = at::empty({1024, 1024}, at::kFloat);  // 4 MiB
    EXPECT_GE(cpu_memory_stats().allocated - before, 4 << 20);
  }
  EXPECT_EQ(cpu_memory_stats().allocated, before);
  EXPECT_GE(cpu_memory_stats().peak - before, 4 << 20);
}

TEST(CpuBudget, RaisesOutOfMemoryPastTheLimitAndRecovers) {
  BudgetScope scope(0);
  const int64_t base = cpu_memory_stats().allocated;
  set_cpu_budget_limit(base + (10 << 20));
  at::Tensor a = at::empty({6 << 20}, at::kByte);
  const auto ooms = cpu_memory_stats().num_ooms;
  try {
    at::Tensor b = at::empty({6 << 20}, at::kByte);
    FAIL() << "expected an out-of-memory error";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("memory.limit"), std::string::npos);
  }
  EXPECT_EQ(cpu_memory_stats().num_ooms, ooms + 1);
  a.reset();  // freeing makes room again
  at::Tensor c = at::empty({6 << 20}, at::kByte);
  EXPECT_EQ(c.numel(), 6 << 20);
}

// Freed blocks of 1 MiB and more are kept and handed out again for a request of their size (up to 1/8 larger):
// the same memory comes back, the budget counts only live bytes, smaller blocks are not kept, and under a limit
// live plus kept bytes stay within it.
TEST(CpuBudget, KeepsFreedLargeBlocksForReuseWithinTheLimit) {
  BudgetScope scope(0);
  empty_cpu_cache();
  const int64_t base = cpu_memory_stats().allocated;
  const void* first = nullptr;
  {
    at::Tensor t = at::empty({8 << 20}, at::kByte);
    first = t.data_ptr();
  }
  EXPECT_EQ(cpu_memory_stats().allocated, base);
  EXPECT_GE(cpu_memory_stats().cached, 8 << 20);
  {
    at::Tensor again = at::empty({(8 << 20) - 4096}, at::kByte);  // a little smaller: the kept block serves it
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(cpu_memory_stats().allocated - base, (8 << 20) - 4096);
    at::Tensor other = at::empty({8 << 20}, at::kByte);  // the kept block is taken: a fresh one
    EXPECT_NE(other.data_ptr(), first);
  }
  const int64_t kept = cpu_memory_stats().cached;
  EXPECT_GE(kept, 16 << 20);
  {
    at::Tensor smaller = at::empty({6 << 20}, at::kByte);  // under 8/9 of the kept blocks: none serves it
    EXPECT_EQ(cpu_memory_stats().cached, kept);
  }
  const int64_t with_smaller = cpu_memory_stats().cached;
  { at::Tensor small = at::empty({64 << 10}, at::kByte); }
  EXPECT_EQ(cpu_memory_stats().cached, with_smaller) << "blocks under 1 MiB are not kept";
  // Under a limit: kept blocks are given back so that live + kept bytes fit.
  set_cpu_budget_limit(base + (12 << 20));
  EXPECT_LE(cpu_memory_stats().allocated + cpu_memory_stats().cached, base + (12 << 20));
  {
    at::Tensor big = at::empty({11 << 20}, at::kByte);
    EXPECT_LE(cpu_memory_stats().allocated + cpu_memory_stats().cached, base + (12 << 20));
  }
  set_cpu_budget_limit(0);
  empty_cpu_cache();
  EXPECT_EQ(cpu_memory_stats().cached, 0);
}

TEST(CpuBudget, AnOutOfMemoryInBackwardUnwindsAndASmallerBatchFits) {
  auto model = load_model(test::source_path("configs/models/tiny-qwen2"), ModelInit::kRandom,
                          at::TensorOptions().dtype(at::kFloat), 1);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  auto batch_of = [](int64_t rows) {
    Batch b;
    b.input_ids = at::randint(3, 500, {rows, 128}, at::kLong);
    b.attention_mask = at::ones_like(b.input_ids);
    b.labels = b.input_ids.clone();
    return b;
  };
  BudgetScope scope(0);
  const int64_t base = cpu_memory_stats().allocated;
  // Measure one row's step, then allow a bit more than that: 16 rows cannot fit.
  reset_cpu_peak();
  forward_loss(*model, batch_of(1)).loss_sum.backward();
  const int64_t one_row = cpu_memory_stats().peak - base;
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.mutable_grad() = at::Tensor(); });
  set_cpu_budget_limit(base + 2 * one_row);
  EXPECT_THROW(forward_loss(*model, batch_of(16)).loss_sum.backward(), c10::OutOfMemoryError);
  // Everything of the failed attempt was released: the same process goes on with one row.
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.mutable_grad() = at::Tensor(); });
  EXPECT_LE(cpu_memory_stats().allocated, base + one_row);
  EXPECT_NO_THROW(forward_loss(*model, batch_of(1)).loss_sum.backward());
}

}  // namespace trainer
