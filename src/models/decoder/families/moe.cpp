// The mixtures of experts on the decoder: Qwen2-MoE (Qwen2's attention with Qwen3-MoE's sparse layers and a shared
// expert every token goes through, gated by a sigmoid), OLMoE (OLMo's q/k norms over the whole projections, top-k
// of 64 experts in every layer), Qwen3-MoE (modeling_qwen3_moe.py: Qwen3's attention, a sparse MLP in every
// decoder_sparse_step-th layer outside mlp_only_layers, top-k renormalised with norm_topk_prob, routing weights in the
// compute dtype) and Mixtral (modeling_mixtral.py: Mistral's attention, a sparse MLP in every layer, top-k always
// renormalised and kept in fp32, the experts' w1 / w3 / w2). Their config classes' defaults for what a file leaves out.
#include <algorithm>

#include "models/decoder/families/families.h"
#include "models/hf_config.h"

namespace trainer {
namespace {

// The keys both read: top-k, expert count and width, the load-balancing loss's switch and coefficient.
void read_moe(const nlohmann::json& c, DecoderSpec& s, const char* experts_key, int64_t default_experts,
              int64_t default_width, int64_t default_top_k, double default_coef = 0.001) {
  MoeSpec& m = s.moe;
  // Qwen3-MoE's files say num_experts, transformers 5 writes num_local_experts (its attribute map): either.
  m.experts = hf::get_int(c, experts_key, hf::get_int(c, "num_local_experts", default_experts));
  m.top_k = hf::get_int(c, "num_experts_per_tok", default_top_k);
  m.aux_loss = hf::get_bool(c, "output_router_logits", false);
  m.aux_coef = hf::get_double(c, "router_aux_loss_coef", default_coef);
  m.intermediate = default_width;
  if (m.experts <= 0 || m.top_k <= 0 || m.top_k > m.experts)
    throw config_error("\"num_experts_per_tok\" (" + std::to_string(m.top_k) + ") must be between 1 and \"" +
                           experts_key + "\" (" + std::to_string(m.experts) + ")",
                       "each token is routed to num_experts_per_tok of the experts");
  if (m.intermediate <= 0)
    throw config_error("the experts' intermediate size must be positive", "check moe_intermediate_size / intermediate_size");
}

// Qwen2-MoE and Qwen3-MoE: a sparse MLP in every decoder_sparse_step-th layer outside mlp_only_layers.
void sparse_layers(const nlohmann::json& c, DecoderSpec& s) {
  const int64_t step = hf::get_int(c, "decoder_sparse_step", 1);
  if (step <= 0) throw config_error("\"decoder_sparse_step\" must be positive", "1 makes every layer sparse");
  std::vector<int64_t> dense;
  if (const auto* list = hf::find(c, "mlp_only_layers"); list && !list->is_null()) {
    if (!list->is_array()) throw config_error("\"mlp_only_layers\" must be a list of layer indices", "for example [0]");
    for (const auto& v : *list) {
      if (!v.is_number_integer()) throw config_error("\"mlp_only_layers\" must hold layer indices", "for example [0]");
      dense.push_back(v.get<int64_t>());
    }
  }
  for (std::size_t i = 0; i < s.layers.size(); ++i) {
    const auto index = static_cast<int64_t>(i);
    const bool only_mlp = std::find(dense.begin(), dense.end(), index) != dense.end();
    s.layers[i].sparse = !only_mlp && (index + 1) % step == 0;
  }
}

}  // namespace

DecoderSpec qwen3_moe_spec(const nlohmann::json& c) {
  DecoderSpec s = qwen3_spec(c);  // Qwen3's attention, q/k norms and windows
  read_moe(c, s, "num_experts", 128, hf::get_int(c, "moe_intermediate_size", 768), 8);
  s.moe.norm_topk = hf::get_bool(c, "norm_topk_prob", false);
  sparse_layers(c, s);
  return s;
}

DecoderSpec qwen2_moe_spec(const nlohmann::json& c) {
  DecoderSpec s = qwen2_spec(c);  // Qwen2's attention and windows; its biases by qkv_bias (true by default)
  s.qkv_bias = hf::get_bool(c, "qkv_bias", true);
  read_moe(c, s, "num_experts", 60, hf::get_int(c, "moe_intermediate_size", 1408), 4);
  s.moe.norm_topk = hf::get_bool(c, "norm_topk_prob", false);
  s.moe.shared_expert = hf::get_int(c, "shared_expert_intermediate_size", 5632);
  if (s.moe.shared_expert <= 0)
    throw config_error("\"shared_expert_intermediate_size\" must be positive", "Qwen2-MoE's shared expert's width");
  sparse_layers(c, s);
  return s;
}

DecoderSpec olmoe_spec(const nlohmann::json& c) {
  // OlmoeConfig's defaults; OLMo's RMSNorm over the whole q and k projections (Llama's norm kind), an optional
  // clamp of q, k and v, a sparse MLP in every layer (experts of intermediate_size).
  DecoderSpec s = common_decoder_spec(c, {.max_position_embeddings = 4096, .vocab_size = 50304, .hidden = 2048,
                                          .intermediate = 2048, .layers = 16, .heads = 16, .eos = 50279});
  s.eps = hf::get_double(c, "rms_norm_eps", 1e-5);
  if (!hf::find(c, "pad_token_id")) s.pad_token_id = 1;
  s.qk_norm = QkNorm::kWholeProjection;
  s.clip_qkv = optional_double(c, "clip_qkv", std::nullopt);
  if (s.clip_qkv && *s.clip_qkv <= 0) throw config_error("\"clip_qkv\" must be positive or null", "null: no clamp");
  read_moe(c, s, "num_experts", 64, s.intermediate, 8, 0.01);
  s.moe.norm_topk = hf::get_bool(c, "norm_topk_prob", false);
  for (auto& layer : s.layers) layer.sparse = true;
  return s;
}

DecoderSpec mixtral_spec(const nlohmann::json& c) {
  DecoderSpec s = mistral_spec(c);
  // MixtralConfig: the experts are intermediate_size wide (14336 by default); every layer is sparse.
  read_moe(c, s, "num_local_experts", 8, s.intermediate, 2);
  s.moe.norm_topk = true;
  s.moe.weights_in_dtype = false;
  s.moe.jitter = hf::get_double(c, "router_jitter_noise", 0.0);
  if (s.moe.jitter < 0 || s.moe.jitter >= 1)
    throw config_error("\"router_jitter_noise\" must be in [0, 1)", "0 turns the router's jitter off");
  s.moe.block = "block_sparse_moe";
  s.moe.gate = "w1";
  s.moe.up = "w3";
  s.moe.down = "w2";
  for (auto& layer : s.layers) layer.sparse = true;
  return s;
}

}  // namespace trainer
