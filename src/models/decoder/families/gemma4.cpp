// Gemma 4's text model (modeling_gemma4.py: Gemma4TextModel) and the multimodal checkpoint's language model
// (Gemma4ForConditionalGeneration, Gemma 4 E2B / E4B and larger). Against Gemma 3: norms that multiply by their
// weight in fp32 (not 1 + weight); values RMS-normed per head without a weight; scores unscaled (1.0); full-attention
// layers with their own head_dim (global_head_dim) and, with attention_k_eq_v, their own key/value head count and
// values taken from the key projection; proportional RoPE on the full layers; the last num_kv_shared_layers layers
// attending over the keys and values of the last earlier layer of their type (with twice the MLP width under
// use_double_wide_mlp); per-layer input embeddings (PLE) added after each block's MLP; each block's output times
// its layer_scalar buffer. The mixture-of-experts block (enable_moe_block) is refused.
#include <cmath>
#include <map>
#include <string>

#include "models/decoder/families/families.h"
#include "models/hf_config.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

constexpr const char* kFull = "full_attention";
constexpr const char* kSliding = "sliding_attention";

// The layer types as Gemma4TextConfig settles them: config.json's layer_types, or five sliding layers to one full
// one; the last layer is always full (transformers forces it, with a warning).
std::vector<std::string> layer_types(const nlohmann::json& c, DecoderSpec& s) {
  std::vector<std::string> types(s.layers.size());
  nlohmann::json with_window = c;  // Gemma4TextConfig's window when config.json has none
  if (!hf::find(with_window, "sliding_window")) with_window["sliding_window"] = 512;
  if (read_layer_types(with_window, s)) {
    for (std::size_t i = 0; i < types.size(); ++i) types[i] = s.layers[i].window ? kSliding : kFull;
  } else {
    const int64_t window = hf::get_int(c, "sliding_window", 512);
    for (std::size_t i = 0; i < types.size(); ++i) {
      const bool sliding = (i + 1) % 6 != 0;
      types[i] = sliding ? kSliding : kFull;
      if (sliding) s.layers[i].window = window;
    }
  }
  types.back() = kFull;
  s.layers.back().window.reset();
  return types;
}

// Per-layer head_dim and key/value heads: config.json's per_layer_config ({"LAYER": {"head_dim": ..,
// "num_key_value_heads": ..}}, what transformers writes), or what Gemma4TextConfig derives from global_head_dim
// (default 512) and num_global_key_value_heads (with attention_k_eq_v) for the full layers.
void layer_shapes(const nlohmann::json& c, DecoderSpec& s, const std::vector<std::string>& types, bool k_eq_v) {
  const auto* per_layer = hf::find(c, "per_layer_config");
  if (per_layer && !per_layer->is_null()) {
    if (!per_layer->is_object())
      throw config_error("\"per_layer_config\" must be an object of layer index -> overrides",
                         "transformers writes it as {\"5\": {\"head_dim\": 512}, ...}");
    for (const auto& [key, overrides] : per_layer->items()) {
      std::size_t layer = 0;
      try {
        std::size_t used = 0;
        layer = static_cast<std::size_t>(std::stoul(key, &used));
        if (used != key.size()) throw std::invalid_argument(key);
      } catch (const std::exception&) {
        throw config_error("per_layer_config has the key \"" + key + "\", not a layer index",
                           "its keys are layer indices as strings (\"0\" to \"num_hidden_layers - 1\")");
      }
      if (layer >= s.layers.size())
        throw config_error("per_layer_config names layer " + key + " of " + std::to_string(s.layers.size()),
                           "layer indices run from 0 to num_hidden_layers - 1");
      if (!overrides.is_object())
        throw config_error("per_layer_config." + key + " must be an object", "for example {\"head_dim\": 512}");
      for (const auto& [name, value] : overrides.items()) {
        if (name == "head_dim") s.layers[layer].head_dim = hf::get_int(overrides, "head_dim");
        else if (name == "num_key_value_heads") s.layers[layer].kv_heads = hf::get_int(overrides, "num_key_value_heads");
        else
          throw config_error("per_layer_config." + key + "." + name + " is an override trainer does not know",
                             "trainer honours head_dim and num_key_value_heads per layer");
      }
    }
    return;
  }
  const int64_t global_head_dim = hf::get_int(c, "global_head_dim", 512);
  const auto global_kv_heads = hf::get_optional_int(c, "num_global_key_value_heads");
  for (std::size_t i = 0; i < types.size(); ++i) {
    if (types[i] != kFull) continue;
    s.layers[i].head_dim = global_head_dim;
    if (k_eq_v && global_kv_heads) s.layers[i].kv_heads = *global_kv_heads;
  }
}

}  // namespace

DecoderSpec gemma4_text_spec(const nlohmann::json& c) {
  // Gemma4TextConfig's defaults.
  DecoderSpec s = common_decoder_spec(c, {.head_dim = 256, .tie = true, .act_key = "hidden_activation",
                                          .act = "gelu_pytorch_tanh", .max_position_embeddings = 131072,
                                          .vocab_size = 262144, .hidden = 2304, .intermediate = 9216,
                                          .layers = 30, .heads = 8, .kv_heads = 4, .eos = 1});
  s.pad_token_id = hf::get_optional_int(c, "pad_token_id").value_or(0);
  if (*s.pad_token_id < 0 || *s.pad_token_id >= s.vocab_size) s.pad_token_id.reset();
  if (hf::get_bool(c, "enable_moe_block", false))
    throw config_error("\"enable_moe_block\" is true: Gemma 4's mixture-of-experts block is not supported yet",
                       "trainer fine-tunes the dense Gemma 4 models (E2B, E4B, 31B)");
  if (const auto* b = hf::find(c, "use_bidirectional_attention");
      b && ((b->is_string() && *b == "all") || (b->is_boolean() && b->get<bool>())))
    throw config_error("\"use_bidirectional_attention\" is " + b->dump() + ": every token attends both ways",
                       "trainer fine-tunes Gemma 4 as a causal language model (null or \"vision\")");
  s.norm = NormKind::kFp32;
  s.post_attention_norm = "post_attention_layernorm";
  s.pre_mlp_norm = "pre_feedforward_layernorm";
  s.post_mlp_norm = "post_feedforward_layernorm";
  s.mlp_bias = false;
  s.qk_norm = QkNorm::kPerHead;
  s.v_norm = true;
  s.embedding_scale = std::sqrt(static_cast<double>(s.hidden));
  s.embedding_scale_in_dtype = true;
  s.attention_scale = 1.0;
  s.final_softcap = optional_double(c, "final_logit_softcapping", std::nullopt);
  s.layer_scalar = true;

  const auto types = layer_types(c, s);
  const bool k_eq_v = hf::get_bool(c, "attention_k_eq_v", false);
  layer_shapes(c, s, types, k_eq_v);
  for (std::size_t i = 0; i < types.size(); ++i) s.layers[i].k_eq_v = k_eq_v && types[i] == kFull;

  // One RoPE per layer type, each over its layers' head_dim: rope_parameters.{sliding,full}_attention, or
  // Gemma4TextConfig's (default at 10k on sliding layers, proportional at 1M over a quarter on full ones).
  const auto* rope = hf::find(c, "rope_parameters");
  const bool given = rope && rope->is_object() && !rope->empty();
  RopeSpec sliding = given ? read_rope(c, 10000.0, kSliding) : RopeSpec{};
  RopeSpec full = given ? read_rope(c, 1000000.0, kFull) : RopeSpec{};
  if (!given) {
    full.type = "proportional";
    full.theta = 1000000.0;
    full.partial_rotary_factor = 0.25;
  }
  s.ropes = {full, sliding};
  std::map<std::string, int64_t> type_head_dim;
  for (std::size_t i = 0; i < types.size(); ++i) {
    s.layers[i].rope_index = types[i] == kFull ? 0 : 1;
    const auto [it, inserted] = type_head_dim.emplace(types[i], s.head_dim_of(i));
    if (!inserted && it->second != s.head_dim_of(i))
      throw config_error("layers of type " + types[i] + " have different head_dim (" + std::to_string(it->second) +
                             " and " + std::to_string(s.head_dim_of(i)) + " at layer " + std::to_string(i) + ")",
                         "a layer type's RoPE is computed once over its head_dim (per_layer_config)");
  }
  for (std::size_t r = 0; r < 2; ++r)
    if (const auto it = type_head_dim.find(r == 0 ? kFull : kSliding); it != type_head_dim.end())
      s.ropes[r].head_dim = it->second;

  // Key/value sharing: the last num_kv_shared_layers layers reuse the keys and values of the last earlier layer
  // of their type, and with use_double_wide_mlp have twice the MLP width.
  const int64_t layers = static_cast<int64_t>(s.layers.size());
  const int64_t shared = hf::get_int(c, "num_kv_shared_layers", 0);
  if (shared < 0 || shared >= layers)
    throw config_error("\"num_kv_shared_layers\" is " + std::to_string(shared) + " of " + std::to_string(layers) +
                           " layers",
                       "at least the first layer computes its own keys and values (0 <= num_kv_shared_layers < "
                       "num_hidden_layers)");
  const bool double_wide = hf::get_bool(c, "use_double_wide_mlp", false);
  const auto first_shared = static_cast<std::size_t>(layers - shared);
  for (std::size_t i = first_shared; i < s.layers.size(); ++i) {
    for (std::size_t j = first_shared; j-- > 0;) {
      if (types[j] != types[i]) continue;
      s.layers[i].kv_from = j;
      break;
    }
    if (!s.layers[i].kv_from)
      throw config_error("layer " + std::to_string(i) + " (" + types[i] + ") shares keys and values, but no layer "
                             "before the shared ones is of its type (num_kv_shared_layers = " +
                             std::to_string(shared) + ")",
                         "every layer type among the last num_kv_shared_layers layers needs an earlier layer of that "
                         "type");
    s.layers[i].head_dim = s.head_dim_of(*s.layers[i].kv_from);
    s.layers[i].kv_heads = s.kv_heads_of(*s.layers[i].kv_from);
    if (double_wide) s.layers[i].intermediate = 2 * s.intermediate;
  }

  // Per-layer input embeddings (hidden_size_per_layer_input; 0 or null: none).
  const auto per_layer = hf::find(c, "hidden_size_per_layer_input");
  s.per_layer_input = !per_layer ? 256 : per_layer->is_null() ? 0 : hf::get_int(c, "hidden_size_per_layer_input");
  s.per_layer_vocab = hf::get_int(c, "vocab_size_per_layer_input", 262144);
  if (s.per_layer_input < 0 || (s.per_layer_input > 0 && s.per_layer_vocab <= 0))
    throw config_error("\"hidden_size_per_layer_input\" / \"vocab_size_per_layer_input\" must be positive",
                       "0 or null turns the per-layer input embeddings off");
  return s;
}

DecoderSpec gemma4_spec(const nlohmann::json& c) {
  const auto* text = hf::find(c, "text_config");
  if (!text || !text->is_object())
    throw UsageError("config.json: model_type \"gemma4\" without a \"text_config\" object",
                     "a Gemma4ForConditionalGeneration config.json describes its language model in text_config");
  nlohmann::json t = *text;
  t["tie_word_embeddings"] = hf::get_bool(c, "tie_word_embeddings", hf::get_bool(t, "tie_word_embeddings", true));
  if (!hf::find(t, "eos_token_id") && hf::find(c, "eos_token_id")) t["eos_token_id"] = c["eos_token_id"];
  DecoderSpec s = gemma4_text_spec(t);
  s.multimodal = true;
  s.multimodal_module_names = true;  // transformers 5 writes model.language_model.* for Gemma 4
  return s;  // Gemma4ForConditionalGeneration caps the logits by text_config's final_logit_softcapping
}

}  // namespace trainer
