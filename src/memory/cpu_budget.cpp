// The CPU budget allocator (see cpu_budget.h). Each allocation is forwarded to the allocator that was installed
// before (LibTorch's default); the returned DataPtr's context owns the inner DataPtr and remembers the size,
// so freeing gives the bytes back to the budget.
#include "memory/cpu_budget.h"

#include <atomic>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "trainer/config.h"

namespace trainer {
namespace {

class BudgetAllocator final : public c10::Allocator {
 public:
  explicit BudgetAllocator(c10::Allocator* inner) : inner_(inner) {}

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
    // If the inner allocator throws, the guard gives the bytes back and its error goes on unchanged.
    struct Undo {
      std::atomic<int64_t>& counter;
      int64_t bytes;
      bool armed = true;
      ~Undo() {
        if (armed) counter.fetch_sub(bytes);
      }
    } undo{allocated_, n};
    c10::DataPtr inner = inner_->allocate(bytes);
    undo.armed = false;
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* context = new Context{std::move(inner), n, this};
    return c10::DataPtr(data, context, &release, device);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_limit(int64_t bytes) { limit_.store(bytes); }
  CpuMemoryStats stats() const { return {allocated_.load(), peak_.load(), limit_.load(), num_ooms_.load()}; }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    int64_t bytes;
    BudgetAllocator* owner;
  };
  static void release(void* raw) {
    auto* context = static_cast<Context*>(raw);
    context->owner->allocated_.fetch_sub(context->bytes);
    delete context;  // frees the inner DataPtr with the inner allocator's deleter
  }

  c10::Allocator* inner_;
  std::atomic<int64_t> allocated_{0}, peak_{0}, limit_{0}, num_ooms_{0};
};

// Never destroyed: tensors can outlive main's locals and static destructors.
BudgetAllocator* instance = nullptr;

}  // namespace

void install_cpu_budget() {
  if (instance) return;
  instance = new BudgetAllocator(c10::GetCPUAllocator());
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
