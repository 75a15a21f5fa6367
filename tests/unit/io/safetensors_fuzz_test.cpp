// A small seeded fuzz of the safetensors reader: valid files mutated at random (bit flips, truncation, header
// length changes, JSON-ish bytes in the header) must each either load completely or throw DataError; nothing
// else, and no crash. scripts/fuzz_safetensors.sh runs many more cases under AddressSanitizer and UBSan.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>

#include "support/temp_dir.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

std::vector<std::string> valid_files(const test::TempDir& dir) {
  const NamedTensors small = {{"w", at::arange(6, at::kFloat).reshape({2, 3})},
                              {"b", at::arange(3, at::kBFloat16)},
                              {"ids", at::arange(5, at::kLong)},
                              {"mask", at::ones({4}, at::kBool)},
                              {"s", at::tensor(2.0).reshape({})},
                              {"e", at::empty({0, 3}, at::kHalf)}};
  const NamedTensors one = {{"encoder.block.0.layer.0.SelfAttention.q.weight", at::ones({4, 4}, at::kBFloat16)}};
  std::vector<std::string> files;
  for (const auto& [name, tensors] : {std::pair{"small", small}, std::pair{"one", one}}) {
    const auto path = dir.file(std::string(name) + ".safetensors");
    write_safetensors(path, tensors, {{"step", "3"}});
    files.push_back(test::read_file(path));
  }
  return files;
}

// One random mutation of a valid file; `what` describes it for the failure message.
std::string mutate(std::string bytes, std::mt19937_64& rng, std::string& what) {
  std::uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  auto pick = [&](std::uint64_t n) { return n == 0 ? 0 : rng() % n; };
  static const std::string json_bytes = "{}[]\":,-.0123456789eE \\u\x80\xff";
  switch (rng() % 6) {
    case 0: {  // flip 1-8 bits anywhere
      const int flips = 1 + static_cast<int>(pick(8));
      for (int i = 0; i < flips; ++i) bytes[pick(bytes.size())] ^= static_cast<char>(1 << pick(8));
      what = std::to_string(flips) + " bit flips";
      break;
    }
    case 1: {  // flip bits in the header only, where the parser works
      const int flips = 1 + static_cast<int>(pick(4));
      for (int i = 0; i < flips; ++i) bytes[8 + pick(header_size)] ^= static_cast<char>(1 << pick(8));
      what = std::to_string(flips) + " header bit flips";
      break;
    }
    case 2: {  // truncate
      bytes.resize(pick(bytes.size()));
      what = "truncated to " + std::to_string(bytes.size());
      break;
    }
    case 3: {  // change the header length: a little, or to anything
      std::uint64_t n = rng() % 2 ? header_size + pick(33) - 16 : rng() >> pick(64);
      std::memcpy(bytes.data(), &n, 8);
      what = "header length " + std::to_string(n);
      break;
    }
    case 4: {  // overwrite header bytes with JSON syntax (makes numbers negative, breaks strings, nests, ...)
      const int count = 1 + static_cast<int>(pick(6));
      for (int i = 0; i < count; ++i) bytes[8 + pick(header_size)] = json_bytes[pick(json_bytes.size())];
      what = std::to_string(count) + " JSON bytes in the header";
      break;
    }
    default: {  // change one digit sequence in the header (offsets, shapes) to another number
      const auto at = 8 + pick(header_size);
      const auto digits = std::to_string(rng() >> pick(64));
      bytes.replace(at, std::min<std::size_t>(digits.size(), bytes.size() - at), digits);
      what = "number " + digits + " written at " + std::to_string(at);
      break;
    }
  }
  return bytes;
}

TEST(SafetensorsFuzz, MutatedFilesLoadOrThrowDataError) {
  const char* cases_env = std::getenv("TRAINER_FUZZ_CASES");
  const char* seed_env = std::getenv("TRAINER_FUZZ_SEED");
  const int cases = cases_env ? std::atoi(cases_env) : 300;
  const std::uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 20240611;
  test::TempDir dir;
  const auto files = valid_files(dir);
  const auto path = dir.file("mutated.safetensors");
  std::mt19937_64 rng(seed);
  int loaded = 0, rejected = 0;
  for (int i = 0; i < cases; ++i) {
    std::string what;
    test::write_file(path, mutate(files[rng() % files.size()], rng, what));
    try {
      const auto file = SafetensorsFile::open(path);
      for (const auto& info : file.tensors()) {
        const at::Tensor view = file.view(info.name);
        const at::Tensor copy = file.load(info.name);
        ASSERT_EQ(view.numel() * view.element_size(), static_cast<int64_t>(info.nbytes()));
        if (info.nbytes() > 0) {  // empty tensors may have no data pointer at all
          ASSERT_EQ(std::memcmp(view.const_data_ptr(), copy.const_data_ptr(), info.nbytes()), 0);
        }
      }
      ++loaded;
    } catch (const DataError&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "case " << i << " (seed " << seed << ", " << what << "): " << e.what();
    }
  }
  std::cout << "[ fuzz     ] " << cases << " cases, seed " << seed << ": " << loaded << " loaded, " << rejected
            << " rejected with DataError\n";
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace trainer
