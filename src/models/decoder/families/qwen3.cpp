// Qwen3 (modeling_qwen3.py): Qwen2 with an RMSNorm over each head's queries and keys, biases (o_proj's too) only
// with attention_bias, and head_dim 128 unless config.json says.
#include "models/decoder/families/families.h"
#include "models/hf_config.h"

namespace trainer {

DecoderSpec qwen3_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {.head_dim = 128, .max_position_embeddings = 32768});
  s.qk_norm = QkNorm::kPerHead;
  // Qwen3Config: sliding windows only with use_sliding_window, in the layers from max_window_layers on.
  if (!read_layer_types(c, s) && hf::get_bool(c, "use_sliding_window", false)) {
    const auto window = hf::get_optional_int(c, "sliding_window");
    const auto layers = static_cast<int64_t>(s.layers.size());
    for (int64_t i = hf::get_int(c, "max_window_layers", 28); i < layers && window; ++i)
      s.layers[static_cast<std::size_t>(i)].window = window;
  }
  return s;
}

}  // namespace trainer
