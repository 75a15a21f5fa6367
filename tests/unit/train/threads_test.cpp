// TRAINER_NUM_THREADS: sets LibTorch's intra-op threads; unset changes nothing; a bad value is a usage error.
#include <cstdlib>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "train/threads.h"
#include "trainer/errors.h"

namespace trainer {

TEST(Threads, TrainerNumThreadsSetsTheIntraOpThreads) {
  const int before = at::get_num_threads();
  unsetenv("TRAINER_NUM_THREADS");
  EXPECT_EQ(apply_num_threads_from_environment(), 0);
  EXPECT_EQ(at::get_num_threads(), before);
  const int wanted = before == 1 ? 2 : 1;
  setenv("TRAINER_NUM_THREADS", std::to_string(wanted).c_str(), 1);
  EXPECT_EQ(apply_num_threads_from_environment(), wanted);
  EXPECT_EQ(at::get_num_threads(), wanted);
  for (const char* bad : {"0", "-2", "four", "2.5", "99999"}) {
    setenv("TRAINER_NUM_THREADS", bad, 1);
    try {
      apply_num_threads_from_environment();
      ADD_FAILURE() << "accepted TRAINER_NUM_THREADS=" << bad;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("TRAINER_NUM_THREADS"), std::string::npos);
    }
  }
  unsetenv("TRAINER_NUM_THREADS");
  at::set_num_threads(before);
}

}  // namespace trainer
