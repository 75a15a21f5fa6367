// A stand-in for bitsandbytes' CPU library (libbitsandbytes_cpu.so) with the fault its 0.50 release shows on an
// AVX-512 CPU, for tests on any CPU: its 4-bit dequantization reads a row's block scales as if every row started a
// block (absmax[row * (cols / blocksize) + column / blocksize]), right where rows are whole blocks and wrong
// elsewhere. trainer's start-up check must find that and decode such weights with ATen ops
// (tests/parity/test_qlora.py). The symbols and their signatures are the library's.
#include <cstdint>

#include "quant/blockwise.h"

namespace {

using trainer::quant::FloatDtype;
using trainer::quant::QuantType;

void dequantize_row_aligned(QuantType type, FloatDtype dtype, const unsigned char* packed, const float* absmax,
                            void* out, long long blocksize, long long rows, long long cols) {
  const auto& code = trainer::quant::four_bit_code(type);
  const long long scales_per_row = cols / blocksize;
  for (long long row = 0; row < rows; ++row) {
    for (long long column = 0; column < cols; ++column) {
      const long long i = row * cols + column;
      const unsigned char byte = packed[i / 2];
      const float value = code[i % 2 == 0 ? byte >> 4 : byte & 0x0f] *
                          absmax[row * scales_per_row + column / blocksize];
      if (dtype == FloatDtype::kFp32) static_cast<float*>(out)[i] = value;
      else if (dtype == FloatDtype::kBf16) static_cast<uint16_t*>(out)[i] = trainer::quant::float_to_bf16_bits(value);
      else static_cast<uint16_t*>(out)[i] = trainer::quant::float_to_fp16_bits(value);
    }
  }
}

}  // namespace

#define FAKE_DEQUANTIZE(name, type, dtype)                                                                   \
  extern "C" void name(unsigned char* packed, float* absmax, void* out, long long blocksize, long long rows, \
                       long long cols) {                                                                     \
    dequantize_row_aligned(type, dtype, packed, absmax, out, blocksize, rows, cols);                         \
  }
FAKE_DEQUANTIZE(cdequantize_blockwise_cpu_nf4_fp32, QuantType::kNf4, FloatDtype::kFp32)
FAKE_DEQUANTIZE(cdequantize_blockwise_cpu_nf4_bf16, QuantType::kNf4, FloatDtype::kBf16)
FAKE_DEQUANTIZE(cdequantize_blockwise_cpu_nf4_fp16, QuantType::kNf4, FloatDtype::kFp16)
FAKE_DEQUANTIZE(cdequantize_blockwise_cpu_fp4_fp32, QuantType::kFp4, FloatDtype::kFp32)
FAKE_DEQUANTIZE(cdequantize_blockwise_cpu_fp4_bf16, QuantType::kFp4, FloatDtype::kBf16)
FAKE_DEQUANTIZE(cdequantize_blockwise_cpu_fp4_fp16, QuantType::kFp4, FloatDtype::kFp16)

extern "C" bool has_avx512f_cpu() { return true; }
