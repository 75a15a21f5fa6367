// trainer's entry point: run the command line, turn every error into one clear message and an exit code.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <iostream>

#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "log/console.h"
#include "memory/cpu_budget.h"
#include "train/threads.h"
#include "trainer/cli.h"
#include "trainer/errors.h"

namespace {

// "[rank r] " on the error lines of data-parallel ranks other than 0, so interleaved output says who failed.
std::string rank_prefix() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (!rank || !world || std::string(rank).empty() || std::string(rank) == "0" || std::string(world) == "1") return "";
  return "[rank " + std::string(rank) + "] ";
}

}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists, so that the CPU memory budget (memory.limit) sees every allocation.
  trainer::install_cpu_budget();
  // Logs and progress go to stderr; stdout carries what a command produces (tables, ids, the resolved config).
  // stdout is written line by line even into a file or pipe (stderr is unbuffered), so with both redirected to one
  // file (docker logs, CI, nohup) the lines keep their order and none is cut by another.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  spdlog::set_default_logger(trainer::make_console_logger());
  try {
    trainer::apply_num_threads_from_environment();
    return trainer::run_cli(argc, argv, std::cout, std::cerr);
  } catch (const trainer::Error& e) {
    std::cout.flush();
    std::cerr << rank_prefix() << "error: " << e.what() << "\n";
    if (!e.hint().empty()) std::cerr << rank_prefix() << "hint: " << e.hint() << "\n";
    return e.exit_code();
  } catch (const c10::OutOfMemoryError& e) {
    std::cerr << "error: out of memory: " << e.what_without_backtrace() << "\n";
    return trainer::kExitOutOfMemory;
  } catch (const c10::Error& e) {
    std::cerr << "error: LibTorch: " << e.what_without_backtrace()
              << "\nThis is a bug in trainer unless the message says otherwise; please report it.\n";
    return trainer::kExitFailure;
  } catch (const std::exception& e) {
    std::cerr << rank_prefix() << "error: " << e.what() << "\nThis is a bug in trainer; please report it.\n";
    return trainer::kExitFailure;
  }
}
