// Phi-3 and Phi-4 (modeling_phi3.py): one qkv_proj and one gate_up_proj (PEFT's names for LoRA too), rotary
// embeddings on the first partial_rotary_factor of each head (Phi-4-mini), longrope, dropout on each residual
// branch (resid_pdrop), and a sliding window in every layer when config.json sets one.
#include "models/decoder/families/families.h"
#include "models/hf_config.h"

namespace trainer {

DecoderSpec phi3_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {.eps = 1e-5, .max_position_embeddings = 4096});
  s.fused_qkv = s.fused_gate_up = true;
  s.qkv_bias = s.o_bias = s.mlp_bias = false;
  s.residual_dropout = hf::get_double(c, "resid_pdrop", 0.0);
  // Phi3Config renames the su and yarn rope types of older files longrope.
  for (auto& rope : s.ropes)
    if (rope.type == "su" || rope.type == "yarn") rope.type = "longrope";
  if (!read_layer_types(c, s))
    for (auto& layer : s.layers) layer.window = hf::get_optional_int(c, "sliding_window");
  return s;
}

}  // namespace trainer
