// The CPU memory budget: a wrapper around LibTorch's CPU allocator that counts live tensor bytes and throws
// c10::OutOfMemoryError past a limit, exactly as the CUDA caching allocator does on a full GPU. Every
// out-of-memory path of the trainer is therefore exercised on a CPU, and CPU runs get allocated/peak statistics.
#pragma once

#include <cstdint>

namespace trainer {

struct CpuMemoryStats {
  int64_t allocated = 0;   // live bytes of tensors allocated through the budget
  int64_t peak = 0;        // highest `allocated` since the last reset
  int64_t limit = 0;       // 0: no limit
  int64_t num_ooms = 0;    // allocations refused
};

// Installs the budget allocator as LibTorch's CPU allocator (once; later calls do nothing). Call it first thing
// in main, before any tensor exists; memory allocated before is not counted (but freed correctly).
void install_cpu_budget();
bool cpu_budget_installed();

// 0 removes the limit. Allocations already made are kept even when they exceed a new, lower limit.
void set_cpu_budget_limit(int64_t bytes);
CpuMemoryStats cpu_memory_stats();
void reset_cpu_peak();

}  // namespace trainer
