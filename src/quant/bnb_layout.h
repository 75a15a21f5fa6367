// The on-disk layout transformers + bitsandbytes save for a 4-bit weight (QuantState.as_dict(packed=True)):
// the tensors' bytes and the `quant_state.bitsandbytes__nf4|fp4` JSON, so trainer writes checkpoints they
// load.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "quant/blockwise.h"

namespace trainer::quant {

// One saved tensor: its safetensors dtype name ("U8" | "F32"), shape and raw little-endian bytes.
struct SavedTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// Python's repr() of a float (shortest round trip, exponent form below 1e-4 and from 1e16), as json.dumps
// writes it.
std::string python_float_repr(double value);

// The JSON bytes bitsandbytes packs into `quant_state.bitsandbytes__<type>`: json.dumps of quant_type,
// blocksize, dtype, shape and, with double quantization, nested_blocksize, nested_dtype, nested_offset (in
// that order).
std::string bnb_quant_state_json(const Quantized4bit& q, FloatDtype dtype, std::span<const int64_t> shape);

// The tensors saved under "<name>." for one quantized weight, keyed by suffix ("weight" is "<name>" itself):
// weight [(n+1)/2, 1] U8, absmax (F32, or U8 codes when nested), quant_map F32[16], and when nested
// nested_absmax F32, nested_quant_map F32[256]; plus quant_state.bitsandbytes__<type> U8 (the JSON).
std::map<std::string, SavedTensor> bnb_saved_tensors(const Quantized4bit& q, FloatDtype dtype,
                                                     std::span<const int64_t> shape);

}  // namespace trainer::quant
