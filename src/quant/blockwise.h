// Blockwise 4-bit (NF4/FP4) and 8-bit (dynamic map) quantization equal bit for bit to bitsandbytes 0.50.2 on
// the CPU, on plain buffers (no LibTorch) so it is testable in isolation and reusable by the loader and the
// optimizer.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace trainer::quant {

enum class QuantType { kNf4, kFp4 };
// The dtype of the values handed in or asked for; 16-bit dtypes travel as raw bit patterns.
enum class FloatDtype { kFp32, kBf16, kFp16 };

QuantType parse_quant_type(const std::string& name);    // "nf4" | "fp4", throws with a hint otherwise
FloatDtype parse_float_dtype(const std::string& name);  // "float32" | "bfloat16" | "float16"
std::string quant_type_name(QuantType type);
std::string float_dtype_name(FloatDtype dtype);

// Exact conversions: widening is exact; narrowing rounds to nearest even like torch's .to(dtype).
float bf16_bits_to_float(uint16_t bits);
float fp16_bits_to_float(uint16_t bits);
uint16_t float_to_bf16_bits(float value);
uint16_t float_to_fp16_bits(float value);

// The 16-entry code tables of bitsandbytes.functional.get_4bit_type (index = stored nibble).
const std::array<float, 16>& four_bit_code(QuantType type);
// bitsandbytes.functional.create_dynamic_map(signed) with max_exponent_bits=7, total_bits=8: 256 sorted
// floats.
std::vector<float> create_dynamic_map(bool is_signed);

// 8-bit blockwise quantization of fp32 values with a 256-entry sorted code (cquantize_blockwise_cpu_fp32).
struct Blockwise8bit {
  std::vector<uint8_t> codes;  // one per element
  std::vector<float> absmax;   // one per block
};
void quantize_blockwise_8bit(std::span<const float> values, std::span<const float> code, int64_t blocksize,
                             std::span<uint8_t> codes_out, std::span<float> absmax_out);
Blockwise8bit quantize_blockwise_8bit(std::span<const float> values, std::span<const float> code,
                                      int64_t blocksize);
// The code quantize_blockwise_8bit gives a normalized value x in [-1, 1]: table[slot(x)], where
// slot(x) = int(fma((x + 1) * 0.5, 65535, 0.5)) (65536 uint8 entries: the nearest code entry by midpoints, a tie
// to the lower one), as libbitsandbytes_cpu computes it. For device implementations of the same quantization.
std::vector<uint8_t> code_lookup_table(std::span<const float> code);
// cdequantize_blockwise_cpu_fp32: code[q] * absmax[block] in fp32.
void dequantize_blockwise_8bit(std::span<const uint8_t> codes, std::span<const float> absmax,
                               std::span<const float> code, int64_t blocksize, std::span<float> out);

// Result of quantize_4bit; with double quantization `absmax` is empty and the nested fields are filled.
struct Quantized4bit {
  QuantType type = QuantType::kNf4;
  int64_t blocksize = 64;
  int64_t numel = 0;
  std::vector<uint8_t> packed;  // (numel + 1) / 2 bytes, element 2j in the high nibble
  std::vector<float> absmax;    // one per block (no double quantization)
  bool nested = false;
  std::vector<uint8_t> nested_codes;  // absmax - offset, 8-bit, one per block
  std::vector<float> nested_absmax;   // one per 256 blocks
  float nested_offset = 0.0f;         // mean of the absmax
  static constexpr int64_t kNestedBlocksize = 256;
};

void check_4bit_blocksize(int64_t blocksize);  // 32..4096 powers of two, as bitsandbytes accepts

// `values` holds numel elements: floats for kFp32, raw 16-bit patterns (as uint16_t) for kBf16/kFp16.
Quantized4bit quantize_4bit(const void* values, int64_t numel, FloatDtype dtype, int64_t blocksize,
                            QuantType type, bool compress_statistics);
// The per-block scale that dequantization uses (nested: code[q] * nested_absmax + offset).
std::vector<float> block_scales(const Quantized4bit& q);
// The format's definition: element i is code[nibble i] * the scale of block i / blocksize, computed in fp32 and
// rounded once (to nearest even) to `dtype` (floats or raw 16-bit patterns) into `out` (numel elements). The code
// table is bitsandbytes' get_4bit_type, so FP4's nibble 8 decodes to +0.0, as bitsandbytes' torch path and its
// AVX-512 loop give; its scalar CPU loop and its CUDA kernel give -0.0 there, the same value (docs/quantization.md).
void dequantize_4bit(const Quantized4bit& q, FloatDtype dtype, void* out);

}  // namespace trainer::quant
