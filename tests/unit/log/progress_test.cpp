// The progress line's formatting and its throughput and time-left estimates, without a terminal.
#include "log/progress.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace trainer {
namespace {

ProgressSnapshot snapshot() {
  ProgressSnapshot p;
  p.step = 250;
  p.total_steps = 1000;
  p.loss = 2.345678;
  p.lr = 3e-4;
  p.grad_norm = 0.8123;
  p.tokens_per_second = 12345;
  p.memory_allocated = 1288490189;  // 1.20 GiB
  p.memory_peak = 1610612736;       // 1.50 GiB
  p.micro_batch = 4;
  p.micro_steps = 8;
  p.eta_seconds = 3725;
  return p;
}

}  // namespace

TEST(LogProgress, Durations) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(44.6), "45s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(3600), "1h00m");
  EXPECT_EQ(format_duration(7620), "2h07m");
  EXPECT_EQ(format_duration(273600), "3d04h");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "?");
  EXPECT_EQ(format_duration(std::nan("")), "?");
}

TEST(LogProgress, Rates) {
  EXPECT_EQ(format_rate(0), "0");
  EXPECT_EQ(format_rate(950.4), "950");
  EXPECT_EQ(format_rate(12345), "12.3k");
  EXPECT_EQ(format_rate(1250000), "1.25M");
  EXPECT_EQ(format_rate(-3), "?");
}

TEST(LogProgress, StatusLineHasEverythingInOrder) {
  const auto line = format_status_line(snapshot(), 20);
  EXPECT_EQ(line,
            "[#####---------------] 250/1000 25% ETA 1h02m | loss 2.3457 | lr 3.00e-04 | 12.3k tok/s | mem 1.20 GiB "
            "(peak 1.50 GiB) | micro 4x8");
  EXPECT_EQ(line.find('\n'), std::string::npos);
  // Without the bar; unknown total and ETA do not divide by zero.
  auto p = snapshot();
  p.total_steps = 0;
  p.eta_seconds = -1;
  const auto bare = format_status_line(p, 0);
  EXPECT_TRUE(bare.starts_with("250/0 0% ETA ? | loss")) << bare;
  // Done: a full bar.
  p = snapshot();
  p.step = 1000;
  EXPECT_TRUE(format_status_line(p, 4).starts_with("[####] 1000/1000 100%"));
}

TEST(LogProgress, PlainLogLine) {
  EXPECT_EQ(format_log_line(snapshot()),
            "step 250/1000 loss 2.3457 lr 3.00e-04 grad_norm 0.812 tokens/s 12345 memory 1.20 GiB (peak 1.50 GiB) "
            "micro-batch 4 x 8 ETA 1h02m");
}

TEST(LogProgress, EtaFromWallTimePerStepSinceTheStart) {
  ProgressClock clock(/*start_step=*/0, /*total_steps=*/100, /*now=*/10.0);
  EXPECT_LT(clock.eta_seconds(), 0) << "unknown before the first step";
  for (int step = 1; step <= 10; ++step) clock.add_step(step, 100, 0.5, 10.0 + 2.0 * step);
  // 10 steps took 20 s of wall time (evaluation included): 90 left take 180 s.
  EXPECT_DOUBLE_EQ(clock.eta_seconds(), 180.0);
  for (int step = 11; step <= 100; ++step) clock.add_step(step, 100, 0.5, 10.0 + 2.0 * step);
  EXPECT_DOUBLE_EQ(clock.eta_seconds(), 0.0);
}

TEST(LogProgress, EtaOfAResumedRunCountsOnlyItsOwnSteps) {
  ProgressClock clock(/*start_step=*/500, /*total_steps=*/1000, /*now=*/0.0);
  clock.add_step(501, 10, 1.0, 4.0);
  clock.add_step(502, 10, 1.0, 8.0);
  EXPECT_DOUBLE_EQ(clock.eta_seconds(), 4.0 * 498);
}

TEST(LogProgress, TokensPerSecondOverTheRecentWindowOfTrainingTime) {
  ProgressClock clock(0, 100, 0.0, /*window=*/3);
  clock.add_step(1, 1000, 10.0, 10.0);  // a slow first step, soon out of the window
  clock.add_step(2, 100, 0.5, 11.0);
  EXPECT_DOUBLE_EQ(clock.tokens_per_second(), 1100 / 10.5);
  clock.add_step(3, 100, 0.5, 12.0);
  clock.add_step(4, 200, 0.5, 30.0);  // a long evaluation after it does not count: step time only
  EXPECT_DOUBLE_EQ(clock.tokens_per_second(), 400 / 1.5);
}

}  // namespace trainer
