// Reading the keys decoder families share, the checks every spec passes, and the table of families.
#include "models/decoder/spec.h"

#include <cmath>
#include <utility>

#include "models/decoder/families/families.h"
#include "models/hf_config.h"
#include "models/layers.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

// (model_type, family) in the order `supported model types` lists them.
const std::vector<std::pair<std::string, DecoderSpec (*)(const nlohmann::json&)>>& families() {
  static const std::vector<std::pair<std::string, DecoderSpec (*)(const nlohmann::json&)>> table = {
      {"llama", llama_spec},   {"qwen2", qwen2_spec},       {"mistral", mistral_spec},
      {"qwen3", qwen3_spec},   {"smollm3", smollm3_spec},   {"olmo2", olmo2_spec},
      {"granite", granite_spec}, {"gemma2", gemma2_spec},   {"gemma3_text", gemma3_text_spec},
      {"gemma3", gemma3_spec},   {"gemma4_text", gemma4_text_spec},
      {"gemma4", gemma4_spec},   {"phi3", phi3_spec},         {"qwen3_moe", qwen3_moe_spec},
      {"mixtral", mixtral_spec},       {"qwen2_moe", qwen2_moe_spec}, {"olmoe", olmoe_spec}};
  return table;
}

}  // namespace

UsageError config_error(const std::string& message, const std::string& hint) {
  return UsageError("config.json: " + message, hint);
}

std::optional<double> optional_double(const nlohmann::json& config, const char* key, std::optional<double> fallback) {
  const auto it = config.find(key);
  if (it == config.end()) return fallback;
  if (it->is_null()) return std::nullopt;
  return hf::get_double(config, key);
}

RopeSpec read_rope(const nlohmann::json& config, double default_theta, const char* section) {
  RopeSpec rope;
  const nlohmann::json* source = nullptr;
  if (const auto* p = hf::find(config, "rope_parameters"); p && p->is_object()) {
    source = p;
    if (section) {
      source = hf::find(*p, section);
      rope.key = std::string("rope_parameters.") + section;
      if (!source || !source->is_object())
        throw config_error("\"rope_parameters\" has no \"" + std::string(section) + "\" entry",
                           "rope_parameters holds one entry per layer type (full_attention, sliding_attention)");
    }
  } else if (const auto* s = hf::find(config, "rope_scaling"); s && s->is_object()) {
    source = s;
    rope.key = "rope_scaling";
  }
  if (source) rope.parameters = *source;
  rope.theta = hf::get_double(rope.parameters, "rope_theta", hf::get_double(config, "rope_theta", default_theta));
  rope.type = hf::get_string(rope.parameters, "rope_type", hf::get_string(rope.parameters, "type", "default"));
  rope.partial_rotary_factor = hf::get_double(rope.parameters, "partial_rotary_factor",
                                              hf::get_double(config, "partial_rotary_factor", 1.0));
  // Phi-3 keeps the pretraining length beside rope_parameters, and transformers prefers it there.
  if (const auto* o = hf::find(config, "original_max_position_embeddings"))
    rope.parameters["original_max_position_embeddings"] = *o;
  return rope;
}

bool read_layer_types(const nlohmann::json& config, DecoderSpec& spec) {
  const auto* types = hf::find(config, "layer_types");
  if (!types) return false;
  const auto layers = static_cast<int64_t>(spec.layers.size());
  if (!types->is_array() || static_cast<int64_t>(types->size()) != layers)
    throw config_error("\"layer_types\" must list one type per layer (num_hidden_layers = " +
                           std::to_string(layers) + "), it has " +
                           (types->is_array() ? std::to_string(types->size()) : std::string("no list")),
                       "fix the list or remove it (the family's pattern of sliding and full layers is the default)");
  const auto window = hf::get_optional_int(config, "sliding_window");
  for (std::size_t i = 0; i < types->size(); ++i) {
    const auto& type = (*types)[i];
    if (type == "full_attention") {
      spec.layers[i].window.reset();
    } else if (type == "sliding_attention") {
      if (!window)
        throw config_error("layer_types[" + std::to_string(i) + "] is \"sliding_attention\" but \"sliding_window\" is "
                           "not set", "set sliding_window to the window's length in tokens");
      spec.layers[i].window = window;
    } else {
      throw config_error("layer_types[" + std::to_string(i) + "] is " + type.dump() + ", not a layer type trainer knows",
                         "known layer types: full_attention, sliding_attention");
    }
  }
  return true;
}

DecoderSpec common_decoder_spec(const nlohmann::json& c, const FamilyDefaults& d) {
  DecoderSpec s;
  s.model_type = hf::get_string(c, "model_type", "");
  s.vocab_size = hf::get_int(c, "vocab_size", d.vocab_size);
  s.hidden = hf::get_int(c, "hidden_size", d.hidden);
  s.intermediate = hf::get_int(c, "intermediate_size", d.intermediate);
  const int64_t layers = hf::get_int(c, "num_hidden_layers", d.layers);
  s.heads = hf::get_int(c, "num_attention_heads", d.heads);
  if (s.heads <= 0 || layers <= 0 || s.hidden <= 0)
    throw config_error("hidden_size, num_hidden_layers and num_attention_heads must be positive",
                       "is this the config.json of the model?");
  s.kv_heads = hf::get_int(c, "num_key_value_heads", d.kv_heads.value_or(s.heads));
  s.head_dim = hf::get_int(c, "head_dim", d.head_dim.value_or(s.hidden / s.heads));
  if (s.kv_heads <= 0 || s.heads % s.kv_heads != 0)
    throw DataError("config.json: num_attention_heads (" + std::to_string(s.heads) +
                    ") is not a multiple of num_key_value_heads (" + std::to_string(s.kv_heads) + ")");
  s.max_position_embeddings = hf::get_int(c, "max_position_embeddings", d.max_position_embeddings);
  s.eps = hf::get_double(c, "rms_norm_eps", d.eps);
  s.initializer_range = hf::get_double(c, "initializer_range", 0.02);
  s.attention_dropout = hf::get_double(c, "attention_dropout", 0.0);
  s.qkv_bias = s.o_bias = hf::get_bool(c, "attention_bias", false);
  s.mlp_bias = hf::get_bool(c, "mlp_bias", false);
  s.tie = hf::get_bool(c, "tie_word_embeddings", d.tie);
  s.act = hf::get_string(c, d.act_key, d.act);
  check_activation(s.act, std::string("config.json \"") + d.act_key + "\"");
  s.pad_token_id = hf::get_optional_int(c, "pad_token_id");
  if (s.pad_token_id && (*s.pad_token_id < 0 || *s.pad_token_id >= s.vocab_size)) s.pad_token_id.reset();
  s.eos = hf::find(c, "eos_token_id") ? hf::get_eos(c) : d.eos;
  s.ropes = {read_rope(c, d.rope_theta)};
  s.layers.assign(static_cast<std::size_t>(layers), DecoderLayerSpec{});
  return s;
}

void finish_decoder_spec(DecoderSpec& s) {
  if (s.attention_scale == 0.0) s.attention_scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  for (const auto& rope : s.ropes) {
    const int64_t head_dim = rope.head_dim ? rope.head_dim : s.head_dim;
    const auto rotary = static_cast<int64_t>(static_cast<double>(head_dim) * rope.partial_rotary_factor);
    if (rope.type != "proportional" && rotary % 2 != 0)
      throw config_error("the rotary dimension head_dim x partial_rotary_factor = " + std::to_string(head_dim) +
                             " x " + std::to_string(rope.partial_rotary_factor) + " is odd (key \"head_dim\")",
                         "rotary embeddings rotate pairs of dimensions: head_dim (and its rotary part) must be even");
    if (rotary <= 0 || rotary > head_dim)
      throw config_error(rope.key + ".partial_rotary_factor " + std::to_string(rope.partial_rotary_factor) +
                             " leaves no rotary dimension or more than head_dim",
                         "partial_rotary_factor is a fraction in (0, 1]");
  }
  for (std::size_t i = 0; i < s.layers.size(); ++i) {
    const int64_t head_dim = s.head_dim_of(i), kv_heads = s.kv_heads_of(i);
    const std::string where = s.layers[i].head_dim || s.layers[i].kv_heads
                                  ? " (layer " + std::to_string(i) + ", per_layer_config)" : std::string();
    if (head_dim <= 0 || head_dim % 2 != 0)
      throw config_error("\"head_dim\" is " + std::to_string(head_dim) + where + ", not a positive even number",
                         "rotary embeddings rotate pairs of dimensions: head_dim must be even");
    if (kv_heads <= 0 || s.heads % kv_heads != 0)
      throw config_error("num_attention_heads (" + std::to_string(s.heads) + ") is not a multiple of "
                             "num_key_value_heads (" + std::to_string(kv_heads) + ")" + where,
                         "grouped-query attention shares each key/value head among a whole number of query heads");
    if (const auto from = s.layers[i].kv_from) {
      if (*from >= i || s.layers[*from].kv_from || s.head_dim_of(*from) != head_dim || s.kv_heads_of(*from) != kv_heads)
        throw config_error("layer " + std::to_string(i) + " cannot reuse layer " + std::to_string(*from) +
                               "'s keys and values", "a layer shares the keys and values of an earlier layer of the "
                                                     "same shape that computes its own");
      if (s.fused_qkv) throw config_error("key/value sharing with a fused qkv_proj", "no family has both");
    }
  }
  if (s.attention_softcap && *s.attention_softcap <= 0)
    throw config_error("\"attn_logit_softcapping\" must be positive or null", "null turns soft-capping off");
  if (s.final_softcap && *s.final_softcap <= 0)
    throw config_error("\"final_logit_softcapping\" must be positive or null", "null turns soft-capping off");
}

std::optional<DecoderSpec> decoder_spec_for(const std::string& model_type, const nlohmann::json& config) {
  for (const auto& [type, family] : families()) {
    if (type != model_type) continue;
    DecoderSpec spec = family(config);
    spec.model_type = model_type;  // the checkpoint's (gemma3 for the multimodal one)
    finish_decoder_spec(spec);
    return spec;
  }
  return std::nullopt;
}

std::vector<std::string> decoder_model_types() {
  std::vector<std::string> out;
  for (const auto& [type, family] : families()) out.push_back(type);
  return out;
}

}  // namespace trainer
