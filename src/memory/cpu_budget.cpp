// The CPU budget allocator (see cpu_budget.h): counts bytes, refuses past the limit, allocates with c10's
// aligned CPU allocation like LibTorch's default allocator.
#include "memory/cpu_budget.h"

#include <atomic>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "trainer/config.h"

namespace trainer {
namespace {

// Each block carries its size in a 64-byte header in front of the data (64 keeps LibTorch's alignment), so the
// DataPtr is "simple" (data == context) and raw_allocate()/raw_deleter() work: some kernels (oneDNN's bf16
// paths) allocate through them, and a DataPtr with a separate context would fail their internal assert.
constexpr std::size_t kHeader = 64;

class BudgetAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    const auto n = static_cast<int64_t>(bytes);
    const int64_t now = allocated_.fetch_add(n) + n;
    const int64_t limit = limit_.load();
    if (limit > 0 && now > limit) {
      allocated_.fetch_sub(n);
      num_ooms_.fetch_add(1);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU memory budget exceeded: tried to allocate ",
                       human_bytes(static_cast<double>(n)), "; ", human_bytes(static_cast<double>(now - n)),
                       " of the ", human_bytes(static_cast<double>(limit)), " budget (memory.limit) are in use");
    }
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    void* base = nullptr;
    try {
      base = c10::alloc_cpu(bytes + kHeader);  // aligned, with LibTorch's large-page advice
    } catch (const c10::Error&) {  // the machine itself is out of memory: give the bytes back, report it as OOM
      allocated_.fetch_sub(n);
      num_ooms_.fetch_add(1);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: could not allocate ",
                       human_bytes(static_cast<double>(n)));
    }
    *static_cast<int64_t*>(base) = n;
    void* data = static_cast<char*>(base) + kHeader;
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_limit(int64_t bytes) { limit_.store(bytes); }
  CpuMemoryStats stats() const { return {allocated_.load(), peak_.load(), limit_.load(), num_ooms_.load()}; }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  static void release(void* data);

  std::atomic<int64_t> allocated_{0}, peak_{0}, limit_{0}, num_ooms_{0};
};

// Never destroyed: tensors can outlive main's locals and static destructors.
BudgetAllocator* instance = nullptr;

}  // namespace

void BudgetAllocator::release(void* data) {
  if (!data) return;
  void* base = static_cast<char*>(data) - kHeader;
  instance->allocated_.fetch_sub(*static_cast<int64_t*>(base));
  c10::free_cpu(base);
}

void install_cpu_budget() {
  if (instance) return;
  instance = new BudgetAllocator();
  // Priority above the built-in registration (0), so nothing re-registers over it.
  c10::SetCPUAllocator(instance, /*priority=*/100);
}

bool cpu_budget_installed() { return instance != nullptr; }

void set_cpu_budget_limit(int64_t bytes) {
  install_cpu_budget();
  instance->set_limit(bytes);
}

CpuMemoryStats cpu_memory_stats() { return instance ? instance->stats() : CpuMemoryStats{}; }

void reset_cpu_peak() {
  if (instance) instance->reset_peak();
}

}  // namespace trainer
