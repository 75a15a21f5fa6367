// Data-parallel integration tests: N ranks of the real binary on 127.0.0.1, started with the variables torchrun
// sets, each under `timeout` (a hang ends the test instead of blocking it), and the comparisons their tests make.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "support/process.h"
#include "support/temp_dir.h"
#include "trainer/safetensors.h"

namespace trainer::test {

// A TCP port nobody listens on now (the kernel's choice for port 0).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  ::close(fd);
  return port;
}

inline std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Runs `world` ranks of trainer at once (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT as
// torchrun sets them; GLOO_SOCKET_IFNAME=lo, one thread each, `environment` added), each under `timeout`, in the
// source directory (the configs' relative paths): rank r gets args + extra[r], and its command starts with
// prefix[r] (e.g. another timeout that signals it). Returns every rank's exit code and output. Without a `port`
// the kernel picks a free one; if another process takes it before rank 0 binds it (the ranks then stop at once
// with "the port is in use"), the ranks run again on another port, up to three times in all.
inline std::vector<ProcessResult> run_ranks_on(int world, const std::vector<std::string>& args,
                                               const std::vector<std::vector<std::string>>& extra, int port,
                                               const std::string& environment, const std::vector<std::string>& prefix);

inline std::vector<ProcessResult> run_ranks(int world, const std::vector<std::string>& args,
                                            const std::vector<std::vector<std::string>>& extra = {}, int port = 0,
                                            const std::string& environment = "",
                                            const std::vector<std::string>& prefix = {}) {
  if (port != 0) return run_ranks_on(world, args, extra, port, environment, prefix);
  std::vector<ProcessResult> results;
  for (int attempt = 0; attempt < 3; ++attempt) {
    results = run_ranks_on(world, args, extra, free_port(), environment, prefix);
    const bool port_taken = std::any_of(results.begin(), results.end(), [](const ProcessResult& r) {
      return r.err.find("the port is in use") != std::string::npos;
    });
    if (!port_taken) break;
  }
  return results;
}

inline std::vector<ProcessResult> run_ranks_on(int world, const std::vector<std::string>& args,
                                               const std::vector<std::vector<std::string>>& extra, int port,
                                               const std::string& environment, const std::vector<std::string>& prefix) {
  TempDir logs;
  // Every rank in the source directory: `cd X && (a) & (b)` would leave b where ctest runs the test.
  std::string command = "cd " + shell_quote(TRAINER_SOURCE_DIR) + " || exit 1; ";
  for (int r = 0; r < world; ++r) {
    const auto k = static_cast<std::size_t>(r);
    command += "( RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) +
               " LOCAL_RANK=" + std::to_string(r) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
               " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
               " GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 " + environment + " timeout -k 5 300 " +
               (k < prefix.size() ? prefix[k] + " " : std::string()) + shell_quote(trainer_binary());
    auto all = args;
    if (k < extra.size()) all.insert(all.end(), extra[k].begin(), extra[k].end());
    for (const auto& a : all) command += " " + shell_quote(a);
    const std::string base = logs.file("rank" + std::to_string(r));
    command += " </dev/null >" + shell_quote(base + ".out") + " 2>" + shell_quote(base + ".err") + "; echo $? >" +
               shell_quote(base + ".rc") + " ) & ";
  }
  command += "wait";
  EXPECT_EQ(std::system(command.c_str()), 0);
  std::vector<ProcessResult> results(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    const std::string base = logs.file("rank" + std::to_string(r));
    auto& result = results[static_cast<std::size_t>(r)];
    result.exit_code = std::stoi(read_text(base + ".rc"));
    result.out = read_text(base + ".out");
    result.err = read_text(base + ".err");
  }
  return results;
}

// Every rank's stderr, headed by its rank and exit code: what a failed expectation prints.
inline std::string all_errors(const std::vector<ProcessResult>& results) {
  std::string text;
  for (std::size_t r = 0; r < results.size(); ++r)
    text += "---- rank " + std::to_string(r) + " (exit " + std::to_string(results[r].exit_code) + ")\n" +
            results[r].err;
  return text;
}

// The largest absolute difference between the same-named tensors of two safetensors files; a tensor missing from
// `b` or of another shape is a test failure and makes the difference infinite.
inline double max_difference(const std::filesystem::path& a_path, const std::filesystem::path& b_path) {
  const auto a = SafetensorsFile::open(a_path.string());
  const auto b = SafetensorsFile::open(b_path.string());
  EXPECT_EQ(a.tensors().size(), b.tensors().size()) << a_path << " vs " << b_path;
  if (a.tensors().size() != b.tensors().size()) return INFINITY;
  double largest = 0;
  for (const auto& t : a.tensors()) {
    if (!b.find(t.name)) {
      ADD_FAILURE() << t.name << " missing in " << b_path;
      return INFINITY;
    }
    const at::Tensor x = a.load(t.name, at::kFloat), y = b.load(t.name, at::kFloat);
    if (!x.sizes().equals(y.sizes())) {
      ADD_FAILURE() << t.name << " has shape " << x.sizes() << " in " << a_path << " and " << y.sizes() << " in "
                    << b_path;
      return INFINITY;
    }
    largest = std::max(largest, (x - y).abs().max().item<double>());
  }
  return largest;
}

}  // namespace trainer::test
