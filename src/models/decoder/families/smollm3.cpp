// SmolLM3 (modeling_smollm3.py): Llama with layers that use no rotary embedding (no_rope_layers: 1 = RoPE,
// 0 = none; by default every no_rope_layer_interval-th layer has none).
#include "models/decoder/families/families.h"
#include "models/hf_config.h"
#include "trainer/errors.h"

namespace trainer {

DecoderSpec smollm3_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {.tie = true, .rope_theta = 2000000.0, .max_position_embeddings = 32768});
  const auto layers = s.layers.size();
  if (const auto* list = hf::find(c, "no_rope_layers")) {
    if (!list->is_array() || list->size() != layers)
      throw UsageError("config.json: \"no_rope_layers\" must list 0 or 1 for each of the " + std::to_string(layers) +
                           " layers",
                       "1 = the layer uses RoPE, 0 = it does not");
    for (std::size_t i = 0; i < layers; ++i) {
      if (!(*list)[i].is_number_integer())
        throw UsageError("config.json: \"no_rope_layers\"[" + std::to_string(i) + "] must be 0 or 1");
      s.layers[i].rope = (*list)[i].get<int64_t>() != 0;
    }
  } else {
    const int64_t interval = hf::get_int(c, "no_rope_layer_interval", 4);
    for (std::size_t i = 0; i < layers; ++i) s.layers[i].rope = (static_cast<int64_t>(i) + 1) % interval != 0;
  }
  // SmolLM3Config: without layer_types, the NoPE layers slide when use_sliding_window is set.
  if (!read_layer_types(c, s) && hf::get_bool(c, "use_sliding_window", false))
    if (const auto window = hf::get_optional_int(c, "sliding_window"))
      for (auto& layer : s.layers)
        if (!layer.rope) layer.window = window;
  if (!hf::get_bool(c, "use_sliding_window", false))
    for (auto& layer : s.layers) layer.window.reset();  // SmolLM3Attention slides only with use_sliding_window
  return s;
}

}  // namespace trainer
