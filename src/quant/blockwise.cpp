// Blockwise 4-bit and 8-bit quantization transcribed from bitsandbytes 0.50.2's CPU paths: quantize_4bit is
// the default backend's torch ops (fp32 arithmetic), the 8-bit quantize is libbitsandbytes_cpu's 65536-entry
// lookup.
#include "quant/blockwise.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace trainer::quant {

namespace {

// bitsandbytes' NF4 table (create_normal_map(offset=0.9677083, use_extra_value=True), hardcoded upstream).
constexpr std::array<float, 16> kNf4Code = {-1.0f,
                                            -0.6961928009986877f,
                                            -0.5250730514526367f,
                                            -0.39491748809814453f,
                                            -0.28444138169288635f,
                                            -0.18477343022823334f,
                                            -0.09105003625154495f,
                                            0.0f,
                                            0.07958029955625534f,
                                            0.16093020141124725f,
                                            0.24611230194568634f,
                                            0.33791524171829224f,
                                            0.44070982933044434f,
                                            0.5626170039176941f,
                                            0.7229568362236023f,
                                            1.0f};

// FP4 (1 sign, 2 exponent, 1 mantissa bits) in bit-pattern order, divided by its maximum 12 in fp32 as
// get_4bit_type does. Nibble 8 is +0, not -0: upstream writes the Python int `-0`, which is 0.
std::array<float, 16> make_fp4_code() {
  const float raw[16] = {0.0f, 0.0625f,  8.0f,  12.0f,  4.0f,  6.0f,  2.0f,  3.0f,
                         0.0f, -0.0625f, -8.0f, -12.0f, -4.0f, -6.0f, -2.0f, -3.0f};
  std::array<float, 16> code{};
  for (int i = 0; i < 16; ++i) code[static_cast<size_t>(i)] = raw[i] / 12.0f;
  return code;
}

// The sort order torch.argsort gives the FP4 code (the tie of nibbles 0 and 8, both zero, broken as
// bitsandbytes 0.50.2 gets it on the CPU: zero quantizes to nibble 0): quantize_4bit bucketizes against
// sorted midpoints and maps the bucket back through this order.
constexpr std::array<uint8_t, 16> kFp4Order = {11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3};

struct FourBitBounds {
  std::array<float, 15> midpoints{};
  std::array<uint8_t, 16> order{};
};

FourBitBounds make_bounds(QuantType type) {
  FourBitBounds bounds;
  const auto& code = four_bit_code(type);
  for (uint8_t i = 0; i < 16; ++i) bounds.order[i] = type == QuantType::kNf4 ? i : kFp4Order[i];
  for (size_t i = 0; i < 15; ++i) {
    bounds.midpoints[i] = (code[bounds.order[i]] + code[bounds.order[i + 1]]) / 2.0f;
  }
  return bounds;
}

// torch.bucketize(x, bounds, right=False): the first i with x <= bounds[i] (ties to the lower bucket).
uint8_t bucketize(float x, const std::array<float, 15>& bounds) {
  return static_cast<uint8_t>(std::lower_bound(bounds.begin(), bounds.end(), x) - bounds.begin());
}

// create_dynamic_map's output as bitsandbytes 0.50.2 produces it with torch 2.13 on an AVX2 CPU, bit
// patterns. Recomputing it here is not exact: it goes through torch.linspace in fp32, whose values depend on
// ATen's vectorized kernel (42 of the 256 signed entries differ by one ulp from a plain scalar linspace).
// tests/parity/test_quantization.py checks these against bitsandbytes' own function.
constexpr std::array<uint32_t, 256> kSignedDynamicMapBits = {
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
};
constexpr std::array<uint32_t, 256> kUnsignedDynamicMapBits = {
    0x00000000, 0x34ae7baa, 0x35500998, 0x360e9b38, 0x3692ccf6, 0x36de4c51, 0x3714e5d5, 0x3783126e,
    0x37e171a0, 0x381fe868, 0x384f1800, 0x387e479a, 0x3896bb99, 0x38ae5364, 0x38c5eb31, 0x3906594b,
    0x394154ca, 0x397c5049, 0x399ba5e4, 0x39b923a2, 0x39d6a163, 0x39f41f22, 0x3a08ce71, 0x3a178d50,
    0x3a264c30, 0x3a350b10, 0x3a43c9ef, 0x3a5288d0, 0x3a6147af, 0x3a70068e, 0x3a7ec56e, 0x3a958106,
    0x3aba5e35, 0x3adf3b64, 0x3b020c4a, 0x3b147ae1, 0x3b26e978, 0x3b395810, 0x3b4bc6a7, 0x3b5e3540,
    0x3b70a3d7, 0x3b818937, 0x3b8ac082, 0x3b93f7cf, 0x3b9d2f1a, 0x3ba66666, 0x3baf9db2, 0x3bb8d4fd,
    0x3bc20c4a, 0x3bcb4395, 0x3bd47ae1, 0x3bddb22e, 0x3be6e978, 0x3bf020c5, 0x3bf9580f, 0x3c0147ae,
    0x3c05e354, 0x3c0a7ef9, 0x3c0f1aa0, 0x3c13b645, 0x3c1851eb, 0x3c1ced92, 0x3c218937, 0x3c2f5c2a,
    0x3c466667, 0x3c5d70a3, 0x3c747ae2, 0x3c85c28f, 0x3c9147af, 0x3c9ccccd, 0x3ca851eb, 0x3cb3d70b,
    0x3cbf5c29, 0x3ccae147, 0x3cd66667, 0x3ce1eb87, 0x3ced70a3, 0x3cf8f5c3, 0x3d023d70, 0x3d080000,
    0x3d0dc28f, 0x3d13851f, 0x3d1947af, 0x3d1f0a3d, 0x3d24cccd, 0x3d2a8f5c, 0x3d3051eb, 0x3d36147b,
    0x3d3bd70a, 0x3d41999a, 0x3d475c28, 0x3d4d1eb8, 0x3d52e147, 0x3d58a3d7, 0x3d5e6667, 0x3d6428f7,
    0x3d69eb87, 0x3d6fae15, 0x3d7570a3, 0x3d7b3333, 0x3d807ae2, 0x3d835c2a, 0x3d863d71, 0x3d891eb8,
    0x3d8c0000, 0x3d8ee148, 0x3d91c290, 0x3d94a3d7, 0x3d97851f, 0x3d9a6667, 0x3d9d47af, 0x3da028f6,
    0x3da30a3e, 0x3da5eb85, 0x3da8cccd, 0x3dabae15, 0x3dae8f5c, 0x3db170a4, 0x3db451eb, 0x3db73333,
    0x3dba147b, 0x3dbcf5c3, 0x3dbfd70b, 0x3dc2b852, 0x3dc5999a, 0x3dc87ae2, 0x3dcb5c29, 0x3dd40000,
    0x3de26666, 0x3df0cccd, 0x3dff3333, 0x3e06cccc, 0x3e0e0000, 0x3e153334, 0x3e1c6666, 0x3e23999a,
    0x3e2acccc, 0x3e320000, 0x3e393334, 0x3e406666, 0x3e47999a, 0x3e4ecccc, 0x3e560000, 0x3e5d3334,
    0x3e646666, 0x3e6b999a, 0x3e72cccc, 0x3e7a0000, 0x3e809999, 0x3e843333, 0x3e87cccd, 0x3e8b6666,
    0x3e8f0000, 0x3e92999a, 0x3e963333, 0x3e99cccc, 0x3e9d6666, 0x3ea10000, 0x3ea4999a, 0x3ea83333,
    0x3eabcccc, 0x3eaf6666, 0x3eb30000, 0x3eb6999a, 0x3eba3333, 0x3ebdcccc, 0x3ec16666, 0x3ec50000,
    0x3ec8999a, 0x3ecc3333, 0x3ecfcccc, 0x3ed36666, 0x3ed70000, 0x3eda999a, 0x3ede3333, 0x3ee1cccc,
    0x3ee56666, 0x3ee90000, 0x3eec999a, 0x3ef03333, 0x3ef3cccc, 0x3ef76666, 0x3efb0000, 0x3efe9999,
    0x3f01199a, 0x3f02e666, 0x3f04b333, 0x3f068000, 0x3f084ccc, 0x3f0a199a, 0x3f0be666, 0x3f0db334,
    0x3f0f8000, 0x3f114ccd, 0x3f13199a, 0x3f14e666, 0x3f16b334, 0x3f188000, 0x3f1a4ccd, 0x3f1c199a,
    0x3f1de666, 0x3f1fb334, 0x3f218000, 0x3f234ccd, 0x3f25199a, 0x3f26e666, 0x3f28b334, 0x3f2a8000,
    0x3f2c4ccd, 0x3f2e199a, 0x3f2fe666, 0x3f31b334, 0x3f338000, 0x3f354ccd, 0x3f37199a, 0x3f38e666,
    0x3f3ab334, 0x3f3c8000, 0x3f3e4ccd, 0x3f40199a, 0x3f41e666, 0x3f43b334, 0x3f458000, 0x3f474ccc,
    0x3f49199a, 0x3f4ae666, 0x3f4cb334, 0x3f4e8000, 0x3f504ccc, 0x3f52199a, 0x3f53e666, 0x3f55b334,
    0x3f578000, 0x3f594ccc, 0x3f5b199a, 0x3f5ce666, 0x3f5eb334, 0x3f608000, 0x3f624ccc, 0x3f64199a,
    0x3f65e666, 0x3f67b334, 0x3f698000, 0x3f6b4ccc, 0x3f6d199a, 0x3f6ee666, 0x3f70b334, 0x3f728000,
    0x3f744ccc, 0x3f76199a, 0x3f77e666, 0x3f79b334, 0x3f7b8000, 0x3f7d4ccc, 0x3f7f199a, 0x3f800000,
};

float load_value(const void* values, FloatDtype dtype, int64_t i) {
  switch (dtype) {
    case FloatDtype::kFp32:
      return static_cast<const float*>(values)[i];
    case FloatDtype::kBf16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(values)[i]);
    case FloatDtype::kFp16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(values)[i]);
  }
  return 0.0f;
}

// libbitsandbytes_cpu maps a normalized value to one of 65536 evenly spaced slots; its build uses one fused
// multiply-add here (checked in the 0.50.2 binary: vaddss, vmulss, vfmadd213ss, vcvttss2si).
uint16_t lut_slot(float normed) {
  normed = std::clamp(normed, -1.0f, 1.0f);
  const float half = (normed + 1.0f) * 0.5f;
  return static_cast<uint16_t>(static_cast<int32_t>(std::fma(half, 65535.0f, 0.5f)));
}

// For each of the 65536 slots the nearest code entry by midpoints (a midpoint tie stays left).
std::vector<uint8_t> build_lut(std::span<const float> code) {
  std::array<float, 255> midpoints{};
  for (size_t i = 0; i < 255; ++i) midpoints[i] = 0.5f * (code[i] + code[i + 1]);
  std::vector<uint8_t> lut(65536);
  size_t code_idx = 0;
  for (int i = 0; i < 65536; ++i) {
    const float slot_value = -1.0f + (2.0f * static_cast<float>(i)) / 65535.0f;
    while (code_idx < 255 && midpoints[code_idx] < slot_value) ++code_idx;
    lut[static_cast<size_t>(i)] = static_cast<uint8_t>(code_idx);
  }
  return lut;
}

// torch's fp32 sum on the CPU (aten/src/ATen/native/cpu/SumKernel.cpp, AVX2 build: 8-lane vectors) in its
// exact order: vectors summed in 4 interleaved rows with a 4-level cascade of 16-step partial sums, the
// leftover vectors into row 0, rows folded, then the scalar tail and finally the 8 lanes. bitsandbytes'
// double quantization offset is absmax.mean() = this sum / n, so a plain or double-precision sum is off by an
// ulp. Exact for a single-threaded reduction; torch splits sums over 32768 elements (GRAIN_SIZE) across
// threads.
float torch_cpu_sum(std::span<const float> x) {
  if (x.size() < 8) {
    // Fewer elements than one vector: scalar_inner_sum, 4 interleaved scalar rows, the rest into row 0.
    std::array<float, 4> rows{};
    const size_t row_count = x.size() / 4;
    for (size_t i = 0; i < row_count * 4; ++i) rows[i % 4] += x[i];
    for (size_t i = row_count * 4; i < x.size(); ++i) rows[0] += x[i];
    return ((rows[0] + rows[1]) + rows[2]) + rows[3];
  }
  constexpr int64_t kLanes = 8;
  constexpr int64_t kRows = 4;
  constexpr int64_t kLevels = 4;
  using Vec = std::array<float, kLanes>;
  const auto n = static_cast<int64_t>(x.size());
  const int64_t vec_count = n / kLanes;
  const auto add_vec = [&](Vec& acc, int64_t vec_index) {
    for (int64_t l = 0; l < kLanes; ++l)
      acc[static_cast<size_t>(l)] += x[static_cast<size_t>(vec_index * kLanes + l)];
  };
  const auto add_acc = [](Vec& acc, const Vec& other) {
    for (size_t l = 0; l < acc.size(); ++l) acc[l] += other[l];
  };
  const int64_t row_count = vec_count / kRows;
  int64_t ceil_log2 = 1;
  if (row_count > 2) ceil_log2 = 64 - std::countl_zero(static_cast<uint64_t>(row_count - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  std::array<std::array<Vec, kRows>, kLevels> acc{};
  int64_t i = 0;
  while (i + level_step <= row_count) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int64_t k = 0; k < kRows; ++k) add_vec(acc[0][static_cast<size_t>(k)], i * kRows + k);
    }
    for (int64_t level = 1; level < kLevels; ++level) {
      for (size_t k = 0; k < kRows; ++k) {
        add_acc(acc[static_cast<size_t>(level)][k], acc[static_cast<size_t>(level - 1)][k]);
        acc[static_cast<size_t>(level - 1)][k] = Vec{};
      }
      if ((i & (level_mask << (level * level_power))) != 0) break;
    }
  }
  for (; i < row_count; ++i) {
    for (int64_t k = 0; k < kRows; ++k) add_vec(acc[0][static_cast<size_t>(k)], i * kRows + k);
  }
  for (size_t level = 1; level < kLevels; ++level) {
    for (size_t k = 0; k < kRows; ++k) add_acc(acc[0][k], acc[level][k]);
  }
  std::array<Vec, kRows>& partial = acc[0];
  for (int64_t v = row_count * kRows; v < vec_count; ++v) add_vec(partial[0], v);
  for (size_t k = 1; k < kRows; ++k) add_acc(partial[0], partial[k]);
  float total = 0.0f;
  for (int64_t k = vec_count * kLanes; k < n; ++k) total += x[static_cast<size_t>(k)];
  for (float lane : partial[0]) total += lane;
  return total;
}

}  // namespace

QuantType parse_quant_type(const std::string& name) {
  if (name == "nf4") return QuantType::kNf4;
  if (name == "fp4") return QuantType::kFp4;
  throw std::invalid_argument("unknown 4-bit quant type '" + name + "'; hint: use \"nf4\" or \"fp4\"");
}

FloatDtype parse_float_dtype(const std::string& name) {
  if (name == "float32") return FloatDtype::kFp32;
  if (name == "bfloat16") return FloatDtype::kBf16;
  if (name == "float16") return FloatDtype::kFp16;
  throw std::invalid_argument("unknown float dtype '" + name +
                              "'; hint: use \"float32\", \"bfloat16\" or \"float16\"");
}

std::string quant_type_name(QuantType type) {
  return type == QuantType::kNf4 ? "nf4" : "fp4";
}

std::string float_dtype_name(FloatDtype dtype) {
  switch (dtype) {
    case FloatDtype::kFp32:
      return "float32";
    case FloatDtype::kBf16:
      return "bfloat16";
    case FloatDtype::kFp16:
      return "float16";
  }
  return "float32";
}

float bf16_bits_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

float fp16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal half: an exact small integer times 2^-24.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_bf16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN, as c10 does
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

uint16_t float_to_fp16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (magnitude >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (magnitude < 6.103515625e-05f) {
    // Subnormal range: the value in units of 2^-24, rounded to nearest even by the FPU.
    const float units = std::nearbyint(std::ldexp(magnitude, 24));
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
  }
  const uint32_t mag_bits = std::bit_cast<uint32_t>(magnitude);
  const uint32_t exponent = (mag_bits >> 23) - 112u;
  uint32_t result = (exponent << 10) | ((mag_bits >> 13) & 0x3ffu);
  const uint32_t rest = mag_bits & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;  // carries into the exponent correctly
  return static_cast<uint16_t>(sign | result);
}

const std::array<float, 16>& four_bit_code(QuantType type) {
  static const std::array<float, 16> fp4 = make_fp4_code();
  return type == QuantType::kNf4 ? kNf4Code : fp4;
}

std::vector<uint8_t> code_lookup_table(std::span<const float> code) {
  if (code.size() != 256) throw std::invalid_argument("8-bit lookup table: the code needs 256 entries");
  return build_lut(code);
}

std::vector<float> create_dynamic_map(bool is_signed) {
  const auto& bits = is_signed ? kSignedDynamicMapBits : kUnsignedDynamicMapBits;
  std::vector<float> map(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) map[i] = std::bit_cast<float>(bits[i]);
  return map;
}

void quantize_blockwise_8bit(std::span<const float> values, std::span<const float> code, int64_t blocksize,
                             std::span<uint8_t> codes_out, std::span<float> absmax_out) {
  if (code.size() != 256) throw std::invalid_argument("8-bit quantization needs a 256-entry code");
  if (blocksize <= 0) throw std::invalid_argument("8-bit quantization: block size must be positive");
  const auto n = static_cast<int64_t>(values.size());
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  if (static_cast<int64_t>(codes_out.size()) != n || static_cast<int64_t>(absmax_out.size()) != blocks) {
    throw std::invalid_argument("8-bit quantization: output sizes do not match " + std::to_string(n) +
                                " elements in blocks of " + std::to_string(blocksize));
  }
  // bitsandbytes caches the table per code; rebuilding costs 65536 steps, small next to a real tensor.
  static thread_local std::vector<float> cached_code;
  static thread_local std::vector<uint8_t> cached_lut;
  if (!std::equal(code.begin(), code.end(), cached_code.begin(), cached_code.end())) {
    cached_code.assign(code.begin(), code.end());
    cached_lut = build_lut(code);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize;
    const int64_t end = std::min(begin + blocksize, n);
    float absmax = 0.0f;
    for (int64_t i = begin; i < end; ++i)
      absmax = std::max(absmax, std::fabs(values[static_cast<size_t>(i)]));
    absmax_out[static_cast<size_t>(b)] = absmax;
    if (absmax == 0.0f) {
      std::fill(codes_out.begin() + begin, codes_out.begin() + end, uint8_t{0});
      continue;
    }
    // A reciprocal then a multiply, not a division: bitsandbytes' rounding depends on it.
    const float inv_absmax = 1.0f / absmax;
    for (int64_t i = begin; i < end; ++i) {
      codes_out[static_cast<size_t>(i)] = cached_lut[lut_slot(values[static_cast<size_t>(i)] * inv_absmax)];
    }
  }
}

Blockwise8bit quantize_blockwise_8bit(std::span<const float> values, std::span<const float> code,
                                      int64_t blocksize) {
  Blockwise8bit result;
  result.codes.resize(values.size());
  result.absmax.resize((values.size() + static_cast<size_t>(blocksize) - 1) / static_cast<size_t>(blocksize));
  quantize_blockwise_8bit(values, code, blocksize, result.codes, result.absmax);
  return result;
}

void dequantize_blockwise_8bit(std::span<const uint8_t> codes, std::span<const float> absmax,
                               std::span<const float> code, int64_t blocksize, std::span<float> out) {
  if (code.size() != 256 || out.size() != codes.size() ||
      absmax.size() != (codes.size() + static_cast<size_t>(blocksize) - 1) / static_cast<size_t>(blocksize)) {
    throw std::invalid_argument("8-bit dequantization: sizes of codes, absmax, code or output do not match");
  }
  for (size_t i = 0; i < codes.size(); ++i) {
    out[i] = code[codes[i]] * absmax[i / static_cast<size_t>(blocksize)];
  }
}

void check_4bit_blocksize(int64_t blocksize) {
  for (int64_t allowed = 32; allowed <= 4096; allowed *= 2) {
    if (blocksize == allowed) return;
  }
  throw std::invalid_argument("4-bit block size " + std::to_string(blocksize) +
                              " is not allowed; hint: use 64 (bitsandbytes' default), 128, ..., 4096");
}

Quantized4bit quantize_4bit(const void* values, int64_t numel, FloatDtype dtype, int64_t blocksize,
                            QuantType type, bool compress_statistics) {
  check_4bit_blocksize(blocksize);
  if (numel <= 0) throw std::invalid_argument("quantize_4bit: nothing to quantize (0 elements)");
  static const FourBitBounds nf4_bounds = make_bounds(QuantType::kNf4);
  static const FourBitBounds fp4_bounds = make_bounds(QuantType::kFp4);
  const FourBitBounds& bounds = type == QuantType::kNf4 ? nf4_bounds : fp4_bounds;

  Quantized4bit q;
  q.type = type;
  q.blocksize = blocksize;
  q.numel = numel;
  q.packed.assign(static_cast<size_t>((numel + 1) / 2), 0);
  const int64_t blocks = (numel + blocksize - 1) / blocksize;
  std::vector<float> absmax(static_cast<size_t>(blocks));
  // 1e-38 is below FLT_MIN: torch keeps it as an fp32 subnormal, so 1/absmax of an all-zero block is finite.
  const auto min_scale = static_cast<float>(1e-38);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize;
    const int64_t end = std::min(begin + blocksize, numel);
    float block_max = 0.0f;
    for (int64_t i = begin; i < end; ++i)
      block_max = std::max(block_max, std::fabs(load_value(values, dtype, i)));
    const bool is_full = end - begin == blocksize;
    const float clamped = std::max(block_max, min_scale);
    // Full blocks store the unclamped maximum and multiply by its reciprocal; the trailing partial block
    // stores the clamped maximum and divides (two separate torch expressions upstream).
    absmax[static_cast<size_t>(b)] = is_full ? block_max : clamped;
    const float reciprocal = 1.0f / clamped;
    for (int64_t i = begin; i < end; ++i) {
      const float value = load_value(values, dtype, i);
      const float scaled = std::clamp(is_full ? value * reciprocal : value / clamped, -1.0f, 1.0f);
      const uint8_t nibble = bounds.order[bucketize(scaled, bounds.midpoints)];
      auto& byte = q.packed[static_cast<size_t>(i / 2)];
      byte = static_cast<uint8_t>(byte | (i % 2 == 0 ? nibble << 4 : nibble));
    }
  }
  if (numel % 2 != 0) {
    // The padding element is 0.0, which bucketizes to the code of zero.
    q.packed.back() = static_cast<uint8_t>(q.packed.back() | bounds.order[bucketize(0.0f, bounds.midpoints)]);
  }
  if (!compress_statistics) {
    q.absmax = std::move(absmax);
    return q;
  }
  q.nested_offset = torch_cpu_sum(absmax) / static_cast<float>(blocks);
  std::vector<float> centered(absmax.size());
  for (size_t i = 0; i < absmax.size(); ++i) centered[i] = absmax[i] - q.nested_offset;
  static const std::vector<float> dynamic_map = create_dynamic_map(true);
  Blockwise8bit nested = quantize_blockwise_8bit(centered, dynamic_map, Quantized4bit::kNestedBlocksize);
  q.nested = true;
  q.nested_codes = std::move(nested.codes);
  q.nested_absmax = std::move(nested.absmax);
  return q;
}

std::vector<float> block_scales(const Quantized4bit& q) {
  if (!q.nested) return q.absmax;
  static const std::vector<float> dynamic_map = create_dynamic_map(true);
  std::vector<float> scales(q.nested_codes.size());
  dequantize_blockwise_8bit(q.nested_codes, q.nested_absmax, dynamic_map, Quantized4bit::kNestedBlocksize,
                            scales);
  for (float& s : scales) s += q.nested_offset;
  return scales;
}

void dequantize_4bit(const Quantized4bit& q, FloatDtype dtype, void* out) {
  check_4bit_blocksize(q.blocksize);
  const std::vector<float> scales = block_scales(q);
  const std::array<float, 16>& code = four_bit_code(q.type);
  if (static_cast<int64_t>(scales.size()) != (q.numel + q.blocksize - 1) / q.blocksize ||
      static_cast<int64_t>(q.packed.size()) != (q.numel + 1) / 2) {
    throw std::invalid_argument("dequantize_4bit: " + std::to_string(q.packed.size()) + " packed bytes and " +
                                std::to_string(scales.size()) + " scales do not fit " +
                                std::to_string(q.numel) + " elements in blocks of " +
                                std::to_string(q.blocksize));
  }
  for (int64_t i = 0; i < q.numel; ++i) {
    const uint8_t byte = q.packed[static_cast<size_t>(i / 2)];
    const uint8_t nibble = i % 2 == 0 ? byte >> 4 : byte & 0x0f;
    const float value = code[nibble] * scales[static_cast<size_t>(i / q.blocksize)];
    switch (dtype) {
      case FloatDtype::kFp32:
        static_cast<float*>(out)[i] = value;
        break;
      case FloatDtype::kBf16:
        static_cast<uint16_t*>(out)[i] = float_to_bf16_bits(value);
        break;
      case FloatDtype::kFp16:
        static_cast<uint16_t*>(out)[i] = float_to_fp16_bits(value);
        break;
    }
  }
}

}  // namespace trainer::quant
