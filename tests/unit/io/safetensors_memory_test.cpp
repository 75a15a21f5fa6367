// Peak resident memory while loading a 64 MiB safetensors file: load() must release the mapped pages of each
// tensor once copied, so the peak is about the data plus one tensor, not the data twice.
#include <malloc.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iostream>
#include <string>

#include "support/temp_dir.h"
#include "trainer/hf_weights.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr int kTensors = 16;
constexpr std::uint64_t kTensorBytes = 4 * kMiB;  // 16 x 4 MiB = 64 MiB of F32

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); 0 when absent.
std::uint64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) * 1024;  // kB
  return 0;
}

// Starts a new peak: returns false where the kernel does not let us reset VmHWM.
bool reset_peak_rss() {
  malloc_trim(0);  // hand memory freed by earlier tests back, so it is not silently reused below
  std::ofstream("/proc/self/clear_refs") << "5";
  return status_bytes("VmHWM") <= status_bytes("VmRSS") + kMiB;
}

// The file is written by hand from a small buffer so that making it allocates nothing big.
std::string write_big_file(const test::TempDir& dir) {
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i)
    header += std::string(i ? "," : "") + "\"w" + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[" +
              std::to_string(kTensorBytes / 4) + "],\"data_offsets\":[" + std::to_string(i * kTensorBytes) + "," +
              std::to_string((i + 1) * kTensorBytes) + "]}";
  header += "}";
  const auto path = dir.file("big.safetensors");
  std::ofstream out(path, std::ios::binary);
  const std::string prefix = test::safetensors_bytes(header, "");
  out.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  const std::string chunk(kMiB, '\x3f');  // 0x3f3f3f3f: about 0.75f
  for (std::uint64_t written = 0; written < kTensors * kTensorBytes; written += kMiB)
    out.write(chunk.data(), static_cast<std::streamsize>(chunk.size()));
  return path;
}

TEST(SafetensorsMemory, LoadingPeaksAtTheDataPlusAboutOneTensor) {
  test::TempDir dir;
  const auto path = write_big_file(dir);
  const double data_mib = static_cast<double>(kTensors * kTensorBytes) / kMiB;

  if (!reset_peak_rss()) GTEST_SKIP() << "cannot reset VmHWM through /proc/self/clear_refs here";
  std::uint64_t baseline = status_bytes("VmRSS");
  double load_growth_mib = 0;
  {
    const StateDict state = load_state_dict_files({path});
    ASSERT_EQ(state.size(), static_cast<std::size_t>(kTensors));
    EXPECT_FLOAT_EQ(state.at("w7")[123].item<float>(), 0.7470588088f);
    load_growth_mib = static_cast<double>(status_bytes("VmHWM") - baseline) / kMiB;
  }

  // The same measurement with the mapping kept resident (view + clone): about twice the data. This shows the
  // measurement can see the difference, so the assertion above can fail.
  if (!reset_peak_rss()) GTEST_SKIP() << "cannot reset VmHWM a second time";
  baseline = status_bytes("VmRSS");
  double resident_growth_mib = 0;
  {
    const auto file = SafetensorsFile::open(path);
    std::vector<at::Tensor> copies;
    for (const auto& info : file.tensors()) copies.push_back(file.view(info.name).clone());
    resident_growth_mib = static_cast<double>(status_bytes("VmHWM") - baseline) / kMiB;
  }

  std::cout << "[ memory   ] data " << data_mib << " MiB; peak RSS growth: load() " << load_growth_mib
            << " MiB, view()+clone() " << resident_growth_mib << " MiB\n";
  RecordProperty("load_peak_growth_mib", std::to_string(load_growth_mib));
  RecordProperty("view_clone_peak_growth_mib", std::to_string(resident_growth_mib));
  EXPECT_LT(load_growth_mib, 1.25 * data_mib) << "load() must not hold the file and the copy at once";
  EXPECT_GT(resident_growth_mib, 1.75 * data_mib) << "the measurement should see mapped pages";
}

}  // namespace
}  // namespace trainer
