// Driven by tests/parity/test_safetensors.py: reads every file Python's safetensors wrote into
// $TRAINER_SAFETENSORS_DIR and writes it back with our writer as <name>.ours.safetensors, which the pytest then
// loads with safetensors.torch and compares. Skipped when the variable is unset (a plain ctest run).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

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
      ASSERT_EQ(std::memcmp(loaded.const_data_ptr(), view.const_data_ptr(), info.nbytes()), 0) << info.name;
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

}  // namespace
}  // namespace trainer
