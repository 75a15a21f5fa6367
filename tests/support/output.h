// Reading back what a run reports, for tests: spdlog's log captured in memory, what a terminal shows of bytes with
// "\r\033[K" in them, and JSONL files.
#pragma once

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

namespace trainer::test {

// Captures what spdlog's default logger writes while it lives (pattern "%l %v": level, then the message).
class CapturedLog {
 public:
  explicit CapturedLog(const std::string& pattern = "%l %v") : saved_(spdlog::default_logger()) {
    auto logger = std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(text_));
    logger->set_pattern(pattern);
    spdlog::set_default_logger(logger);
  }
  ~CapturedLog() { spdlog::set_default_logger(saved_); }
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;

  std::string text() const {
    spdlog::default_logger()->flush();
    return text_.str();
  }

 private:
  std::ostringstream text_;
  std::shared_ptr<spdlog::logger> saved_;
};

// The lines a terminal shows: "\r\033[K" returns to the start of the line and clears it.
inline std::vector<std::string> rendered_lines(const std::string& bytes) {
  const std::string erase = "\r\033[K";
  std::vector<std::string> lines(1);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes.compare(i, erase.size(), erase) == 0) {
      lines.back().clear();
      i += erase.size() - 1;
    } else if (bytes[i] == '\n') {
      lines.emplace_back();
    } else {
      lines.back().push_back(bytes[i]);
    }
  }
  return lines;
}

inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(file, line);) records.push_back(nlohmann::json::parse(line));
  return records;
}

}  // namespace trainer::test
