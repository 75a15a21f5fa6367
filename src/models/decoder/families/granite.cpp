// Granite (modeling_granite.py): Llama with four multipliers: the embeddings', each residual branch's, the
// attention scores' (instead of head_dim^-0.5) and the logits' divisor.
#include "models/decoder/families/families.h"
#include "models/hf_config.h"
#include "trainer/errors.h"

namespace trainer {

DecoderSpec granite_spec(const nlohmann::json& c) {
  DecoderSpec s = common_decoder_spec(c, {});
  s.embedding_scale = hf::get_double(c, "embedding_multiplier", 1.0);
  s.residual_multiplier = hf::get_double(c, "residual_multiplier", 1.0);
  s.attention_scale = hf::get_double(c, "attention_multiplier", 1.0);
  s.logits_scaling = hf::get_double(c, "logits_scaling", 1.0);
  if (s.logits_scaling == 0.0) throw UsageError("config.json: \"logits_scaling\" is 0", "the logits are divided by it");
  read_layer_types(c, s);
  return s;
}

}  // namespace trainer
