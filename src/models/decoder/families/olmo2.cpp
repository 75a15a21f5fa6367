// OLMo 2 (modeling_olmo2.py): no norm before attention or MLP, one on each of their outputs
// (post_attention_layernorm, post_feedforward_layernorm), an RMSNorm over the whole q and k projections, and
// norms that multiply by the weight in fp32 before casting back.
#include "models/decoder/families/families.h"

namespace trainer {

DecoderSpec olmo2_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {.eps = 1e-5});
  s.norm = NormKind::kFp32;
  s.qk_norm = QkNorm::kWholeProjection;
  s.pre_attention_norm.clear();
  s.post_attention_norm = "post_attention_layernorm";
  s.pre_mlp_norm.clear();
  s.post_mlp_norm = "post_feedforward_layernorm";
  s.mlp_bias = false;
  read_layer_types(c, s);
  return s;
}

}  // namespace trainer
