// Rotary position embeddings of every rope type transformers' modeling_rope_utils.py defines for the decoder
// families: default, linear, llama3, dynamic (NTK), yarn, longrope, proportional. Inverse frequencies in fp32 and
// the attention scaling that multiplies cos and sin (yarn, longrope).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "models/decoder/spec.h"

namespace trainer {

class Rope {
 public:
  // Throws UsageError naming config.json's key for an unknown rope type or a missing parameter.
  Rope(const RopeSpec& spec, int64_t head_dim, int64_t max_position_embeddings);
  // The inverse frequencies (rotary_dim / 2) fp32 for a forward whose positions reach `length` - 1: dynamic and
  // longrope change with the length (as transformers' dynamic_rope_update does per forward), the others do not.
  at::Tensor inverse_frequencies(int64_t length) const;
  bool depends_on_length() const { return type_ == "dynamic" || type_ == "longrope"; }
  double attention_scaling() const { return attention_scaling_; }
  int64_t rotary_dim() const { return rotary_dim_; }

 private:
  at::Tensor compute(int64_t length) const;

  std::string type_;
  RopeSpec spec_;
  int64_t head_dim_, dim_, rotary_dim_, max_position_embeddings_;
  double attention_scaling_ = 1.0;
  at::Tensor base_;  // the frequencies at lengths that change nothing
};

}  // namespace trainer
