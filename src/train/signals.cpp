// Signal handling for a graceful stop (see signals.h). The handler only stores the signal number; the loop polls.
#include "train/signals.h"

#include <csignal>
#include <unistd.h>

namespace trainer {
namespace {

volatile std::sig_atomic_t requested = 0;

extern "C" void on_stop_signal(int signal) {
  if (requested != 0) _exit(128 + signal);  // the second signal: stop now (async-signal-safe)
  requested = signal;
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int stop_requested() { return requested; }

}  // namespace trainer
