// CLIP inference pieces: zero-shot texts and probabilities (clip_zero_shot.h), caption tokenisation, and LoRA on
// either tower (clip_lora.h). Parity with transformers and PEFT is in tests/parity/test_clip.py.
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/image/clip.h"
#include "models/image/clip_lora.h"
#include "models/image/clip_zero_shot.h"
#include "support/paths.h"
#include "support/temp_dir.h"
#include "trainer/errors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace {

nlohmann::json tiny_clip_config() {
  return {{"model_type", "clip"},
          {"projection_dim", 6},
          {"text_config",
           {{"hidden_size", 8}, {"intermediate_size", 12}, {"num_attention_heads", 2}, {"num_hidden_layers", 2},
            {"vocab_size", 20}, {"max_position_embeddings", 8}, {"eos_token_id", 19}}},
          {"vision_config",
           {{"hidden_size", 8}, {"intermediate_size", 12}, {"num_attention_heads", 2}, {"num_hidden_layers", 2},
            {"image_size", 8}, {"patch_size", 4}}}};
}

struct Inputs {
  at::Tensor pixels, ids, mask;
};

Inputs tiny_inputs() {
  at::manual_seed(3);
  Inputs in{at::randn({3, 3, 8, 8}), at::randint(1, 18, {4, 6}, at::kLong), at::ones({4, 6}, at::kLong)};
  in.ids.select(1, 5).fill_(19);   // every caption ends in the end-of-text id
  in.ids[1][3] = 19;               // one shorter caption, padded after its end
  in.mask[1].slice(0, 4).fill_(0);
  return in;
}

TEST(ClipZeroShot, ClassTextsFillThePromptAndATemplateWithoutBracesIsRefused) {
  EXPECT_EQ(zero_shot_class_texts({"daisy", "red car"}),
            (std::vector<std::string>{"a photo of a daisy.", "a photo of a red car."}));
  EXPECT_EQ(zero_shot_class_texts({"cat"}, "{} or not {}?"), (std::vector<std::string>{"cat or not cat?"}));
  EXPECT_EQ(zero_shot_class_texts({"{}"}, "a {}"), (std::vector<std::string>{"a {}"}));  // a name holding braces
  EXPECT_THROW(zero_shot_class_texts({"cat"}, "a photo"), UsageError);
}

TEST(ClipZeroShot, ProbabilitiesAreTheSoftmaxOfTheModelsLogitsPerImage) {
  ClipModel model(tiny_clip_config(), at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(1);
  model.init_weights();
  model.train(false);
  const Inputs in = tiny_inputs();
  const at::Tensor p = clip_image_text_probabilities(model, in.pixels, in.ids, in.mask);
  ASSERT_EQ(p.sizes(), (std::vector<int64_t>{3, 4}));
  at::Tensor expected;
  {
    at::NoGradGuard no_grad;
    expected = at::softmax(model.forward(in.pixels, in.ids, in.mask, false).logits_per_image, -1);
  }
  EXPECT_LT((p - expected).abs().max().item<double>(), 1e-6);
  EXPECT_LT((p.sum(-1) - 1).abs().max().item<double>(), 1e-6);
  EXPECT_FALSE(p.requires_grad());
  // The scale matters: a larger logit_scale sharpens the distribution.
  {
    at::NoGradGuard no_grad;
    model.logit_scale().fill_(kClipMaxLogitScale);
  }
  const at::Tensor sharp = clip_image_text_probabilities(model, in.pixels, in.ids, in.mask);
  EXPECT_GT(sharp.max().item<double>(), p.max().item<double>());
}

TEST(ClipZeroShot, TokenizeAddsClipsSpecialTokensPadsAndRefusesTooLongTexts) {
  const auto tokenizer = load_tokenizer(test::source_path("tests/assets/tokenizers/clip-style"));
  const auto bos = *tokenizer->token_to_id("<|startoftext|>"), eos = *tokenizer->token_to_id("<|endoftext|>");
  const ClipTextBatch batch = clip_tokenize(*tokenizer, {"a photo of a car", "car"}, 77);
  ASSERT_EQ(batch.input_ids.size(0), 2);
  const auto length = batch.input_ids.size(1);
  EXPECT_EQ(batch.input_ids[0][0].item<int64_t>(), bos);
  EXPECT_EQ(batch.input_ids[0][length - 1].item<int64_t>(), eos);
  EXPECT_EQ(batch.attention_mask[0].sum().item<int64_t>(), length);
  const auto short_length = static_cast<int64_t>(tokenizer->encode("car").size()) + 2;  // with both specials
  ASSERT_LT(short_length, length);
  EXPECT_EQ(batch.attention_mask[1].sum().item<int64_t>(), short_length);
  EXPECT_EQ(batch.input_ids[1][short_length - 1].item<int64_t>(), eos);
  EXPECT_EQ(batch.attention_mask[1][short_length].item<int64_t>(), 0);
  EXPECT_THROW(clip_tokenize(*tokenizer, {"a photo of a car"}, 4), UsageError);
}

TEST(ClipLora, OneTowerIsAdaptedTheRestFrozenAndTheModelStartsAsTheBase) {
  ClipModel model(tiny_clip_config(), at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(1);
  model.init_weights();
  model.train(false);
  const Inputs in = tiny_inputs();
  at::Tensor before;
  {
    at::NoGradGuard no_grad;
    before = model.forward(in.pixels, in.ids, in.mask, false).logits_per_image.clone();
  }
  LoraConfig config;
  config.r = 2;
  config.dropout = 0.0;
  config.target_modules = {"q_proj", "v_proj", "fc1"};
  auto adapters = apply_clip_lora(model, config, 7, /*vision=*/true, /*text=*/false);
  EXPECT_EQ(adapters->layers().size(), 2u * 3u);  // two vision layers, three targets each
  for (const auto& [path, layer] : adapters->layers()) EXPECT_TRUE(path.starts_with("vision_model.")) << path;
  model.for_each_parameter([](const std::string& name, at::Tensor& p) { EXPECT_FALSE(p.requires_grad()) << name; });
  {
    at::NoGradGuard no_grad;
    EXPECT_LT((model.forward(in.pixels, in.ids, in.mask, false).logits_per_image - before).abs().max().item<double>(),
              1e-6);
  }
  // Gradients reach the adapters (B first, as lora_B starts at zero), none reaches the base.
  model.forward(in.pixels, in.ids, in.mask, false).logits_per_image.pow(2).sum().backward();
  for (const auto& [path, layer] : adapters->layers()) {
    ASSERT_TRUE(layer->lora_B.grad().defined()) << path;
    EXPECT_GT(layer->lora_B.grad().abs().max().item<double>(), 0.0) << path;
  }
  model.for_each_parameter([](const std::string& name, at::Tensor& p) { EXPECT_FALSE(p.grad().defined()) << name; });

  // A written adapter reloads into a fresh model's adapters.
  test::TempDir dir;
  {
    at::NoGradGuard no_grad;
    for (const auto& [path, layer] : adapters->layers()) layer->lora_B.normal_();
  }
  write_clip_adapter(dir.path().string(), *adapters, "base");
  const auto written = nlohmann::json::parse(test::read_file(dir.file("adapter_config.json")));
  EXPECT_EQ(written["target_modules"], "vision_model\\..*\\.(fc1|q_proj|v_proj)");
  ClipModel other(tiny_clip_config(), at::TensorOptions().dtype(at::kFloat));
  auto reloaded = apply_clip_lora(other, config, 99, true, false);
  load_clip_adapter(dir.path().string(), *reloaded);
  for (std::size_t i = 0; i < adapters->layers().size(); ++i) {
    EXPECT_TRUE(at::equal(adapters->layers()[i].second->lora_A, reloaded->layers()[i].second->lora_A));
    EXPECT_TRUE(at::equal(adapters->layers()[i].second->lora_B, reloaded->layers()[i].second->lora_B));
  }
}

TEST(ClipLora, WhatCannotBeAdaptedIsAUsageError) {
  ClipModel model(tiny_clip_config(), at::TensorOptions().dtype(at::kFloat));
  LoraConfig config;
  EXPECT_THROW(apply_clip_lora(model, config, 0, false, false), UsageError);
  config.target_modules = {"query"};
  EXPECT_THROW(apply_clip_lora(model, config, 0, true, true), UsageError);
  config.target_modules = {};
  config.base_in_bf16 = true;
  EXPECT_THROW(apply_clip_lora(model, config, 0, true, true), UsageError);
  config.base_in_bf16 = false;
  const auto both = apply_clip_lora(model, config, 0, true, true);
  std::set<std::string> towers;
  for (const auto& [path, layer] : both->layers()) towers.insert(path.substr(0, path.find('.')));
  EXPECT_EQ(towers, (std::set<std::string>{"text_model", "vision_model"}));
  EXPECT_EQ(both->layers().size(), 2u * 2u * 2u);  // two towers, two layers, q_proj and v_proj
}

}  // namespace
}  // namespace trainer
