// The output directory's run lock (see run_lock.h).
#include "train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <thread>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown host";
  return name;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string read_fd(int fd) {
  std::string text;
  char block[512];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd, block, sizeof block, at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(block, static_cast<std::size_t>(n));
    at += n;
  }
  return text;
}

// "pid 1234 on host gpu-7 (since 2026-11-24T05:00:00Z)" from what the holder wrote. The holder writes right after
// it takes the lock, so a reader that comes in between finds the file empty for a moment: it looks again briefly.
std::string describe_holder(int fd) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    const auto record = nlohmann::json::parse(read_fd(fd), nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.contains("pid") && record.contains("host") && record["host"].is_string())
      return "pid " + record["pid"].dump() + " on host " + record["host"].get<std::string>() +
             (record.contains("started") && record["started"].is_string()
                  ? " (since " + record["started"].get<std::string>() + ")"
                  : "");
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return "a process that has not written its pid yet";
}

}  // namespace

RunLock RunLock::acquire(const fs::path& output_dir) {
  std::error_code error;
  fs::create_directories(output_dir, error);
  if (error)
    throw DataError("checkpoint.output_dir " + output_dir.string() + ": cannot create (" + error.message() + ")",
                    "point checkpoint.output_dir at a writable directory");
  const fs::path path = output_dir / kRunLockFileName;
  // O_CLOEXEC: a program trainer starts must not inherit the lock and hold it past trainer's own end.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw DataError(path.string() + ": cannot create the run lock (" + std::strerror(errno) + ")",
                    "point checkpoint.output_dir at a writable directory");
  int rc;
  do rc = ::flock(fd, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int lock_errno = errno;
    const std::string holder = lock_errno == EWOULDBLOCK ? describe_holder(fd) : "";
    ::close(fd);
    if (lock_errno != EWOULDBLOCK)
      throw DataError(path.string() + ": cannot lock (" + std::strerror(lock_errno) + ")",
                      "the file system of checkpoint.output_dir must support flock(2); use a local directory");
    throw UsageError("checkpoint.output_dir " + output_dir.string() + " is in use by another training run: " + holder,
                     "wait for that run to end, or give this one its own checkpoint.output_dir (--set "
                     "checkpoint.output_dir=...); two runs in one directory would mix their checkpoints and metrics");
  }
  const std::string record =
      nlohmann::json{{"pid", static_cast<long>(::getpid())}, {"host", host_name()}, {"started", utc_now()}}.dump() +
      "\n";
  // Best effort: the lock is the flock, the text only names its holder.
  if (::ftruncate(fd, 0) == 0) {
    const ssize_t written = ::pwrite(fd, record.data(), record.size(), 0);
    (void)written;
  }
  return RunLock(path, fd);
}

RunLock::RunLock(RunLock&& other) noexcept : path_(std::move(other.path_)), fd_(other.fd_) { other.fd_ = -1; }

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace trainer
