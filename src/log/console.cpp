// The console sink with its status line, the log file and the log level (see console.h).
#include "log/console.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/spdlog.h>

namespace trainer {
namespace {

constexpr const char* kEraseLine = "\r\033[K";  // to the start of the line, then clear to its end

std::size_t terminal_columns(std::FILE* file) {
  winsize size{};
  if (ioctl(fileno(file), TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 0;
}

spdlog::level::level_enum spdlog_level(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
  }
  return spdlog::level::info;
}

}  // namespace

ConsoleSink::ConsoleSink(std::FILE* file, spdlog::color_mode colors)
    : file_(file), is_terminal_(isatty(fileno(file)) != 0), inner_(file, colors) {}

void ConsoleSink::log(const spdlog::details::log_msg& message) {
  std::lock_guard lock(mutex_);
  erase_locked();
  inner_.log(message);
  draw_locked();
  std::fflush(file_);
}

void ConsoleSink::flush() {
  std::lock_guard lock(mutex_);
  std::fflush(file_);
}

void ConsoleSink::set_pattern(const std::string& pattern) {
  std::lock_guard lock(mutex_);
  inner_.set_pattern(pattern);
}

void ConsoleSink::set_formatter(std::unique_ptr<spdlog::formatter> formatter) {
  std::lock_guard lock(mutex_);
  inner_.set_formatter(std::move(formatter));
}

void ConsoleSink::set_status(const std::string& line) {
  std::lock_guard lock(mutex_);
  status_ = line;
  if (const auto columns = is_terminal_ ? terminal_columns(file_) : 0; columns > 1 && status_.size() >= columns)
    status_.resize(columns - 1);  // a wrapped line could not be redrawn in place
  erase_locked();
  draw_locked();
  std::fflush(file_);
}

void ConsoleSink::clear_status() {
  std::lock_guard lock(mutex_);
  erase_locked();
  status_.clear();
  std::fflush(file_);
}

void ConsoleSink::erase_locked() {
  if (!shown_) return;
  std::fputs(kEraseLine, file_);
  shown_ = false;
}

void ConsoleSink::draw_locked() {
  if (status_.empty()) return;
  std::fputs(status_.c_str(), file_);
  shown_ = true;
}

std::shared_ptr<spdlog::logger> make_console_logger() {
  return std::make_shared<spdlog::logger>("trainer", std::make_shared<ConsoleSink>(stderr));
}

std::shared_ptr<ConsoleSink> default_console_sink() {
  for (const auto& sink : spdlog::default_logger()->sinks())
    if (auto console = std::dynamic_pointer_cast<ConsoleSink>(sink)) return console;
  return nullptr;
}

void configure_logging(const LoggingConfig& logging) {
  auto logger = spdlog::default_logger();
  logger->set_level(spdlog_level(logging.level));
  auto& sinks = logger->sinks();
  // Once per process in the binary; tests configure repeatedly, and each call replaces the previous file.
  std::erase_if(sinks, [](const auto& sink) { return std::dynamic_pointer_cast<spdlog::sinks::basic_file_sink_mt>(sink) != nullptr;
  });
  if (logging.log_file.empty()) return;
  try {
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(logging.log_file, /*truncate=*/false));
  } catch (const spdlog::spdlog_ex& e) {
    throw UsageError("logging.log_file: cannot open " + logging.log_file + " for writing (" + e.what() + ")",
                     "point logging.log_file at a writable path, or leave it empty");
  }
  logger->flush_on(spdlog::level::info);  // the file is complete up to the last info line, even after kill -9
}

}  // namespace trainer
