// The single-node launcher (see launch.h).
#include "distributed/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "trainer/errors.h"

namespace trainer::distributed {
namespace {

std::atomic<int> forwarded_signal{0};

void remember_signal(int signal) { forwarded_signal = signal; }

// A port no one listens on now (the kernel's choice for port 0 on the loopback interface).
int pick_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw UsageError("trainer launch: cannot open a socket to pick a port", "pass --master-port P");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  if (!ok) throw UsageError("trainer launch: cannot pick a free port", "pass --master-port P");
  return ntohs(address.sin_port);
}

int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

}  // namespace

int run_launch(const LaunchOptions& options) {
  if (options.nproc_per_node < 1)
    throw UsageError("trainer launch: --nproc-per-node must be at least 1", "e.g. --nproc-per-node 2");
  if (options.args.empty())
    throw UsageError("trainer launch: no trainer arguments after --",
                     "trainer launch --nproc-per-node 2 -- --config configs/tiny-t5.json");
  const int port = options.master_port > 0 ? options.master_port : pick_free_port();
  const int n = options.nproc_per_node;
  std::vector<std::string> argv_strings = {"/proc/self/exe"};
  argv_strings.insert(argv_strings.end(), options.args.begin(), options.args.end());
  std::vector<char*> argv;
  for (auto& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);
  char self[4096] = {};
  const ssize_t self_length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (self_length <= 0) throw UsageError("trainer launch: cannot find its own executable (/proc/self/exe)");

  struct sigaction action {};
  action.sa_handler = remember_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);

  spdlog::info("trainer launch: {} ranks on this machine, rendezvous 127.0.0.1:{}", n, port);
  std::vector<pid_t> pids(static_cast<std::size_t>(n), 0);
  const pid_t launcher = ::getpid();
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) throw Error(std::string("trainer launch: fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      // A launcher that is killed outright (SIGKILL) takes its ranks with it: SIGTERM, a graceful stop.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) ::_exit(130);  // the launcher died before prctl took effect
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
      ::execv(self, argv.data());
      std::fprintf(stderr, "trainer launch: cannot start rank %d: %s\n", r, std::strerror(errno));
      ::_exit(127);
    }
    pids[static_cast<std::size_t>(r)] = pid;
  }

  int running = n, result = 0, failed_rank = -1;
  bool kill_pending = false;  // after a rank failed: SIGKILL whoever is left at kill_after
  auto kill_after = std::chrono::steady_clock::now();
  int last_forwarded = 0;
  while (running > 0) {
    if (const int signal = forwarded_signal.exchange(0)) {
      last_forwarded = signal;
      for (const pid_t pid : pids)
        if (pid > 0) ::kill(pid, signal);
    }
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (int r = 0; r < n; ++r)
        if (pids[static_cast<std::size_t>(r)] == done) {
          pids[static_cast<std::size_t>(r)] = 0;
          --running;
          const int code = exit_code_of(status);
          if (code != 0 && failed_rank < 0 && !(last_forwarded && (code == 130 || code == 0))) {
            failed_rank = r;
            result = code;
            if (running > 0) {
              spdlog::error("trainer launch: rank {} exited with code {}; stopping the other ranks", r, code);
              for (const pid_t pid : pids)
                if (pid > 0) {
                  ::kill(pid, SIGTERM);
                  ::kill(pid, SIGCONT);  // a stopped rank (SIGSTOP) must run to act on it
                }
              kill_pending = true;
              kill_after = std::chrono::steady_clock::now() +
                           std::chrono::milliseconds(static_cast<int64_t>(options.grace_s * 1000));
            }
          } else if (failed_rank < 0 && code != 0) {
            result = code;  // stopped by a forwarded signal: 130 after SIGINT
          }
        }
      continue;
    }
    if (kill_pending && std::chrono::steady_clock::now() > kill_after) {
      for (const pid_t pid : pids)
        if (pid > 0) ::kill(pid, SIGKILL);
      kill_pending = false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (failed_rank >= 0) spdlog::error("trainer launch: rank {} failed with exit code {}", failed_rank, result);
  return result;
}

}  // namespace trainer::distributed
