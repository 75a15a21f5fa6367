// TRAINER_NUM_THREADS: an override of the intra-op thread count that needs no OpenMP knowledge (OMP_NUM_THREADS
// works too, read by OpenMP itself; this one wins when both are set).
#include "train/threads.h"

#include <cstdlib>
#include <string>

#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include "trainer/errors.h"

namespace trainer {

int apply_num_threads_from_environment() {
  const char* value = std::getenv("TRAINER_NUM_THREADS");
  if (!value || !*value) return 0;
  const std::string text(value);
  int threads = 0;
  bool ok = text.size() <= 4;
  for (const char c : text) ok = ok && c >= '0' && c <= '9';
  if (ok) threads = std::stoi(text);
  if (!ok || threads < 1 || threads > 1024)
    throw UsageError("TRAINER_NUM_THREADS='" + text + "' is not a thread count from 1 to 1024",
                     "unset TRAINER_NUM_THREADS to let LibTorch use one thread per core, or set e.g. TRAINER_NUM_THREADS=4");
  at::set_num_threads(threads);
  spdlog::info("{} intra-op threads (TRAINER_NUM_THREADS)", threads);
  return threads;
}

}  // namespace trainer
