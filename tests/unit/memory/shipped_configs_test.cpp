// Every shipped GPU config fits the card it names, by `trainer plan`'s own estimate with the safety margin: the
// real models' config.json shapes (no weights: plan builds the architecture on the meta device), the config as
// shipped, memory.limit = the card. A GPU config added to configs/ without an entry here fails the test.
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memory/planner.h"
#include "train/engine/task_kind.h"
#include "models/image/image_model.h"
#include "models/inspect.h"
#include "support/paths.h"
#include "support/temp_dir.h"
#include "trainer/config.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

// The Hugging Face config.json of the models the shipped configs train (shapes and the keys our builders read).
const nlohmann::json kQwen25_7B = {{"model_type", "qwen2"},        {"vocab_size", 152064},
                                   {"hidden_size", 3584},          {"intermediate_size", 18944},
                                   {"num_hidden_layers", 28},      {"num_attention_heads", 28},
                                   {"num_key_value_heads", 4},     {"max_position_embeddings", 131072},
                                   {"rms_norm_eps", 1e-6},         {"rope_theta", 1000000.0},
                                   {"hidden_act", "silu"},         {"tie_word_embeddings", false},
                                   {"bos_token_id", 151643},       {"eos_token_id", 151643},
                                   {"attention_dropout", 0.0},     {"use_sliding_window", false}};
// Qwen/Qwen2.5-14B.
const nlohmann::json kQwen25_14B = {{"model_type", "qwen2"},        {"vocab_size", 152064},
                                    {"hidden_size", 5120},          {"intermediate_size", 13824},
                                    {"num_hidden_layers", 48},      {"num_attention_heads", 40},
                                    {"num_key_value_heads", 8},     {"max_position_embeddings", 131072},
                                    {"rms_norm_eps", 1e-5},         {"rope_theta", 1000000.0},
                                    {"hidden_act", "silu"},         {"tie_word_embeddings", false},
                                    {"bos_token_id", 151643},       {"eos_token_id", 151643},
                                    {"attention_dropout", 0.0},     {"use_sliding_window", false}};
// Qwen/Qwen3-8B.
const nlohmann::json kQwen3_8B = {{"model_type", "qwen3"},        {"vocab_size", 151936},
                                  {"hidden_size", 4096},          {"intermediate_size", 12288},
                                  {"num_hidden_layers", 36},      {"num_attention_heads", 32},
                                  {"num_key_value_heads", 8},     {"head_dim", 128},
                                  {"max_position_embeddings", 40960}, {"rms_norm_eps", 1e-6},
                                  {"rope_theta", 1000000.0},      {"hidden_act", "silu"},
                                  {"tie_word_embeddings", false}, {"attention_bias", false},
                                  {"bos_token_id", 151643},       {"eos_token_id", 151645},
                                  {"use_sliding_window", false},  {"max_window_layers", 36}};
// Qwen/Qwen3-30B-A3B: 48 sparse layers of 128 experts (768 wide), 8 per token.
const nlohmann::json kQwen3_30B_A3B = {
    {"model_type", "qwen3_moe"},    {"vocab_size", 151936},       {"hidden_size", 2048},
    {"intermediate_size", 6144},    {"moe_intermediate_size", 768}, {"num_hidden_layers", 48},
    {"num_attention_heads", 32},    {"num_key_value_heads", 4},   {"head_dim", 128},
    {"num_experts", 128},           {"num_experts_per_tok", 8},   {"norm_topk_prob", true},
    {"decoder_sparse_step", 1},     {"mlp_only_layers", nlohmann::json::array()},
    {"max_position_embeddings", 40960}, {"rms_norm_eps", 1e-6},   {"rope_theta", 1000000.0},
    {"hidden_act", "silu"},         {"tie_word_embeddings", false}, {"output_router_logits", false},
    {"router_aux_loss_coef", 0.001}, {"bos_token_id", 151643},    {"eos_token_id", 151645},
    {"use_sliding_window", false},  {"max_window_layers", 48},    {"attention_bias", false}};
// microsoft/Phi-4-mini-instruct (its longrope factors: 48 a list, one per rotated pair of the 96 rotary dimensions;
// their values do not change the memory).
const nlohmann::json kPhi4Mini = {
    {"model_type", "phi3"},          {"vocab_size", 200064},           {"hidden_size", 3072},
    {"intermediate_size", 8192},     {"num_hidden_layers", 32},        {"num_attention_heads", 24},
    {"num_key_value_heads", 8},      {"max_position_embeddings", 131072}, {"original_max_position_embeddings", 4096},
    {"partial_rotary_factor", 0.75}, {"rms_norm_eps", 1e-5},           {"rope_theta", 10000.0},
    {"hidden_act", "silu"},          {"tie_word_embeddings", true},    {"sliding_window", 262144},
    {"rope_scaling", {{"type", "longrope"}, {"short_factor", std::vector<double>(48, 1.0)},
                      {"long_factor", std::vector<double>(48, 1.0)}}},
    {"bos_token_id", 199999},        {"eos_token_id", 199999},         {"pad_token_id", 199999}};
// google/gemma-3-4b-it as its config.json is (multimodal; text_config gives only what differs from the defaults).
const nlohmann::json kGemma3_4B = {
    {"model_type", "gemma3"},       {"architectures", {"Gemma3ForConditionalGeneration"}},
    {"eos_token_id", {1, 106}},     {"image_token_index", 262144},
    {"boi_token_index", 255999},    {"eoi_token_index", 256000},
    {"mm_tokens_per_image", 256},
    {"text_config", {{"hidden_size", 2560}, {"intermediate_size", 10240}, {"model_type", "gemma3_text"},
                     {"num_hidden_layers", 34}, {"rope_scaling", {{"factor", 8.0}, {"rope_type", "linear"}}},
                     {"sliding_window", 1024}}},
    {"vision_config", {{"hidden_size", 1152}, {"image_size", 896}, {"intermediate_size", 4304},
                       {"model_type", "siglip_vision_model"}, {"num_attention_heads", 16},
                       {"num_hidden_layers", 27}, {"patch_size", 14}, {"vision_use_head", false}}}};
const nlohmann::json kFlanT5XL = {{"model_type", "t5"},
                                  {"vocab_size", 32128},
                                  {"d_model", 2048},
                                  {"d_ff", 5120},
                                  {"d_kv", 64},
                                  {"num_heads", 32},
                                  {"num_layers", 24},
                                  {"num_decoder_layers", 24},
                                  {"feed_forward_proj", "gated-gelu"},
                                  {"dense_act_fn", "gelu_new"},
                                  {"is_gated_act", true},
                                  {"dropout_rate", 0.1},
                                  {"layer_norm_epsilon", 1e-6},
                                  {"relative_attention_num_buckets", 32},
                                  {"relative_attention_max_distance", 128},
                                  {"tie_word_embeddings", false},
                                  {"decoder_start_token_id", 0},
                                  {"pad_token_id", 0},
                                  {"eos_token_id", 1},
                                  {"is_encoder_decoder", true}};

// google/vit-base-patch16-224-in21k (a ViTModel backbone; the run adds the head).
const nlohmann::json kVitBase16 = {{"model_type", "vit"},          {"hidden_size", 768},
                                   {"num_hidden_layers", 12},      {"num_attention_heads", 12},
                                   {"intermediate_size", 3072},    {"hidden_act", "gelu"},
                                   {"hidden_dropout_prob", 0.0},   {"attention_probs_dropout_prob", 0.0},
                                   {"layer_norm_eps", 1e-12},      {"image_size", 224},
                                   {"patch_size", 16},             {"num_channels", 3},
                                   {"qkv_bias", true}};

// openai/clip-vit-base-patch32 (CLIPModel: both towers; the plan estimates the image tower).
const nlohmann::json kClipB32 = {
    {"model_type", "clip"},
    {"projection_dim", 512},
    {"logit_scale_init_value", 2.6592},
    {"vision_config",
     {{"hidden_size", 768}, {"intermediate_size", 3072}, {"num_hidden_layers", 12}, {"num_attention_heads", 12},
      {"image_size", 224}, {"patch_size", 32}, {"hidden_act", "quick_gelu"}, {"layer_norm_eps", 1e-5}}},
    {"text_config",
     {{"hidden_size", 512}, {"intermediate_size", 2048}, {"num_hidden_layers", 12}, {"num_attention_heads", 8},
      {"vocab_size", 49408}, {"max_position_embeddings", 77}, {"hidden_act", "quick_gelu"}, {"layer_norm_eps", 1e-5},
      {"eos_token_id", 2}}}};

struct Card {
  nlohmann::json model;
  double bytes;
  int64_t world = 1;  // cards (ranks) of a fully sharded config: the plan is one rank's
};

// The card each GPU config is written for (its comment and the README say which).
const std::map<std::string, Card>& cards() {
  static const std::map<std::string, Card> table = {
      {"clip-cars.json", {kClipB32, 16.0 * (1ull << 30)}},
      {"qwen2.5-7b-lora.json", {kQwen25_7B, 24.0 * (1ull << 30)}},
      {"qwen3-8b-lora.json", {kQwen3_8B, 24.0 * (1ull << 30)}},
      {"phi-4-mini-qlora.json", {kPhi4Mini, 12.0 * (1ull << 30)}},
      {"qwen3-30b-a3b-qlora.json", {kQwen3_30B_A3B, 24.0 * (1ull << 30)}},
      {"gemma-3-4b-it-lora.json", {kGemma3_4B, 16.0 * (1ull << 30)}},
      {"qwen2.5-7b-dpo-lora.json", {kQwen25_7B, 24.0 * (1ull << 30)}},
      {"qwen2.5-7b-qlora.json", {kQwen25_7B, 16.0 * (1ull << 30)}},
      {"qwen2.5-14b-qlora.json", {kQwen25_14B, 24.0 * (1ull << 30)}},
      {"t5xl.json", {kFlanT5XL, 32.0 * (1ull << 30)}},
      {"t5xl-sharded.json", {kFlanT5XL, 16.0 * (1ull << 30), 2}},
      {"qwen2.5-7b-full-sharded.json", {kQwen25_7B, 24.0 * (1ull << 30), 8}},
      {"vit-base-flowers-lora.json", {kVitBase16, 8.0 * (1ull << 30)}},
      {"vit-base-flowers-probe.json", {kVitBase16, 8.0 * (1ull << 30)}},
  };
  return table;
}

}  // namespace

TEST(ShippedConfigs, EveryGpuConfigFitsItsCardByThePlan) {
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(test::source_path("configs"))) {
    if (entry.path().extension() != ".json") continue;
    Config config = load_config(entry.path().string());
    if (!config.device.type.starts_with("cuda")) continue;
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(name);
    ASSERT_TRUE(cards().contains(name)) << "a GPU config without its card and model shape in this test";
    const Card& card = cards().at(name);
    // The model directory as `trainer plan` reads it: config.json only, no weights.
    test::TempDir dir;
    std::ofstream(dir.file("config.json")) << card.model.dump(2);
    config.model.path = dir.path().string();
    const auto hf = read_json_file(config.model.path + "/config.json");
    if (is_image_model_config(hf)) {
      // An image classifier: the mode's fixed memory and at least one micro-batch of images (a probe's backbone
      // keeps no activations) under the card's memory.
      const auto e = estimate_image_memory(config.model.path);
      const double fixed = config.training.linear_probe ? e.probe_fixed : e.full_fixed;
      const double per_image = config.training.linear_probe ? 0.0 : e.activations_per_image;
      EXPECT_LT(fixed + per_image, card.bytes);
      if (per_image > 0) {
        EXPECT_GE((card.bytes - fixed) / per_image, 16) << "fewer than 16 images per micro-batch";
      }
      ++checked;
      continue;
    }
    // What an example is to the planner is the task's (a DPO pair: two sequences and the reference).
    const ExampleShape shape = task_kind(config).example_shape(config);
    MemoryPlan plan = plan_memory(config, hf, c10::Device(c10::kCUDA, 0), card.bytes, "test card", shape);
    EXPECT_EQ(config.distributed.shard_weights, card.world > 1);
    std::string sharded;
    if (card.world > 1) {  // one rank's plan, as `trainer plan --nproc-per-node N` makes it
      plan.batch_size = (config.training.batch_size + card.world - 1) / card.world;
      sharded = plan_fully_sharded(plan, config, hf, card.world);
    }
    SCOPED_TRACE(sharded);
    std::ostringstream out;
    print_plan(plan, config, out);
    SCOPED_TRACE(out.str());
    const int64_t micro =
        plan.largest_micro_batch(config.training.activation_checkpointing, config.training.chunked_loss);
    EXPECT_GE(micro, config.training.micro_batch_size.is_auto ? 1 : config.training.micro_batch_size.value);
    EXPECT_NE(out.str().find("recommendation: micro_batch_size "), std::string::npos);
    ++checked;
  }
  EXPECT_GE(checked, 5);
}

TEST(ShippedConfigs, PlanShowsTheLossChunkSizeThatFits) {
  // Qwen2.5-7B LoRA on 23 GiB with chunks of 2048 tokens: 2048 and 1024 do not fit at micro-batch 1, 512 does
  // (each halving takes 152,064 x 6 bytes a token off the chunk); the plan says so, as the escalation would do.
  Config config = load_config(test::source_path("configs/qwen2.5-7b-lora.json"));
  config.training.loss_chunk_size = 2048;
  const double capacity = 23.0 * (1ull << 30);
  const MemoryPlan plan = plan_memory(config, kQwen25_7B, c10::Device(c10::kCPU), capacity, "test");
  EXPECT_EQ(plan.largest_micro_batch(true, true), 0);
  EXPECT_EQ(plan.fitting_loss_chunk_size(1), 512);
  EXPECT_EQ(plan.largest_micro_batch(true, true, 512), 1);
  std::ostringstream out;
  print_plan(plan, config, out);
  EXPECT_NE(out.str().find("recommendation: training.loss_chunk_size=512 (configured 2048); then micro_batch_size 1"),
            std::string::npos)
      << out.str();
  // Below what even chunks of 128 need, the plan says nothing fits.
  const MemoryPlan small = plan_memory(config, kQwen25_7B, c10::Device(c10::kCPU), 22.0 * (1ull << 30), "test");
  EXPECT_EQ(small.fitting_loss_chunk_size(1), 0);
}

}  // namespace trainer
