// `trainer plan`'s precision and optimizer choices: the optimizer state each optimizer keeps, and which setting of
// configs/t5xl.json fits a 32 GB card (FLAN-T5-XL's config.json, built on the meta device only).
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/planner.h"
#include "support/paths.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

// google/flan-t5-xl's config.json (the architecture keys).
nlohmann::json flan_t5_xl() {
  return {{"model_type", "t5"}, {"d_ff", 5120}, {"d_kv", 64}, {"d_model", 2048}, {"decoder_start_token_id", 0},
          {"dense_act_fn", "gelu_new"}, {"dropout_rate", 0.1}, {"eos_token_id", 1},
          {"feed_forward_proj", "gated-gelu"}, {"is_encoder_decoder", true}, {"is_gated_act", true},
          {"layer_norm_epsilon", 1e-6}, {"num_decoder_layers", 24}, {"num_heads", 32}, {"num_layers", 24},
          {"pad_token_id", 0}, {"relative_attention_max_distance", 128}, {"relative_attention_num_buckets", 32},
          {"tie_word_embeddings", false}, {"vocab_size", 32128}};
}

constexpr double kCard = 32e9;  // "32 GB"

TEST(PlannerChoices, T5xlConfigFitsA32GBCardWhereMasterWeightsWithAutocastDoNot) {
  const Config config = load_config(test::source_path("configs/t5xl.json"));
  const auto plan = plan_memory(config, flan_t5_xl(), c10::Device(c10::kCUDA), kCard, "test");
  EXPECT_GT(plan.largest_micro_batch(true, true), 16);
  // Adafactor's factored statistics: under 1% of a byte per parameter.
  EXPECT_LT(plan.optimizer_state - 2.0 * static_cast<double>(plan.parameters), 0.01 * static_cast<double>(plan.parameters));
  std::ostringstream out;
  print_optimizer_choices(config, flan_t5_xl(), c10::Device(c10::kCUDA), kCard, "test", out);
  const std::string text = out.str();
  // fp32 weights with Adafactor fit (no autocast copies), at a quarter of the micro-batch and without bf16 compute.
  EXPECT_NE(text.find("the least loss of precision that fits: fp32, Adafactor"), std::string::npos) << text;
  const auto line_of = [&](const std::string& label) {
    const auto begin = text.find("  " + label + " ");
    return text.substr(begin, text.find('\n', begin) - begin);
  };
  EXPECT_NE(line_of("bf16 + kahan, Adafactor").find("(this config)"), std::string::npos) << text;
  EXPECT_EQ(line_of("bf16 + kahan, Adafactor").find("does not fit"), std::string::npos) << text;
  EXPECT_NE(line_of("bf16-mixed, Adafactor").find("does not fit"), std::string::npos) << text;
  EXPECT_NE(line_of("bf16 + stochastic, AdamW").find("does not fit"), std::string::npos) << text;
}

TEST(PlannerChoices, AdafactorStateIsRowsAndColumns) {
  Config config = load_config(test::source_path("configs/tiny-t5.json"));
  config.model.path = test::source_path(config.model.path);
  const auto hf = read_json_file(config.model.path + "/config.json");
  config.optimizer.name = OptimizerName::kAdamW;
  const auto adamw = plan_memory(config, hf, c10::Device(c10::kCPU), 0, "test");
  EXPECT_DOUBLE_EQ(adamw.optimizer_state, 8.0 * static_cast<double>(adamw.parameters));
  config.optimizer.name = OptimizerName::kAdafactor;
  const auto adafactor = plan_memory(config, hf, c10::Device(c10::kCPU), 0, "test");
  EXPECT_LT(adafactor.optimizer_state, 0.2 * adamw.optimizer_state);
  config.optimizer.adafactor_beta1 = true;
  EXPECT_GT(plan_memory(config, hf, c10::Device(c10::kCPU), 0, "test").optimizer_state,
            4.0 * static_cast<double>(adamw.parameters));
}

}  // namespace
}  // namespace trainer
