// The mixtures of experts on the decoder: Qwen3-MoE (modeling_qwen3_moe.py: Qwen3's attention, a sparse MLP in every
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
              int64_t default_width) {
  MoeSpec& m = s.moe;
  // Qwen3-MoE's files say num_experts, transformers 5 writes num_local_experts (its attribute map): either.
  m.experts = hf::get_int(c, experts_key, hf::get_int(c, "num_local_experts", default_experts));
  m.top_k = hf::get_int(c, "num_experts_per_tok", 2);
  m.aux_loss = hf::get_bool(c, "output_router_logits", false);
  m.aux_coef = hf::get_double(c, "router_aux_loss_coef", 0.001);
  m.intermediate = default_width;
  if (m.experts <= 0 || m.top_k <= 0 || m.top_k > m.experts)
    throw config_error("\"num_experts_per_tok\" (" + std::to_string(m.top_k) + ") must be between 1 and \"" +
                           experts_key + "\" (" + std::to_string(m.experts) + ")",
                       "each token is routed to num_experts_per_tok of the experts");
  if (m.intermediate <= 0)
    throw config_error("the experts' intermediate size must be positive", "check moe_intermediate_size / intermediate_size");
  if (hf::get_double(c, "router_jitter_noise", 0.0) != 0.0)
    throw config_error("\"router_jitter_noise\" is " + std::to_string(hf::get_double(c, "router_jitter_noise", 0.0)) +
                           ": router jitter is not supported yet",
                       "set it to 0.0 (the released Mixtral configs' value)");
}

}  // namespace

DecoderSpec qwen3_moe_spec(const nlohmann::json& c) {
  DecoderSpec s = qwen3_spec(c);  // Qwen3's attention, q/k norms and windows
  read_moe(c, s, "num_experts", 128, hf::get_int(c, "moe_intermediate_size", 768));
  s.moe.norm_topk = hf::get_bool(c, "norm_topk_prob", false);
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
  return s;
}

DecoderSpec mixtral_spec(const nlohmann::json& c) {
  DecoderSpec s = mistral_spec(c);
  // MixtralConfig: the experts are intermediate_size wide (14336 by default); every layer is sparse.
  read_moe(c, s, "num_local_experts", 8, s.intermediate);
  s.moe.norm_topk = true;
  s.moe.weights_in_dtype = false;
  s.moe.block = "block_sparse_moe";
  s.moe.gate = "w1";
  s.moe.up = "w3";
  s.moe.down = "w2";
  for (auto& layer : s.layers) layer.sparse = true;
  return s;
}

}  // namespace trainer
