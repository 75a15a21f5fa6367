// The error types trainer_core throws, each mapped to one process exit code by main (and documented in README.md).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace trainer {

// Exit codes of the trainer process.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      // an unexpected internal error (a bug: please report it)
  kExitUsage = 2,        // bad command line or configuration
  kExitData = 3,         // bad data, model or checkpoint files
  kExitOutOfMemory = 4,  // out of memory with every adaptation exhausted
  kExitInterrupted = 130,
};

// Base of every error trainer reports to the user: a message and an optional hint with the likely fix.
class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string hint = {})
      : std::runtime_error(std::move(message)), hint_(std::move(hint)) {}
  const std::string& hint() const { return hint_; }
  virtual ExitCode exit_code() const { return kExitFailure; }

 private:
  std::string hint_;
};

// One problem in a configuration: where (key path, or file:line for syntax) and what.
struct ConfigProblem {
  std::string where;
  std::string what;
  bool operator==(const ConfigProblem&) const = default;
};

// Every problem found in a configuration, reported together.
class ConfigError : public Error {
 public:
  ConfigError(std::string source, std::vector<ConfigProblem> problems);
  const std::vector<ConfigProblem>& problems() const { return problems_; }
  ExitCode exit_code() const override { return kExitUsage; }

 private:
  std::vector<ConfigProblem> problems_;
};

class UsageError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return kExitUsage; }
};

// Bad data, model or checkpoint files: names the file (and line or tensor) in the message.
class DataError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return kExitData; }
};

// Out of memory with the micro-batch at its floor and every escalation used: exit code 4.
// (Thrown by the training step, by data parallelism's gradient sums and by evaluation.)
class OutOfMemoryAtFloor : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return kExitOutOfMemory; }
};

}  // namespace trainer
