// The decoder families' specs read from config.json (models/decoder/spec.h): the family defaults for keys a file
// leaves out, and the clear errors for what the decoder cannot honour. The numerics are in
// tests/parity/test_models.py (every family against transformers).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/decoder/rope.h"
#include "models/decoder/spec.h"
#include "models/model.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

nlohmann::json config(const std::string& type, nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json c = {{"model_type", type},           {"vocab_size", 64},      {"hidden_size", 32},
                      {"intermediate_size", 48},      {"num_hidden_layers", 4}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}};
  c.update(extra);
  return c;
}

// The UsageError (exit 2) building `c` throws: its message and hint.
std::string usage_error(const nlohmann::json& c) {
  try {
    build_model(c, at::TensorOptions());
  } catch (const UsageError& e) {
    return std::string(e.what()) + " | " + e.hint();
  }
  ADD_FAILURE() << "no UsageError for " << c.dump();
  return "";
}

}  // namespace

TEST(DecoderSpec, EveryFamilyIsASupportedCausalModelType) {
  for (const auto& type : decoder_model_types()) {
    bool causal = false;
    for (const auto& [known, family] : supported_model_types()) causal = causal || (known == type && family == "causal");
    EXPECT_TRUE(causal) << type << " is a decoder family but not listed by supported_model_types()";
  }
  for (const auto& [known, family] : supported_model_types()) {
    if (family != "causal") continue;
    // A multimodal checkpoint describes its language model in text_config.
    const auto c = known == "gemma3" || known == "gemma4"
                       ? nlohmann::json{{"model_type", known}, {"text_config", config(known + "_text")}}
                       : config(known);
    EXPECT_TRUE(decoder_spec_for(known, c).has_value()) << known;
  }
}

TEST(DecoderSpec, FamilyDefaultsFillWhatConfigJsonLeavesOut) {
  const auto qwen3 = *decoder_spec_for("qwen3", config("qwen3"));
  EXPECT_EQ(qwen3.head_dim, 128);  // Qwen3Config's default, not hidden / heads
  EXPECT_EQ(qwen3.qk_norm, QkNorm::kPerHead);
  EXPECT_FALSE(qwen3.tie);

  const auto gemma2 = *decoder_spec_for("gemma2", config("gemma2"));
  EXPECT_EQ(gemma2.head_dim, 256);
  EXPECT_TRUE(gemma2.tie);
  EXPECT_EQ(gemma2.act, "gelu_pytorch_tanh");
  EXPECT_EQ(gemma2.attention_softcap, 50.0);  // absent: the default; null: off
  EXPECT_EQ(gemma2.final_softcap, 30.0);
  EXPECT_FALSE(decoder_spec_for("gemma2", config("gemma2", {{"final_logit_softcapping", nullptr}}))->final_softcap);
  EXPECT_TRUE(gemma2.layers[0].window && !gemma2.layers[1].window);  // sliding, full, sliding, full
  EXPECT_DOUBLE_EQ(gemma2.attention_scale, 1.0 / 16.0);              // query_pre_attn_scalar 256

  // Gemma 3 in the older file format: rope_theta and rope_scaling for full layers, rope_local_base_freq for
  // sliding ones, sliding_window_pattern.
  const auto gemma3 = *decoder_spec_for(
      "gemma3_text", config("gemma3_text", {{"rope_theta", 1000000.0}, {"rope_local_base_freq", 10000.0},
                                            {"rope_scaling", {{"rope_type", "linear"}, {"factor", 8.0}}},
                                            {"sliding_window_pattern", 2}, {"sliding_window", 8}}));
  ASSERT_EQ(gemma3.ropes.size(), 2u);
  EXPECT_EQ(gemma3.ropes[0].type, "linear");
  EXPECT_DOUBLE_EQ(gemma3.ropes[0].theta, 1000000.0);
  EXPECT_DOUBLE_EQ(gemma3.ropes[1].theta, 10000.0);
  EXPECT_EQ(gemma3.layers[0].rope_index, 1u);  // sliding
  EXPECT_EQ(gemma3.layers[1].rope_index, 0u);  // full
  EXPECT_EQ(gemma3.layers[0].window, 8);

  const auto smol = *decoder_spec_for("smollm3", config("smollm3"));
  EXPECT_TRUE(smol.layers[0].rope && smol.layers[2].rope);
  EXPECT_FALSE(smol.layers[3].rope);  // every fourth layer: no RoPE

  const auto phi3 = *decoder_spec_for("phi3", config("phi3", {{"rope_scaling", {{"type", "su"}}}}));
  EXPECT_TRUE(phi3.fused_qkv && phi3.fused_gate_up);
  EXPECT_EQ(phi3.ropes[0].type, "longrope");  // su, as older Phi-3 files name it
}

TEST(DecoderSpec, ConfigsTheDecoderCannotHonourAreUsageErrorsNamingTheKey) {
  auto rope = usage_error(config("llama", {{"rope_parameters", {{"rope_type", "su-per"}, {"rope_theta", 1e4}}}}));
  EXPECT_NE(rope.find("rope_parameters.rope_type \"su-per\""), std::string::npos) << rope;
  EXPECT_NE(rope.find("yarn"), std::string::npos) << rope;  // the hint lists the known types

  const auto odd = usage_error(config("qwen3", {{"head_dim", 9}}));
  EXPECT_NE(odd.find("config.json"), std::string::npos) << odd;
  EXPECT_NE(odd.find("head_dim"), std::string::npos) << odd;

  const auto types = usage_error(config("qwen3", {{"layer_types", {"full_attention", "full_attention"}}}));
  EXPECT_NE(types.find("\"layer_types\" must list one type per layer (num_hidden_layers = 4), it has 2"),
            std::string::npos)
      << types;
  const auto unknown = usage_error(config("llama", {{"layer_types", {"full_attention", "chunked_attention",
                                                                     "full_attention", "full_attention"}}}));
  EXPECT_NE(unknown.find("layer_types[1]"), std::string::npos) << unknown;
  const auto no_window = usage_error(config("mistral", {{"layer_types", {"sliding_attention", "full_attention",
                                                                         "full_attention", "full_attention"}}}));
  EXPECT_NE(no_window.find("sliding_window"), std::string::npos) << no_window;

  const auto longrope = usage_error(config("phi3", {{"rope_parameters", {{"rope_type", "longrope"},
                                                                         {"short_factor", {1.0}},
                                                                         {"long_factor", {1.0}}}}}));
  EXPECT_NE(longrope.find("short_factor must list 4 numbers"), std::string::npos) << longrope;  // head_dim 8
  const auto cap = usage_error(config("gemma2", {{"attn_logit_softcapping", -1.0}}));
  EXPECT_NE(cap.find("attn_logit_softcapping"), std::string::npos) << cap;
  const auto multimodal = usage_error(config("gemma3"));
  EXPECT_NE(multimodal.find("\"text_config\""), std::string::npos) << multimodal;
  const auto bidirectional = usage_error(config("gemma3_text", {{"use_bidirectional_attention", true}}));
  EXPECT_NE(bidirectional.find("use_bidirectional_attention"), std::string::npos) << bidirectional;
}

TEST(DecoderSpec, Gemma4ReadsItsLayersAsGemma4TextConfigSettlesThem) {
  // Twelve layers: five sliding to one full by default (the last always full), full layers of global_head_dim with
  // num_global_key_value_heads under attention_k_eq_v, the last two reusing the last earlier layer of their type.
  const auto s = *decoder_spec_for("gemma4_text", config("gemma4_text", {{"num_hidden_layers", 12},
                                                                         {"head_dim", 8},
                                                                         {"global_head_dim", 16},
                                                                         {"attention_k_eq_v", true},
                                                                         {"num_global_key_value_heads", 1},
                                                                         {"num_kv_shared_layers", 2},
                                                                         {"use_double_wide_mlp", true}}));
  ASSERT_EQ(s.layers.size(), 12u);
  for (std::size_t i : {0, 4, 6, 10}) EXPECT_EQ(s.layers[i].window, std::optional<int64_t>(512)) << i;
  for (std::size_t i : {5, 11}) EXPECT_FALSE(s.layers[i].window.has_value()) << i;
  EXPECT_EQ(s.head_dim_of(0), 8);
  EXPECT_EQ(s.head_dim_of(5), 16);
  EXPECT_EQ(s.kv_heads_of(5), 1);
  EXPECT_EQ(s.kv_heads_of(4), 2);
  EXPECT_TRUE(s.layers[5].k_eq_v);
  EXPECT_FALSE(s.layers[4].k_eq_v);
  EXPECT_EQ(s.layers[10].kv_from, std::optional<std::size_t>(9));
  EXPECT_EQ(s.layers[11].kv_from, std::optional<std::size_t>(5));
  EXPECT_FALSE(s.layers[9].kv_from.has_value());
  EXPECT_EQ(s.head_dim_of(11), 16);
  EXPECT_EQ(s.intermediate_of(10), 96);
  EXPECT_EQ(s.intermediate_of(9), 48);
  EXPECT_EQ(s.ropes[0].type, "proportional");
  EXPECT_EQ(s.ropes[0].head_dim, 16);
  EXPECT_EQ(s.ropes[1].head_dim, 8);
  EXPECT_EQ(s.per_layer_input, 256);
  EXPECT_DOUBLE_EQ(s.attention_scale, 1.0);

  // transformers' per_layer_config (what save_pretrained writes) wins over global_head_dim.
  const auto p = *decoder_spec_for("gemma4_text", config("gemma4_text", {
      {"head_dim", 8}, {"global_head_dim", 64}, {"layer_types", {"sliding_attention", "full_attention",
                                                                 "sliding_attention", "full_attention"}},
      {"sliding_window", 4}, {"per_layer_config", {{"1", {{"head_dim", 32}}}, {"3", {{"head_dim", 32}}}}}}));
  EXPECT_EQ(p.head_dim_of(1), 32);
  EXPECT_EQ(p.head_dim_of(2), 8);
}

TEST(DecoderSpec, Gemma4ConfigsTrainerCannotHonourAreUsageErrorsNamingTheKey) {
  const auto moe = usage_error(config("gemma4_text", {{"enable_moe_block", true}}));
  EXPECT_NE(moe.find("enable_moe_block"), std::string::npos) << moe;
  const auto all = usage_error(config("gemma4_text", {{"use_bidirectional_attention", "all"}}));
  EXPECT_NE(all.find("use_bidirectional_attention"), std::string::npos) << all;
  const auto shared = usage_error(config("gemma4_text", {{"num_kv_shared_layers", 4}}));
  EXPECT_NE(shared.find("num_kv_shared_layers"), std::string::npos) << shared;
  // The last layer (full) shares, but every layer before the shared ones is sliding.
  const auto no_producer = usage_error(config("gemma4_text", {{"num_kv_shared_layers", 2}}));
  EXPECT_NE(no_producer.find("no layer before the shared ones is of its type"), std::string::npos) << no_producer;
  const auto key = usage_error(config("gemma4_text", {{"per_layer_config", {{"3", {{"sliding_window", 8}}}}}}));
  EXPECT_NE(key.find("per_layer_config.3.sliding_window"), std::string::npos) << key;
  const auto index = usage_error(config("gemma4_text", {{"per_layer_config", {{"9", {{"head_dim", 8}}}}}}));
  EXPECT_NE(index.find("per_layer_config names layer 9 of 4"), std::string::npos) << index;
  const auto odd = usage_error(config("gemma4_text", {{"per_layer_config", {{"3", {{"head_dim", 7}}}}}}));
  EXPECT_NE(odd.find("layer 3, per_layer_config"), std::string::npos) << odd;
  const auto multimodal = usage_error(nlohmann::json{{"model_type", "gemma4"}});
  EXPECT_NE(multimodal.find("\"text_config\""), std::string::npos) << multimodal;
}

TEST(DecoderSpec, LongropeAndDynamicFrequenciesFollowTheLength) {
  RopeSpec longrope;
  longrope.type = "longrope";
  longrope.parameters = {{"short_factor", {1.0, 1.0}}, {"long_factor", {2.0, 4.0}},
                         {"original_max_position_embeddings", 8}};
  const Rope rope(longrope, 4, 32);
  EXPECT_TRUE(at::allclose(rope.inverse_frequencies(8) / rope.inverse_frequencies(9), at::tensor({2.0f, 4.0f})));
  EXPECT_NEAR(rope.attention_scaling(), std::sqrt(1 + std::log(4.0) / std::log(8.0)), 1e-12);  // factor 32 / 8

  RopeSpec dynamic;
  dynamic.type = "dynamic";
  dynamic.parameters = {{"factor", 2.0}};
  const Rope ntk(dynamic, 8, 16);
  EXPECT_TRUE(at::equal(ntk.inverse_frequencies(16), ntk.inverse_frequencies(1)));  // within the trained length
  EXPECT_FALSE(at::equal(ntk.inverse_frequencies(17), ntk.inverse_frequencies(16)));
}

}  // namespace trainer
