// Blockwise 4-bit and 8-bit quantization transcribed from bitsandbytes 0.50.2's CPU paths: quantize_4bit is the
// default backend's torch ops (fp32 arithmetic), the 8-bit quantize is libbitsandbytes_cpu's 65536-entry lookup.
#include "quant/blockwise.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace trainer::quant {

namespace {

// bitsandbytes' NF4 table (create_normal_map(offset=0.9677083, use_extra_value=True), hardcoded upstream).
constexpr std::array<float, 16> kNf4Code = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
    0.7229568362236023f, 1.0f};

// FP4 (1 sign, 2 exponent, 1 mantissa bits) in bit-pattern order, divided by its maximum 12 in fp32 as
// get_4bit_type does; -0 is kept because the nibble 8 decodes to it.
std::array<float, 16> make_fp4_code() {
    const float raw[16] = {0.0f, 0.0625f, 8.0f, 12.0f, 4.0f, 6.0f, 2.0f, 3.0f,
                           -0.0f, -0.0625f, -8.0f, -12.0f, -4.0f, -6.0f, -2.0f, -3.0f};
    std::array<float, 16> code{};
    for (int i = 0; i < 16; ++i) code[static_cast<size_t>(i)] = raw[i] / 12.0f;
    return code;
}

// The sort order torch.argsort gives the FP4 code (its -0/0 tie broken as bitsandbytes 0.50.2 gets it on the
// CPU): quantize_4bit bucketizes against sorted midpoints and maps the bucket back through this order.
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

// torch.linspace(start, end, steps) in fp32 on the CPU: the first half counts up from start, the second half
// down from end, which is why the two halves are not symmetric in their rounding.
std::vector<float> linspace_fp32(float start, float end, int64_t steps) {
    std::vector<float> out(static_cast<size_t>(steps));
    const float step = (end - start) / static_cast<float>(steps - 1);
    const int64_t halfway = steps / 2;
    for (int64_t i = 0; i < steps; ++i) {
        out[static_cast<size_t>(i)] =
            i < halfway ? start + step * static_cast<float>(i) : end - step * static_cast<float>(steps - i - 1);
    }
    return out;
}

float load_value(const void* values, FloatDtype dtype, int64_t i) {
    switch (dtype) {
        case FloatDtype::kFp32: return static_cast<const float*>(values)[i];
        case FloatDtype::kBf16: return bf16_bits_to_float(static_cast<const uint16_t*>(values)[i]);
        case FloatDtype::kFp16: return fp16_bits_to_float(static_cast<const uint16_t*>(values)[i]);
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

std::string quant_type_name(QuantType type) { return type == QuantType::kNf4 ? "nf4" : "fp4"; }

std::string float_dtype_name(FloatDtype dtype) {
    switch (dtype) {
        case FloatDtype::kFp32: return "float32";
        case FloatDtype::kBf16: return "bfloat16";
        case FloatDtype::kFp16: return "float16";
    }
    return "float32";
}

float bf16_bits_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

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

std::vector<float> create_dynamic_map(bool is_signed) {
    constexpr int kMaxExponentBits = 7;
    constexpr int kNonSignBits = 7;
    std::vector<float> data;
    data.reserve(256);
    for (int i = 0; i < kMaxExponentBits; ++i) {
        const int64_t fraction_items = is_signed ? (int64_t{1} << (i + kNonSignBits - kMaxExponentBits)) + 1
                                                 : (int64_t{1} << (i + kNonSignBits - kMaxExponentBits + 1)) + 1;
        const std::vector<float> boundaries = linspace_fp32(0.1f, 1.0f, fraction_items);
        // Python multiplies the fp32 means by the double 10**k; torch rounds the scalar to fp32 first.
        const auto scale = static_cast<float>(std::pow(10.0, -(kMaxExponentBits - 1) + i));
        std::vector<float> means;
        for (size_t j = 0; j + 1 < boundaries.size(); ++j) means.push_back((boundaries[j] + boundaries[j + 1]) / 2.0f);
        for (float mean : means) data.push_back(scale * mean);
        if (is_signed) {
            for (float mean : means) data.push_back(-scale * mean);
        }
    }
    // additional_items = 2**(7 - 7) - 1 = 0 for the 8-bit map, so no extra linear region.
    data.push_back(0.0f);
    data.push_back(1.0f);
    while (data.size() < 256) data.push_back(0.0f);
    std::sort(data.begin(), data.end());
    return data;
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
        for (int64_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(values[static_cast<size_t>(i)]));
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

Quantized4bit quantize_4bit(const void* values, int64_t numel, FloatDtype dtype, int64_t blocksize, QuantType type,
                            bool compress_statistics) {
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
        for (int64_t i = begin; i < end; ++i) block_max = std::max(block_max, std::fabs(load_value(values, dtype, i)));
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
    // absmax.mean(): torch sums fp32 in a cascade; we sum in double, which is exact enough only if the test
    // agrees (checked against bitsandbytes over many sizes in tests/parity/test_quantization.py).
    double sum = 0.0;
    for (float a : absmax) sum += a;
    q.nested_offset = static_cast<float>(sum / static_cast<double>(blocks));
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
    dequantize_blockwise_8bit(q.nested_codes, q.nested_absmax, dynamic_map, Quantized4bit::kNestedBlocksize, scales);
    for (float& s : scales) s += q.nested_offset;
    return scales;
}

void dequantize_4bit(const Quantized4bit& q, FloatDtype dtype, void* out) {
    check_4bit_blocksize(q.blocksize);
    const std::vector<float> scales = block_scales(q);
    const auto& code = four_bit_code(q.type);
    if (static_cast<int64_t>(scales.size()) != (q.numel + q.blocksize - 1) / q.blocksize ||
        static_cast<int64_t>(q.packed.size()) != (q.numel + 1) / 2) {
        throw std::invalid_argument("dequantize_4bit: " + std::to_string(q.packed.size()) + " packed bytes and " +
                                    std::to_string(scales.size()) + " scales do not fit " + std::to_string(q.numel) +
                                    " elements in blocks of " + std::to_string(q.blocksize));
    }
    for (int64_t i = 0; i < q.numel; ++i) {
        const uint8_t byte = q.packed[static_cast<size_t>(i / 2)];
        const uint8_t nibble = i % 2 == 0 ? byte >> 4 : byte & 0x0f;
        const float value = code[nibble] * scales[static_cast<size_t>(i / q.blocksize)];
        switch (dtype) {
            case FloatDtype::kFp32: static_cast<float*>(out)[i] = value; break;
            case FloatDtype::kBf16: static_cast<uint16_t*>(out)[i] = float_to_bf16_bits(value); break;
            case FloatDtype::kFp16: static_cast<uint16_t*>(out)[i] = float_to_fp16_bits(value); break;
        }
    }
}

}  // namespace trainer::quant
