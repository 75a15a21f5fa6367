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
