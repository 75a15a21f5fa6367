// Gemma 2 and Gemma 3's text model (modeling_gemma2.py, modeling_gemma3.py): norms that multiply by (1 + weight),
// four of them per block (before and after attention and the MLP), embeddings scaled by sqrt(hidden_size) in the
// weights' dtype, scores scaled by query_pre_attn_scalar^-0.5, alternating sliding and full layers. Gemma 2
// soft-caps attention scores and the final logits; Gemma 3 adds an RMSNorm over each head's queries and keys and a
// RoPE per layer type (a local base for sliding layers), and soft-caps the logits only when config.json says. The
// multimodal Gemma 3 (Gemma-3-4B-it and larger) trains its text_config's model; its vision tower is carried.
#include <cmath>

#include "models/decoder/families/families.h"
#include "models/hf_config.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

DecoderSpec gemma_common(const nlohmann::json& c, int64_t max_position_embeddings, int64_t vocab_size) {
  // Gemma2Config's and Gemma3TextConfig's defaults: Gemma-3-4B-it's text_config gives only what differs from them.
  DecoderSpec s = common_decoder_spec(c, {.head_dim = 256, .tie = true, .act_key = "hidden_activation",
                                          .act = "gelu_pytorch_tanh",
                                          .max_position_embeddings = max_position_embeddings,
                                          .vocab_size = vocab_size, .hidden = 2304, .intermediate = 9216,
                                          .layers = 26, .heads = 8, .kv_heads = 4, .eos = 1});
  s.pad_token_id = hf::get_optional_int(c, "pad_token_id").value_or(0);
  if (*s.pad_token_id < 0 || *s.pad_token_id >= s.vocab_size) s.pad_token_id.reset();
  s.norm = NormKind::kGemma;
  s.post_attention_norm = "post_attention_layernorm";
  s.pre_mlp_norm = "pre_feedforward_layernorm";
  s.post_mlp_norm = "post_feedforward_layernorm";
  s.mlp_bias = false;
  s.embedding_scale = std::sqrt(static_cast<double>(s.hidden));
  s.embedding_scale_in_dtype = true;
  s.attention_scale = 1.0 / std::sqrt(hf::get_double(c, "query_pre_attn_scalar", 256.0));
  if (hf::get_bool(c, "use_bidirectional_attention", false))
    throw UsageError("config.json: \"use_bidirectional_attention\" is true: an embedding model, not a causal LM",
                     "trainer fine-tunes Gemma as a causal language model");
  return s;
}

// Without layer_types: every `pattern`-th layer full, the others sliding.
void default_layer_types(const nlohmann::json& c, DecoderSpec& s, int64_t pattern, int64_t default_window) {
  if (read_layer_types(c, s)) return;
  const int64_t window = hf::get_int(c, "sliding_window", default_window);
  for (std::size_t i = 0; i < s.layers.size(); ++i)
    if ((static_cast<int64_t>(i) + 1) % pattern != 0) s.layers[i].window = window;
}

}  // namespace

DecoderSpec gemma2_spec(const nlohmann::json& c) {
  DecoderSpec s = gemma_common(c, 8192, 256000);
  s.attention_softcap = optional_double(c, "attn_logit_softcapping", 50.0);
  s.final_softcap = optional_double(c, "final_logit_softcapping", 30.0);
  default_layer_types(c, s, 2, 4096);
  return s;
}

DecoderSpec gemma3_text_spec(const nlohmann::json& c) {
  DecoderSpec s = gemma_common(c, 131072, 262208);
  s.qk_norm = QkNorm::kPerHead;
  // Gemma3Attention keeps attn_logit_softcapping but never applies it; the final logits are capped when set.
  s.final_softcap = optional_double(c, "final_logit_softcapping", std::nullopt);
  default_layer_types(c, s, hf::get_int(c, "sliding_window_pattern", hf::get_int(c, "_sliding_window_pattern", 6)),
                      4096);
  // One RoPE per layer type: rope_parameters.{full_attention,sliding_attention} (transformers 5), or rope_theta
  // with rope_scaling for full layers and rope_local_base_freq for sliding ones (older files).
  const auto* per_type = hf::find(c, "rope_parameters");
  if (per_type && per_type->is_object() && per_type->contains("full_attention")) {
    s.ropes = {read_rope(c, 1000000.0, "full_attention"), read_rope(c, 10000.0, "sliding_attention")};
  } else {
    RopeSpec local;
    local.theta = hf::get_double(c, "rope_local_base_freq", 10000.0);
    local.key = "rope_local_base_freq";
    s.ropes = {read_rope(c, 1000000.0), local};
  }
  for (auto& layer : s.layers) layer.rope_index = layer.window ? 1 : 0;
  return s;
}

DecoderSpec gemma3_spec(const nlohmann::json& c) {
  const auto* text = hf::find(c, "text_config");
  if (!text || !text->is_object())
    throw UsageError("config.json: model_type \"gemma3\" without a \"text_config\" object",
                     "a Gemma3ForConditionalGeneration config.json describes its language model in text_config");
  nlohmann::json t = *text;
  // Gemma3Config ties the LM head to the language model's embeddings unless its own tie_word_embeddings says not.
  t["tie_word_embeddings"] = hf::get_bool(c, "tie_word_embeddings", hf::get_bool(t, "tie_word_embeddings", true));
  if (!hf::find(t, "eos_token_id") && hf::find(c, "eos_token_id")) t["eos_token_id"] = c["eos_token_id"];
  DecoderSpec s = gemma3_text_spec(t);
  s.multimodal = true;
  s.final_softcap.reset();  // Gemma3ForConditionalGeneration never applies text_config's final_logit_softcapping
  return s;
}

}  // namespace trainer
