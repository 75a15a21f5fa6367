// The console: spdlog's log lines on stderr, plus one live status line (the training progress) kept below them.
// Log lines come from any thread at any time; the sink erases the status line before each one and draws it again
// after, under one mutex, so neither garbles the other. Also the optional log file and the log level.
#pragma once

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include <spdlog/sinks/ansicolor_sink.h>
#include <spdlog/sinks/sink.h>

#include "trainer/config.h"

namespace trainer {

class ConsoleSink final : public spdlog::sinks::sink {
 public:
  // Colors as spdlog's own console sink decides (automatic: on a terminal only).
  explicit ConsoleSink(std::FILE* file, spdlog::color_mode colors = spdlog::color_mode::automatic);

  void log(const spdlog::details::log_msg& message) override;
  void flush() override;
  void set_pattern(const std::string& pattern) override;
  void set_formatter(std::unique_ptr<spdlog::formatter> formatter) override;

  // Draws `line` in place of the previous status line (cut to the terminal's width, so it never wraps).
  void set_status(const std::string& line);
  // Erases the status line: what is written next starts on a clean line.
  void clear_status();
  bool is_terminal() const { return is_terminal_; }

 private:
  void erase_locked();
  void draw_locked();

  std::mutex mutex_;
  std::FILE* file_;
  bool is_terminal_;
  spdlog::sinks::ansicolor_sink<spdlog::details::console_nullmutex> inner_;
  std::string status_;
  bool shown_ = false;
};

// The process's logger: a ConsoleSink on stderr. main installs it as spdlog's default logger.
std::shared_ptr<spdlog::logger> make_console_logger();
// The ConsoleSink of spdlog's default logger, or null (tests run with spdlog's plain default logger).
std::shared_ptr<ConsoleSink> default_console_sink();

// Applies logging.level, and logging.log_file (appended; every log line goes there too). Throws UsageError when
// the file cannot be opened.
void configure_logging(const LoggingConfig& logging);

}  // namespace trainer
