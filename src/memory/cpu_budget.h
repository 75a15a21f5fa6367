// The CPU memory budget: a wrapper around LibTorch's CPU allocator that counts live tensor bytes and throws
// c10::OutOfMemoryError past a limit, exactly as the CUDA caching allocator does on a full GPU. Every
// out-of-memory path of the trainer is therefore exercised on a CPU, and CPU runs get allocated/peak statistics.
// Like the CUDA allocator it keeps freed blocks of 1 MiB and more for reuse (a request of their size, up to 1/8
// larger), so the large tensors a step frees and allocates again are not page-faulted in anew every step: at most
// a quarter of the peak of live bytes (64 MiB at least), and under a limit live plus cached bytes stay within it.
// TRAINER_CPU_CACHE=0 turns the cache off (benchmarks).
#pragma once

#include <cstdint>

namespace trainer {

struct CpuMemoryStats {
  int64_t allocated = 0;   // live bytes of tensors allocated through the budget
  int64_t peak = 0;        // highest `allocated` since the last reset
  int64_t limit = 0;       // 0: no limit
  int64_t num_ooms = 0;    // allocations refused
  int64_t cached = 0;      // bytes of freed blocks kept for reuse (not live, not counted against the limit)
};

// Installs the budget allocator as LibTorch's CPU allocator (once; later calls do nothing). Call it first thing
// in main, before any tensor exists; memory allocated before is not counted (but freed correctly).
void install_cpu_budget();
bool cpu_budget_installed();

// 0 removes the limit. Allocations already made are kept even when they exceed a new, lower limit.
void set_cpu_budget_limit(int64_t bytes);
CpuMemoryStats cpu_memory_stats();
void reset_cpu_peak();
// Frees every kept block (tests; a run gives kept blocks back by itself when the machine is short of memory).
void empty_cpu_cache();

}  // namespace trainer
