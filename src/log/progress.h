// What a user watches during training: the live status line (on a terminal) or the plain periodic log line
// (CI, docker logs), and the throughput and time-left estimates behind both. Pure formatting and arithmetic, so it
// is tested without a terminal; log/console.h draws the line.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

namespace trainer {

struct ProgressSnapshot {
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_second = 0;
  int64_t memory_allocated = 0;
  int64_t memory_peak = 0;
  int64_t micro_batch = 0;
  int64_t micro_steps = 0;     // micro-batches per optimizer step (the accumulation)
  double eta_seconds = -1;     // negative: not known yet
  std::string unit = "tokens";  // what the rate counts: tokens, images, pairs
};

// "45s", "3m05s", "2h07m", "3d04h"; "?" when unknown (negative or not finite).
std::string format_duration(double seconds);
// "950", "12.3k", "1.25M".
std::string format_rate(double per_second);
// The live line, e.g. "[##----------] 120/1000 12% ETA 1h02m | loss 2.3456 | lr 3.00e-04 | 12.3k tok/s |
// mem 1.20 GiB (peak 1.50 GiB) | micro 4x4". bar_width 0 leaves the bar out.
std::string format_status_line(const ProgressSnapshot& snapshot, int bar_width = 20);
// The plain log line, the same facts plus the gradient norm.
std::string format_log_line(const ProgressSnapshot& snapshot);

// Throughput over the last `window` steps (training time only: evaluation and checkpoints do not count), and the
// time left from the wall time per step since the run (or the resumed run) started, which does include them.
// Times are seconds on any monotonic clock.
class ProgressClock {
 public:
  ProgressClock(int64_t start_step, int64_t total_steps, double now, std::size_t window = 10);

  void add_step(int64_t step, int64_t tokens, double step_seconds, double now);
  double tokens_per_second() const;
  double eta_seconds() const;  // negative before the first step

 private:
  struct Sample {
    int64_t tokens;
    double seconds;
  };
  int64_t start_step_, total_steps_, step_;
  double start_, last_;
  std::size_t window_;
  std::deque<Sample> recent_;
};

}  // namespace trainer
