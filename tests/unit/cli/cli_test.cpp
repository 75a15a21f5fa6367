#include <sstream>

#include <gtest/gtest.h>

#include "support/paths.h"
#include "trainer/cli.h"
#include "trainer/config.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

struct CliResult {
  int code;
  std::string out, err;
};

CliResult cli(std::vector<std::string> args) {
  args.insert(args.begin(), "trainer");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(Cli, HelpOnEveryCommandExitsZero) {
  auto top = cli({"--help"});
  EXPECT_EQ(top.code, 0);
  EXPECT_TRUE(contains(top.out, "train"));
  EXPECT_TRUE(contains(top.out, "Exit codes"));
  auto train = cli({"train", "--help"});
  EXPECT_EQ(train.code, 0);
  EXPECT_TRUE(contains(train.out, "--config"));
  EXPECT_TRUE(contains(train.out, "--set"));
  EXPECT_TRUE(contains(train.out, "--dry-run"));
}

TEST(Cli, VersionNamesTrainerAndLibTorch) {
  auto r = cli({"--version"});
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(contains(r.out, "trainer 0."));
  EXPECT_TRUE(contains(r.out, "LibTorch"));
  // And whether it is a CUDA build: what a user on a GPU machine checks first.
  EXPECT_TRUE(contains(r.out, TRAINER_WITH_CUDA ? ", CUDA " : ", CPU)")) << r.out;
}

TEST(Cli, HelpConfigListsEveryKey) {
  auto r = cli({"--help-config"});
  EXPECT_EQ(r.code, 0);
  for (const auto& key : config_keys()) EXPECT_TRUE(contains(r.out, key.path)) << key.path;
}

TEST(Cli, UsageErrorsExitTwo) {
  auto unknown = cli({"--config", "x.json", "--frobnicate"});
  EXPECT_EQ(unknown.code, kExitUsage);
  EXPECT_TRUE(contains(unknown.err, "--frobnicate"));
  EXPECT_TRUE(contains(unknown.err, "hint:"));
  EXPECT_EQ(cli({"train", "--config"}).code, kExitUsage);  // option without its value
  EXPECT_THROW(cli({"train"}), UsageError);                // no config at all
  EXPECT_THROW(cli({"--config", "no/such/file.json"}), UsageError);
}

TEST(Cli, ConfigProblemsAreThrownAsConfigError) {
  try {
    cli({"--config", test::source_path("configs/tiny-t5.json"), "--set", "training.batchsize=3"});
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.exit_code(), kExitUsage);
    EXPECT_TRUE(contains(e.what(), "did you mean training.batch_size?"));
  }
}

}  // namespace trainer
