// What distinguishes one decoder-only family from another, as data: the one decoder (decoder.cpp) reads a
// DecoderSpec and nothing else, and a family is a function from its config.json to a spec (families/*.cpp) plus
// the module names the spec gives its weights, which are transformers' names (so loading, saving, LoRA's PEFT
// names and QLoRA follow). No LibTorch here: a family file is plain C++ over the JSON.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"

namespace trainer {

// How an RMS norm turns its normalised fp32 input and its weight into the output.
enum class NormKind {
  kLlama,  // LlamaRMSNorm: cast back to the input dtype, then times the weight
  kFp32,   // Olmo2RMSNorm: times the weight in fp32, then cast back
  kGemma,  // GemmaRMSNorm: times (1 + weight) in fp32, then cast back (the weight starts at zero)
};

enum class QkNorm {
  kNone,
  kPerHead,          // q_norm / k_norm over each head's head_dim (Qwen3, Gemma 3)
  kWholeProjection,  // over the whole q / k projection (OLMo 2)
};

// One RoPE as modeling_rope_utils.py computes it: the rope type and its parameters (rope_parameters, or the older
// rope_scaling + rope_theta), read by decoder/rope.cpp.
struct RopeSpec {
  std::string type = "default";  // default, linear, llama3, dynamic, yarn, longrope, proportional
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
  nlohmann::json parameters = nlohmann::json::object();  // factor, low_freq_factor, short_factor, ... as given
  std::string key = "rope_parameters";                   // where config.json holds it (for errors)
  int64_t head_dim = 0;  // the head_dim its frequencies are computed over; 0: the spec's (Gemma 4: per layer type)
};

struct DecoderLayerSpec {
  std::optional<int64_t> window;  // sliding-window attention over this many keys, or full attention
  bool rope = true;               // false: no rotary embedding in this layer (SmolLM3's NoPE layers)
  std::size_t rope_index = 0;     // which of DecoderSpec::ropes (Gemma 3: one per layer type)
  // Gemma 4's layers differ in shape: 0 is the spec's head_dim / num_key_value_heads / intermediate_size.
  int64_t head_dim = 0, kv_heads = 0, intermediate = 0;
  bool k_eq_v = false;                 // no v_proj: the values are the key projection's output (attention_k_eq_v)
  std::optional<std::size_t> kv_from;  // no k/v projections: attends over that earlier layer's keys and values
  bool sparse = false;                 // a mixture of experts (DecoderSpec::moe) instead of the dense MLP
};

// A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router (`router`, a linear layer without bias over the
// hidden state) scores `experts` experts, softmax in fp32, the top `top_k` weight each token's experts' outputs
// (renormalised to sum 1 with norm_topk); each expert is a gated MLP of `intermediate` with transformers' module
// names as the files store them (one tensor per expert: <block>.experts.<e>.<gate>/<up>/<down>).
struct MoeSpec {
  int64_t experts = 0, top_k = 0, intermediate = 0;
  bool norm_topk = false;
  bool weights_in_dtype = true;  // the routing weights cast to the compute dtype (Qwen3-MoE) or kept fp32 (Mixtral)
  std::string block = "mlp", router = "gate", gate = "gate_proj", up = "up_proj", down = "down_proj";
  // The load-balancing loss (output_router_logits): router_aux_loss_coef x transformers' load_balancing_loss_func.
  bool aux_loss = false;
  double aux_coef = 0.001;
  // Gemma 4's block (enable_moe_block): the experts run beside the dense MLP, not instead of it, on the block's
  // residual (pre_feedforward_layernorm_2 before them, post_feedforward_layernorm_1 / _2 on the two outputs, summed
  // before post_feedforward_layernorm); its router (router.proj) scores the unweighted-RMS-normed residual times
  // router.scale and hidden^-0.5, and multiplies the renormalised top-k weights by router.per_expert_scale; the
  // experts are two stacked tensors as the files hold them (experts.gate_up_proj (E, 2I, H), experts.down_proj).
  bool gemma4 = false;
  // Mixtral's router_jitter_noise: in training the block's input times uniform noise in [1 - j, 1 + j], keyed like
  // dropout (the module `jitter`), so no split changes it.
  double jitter = 0.0;
  // Qwen2-MoE: a shared expert of this width (a gated MLP, shared_expert.*) every token also goes through, times
  // sigmoid(shared_expert_gate(x)); 0: none.
  int64_t shared_expert = 0;
};

struct DecoderSpec {
  std::string model_type;
  int64_t vocab_size = 0, hidden = 0, intermediate = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double eps = 1e-6, initializer_range = 0.02, attention_dropout = 0.0;
  double residual_dropout = 0.0;  // Phi-3's resid_pdrop on each sub-block's output
  bool qkv_bias = false, o_bias = false, mlp_bias = false, tie = false;
  std::string act = "silu";
  bool fused_qkv = false;      // one qkv_proj (Phi-3) instead of q_proj, k_proj, v_proj
  bool fused_gate_up = false;  // one gate_up_proj (Phi-3): gate first, up second
  NormKind norm = NormKind::kLlama;
  QkNorm qk_norm = QkNorm::kNone;
  std::optional<double> clip_qkv;  // OLMoE: q, k (after their norms) and v clamped to [-clip, clip]
  // The block's norms by place, each transformers' module name or empty for none: before attention, on the
  // attention's output, before the MLP, on the MLP's output.
  std::string pre_attention_norm = "input_layernorm", post_attention_norm;
  std::string pre_mlp_norm = "post_attention_layernorm", post_mlp_norm;
  double attention_scale = 0.0;          // multiplies q.k (set by finish(): head_dim^-0.5 unless a family says)
  double embedding_scale = 1.0;          // multiplies the embeddings (Gemma: sqrt(hidden), Granite's multiplier)
  bool embedding_scale_in_dtype = false; // Gemma rounds its scale to the weights' dtype first
  double residual_multiplier = 1.0;      // Granite: residual + out * multiplier
  double logits_scaling = 1.0;           // Granite: the logits are divided by it
  std::optional<double> attention_softcap, final_softcap;  // Gemma 2: cap * tanh(x / cap)
  std::vector<RopeSpec> ropes{RopeSpec{}};
  std::vector<DecoderLayerSpec> layers;
  std::optional<int64_t> pad_token_id, eos;
  // A multimodal checkpoint's language model (Gemma3ForConditionalGeneration): the modules sit under
  // model.language_model (transformers 5's tree), the files say language_model.model (and transformers writes
  // that), and every tensor outside it is carried unchanged.
  bool multimodal = false;
  // The files name the multimodal text model as the modules do (model.language_model.*: Gemma 4), not
  // language_model.model.* (Gemma 3).
  bool multimodal_module_names = false;
  // Gemma 4: values RMS-normed per head without a weight; per-layer input embeddings (PLE) of this width per layer
  // from a table of per_layer_vocab rows (0: none); each block's output times its checkpoint's layer_scalar (a
  // buffer transformers never trains: carried, read, saved back).
  bool v_norm = false;
  int64_t per_layer_input = 0, per_layer_vocab = 0;
  bool layer_scalar = false;
  MoeSpec moe;  // for the layers marked sparse

  int64_t head_dim_of(std::size_t layer) const { return layers[layer].head_dim ? layers[layer].head_dim : head_dim; }
  int64_t kv_heads_of(std::size_t layer) const { return layers[layer].kv_heads ? layers[layer].kv_heads : kv_heads; }
  int64_t intermediate_of(std::size_t layer) const {
    return layers[layer].intermediate ? layers[layer].intermediate : intermediate;
  }
};

// Defaults a family's config class has for keys config.json may leave out.
struct FamilyDefaults {
  std::optional<int64_t> head_dim;  // none: hidden_size / num_attention_heads
  bool tie = false;
  double eps = 1e-6;
  const char* act_key = "hidden_act";
  const char* act = "silu";
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 2048;
  // Sizes for the config classes that default them (Gemma: a Hub file's text_config may give only what differs).
  std::optional<int64_t> vocab_size, hidden, intermediate, layers, heads, kv_heads, eos;
};

// The keys every Llama-like config.json has (sizes, eps, biases as attention_bias / mlp_bias, tie, activation,
// pad and EOS, one RoPE), with the family's defaults; every layer full attention with RoPE.
DecoderSpec common_decoder_spec(const nlohmann::json& config, const FamilyDefaults& defaults);

// The RoPE of config.json: rope_parameters (transformers 5), or rope_scaling with rope_theta (older files);
// `section` reads one layer type's entry of a per-type rope_parameters (Gemma 3).
RopeSpec read_rope(const nlohmann::json& config, double default_theta, const char* section = nullptr);

// layer_types (sliding_attention / full_attention) into per-layer windows; false when config.json has none. A list
// of the wrong length, an unknown type or a sliding layer without sliding_window is a UsageError naming the key.
bool read_layer_types(const nlohmann::json& config, DecoderSpec& spec);

// A UsageError about config.json: "config.json: " + message, with a hint.
UsageError config_error(const std::string& message, const std::string& hint);

// A float key that may be null (none) or absent (the family's default).
std::optional<double> optional_double(const nlohmann::json& config, const char* key, std::optional<double> fallback);

// Checks what the decoder cannot honour (odd rotary dimensions, ...), fills attention_scale when unset. Throws
// UsageError naming config.json and the key.
void finish_decoder_spec(DecoderSpec& spec);

// The family of `model_type`: its spec from config.json, or nullopt when no family has that name.
std::optional<DecoderSpec> decoder_spec_for(const std::string& model_type, const nlohmann::json& config);
// The model types the decoder families cover, in registry order.
std::vector<std::string> decoder_model_types();

}  // namespace trainer
