// One training run per checkpoint.output_dir: an exclusive flock(2) on output_dir/.lock, held for the whole run.
// The kernel drops it when the process ends in any way (kill -9 included), so nothing stale is ever left behind;
// the file stays and names its last holder (pid, host, start time) for the message a second run prints.
#pragma once

#include <filesystem>
#include <string>

namespace trainer {

class RunLock {
 public:
  // Creates `output_dir` when needed and locks it. Throws UsageError (exit 2) naming the directory and the
  // holder's pid and host when another process holds it, DataError when the lock file cannot be created.
  static RunLock acquire(const std::filesystem::path& output_dir);

  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&&) = delete;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock();  // releases the lock (the file stays)

  const std::filesystem::path& path() const { return path_; }

 private:
  RunLock(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::filesystem::path path_;
  int fd_ = -1;
};

// The lock file's name inside output_dir.
inline constexpr const char* kRunLockFileName = ".lock";

}  // namespace trainer
