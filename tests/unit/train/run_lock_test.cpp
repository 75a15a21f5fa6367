// The output directory's run lock: one holder at a time, its pid and host named to the next, released on close.
#include "train/run_lock.h"

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/temp_dir.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

std::string this_host() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

TEST(TrainRunLock, OneHolderAtATimeNamedByPidAndHost) {
  test::TempDir dir;
  const auto output_dir = dir.path() / "run" / "nested";  // created when missing
  {
    auto lock = RunLock::acquire(output_dir);
    EXPECT_EQ(lock.path(), output_dir / ".lock");
    const auto record = nlohmann::json::parse(test::read_file(lock.path().string()));
    EXPECT_EQ(record["pid"].get<long>(), static_cast<long>(::getpid()));
    EXPECT_EQ(record["host"].get<std::string>(), this_host());
    EXPECT_TRUE(record.contains("started"));
    // flock belongs to the open file description: a second acquire, even from this process, is refused.
    try {
      RunLock::acquire(output_dir);
      FAIL() << "a second lock on the same directory was granted";
    } catch (const UsageError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("checkpoint.output_dir " + output_dir.string() + " is in use by another training run"),
                std::string::npos) << what;
      EXPECT_NE(what.find("pid " + std::to_string(::getpid()) + " on host " + this_host()), std::string::npos) << what;
      EXPECT_NE(std::string(e.hint()).find("checkpoint.output_dir"), std::string::npos);
    }
    // A moved lock still holds it.
    RunLock moved(std::move(lock));
    EXPECT_THROW(RunLock::acquire(output_dir), UsageError);
  }
  // Released with its holder; the file stays (removing it would race with a run opening it) and names the new one.
  EXPECT_TRUE(std::filesystem::exists(output_dir / ".lock"));
  auto again = RunLock::acquire(output_dir);
  EXPECT_EQ(nlohmann::json::parse(test::read_file(again.path().string()))["pid"].get<long>(),
            static_cast<long>(::getpid()));
}

TEST(TrainRunLock, AnUnwritableDirectoryIsADataError) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes anywhere";
  test::TempDir dir;
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  EXPECT_THROW(RunLock::acquire(dir.path()), DataError);
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all);
}

}  // namespace
}  // namespace trainer
