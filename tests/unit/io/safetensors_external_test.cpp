// Driven by tests/parity/test_safetensors.py: reads every file Python's safetensors wrote into
// $TRAINER_SAFETENSORS_DIR and writes it back with our writer as <name>.ours.safetensors, and re-saves the model
// directory transformers wrote into $TRAINER_HF_MODEL_DIR (sharded) into its subdirectory "ours"; the pytest then
// loads our files with safetensors.torch and transformers and compares. Skipped when the variables are unset.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "trainer/hf_weights.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TEST(SafetensorsExternal, RewritesEveryFileOfTheDirectory) {
  const char* dir = std::getenv("TRAINER_SAFETENSORS_DIR");
  if (dir == nullptr) GTEST_SKIP() << "TRAINER_SAFETENSORS_DIR is not set (run by tests/parity/test_safetensors.py)";
  int rewritten = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const auto path = entry.path().string();
    if (!ends_with(path, ".safetensors") || ends_with(path, ".ours.safetensors")) continue;
    SCOPED_TRACE(path);
    const auto file = SafetensorsFile::open(path);
    NamedTensors tensors;
    for (const auto& info : file.tensors()) {
      const at::Tensor loaded = file.load(info.name);
      const at::Tensor view = file.view(info.name);
      ASSERT_EQ(loaded.scalar_type(), view.scalar_type()) << info.name;
      ASSERT_EQ(loaded.sizes(), view.sizes()) << info.name;
      if (info.nbytes() > 0) {  // empty tensors may have no data pointer at all
        ASSERT_EQ(std::memcmp(loaded.const_data_ptr(), view.const_data_ptr(), info.nbytes()), 0) << info.name;
      }
      tensors.emplace_back(info.name, loaded);
    }
    auto metadata = file.metadata();
    metadata.erase("format");  // ours always writes "pt"; the pytest checks it is there
    write_safetensors(path.substr(0, path.size() - std::strlen(".safetensors")) + ".ours.safetensors", tensors,
                      metadata);
    ++rewritten;
  }
  EXPECT_GT(rewritten, 0) << "no .safetensors files in " << dir;
}

TEST(SafetensorsExternal, ResavesATransformersModelDirectory) {
  const char* dir = std::getenv("TRAINER_HF_MODEL_DIR");
  if (dir == nullptr) GTEST_SKIP() << "TRAINER_HF_MODEL_DIR is not set (run by tests/parity/test_safetensors.py)";
  const char* shard_env = std::getenv("TRAINER_HF_MAX_SHARD_BYTES");
  const StateDict state = load_state_dict(dir);
  ASSERT_FALSE(state.empty());
  const NamedTensors tensors(state.begin(), state.end());
  save_state_dict(std::string(dir) + "/ours", tensors, shard_env ? std::strtoull(shard_env, nullptr, 10) : 0);
}

}  // namespace
}  // namespace trainer
