// Progress lines and estimates (see progress.h).
#include "log/progress.h"

#include <algorithm>
#include <cmath>

#include <spdlog/fmt/fmt.h>

#include "trainer/config.h"

namespace trainer {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
  return fmt::format("{}d{:02}h", s / 86400, s % 86400 / 3600);
}

std::string format_rate(double per_second) {
  if (!std::isfinite(per_second) || per_second < 0) return "?";
  if (per_second < 1000) return fmt::format("{:.0f}", per_second);
  if (per_second < 1e6) return fmt::format("{:.1f}k", per_second / 1e3);
  return fmt::format("{:.2f}M", per_second / 1e6);
}

std::string format_status_line(const ProgressSnapshot& p, int bar_width) {
  std::string line;
  const double done = p.total_steps > 0 ? std::clamp(static_cast<double>(p.step) / p.total_steps, 0.0, 1.0) : 0.0;
  if (bar_width > 0) {
    const auto filled = static_cast<int>(done * bar_width);
    line = "[" + std::string(static_cast<std::size_t>(filled), '#') +
           std::string(static_cast<std::size_t>(bar_width - filled), '-') + "] ";
  }
  // ETA early: a narrow terminal cuts the line's end.
  line += fmt::format("{}/{} {:.0f}% ETA {} | loss {:.4f} | lr {:.2e} | {} {}/s | mem {} (peak {}) | micro {}x{}",
                      p.step, p.total_steps, 100 * done, format_duration(p.eta_seconds), p.loss, p.lr,
                      format_rate(p.tokens_per_second), p.unit == "tokens" ? "tok" : p.unit, human_bytes(static_cast<double>(p.memory_allocated)),
                      human_bytes(static_cast<double>(p.memory_peak)), p.micro_batch, p.micro_steps);
  return line;
}

std::string format_log_line(const ProgressSnapshot& p) {
  return fmt::format(
      "step {}/{} loss {:.4f} lr {:.2e} grad_norm {:.3f} {}/s {:.0f} memory {} (peak {}) micro-batch {} x {} ETA {}",
      p.step, p.total_steps, p.loss, p.lr, p.grad_norm, p.unit, p.tokens_per_second,
      human_bytes(static_cast<double>(p.memory_allocated)), human_bytes(static_cast<double>(p.memory_peak)),
      p.micro_batch, p.micro_steps, format_duration(p.eta_seconds));
}

ProgressClock::ProgressClock(int64_t start_step, int64_t total_steps, double now, std::size_t window)
    : start_step_(start_step),
      total_steps_(total_steps),
      step_(start_step),
      start_(now),
      last_(now),
      window_(std::max<std::size_t>(window, 1)) {}

void ProgressClock::add_step(int64_t step, int64_t tokens, double step_seconds, double now) {
  step_ = step;
  last_ = now;
  recent_.push_back({tokens, step_seconds});
  if (recent_.size() > window_) recent_.pop_front();
}

double ProgressClock::tokens_per_second() const {
  int64_t tokens = 0;
  double seconds = 0;
  for (const auto& sample : recent_) {
    tokens += sample.tokens;
    seconds += sample.seconds;
  }
  return seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
}

double ProgressClock::eta_seconds() const {
  const int64_t done = step_ - start_step_;
  if (done <= 0) return -1;
  return (last_ - start_) / static_cast<double>(done) * static_cast<double>(std::max<int64_t>(total_steps_ - step_, 0));
}

}  // namespace trainer
