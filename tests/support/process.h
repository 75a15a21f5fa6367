// Runs the real trainer binary for integration tests: exit code, stdout and stderr.
#pragma once

#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/paths.h"

namespace trainer::test {

struct ProcessResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string shell_quote(const std::string& s) {
  std::string quoted = "'";
  for (char c : s) quoted += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// Runs `trainer args...` with the source tree as working directory (the shipped configs use relative paths).
// With `one_stream`, stdout and stderr go to one file (as `> log 2>&1` does), returned in `out`.
inline ProcessResult run_trainer(const std::vector<std::string>& args, const std::string& env = "",
                                 bool one_stream = false) {
  namespace fs = std::filesystem;
  static std::atomic<int> calls{0};  // several runs may be under way at once (from threads)
  const fs::path dir = fs::temp_directory_path() / ("trainer-run-" + std::to_string(::getpid()) + "-" +
                                                    std::to_string(calls++));
  fs::create_directories(dir);
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " && " + env + " " + shell_quote(trainer_binary());
  for (const auto& a : args) command += " " + shell_quote(a);
  command += " </dev/null >" + shell_quote((dir / "out").string()) + " 2>" +
             (one_stream ? std::string("&1") : shell_quote((dir / "err").string()));
  const int status = std::system(command.c_str());
  ProcessResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = read_text(dir / "out");
  if (!one_stream) result.err = read_text(dir / "err");
  fs::remove_all(dir);
  return result;
}

}  // namespace trainer::test
