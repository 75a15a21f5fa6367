// Llama (modeling_llama.py) and the two families that are Llama with one switch: Qwen2 (q/k/v biases, sliding
// windows above max_window_layers) and Mistral (a sliding window in every layer).
#include "models/decoder/families/families.h"
#include "models/hf_config.h"

namespace trainer {

DecoderSpec llama_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {});
  read_layer_types(c, s);
  return s;
}

DecoderSpec qwen2_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {});
  s.qkv_bias = true;
  s.o_bias = false;
  if (!read_layer_types(c, s) && hf::get_bool(c, "use_sliding_window", false)) {
    const auto window = hf::get_optional_int(c, "sliding_window");
    const auto layers = static_cast<int64_t>(s.layers.size());
    for (int64_t i = hf::get_int(c, "max_window_layers", layers); i < layers; ++i)
      s.layers[static_cast<std::size_t>(i)].window = window;
  }
  return s;
}

DecoderSpec mistral_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {});
  if (!read_layer_types(c, s))
    for (auto& layer : s.layers) layer.window = hf::get_optional_int(c, "sliding_window");
  return s;
}

}  // namespace trainer
