// Signal handling for a graceful stop (see signals.h). The handler stores the signal number and says once what
// will happen; the loop polls.
#include "train/signals.h"

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <unistd.h>

namespace trainer {
namespace {

volatile std::sig_atomic_t requested = 0;
// When the first signal came, in milliseconds of CLOCK_MONOTONIC (clock_gettime is async-signal-safe).
volatile std::sig_atomic_t first_ms = 0;

long monotonic_ms() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec * 1000L + now.tv_nsec / 1000000L;
}

// "[rank r] " for data-parallel ranks other than 0 (as main's error lines), filled before the handler is installed.
char rank_prefix[32] = "";

void write_all(const char* text) {
  std::size_t length = 0;
  while (text[length] != '\0') ++length;
  [[maybe_unused]] const auto written = write(STDERR_FILENO, text, length);
}

// One line on a line of its own (async-signal-safe: write(2) only).
void say(const char* line) {
  write_all("\n");
  write_all(rank_prefix);
  write_all(line);
}

extern "C" void on_stop_signal(int signal) {
  // Process supervisors often deliver one stop twice: GNU timeout signals the child and then its whole process
  // group, a shell's kill of a process group reaches both a wrapper and trainer. A repeat within this window is
  // the same request, not a user asking a second time.
  constexpr long kSameRequestMs = 500;
  const long now = monotonic_ms() & 0x3fffffffL;  // fits a sig_atomic_t
  if (requested != 0) {
    const long since = (now - first_ms) & 0x3fffffffL;
    if (since < kSameRequestMs) return;
    say("trainer: second stop signal: exiting now; the newest complete checkpoint is kept\n");
    _exit(128 + signal);
  }
  requested = signal;
  first_ms = static_cast<std::sig_atomic_t>(now);
  say(signal == SIGINT
          ? "trainer: SIGINT: finishing this step, then writing a checkpoint (Ctrl-C again to stop now)\n"
          : "trainer: SIGTERM: finishing this step, then writing a checkpoint (signal again to stop now)\n");
}

}  // namespace

void install_stop_handlers() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank && world && std::strcmp(rank, "0") != 0 && std::strcmp(world, "1") != 0 && std::strlen(rank) < 16) {
    std::strcpy(rank_prefix, "[rank ");
    std::strcat(rank_prefix, rank);
    std::strcat(rank_prefix, "] ");
  }
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int stop_requested() { return requested; }

}  // namespace trainer
