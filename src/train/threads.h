// The intra-op thread count: LibTorch's automatic choice (one thread per core) unless TRAINER_NUM_THREADS says
// otherwise (docs/benchmarks.md#threads has what was measured).
#pragma once

namespace trainer {

// Sets LibTorch's intra-op threads from TRAINER_NUM_THREADS when it is set and returns that number; returns 0
// and changes nothing when it is not. A value that is not a whole number from 1 to 1024 is a UsageError.
int apply_num_threads_from_environment();

}  // namespace trainer
