// 4-bit linear layers (QLoRA's frozen base): a Linear's weight held as bitsandbytes holds it (NF4 or FP4 codes
// packed two to a byte, one scale per block, the scales themselves 8-bit quantized with double quantization),
// quantized by src/quant (bit for bit bitsandbytes 0.50.2) and dequantized on the layer's device with ATen ops.
//
// A quantized Linear keeps the packed codes in its `weight` slot and registers the rest of the state under
// bitsandbytes' checkpoint names ("X.weight.absmax", "X.weight.quant_map", "X.weight.nested_absmax",
// "X.weight.nested_quant_map", "X.weight.quant_state.bitsandbytes__nf4"), so saving writes what transformers +
// bitsandbytes save, and moving the model moves the state with it. Forward dequantizes to the input's dtype and
// runs the ordinary linear (as bitsandbytes' MatMul4Bit does); backward dequantizes again instead of keeping the
// full-precision weight, so the layer costs its 4-bit size between forward and backward. Where the memory budget
// allows (memory.dequantized_base), a layer instead keeps its dequantized weight resident across steps and skips
// both dequantizations: the same bits, the full-precision size.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "quant/blockwise.h"
#include "trainer/config.h"

namespace trainer {

class Linear;
class LanguageModel;

struct Quantize4bitOptions {
  quant::QuantType type = quant::QuantType::kNf4;
  int64_t blocksize = 64;
  bool double_quant = true;
  // A mixture of experts' experts too (QLoRA in memory: they are most of the weights). transformers' bitsandbytes
  // integration keeps them in full precision, so a model written in 4 bits (trainer quantize, merge) keeps them so.
  bool experts = true;
};

// What a 4-bit weight needs besides its packed codes (bitsandbytes' QuantState).
struct QuantState4bit {
  quant::QuantType type = quant::QuantType::kNf4;
  int64_t blocksize = 64;
  int64_t out_features = 0, in_features = 0;
  at::ScalarType dtype = at::kFloat;  // the dtype the weight was quantized from (the JSON's "dtype")
  bool nested = false;
  double nested_offset = 0.0;  // mean of the block scales (double quantization), an fp32 value
  at::Tensor absmax;            // (blocks) fp32, or uint8 codes when nested
  at::Tensor quant_map;         // (16) fp32: the 4-bit code
  at::Tensor nested_absmax;     // (blocks / 256, rounded up) fp32 (nested)
  at::Tensor nested_quant_map;  // (256) fp32: the signed dynamic map (nested)
  at::Tensor state_json;        // uint8: the quant_state JSON bitsandbytes saves beside the tensors

  std::string state_key() const { return "quant_state.bitsandbytes__" + quant::quant_type_name(type); }
  int64_t numel() const { return out_features * in_features; }
  // Bytes of the packed codes and of every scale tensor: what the layer holds on its device.
  int64_t bytes() const;
};

// Bytes a 4-bit weight of `numel` elements holds on its device: packed codes, block scales (uint8 codes and fp32
// nested scales with double quantization, fp32 otherwise), the code tables and about 200 bytes of JSON.
int64_t quantized_weight_bytes(int64_t numel, const Quantize4bitOptions& options);

// Options from the config (model.quantize, model.quantize_block_size, model.double_quant); none -> nullopt.
std::optional<Quantize4bitOptions> quantize_options(const ModelConfig& model);

// Quantizes a full-precision weight (out, in) of any float dtype: the packed codes (uint8, ((n + 1) / 2, 1)) and
// the state, on `device`. The arithmetic runs on the CPU (src/quant), equal to bitsandbytes.functional.quantize_4bit.
std::pair<at::Tensor, QuantState4bit> quantize_weight(const at::Tensor& weight, const Quantize4bitOptions& options,
                                                      const c10::Device& device);

// The weight (out, in) in `dtype`, computed on the packed codes' device by bitsandbytes' kernel (four_bit_kernels)
// where its start-up check passed for such a call, else with ATen ops: code[nibble] * block scale in fp32
// (scale = dynamic_map[code8] * nested_absmax + offset with double quantization), then rounded to `dtype`.
// The format's values (quant::dequantize_4bit) on either path; only the sign of FP4's zero may differ (+0.0 from
// ATen ops, -0.0 from some of the library's loops).
at::Tensor dequantize_weight(const at::Tensor& packed, const QuantState4bit& state, at::ScalarType dtype);
// The ATen path alone: the format's definition (quant::dequantize_4bit) bit for bit, FP4's nibble 8 as the
// state's code table has it (+0.0).
at::Tensor dequantize_weight_aten(const at::Tensor& packed, const QuantState4bit& state, at::ScalarType dtype);

// What 4-bit layers dequantize with on `device`: bitsandbytes' own kernels from its shared library when it is
// found (the variable TRAINER_BITSANDBYTES names the file or its folder, "none" for ATen ops; by default the
// bitsandbytes package beside the torch package trainer's LibTorch comes from), else ATen ops, equal bit for bit
// (the CPU only: CUDA without the library is an error). Loads the library and checks every symbol on first use.
// Before the library decodes a kind of call (quant type, dtype, block size) the first time, it decodes a few small
// weights of that kind, of whole-block rows and of rows that are not, and its output is compared with the format's
// values (a few milliseconds, once a kind); what it gets wrong goes to ATen ops. Returns a line for the log that
// says which library, and what the checks so far sent to ATen ops and why. Throws UsageError naming the library,
// the variable and a missing function.
std::string four_bit_kernels(c10::DeviceType device);
// The same after checking the kinds of call the model's 4-bit layers make when dequantized to `dtype`.
std::string four_bit_kernels(LanguageModel& model, c10::DeviceType device, at::ScalarType dtype);

// y = x W^T + b with W dequantized to x's dtype; only x's gradient flows (the packed weight is frozen). Without
// `kept`, backward dequantizes W again rather than keeping it. With `kept` (a layer's resident copy,
// memory.dequantized_base=keep), W is taken from it when it holds x's dtype on the packed weight's device, else
// dequantized and stored there; forward and backward both use it. Bit for bit the same result either way.
at::Tensor linear4bit(const at::Tensor& x, const at::Tensor& packed, const QuantState4bit& state,
                      const at::Tensor& bias, at::Tensor* kept = nullptr);

// The state from the tensors bitsandbytes saved for one weight (`source` names the file in errors). Throws
// DataError for a missing tensor, an unknown quant type, a block size bitsandbytes does not allow, or sizes that
// do not fit the JSON's shape.
QuantState4bit state_from_saved(const std::string& name, const nlohmann::json& quant_state,
                                const at::Tensor& absmax, const at::Tensor& quant_map,
                                const at::Tensor& nested_absmax, const at::Tensor& nested_quant_map,
                                const at::Tensor& state_json, const std::string& source);

// The linear layers of `model` that quantization converts, by module path: every Linear but those transformers
// keeps in full precision (T5's `wo`, its _keep_in_fp32_modules; the LM head and embeddings are not Linear layers
// here).
std::vector<std::string> quantizable_layers(LanguageModel& model, bool experts = true);

// config.json's "quantization_config" for a model saved with 4-bit layers (what transformers writes and reads).
nlohmann::json bnb_quantization_config(const Quantize4bitOptions& options, at::ScalarType compute_dtype,
                                       const std::vector<std::string>& skipped_modules);

// Whether any Linear of `model` holds a 4-bit weight; the options of the first one (for saving).
bool has_quantized_layers(LanguageModel& model);

// Replaces every 4-bit weight of `model` by its dequantized weight in `dtype` (merging, `trainer merge`).
void dequantize_model(LanguageModel& model, at::ScalarType dtype);

// Turns the resident dequantized copies of every 4-bit layer of `model` on or off (memory.dequantized_base); off
// frees them. Returns the number of 4-bit layers.
int64_t keep_dequantized_weights(LanguageModel& model, bool keep);

// Bytes the dequantized copies of `model`'s 4-bit layers take in `dtype` (what keeping them costs).
int64_t dequantized_weight_bytes(LanguageModel& model, at::ScalarType dtype);

}  // namespace trainer
