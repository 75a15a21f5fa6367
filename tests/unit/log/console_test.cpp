// The console sink keeps its status line and log lines apart; the log file and level come from the config.
#include "log/console.h"

#include <cstdio>
#include <thread>

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include "support/output.h"
#include "support/temp_dir.h"

namespace trainer {
namespace {

constexpr const char* kErase = "\r\033[K";

std::string contents(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text.push_back(static_cast<char>(c));
  return text;
}

// Restores spdlog's default logger after a test replaces it.
struct DefaultLoggerGuard {
  std::shared_ptr<spdlog::logger> saved = spdlog::default_logger();
  ~DefaultLoggerGuard() { spdlog::set_default_logger(saved); }
};

}  // namespace

TEST(LogConsole, LogLinesEraseAndRedrawTheStatusLine) {
  std::FILE* file = std::tmpfile();
  auto sink = std::make_shared<ConsoleSink>(file, spdlog::color_mode::never);
  spdlog::logger logger("test", sink);
  logger.set_pattern("%v");
  EXPECT_FALSE(sink->is_terminal());
  sink->set_status("step 1/10");
  logger.info("eval loss 2.0");
  sink->set_status("step 2/10");
  sink->clear_status();
  logger.info("done");
  const std::string expected = std::string("step 1/10") + kErase + "eval loss 2.0\n" + "step 1/10" + kErase +
                               "step 2/10" + kErase + "done\n";
  EXPECT_EQ(contents(file), expected);
  std::fclose(file);
}

TEST(LogConsole, ConcurrentLogLinesNeverSplitTheStatusLine) {
  std::FILE* file = std::tmpfile();
  auto sink = std::make_shared<ConsoleSink>(file, spdlog::color_mode::never);
  spdlog::logger logger("test", sink);
  logger.set_pattern("%v");
  std::thread writer([&] {
    for (int i = 0; i < 200; ++i) logger.info("log line {}", i);
  });
  for (int i = 0; i < 200; ++i) sink->set_status("status " + std::to_string(i));
  writer.join();
  sink->clear_status();
  // On the screen every finished line is a whole log line, and nothing is left of the status line.
  const auto lines = test::rendered_lines(contents(file));
  ASSERT_EQ(lines.size(), 201u);
  for (std::size_t i = 0; i < 200; ++i) EXPECT_EQ(lines[i], "log line " + std::to_string(i));
  EXPECT_EQ(lines.back(), "");
  std::fclose(file);
}

TEST(LogConsole, LogFileGetsTheLogAndTheLevelFilters) {
  DefaultLoggerGuard guard;
  test::TempDir dir;
  std::FILE* console = std::tmpfile();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "trainer", std::make_shared<ConsoleSink>(console, spdlog::color_mode::never)));
  EXPECT_NE(default_console_sink(), nullptr);
  LoggingConfig logging;
  logging.level = LogLevel::kWarn;
  logging.log_file = dir.file("run.log");
  configure_logging(logging);
  spdlog::info("not at warn level");
  spdlog::warn("memory is tight");
  configure_logging(logging);  // again: still one file sink, no line written twice
  spdlog::error("it failed");
  spdlog::default_logger()->flush();
  const auto text = test::read_file(dir.file("run.log"));
  EXPECT_EQ(text.find("not at warn level"), std::string::npos);
  EXPECT_NE(text.find("[warning] memory is tight\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("it failed"), text.rfind("it failed"));
  EXPECT_NE(contents(console).find("it failed"), std::string::npos) << "the console still gets the log";
  std::fclose(console);
}

TEST(LogConsole, UnwritableLogFileIsAUsageErrorNamingTheKey) {
  DefaultLoggerGuard guard;
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("trainer"));
  LoggingConfig logging;
  logging.log_file = "/proc/trainer-cannot-write-here/run.log";
  try {
    configure_logging(logging);
    FAIL() << "expected a UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("logging.log_file"), std::string::npos) << e.what();
  }
}

}  // namespace trainer
