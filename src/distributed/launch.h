// `trainer launch --nproc-per-node N [--master-port P] -- <trainer arguments>`: a single-node launcher for machines
// without Python (the Docker image). It starts N ranks of this same executable with torchrun's environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), forwards SIGINT and SIGTERM
// to all of them, and when one rank fails ends the others and exits with that rank's code.
#pragma once

#include <string>
#include <vector>

namespace trainer::distributed {

struct LaunchOptions {
  int nproc_per_node = 1;
  int master_port = 0;  // 0: a free port chosen by the kernel
  std::vector<std::string> args;  // what each rank runs: `trainer <args>`
  double grace_s = 30;  // after a rank failed, how long the others get to stop after SIGTERM before SIGKILL
};

// Returns the exit code: 0 when every rank succeeded, else the first failed rank's (128 + signal when killed).
int run_launch(const LaunchOptions& options);

}  // namespace trainer::distributed
