// The CPU budget allocator (see cpu_budget.h): counts bytes, refuses past the limit, allocates with c10's
// aligned CPU allocation like LibTorch's default allocator, and keeps freed large blocks for reuse.
#include "memory/cpu_budget.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "trainer/config.h"

namespace trainer {
namespace {

// Each block carries its sizes in a 64-byte header in front of the data (64 keeps LibTorch's alignment), so the
// DataPtr is "simple" (data == context) and raw_allocate()/raw_deleter() work: some kernels (oneDNN's bf16
// paths) allocate through them, and a DataPtr with a separate context would fail their internal assert.
constexpr std::size_t kHeader = 64;
struct Header {
  int64_t requested;  // the bytes asked for: what the budget counts
  int64_t capacity;   // the bytes behind the header (a reused block may be a little larger)
};

// Freed blocks of at least kCacheMin bytes are kept and handed out again for a request of their size (up to
// 1/8 larger). A training step frees and allocates the same large tensors every step (an embedding's gradient,
// the loss's logits chunks, attention scores); without the cache glibc returns blocks of 32 MiB and more to the
// kernel at every free and the next step page-faults them in again (7% of a bf16-mixed t5-60m step).
constexpr int64_t kCacheMin = int64_t{1} << 20;

class BudgetAllocator final : public c10::Allocator {
 public:
  BudgetAllocator() {
    const char* value = std::getenv("TRAINER_CPU_CACHE");
    caching_ = !(value && std::strcmp(value, "0") == 0);
  }

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
    int64_t capacity = n;
    void* base = caching_ && n >= kCacheMin ? take_cached(n, &capacity) : nullptr;
    if (base == nullptr) {
      // Under a limit, live and kept bytes together stay within it.
      if (limit > 0 && now + cached_.load() > limit) trim_cache(std::max<int64_t>(0, limit - now));
      try {
        base = c10::alloc_cpu(bytes + kHeader);  // aligned, with LibTorch's large-page advice
      } catch (const c10::Error&) {
        try {  // the machine is out of memory: what the cache holds goes back first
          trim_cache(0);
          base = c10::alloc_cpu(bytes + kHeader);
        } catch (const c10::Error&) {  // still out of memory: give the bytes back, report it as OOM
          allocated_.fetch_sub(n);
          num_ooms_.fetch_add(1);
          TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: could not allocate ",
                           human_bytes(static_cast<double>(n)));
        }
      }
    }
    *static_cast<Header*>(base) = {n, capacity};
    void* data = static_cast<char*>(base) + kHeader;
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void set_limit(int64_t bytes) {
    limit_.store(bytes);
    if (bytes > 0) trim_cache(std::max<int64_t>(0, bytes - allocated_.load()));
  }
  CpuMemoryStats stats() const {
    return {allocated_.load(), peak_.load(), limit_.load(), num_ooms_.load(), cached_.load()};
  }
  void reset_peak() { peak_.store(allocated_.load()); }
  void empty_cache() { trim_cache(0); }

 private:
  static void release(void* data);

  // Without a limit the cache holds at most a quarter of the peak of live bytes (64 MiB at least); under a limit,
  // live and cached bytes together stay within it.
  int64_t cache_cap() const {
    const int64_t limit = limit_.load();
    if (limit > 0) return std::max<int64_t>(0, limit - allocated_.load());
    return std::max<int64_t>(int64_t{64} << 20, peak_.load() / 4);
  }

  void* take_cached(int64_t n, int64_t* capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = blocks_.lower_bound(n);
    if (it == blocks_.end() || it->first > n + n / 8) return nullptr;
    void* base = it->second;
    *capacity = it->first;
    cached_ -= it->first;
    blocks_.erase(it);
    return base;
  }

  // Keeps a freed block when it fits under the cap (freeing the smallest kept blocks to make room); false: the
  // caller frees it.
  bool offer(void* base, int64_t capacity) {
    const int64_t cap = cache_cap();
    if (capacity > cap) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    while (cached_ + capacity > cap && !blocks_.empty()) {
      c10::free_cpu(blocks_.begin()->second);
      cached_ -= blocks_.begin()->first;
      blocks_.erase(blocks_.begin());
    }
    blocks_.emplace(capacity, base);
    cached_ += capacity;
    return true;
  }

  // Frees kept blocks, largest first, until at most `keep` bytes are kept.
  void trim_cache(int64_t keep) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (cached_ > keep && !blocks_.empty()) {
      auto last = std::prev(blocks_.end());
      c10::free_cpu(last->second);
      cached_ -= last->first;
      blocks_.erase(last);
    }
  }

  std::atomic<int64_t> allocated_{0}, peak_{0}, limit_{0}, num_ooms_{0};
  bool caching_ = true;
  std::mutex mutex_;
  std::multimap<int64_t, void*> blocks_;  // capacity -> block base
  std::atomic<int64_t> cached_{0};        // bytes in blocks_ (changed under mutex_)
};

// Never destroyed: tensors can outlive main's locals and static destructors.
BudgetAllocator* instance = nullptr;

}  // namespace

void BudgetAllocator::release(void* data) {
  if (!data) return;
  void* base = static_cast<char*>(data) - kHeader;
  const Header header = *static_cast<Header*>(base);
  instance->allocated_.fetch_sub(header.requested);
  if (instance->caching_ && header.capacity >= kCacheMin && instance->offer(base, header.capacity)) return;
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

void empty_cpu_cache() {
  if (instance) instance->empty_cache();
}

}  // namespace trainer
