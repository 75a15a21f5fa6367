// LoRA applied from outside: target selection, the frozen base, PEFT's initialisation and scaling, merging, and
// PEFT's files. Numerical agreement with PEFT itself is in tests/parity/test_lora.py.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/inspect.h"
#include "models/lora.h"
#include "support/temp_dir.h"
#include "support/tiny_models.h"
#include "train/activation_checkpointing.h"
#include "train/optim/optimizer.h"
#include "trainer/errors.h"
#include "trainer/peft.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

using test::padded_batch;
using test::tiny_model;

LoraConfig lora(int64_t r, std::vector<std::string> targets = {}) {
  LoraConfig c;
  c.enabled = true;
  c.r = r;
  c.alpha = 2.0 * static_cast<double>(r);
  c.dropout = 0.0;
  c.target_modules = std::move(targets);
  return c;
}

at::Tensor logits_of(LanguageModel& model, const Batch& batch) {
  at::NoGradGuard no_grad;
  return forward_loss(model, batch, /*keep_logits=*/true).logits;
}

// Non-zero B (and a changed A), so the adapters change what the model computes.
void perturb(LoraAdapters& adapters, uint64_t seed) {
  at::manual_seed(seed);
  at::NoGradGuard no_grad;
  for (const auto& [path, layer] : adapters.layers()) {
    layer->lora_B.normal_(0.0, 0.2);
    layer->lora_A.add_(at::randn_like(layer->lora_A), 0.1);
  }
}

std::vector<std::string> layer_paths(const LoraAdapters& adapters) {
  std::vector<std::string> out;
  for (const auto& [path, layer] : adapters.layers()) out.push_back(path);
  return out;
}

std::map<std::string, at::Tensor> adapter_grads(Module& adapters) {
  std::map<std::string, at::Tensor> out;
  adapters.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    out[name] = p.grad().clone();
    p.mutable_grad() = at::Tensor();
  });
  return out;
}

void rewrite_json(const std::string& path, const std::function<void(nlohmann::json&)>& change) {
  nlohmann::json j;
  std::ifstream(path) >> j;
  change(j);
  std::ofstream(path) << j.dump();
}

}  // namespace

TEST(Lora, DefaultTargetsAreQAndVMatchedByLastName) {
  auto t5 = tiny_model("tiny-t5");
  const auto t5_paths = layer_paths(*apply_lora(*t5, lora(4), 0));
  // 2 encoder blocks (self-attention) + 2 decoder blocks (self- and cross-attention): 6 attentions, q and v each.
  EXPECT_EQ(t5_paths.size(), 12u);
  for (const auto& path : t5_paths) EXPECT_TRUE(path.ends_with(".q") || path.ends_with(".v")) << path;
  EXPECT_NE(std::find(t5_paths.begin(), t5_paths.end(), "decoder.block.1.layer.1.EncDecAttention.v"), t5_paths.end());

  auto qwen = tiny_model("tiny-qwen2");
  EXPECT_EQ(layer_paths(*apply_lora(*qwen, lora(4), 0)),
            (std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                      "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  // A full name selects exactly that module (PEFT: the name equals the target, or ends with "." + target).
  auto one = tiny_model("tiny-qwen2");
  EXPECT_EQ(layer_paths(*apply_lora(*one, lora(4, {"model.layers.1.mlp.down_proj"}), 0)),
            std::vector<std::string>{"model.layers.1.mlp.down_proj"});
  auto suffix = tiny_model("tiny-qwen2");
  EXPECT_EQ(layer_paths(*apply_lora(*suffix, lora(4, {"mlp.up_proj"}), 0)).size(), 2u);
}

TEST(Lora, TargetsThatSelectNothingOrNoLinearLayerAreUsageErrors) {
  auto qwen = tiny_model("tiny-qwen2");
  try {
    apply_lora(*qwen, lora(4, {"q_proj", "query"}), 0);
    FAIL() << "an unknown target was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("query"), std::string::npos) << e.what();
    EXPECT_FALSE(e.hint().empty());
  }
  try {
    apply_lora(*qwen, lora(4, {"self_attn"}), 0);
    FAIL() << "an attention module (not a linear layer) was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn"), std::string::npos) << e.what();
  }
  EXPECT_THROW(apply_lora(*qwen, lora(4, {"lm_head"}), 0), UsageError);
  // Nothing was applied by the failed attempts.
  EXPECT_TRUE(apply_lora(*qwen, lora(4), 0)->layers().size() == 4u);
}

TEST(Lora, TheBaseIsFrozenAndOnlyAdaptersGetGradientsAndOptimizerState) {
  auto model = tiny_model("tiny-qwen2");
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });  // as train() does
  auto adapters = apply_lora(*model, lora(4), 0);
  model->train(true);
  perturb(*adapters, 1);  // with B = 0 the gradient of A is zero; make both non-trivial
  model->for_each_parameter([](const std::string& name, at::Tensor& p) { EXPECT_FALSE(p.requires_grad()) << name; });

  forward_loss(*model, padded_batch(false)).loss_sum.backward();
  model->for_each_parameter([](const std::string& name, at::Tensor& p) { EXPECT_FALSE(p.grad().defined()) << name; });
  int64_t with_grad = 0;
  adapters->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_GT(p.grad().abs().max().item<double>(), 0.0) << name;
    ++with_grad;
  });
  EXPECT_EQ(with_grad, 8);

  // PEFT's print_trainable_parameters says 1,792 for r=4 on q_proj and v_proj of this model:
  // per layer 4 x (64 + 64) + 4 x (64 + 32), two layers.
  EXPECT_EQ(adapters->trainable_parameters(), 1792);
  OptimizerConfig adam;
  AdamW optimizer(*adapters, adam);
  EXPECT_EQ(optimizer.trainable_parameters(), 1792);
  EXPECT_EQ(optimizer.state_bytes(), 2 * 4 * 1792);
  for (const auto& [name, t] : optimizer.state_tensors()) EXPECT_NE(name.find(".lora_"), std::string::npos) << name;
  // The optimizer takes only parameters that train: over the frozen model it holds nothing.
  EXPECT_EQ(AdamW(*model, adam).trainable_parameters(), 0);
  // Adapters decay like other weight matrices (no-decay rules: norms, biases, embeddings).
  EXPECT_TRUE(decays_by_default("model.layers.0.self_attn.q_proj.lora_A.weight"));
}

TEST(Lora, ZeroInitialisedBMeansTheAdaptedModelStartsAsTheBase) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto model = tiny_model(name);
    const Batch batch = padded_batch(model->family() == ModelFamily::kSeq2Seq);
    const at::Tensor before = logits_of(*model, batch);
    auto adapters = apply_lora(*model, lora(8), 5);
    EXPECT_TRUE(at::equal(before, logits_of(*model, batch)));
    for (const auto& [path, layer] : adapters->layers()) {
      EXPECT_EQ(layer->lora_B.abs().max().item<double>(), 0.0) << path;
      // kaiming_uniform_(a=sqrt(5)) on (r, in): uniform in +-1/sqrt(in), so standard deviation bound/sqrt(3).
      const double bound = 1.0 / std::sqrt(static_cast<double>(layer->lora_A.size(1)));
      EXPECT_LE(layer->lora_A.abs().max().item<double>(), bound) << path;
      EXPECT_GT(layer->lora_A.abs().max().item<double>(), 0.8 * bound) << path;
      EXPECT_EQ(layer->lora_A.scalar_type(), at::kFloat);
    }
  }
  // The start depends on the seed alone.
  auto a = tiny_model("tiny-qwen2"), b = tiny_model("tiny-qwen2"), c = tiny_model("tiny-qwen2");
  auto la = apply_lora(*a, lora(4), 1), lb = apply_lora(*b, lora(4), 1), lc = apply_lora(*c, lora(4), 2);
  EXPECT_TRUE(at::equal(la->layers()[0].second->lora_A, lb->layers()[0].second->lora_A));
  EXPECT_FALSE(at::equal(la->layers()[0].second->lora_A, lc->layers()[0].second->lora_A));
}

// DPO's reference under LoRA: with the adapters off the model computes the base alone (PEFT's disable_adapter), and
// they are on again after the scope, however it ends.
TEST(Lora, AdaptersOffGivesTheBaseAndTheyAreOnAgainAfter) {
  auto model = tiny_model("tiny-qwen2");
  const Batch batch = padded_batch(false);
  const at::Tensor base = logits_of(*model, batch);
  auto adapters = apply_lora(*model, lora(8), 5);
  for (const auto& [path, layer] : adapters->layers()) layer->lora_B.data().normal_(0, 0.5);
  const at::Tensor adapted = logits_of(*model, batch);
  ASSERT_GT((adapted - base).abs().max().item<double>(), 1e-2);
  {
    AdaptersOff off(adapters.get());
    EXPECT_TRUE(at::equal(logits_of(*model, batch), base));
  }
  EXPECT_TRUE(at::equal(logits_of(*model, batch), adapted));
  try {
    AdaptersOff off(adapters.get());
    throw std::runtime_error("leaving the scope early");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(at::equal(logits_of(*model, batch), adapted));
  AdaptersOff none(nullptr);  // a model without adapters: nothing to turn off
  EXPECT_TRUE(at::equal(logits_of(*model, batch), adapted));
}

TEST(Lora, TheAdaptedLayerComputesPeftsFormula) {
  EXPECT_DOUBLE_EQ(lora_scaling(16, 4, false), 4.0);
  EXPECT_DOUBLE_EQ(lora_scaling(16, 4, true), 8.0);  // rsLoRA: alpha / sqrt(r)
  for (const bool rslora : {false, true}) {
    auto model = tiny_model("tiny-qwen2");
    auto config = lora(4, {"model.layers.0.mlp.up_proj"});
    config.alpha = 16;
    config.rslora = rslora;
    auto adapters = apply_lora(*model, config, 0);
    perturb(*adapters, 2);
    const auto& layer = *adapters->layers()[0].second;
    EXPECT_DOUBLE_EQ(layer.scaling(), rslora ? 8.0 : 4.0);
    at::manual_seed(3);
    const at::Tensor x = at::randn({2, 5, 64});
    const Linear& base = layer.base();
    const at::Tensor expected =
        at::linear(x, base.weight) + at::matmul(at::matmul(x, layer.lora_A.t()), layer.lora_B.t()) * layer.scaling();
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::allclose(base.forward(x), expected, 1e-5, 1e-5));
  }
}

TEST(Lora, TheMergedModelComputesTheAdaptedFunction) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto model = tiny_model(name);
    const Batch batch = padded_batch(model->family() == ModelFamily::kSeq2Seq);
    const at::Tensor base_logits = logits_of(*model, batch);
    auto adapters = apply_lora(*model, lora(4, model->family() == ModelFamily::kSeq2Seq
                                                  ? std::vector<std::string>{"q", "k", "v", "o", "wi_0", "wo"}
                                                  : std::vector<std::string>{"q_proj", "o_proj", "down_proj"}),
                               0);
    perturb(*adapters, 3);
    const at::Tensor adapted = logits_of(*model, batch);
    ASSERT_FALSE(at::allclose(adapted, base_logits, 1e-3, 1e-3)) << "the adapters change nothing";
    const auto& [path, first] = adapters->layers()[0];
    const at::Tensor expected_weight =
        first->base().weight + at::matmul(first->lora_B, first->lora_A).detach() * first->scaling();
    merge_lora(*adapters);
    for (const auto& [p, layer] : adapters->layers()) EXPECT_FALSE(layer->base().has_output_hook()) << p;
    EXPECT_TRUE(at::allclose(first->base().weight, expected_weight, 1e-6, 1e-6)) << path;
    const at::Tensor merged = logits_of(*model, batch);
    EXPECT_TRUE(at::allclose(merged, adapted, 1e-4, 1e-4)) << (merged - adapted).abs().max().item<double>();
    merge_lora(*adapters);  // a second merge changes nothing
    EXPECT_TRUE(at::equal(merged, logits_of(*model, batch)));
  }
}

TEST(Lora, PeftFilesRoundTrip) {
  test::TempDir dir;
  auto model = tiny_model("tiny-qwen2");
  auto config = lora(4, {"q_proj", "k_proj", "v_proj", "gate_proj"});
  config.alpha = 8;
  config.rslora = true;
  config.dropout = 0.05;
  auto adapters = apply_lora(*model, config, 0);
  perturb(*adapters, 4);
  const Batch batch = padded_batch(false);
  const at::Tensor adapted = logits_of(*model, batch);
  write_peft_adapter(dir.path().string(), to_peft_adapter(*adapters, *model, "/models/tiny-qwen2"));

  // PEFT's key names: base_model.model.<module path>.lora_A.weight, no adapter name.
  const auto file = SafetensorsFile::open(dir.file(kAdapterWeightsName));
  EXPECT_EQ(file.tensors().size(), 16u);
  EXPECT_NE(file.find("base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"), nullptr);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  nlohmann::json saved;
  std::ifstream(dir.file(kAdapterConfigName)) >> saved;
  EXPECT_EQ(saved["peft_type"], "LORA");
  EXPECT_EQ(saved["task_type"], "CAUSAL_LM");
  EXPECT_EQ(saved["bias"], "none");
  EXPECT_EQ(saved["lora_alpha"], 8);
  EXPECT_EQ(saved["use_rslora"], true);

  const PeftAdapter read = read_peft_adapter(dir.path().string());
  EXPECT_EQ(read.config.r, 4);
  EXPECT_DOUBLE_EQ(read.config.lora_alpha, 8.0);
  EXPECT_DOUBLE_EQ(read.config.lora_dropout, 0.05);
  EXPECT_TRUE(read.config.use_rslora);
  EXPECT_EQ(read.config.target_modules, config.target_modules);
  EXPECT_EQ(read.config.base_model_name_or_path, "/models/tiny-qwen2");
  EXPECT_EQ(read.modules.size(), 8u);

  // Onto a fresh copy of the base: the same function.
  auto fresh = tiny_model("tiny-qwen2");
  auto loaded = apply_peft_adapter(*fresh, read, dir.path().string());
  EXPECT_TRUE(at::equal(adapted, logits_of(*fresh, batch)));
  // Into adapters applied from the config (resume): the same function again.
  auto resumed_model = tiny_model("tiny-qwen2");
  auto resumed = apply_lora(*resumed_model, config, 99);
  load_lora_weights(*resumed, read, dir.path().string());
  EXPECT_TRUE(at::equal(adapted, logits_of(*resumed_model, batch)));
  // Other settings do not fit: the error names the tensors.
  auto other_model = tiny_model("tiny-qwen2");
  auto other = apply_lora(*other_model, lora(8, config.target_modules), 0);
  try {
    load_lora_weights(*other, read, "ckpt");
    FAIL() << "rank 4 weights were loaded into rank 8 adapters";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.q_proj.lora_A.weight: expected [8, 64]"),
              std::string::npos)
        << e.what();
  }
  // A seq2seq adapter does not go onto a causal model.
  auto t5 = tiny_model("tiny-t5");
  auto t5_adapters = apply_lora(*t5, lora(4), 0);
  test::TempDir t5_dir;
  write_peft_adapter(t5_dir.path().string(), to_peft_adapter(*t5_adapters, *t5, ""));
  auto target = tiny_model("tiny-qwen2");
  EXPECT_THROW(apply_peft_adapter(*target, read_peft_adapter(t5_dir.path().string()), "t5"), DataError);
}

TEST(Lora, PeftFeaturesTrainerCannotReproduceAreRefused) {
  test::TempDir dir;
  auto model = tiny_model("tiny-qwen2");
  auto adapters = apply_lora(*model, lora(4), 0);
  write_peft_adapter(dir.path().string(), to_peft_adapter(*adapters, *model, ""));
  const std::string config_path = dir.file(kAdapterConfigName);
  nlohmann::json original;
  std::ifstream(config_path) >> original;
  auto refused = [&](const std::function<void(nlohmann::json&)>& change, const std::string& expected) {
    rewrite_json(config_path, [&](nlohmann::json& j) {
      j = original;
      change(j);
    });
    try {
      read_peft_adapter(dir.path().string());
      ADD_FAILURE() << "accepted: " << expected;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(kAdapterConfigName), std::string::npos) << e.what();
    }
  };
  refused([](nlohmann::json& j) { j["use_dora"] = true; }, "DoRA");
  refused([](nlohmann::json& j) { j["modules_to_save"] = {"lm_head"}; }, "modules_to_save");
  refused([](nlohmann::json& j) { j["bias"] = "all"; }, "bias");
  refused([](nlohmann::json& j) { j["alpha_pattern"] = {{"q_proj", 4}}; }, "alpha_pattern");
  refused([](nlohmann::json& j) { j["peft_type"] = "IA3"; }, "IA3");
  refused([](nlohmann::json& j) { j["r"] = 2.5; }, "positive integer");
  rewrite_json(config_path, [&](nlohmann::json& j) { j = original; });
  EXPECT_NO_THROW(read_peft_adapter(dir.path().string()));

  // A tensor that is not a LoRA weight (an embedding adapter, a saved module) is named.
  auto tensors = NamedTensors{{"base_model.model.model.embed_tokens.lora_embedding_A", at::zeros({4, 512})}};
  for (const auto& [path, layer] : adapters->layers()) {
    tensors.emplace_back(kPeftKeyPrefix + path + ".lora_A.weight", layer->lora_A.detach());
    tensors.emplace_back(kPeftKeyPrefix + path + ".lora_B.weight", layer->lora_B.detach());
  }
  write_safetensors(dir.file(kAdapterWeightsName), tensors);
  try {
    read_peft_adapter(dir.path().string());
    FAIL() << "an embedding adapter was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("lora_embedding_A"), std::string::npos) << e.what();
  }
  // Half an adapter.
  write_safetensors(dir.file(kAdapterWeightsName), {tensors[1]});
  EXPECT_THROW(read_peft_adapter(dir.path().string()), DataError);
}

TEST(Lora, Bf16BaseWithFp32Adapters) {
  auto reference = tiny_model("tiny-qwen2");
  auto model = tiny_model("tiny-qwen2");
  auto config = lora(4);
  auto fp32_adapters = apply_lora(*reference, config, 0);
  config.base_in_bf16 = true;
  auto adapters = apply_lora(*model, config, 0);
  perturb(*fp32_adapters, 6);
  perturb(*adapters, 6);
  model->for_each_parameter([](const std::string& name, at::Tensor& p) {
    EXPECT_EQ(p.scalar_type(), at::kBFloat16) << name;
  });
  const Batch batch = padded_batch(false);
  model->train(true);
  const auto result = forward_loss(*model, batch, /*keep_logits=*/true);
  result.loss_sum.backward();
  adapters->for_each_parameter([](const std::string& name, at::Tensor& p) {
    EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << name;
  });
  // bf16 keeps 8 significant bits: close to the fp32 base with the same adapters, not equal.
  const at::Tensor expected = logits_of(*reference, batch);
  const at::Tensor got = result.logits.detach().to(at::kFloat);
  const at::Tensor real = batch.attention_mask.to(at::kBool).unsqueeze(-1);  // padded positions mean nothing
  EXPECT_LE((got.masked_select(real) - expected.masked_select(real)).abs().max().item<double>(),
            0.05 * expected.masked_select(real).abs().max().item<double>());
}

TEST(Lora, ActivationCheckpointingGivesTheSameAdapterGradients) {
  for (const char* name : {"tiny-t5", "tiny-qwen2"}) {
    SCOPED_TRACE(name);
    auto model = tiny_model(name);
    auto config = lora(4);
    config.dropout = 0.1;  // dropout on the adapters' input, and T5's own: the recomputation must redraw the same
    auto adapters = apply_lora(*model, config, 0);
    perturb(*adapters, 7);
    model->train(true);
    const Batch batch = padded_batch(model->family() == ModelFamily::kSeq2Seq);
    at::manual_seed(8);
    forward_loss(*model, batch).loss_sum.backward();
    const auto plain = adapter_grads(*adapters);
    apply_activation_checkpointing(*model);
    at::manual_seed(8);
    forward_loss(*model, batch).loss_sum.backward();
    const auto checkpointed = adapter_grads(*adapters);
    ASSERT_EQ(plain.size(), checkpointed.size());
    // Equal up to the order in which the decoder's contributions to the encoder's gradients are summed.
    for (const auto& [param, grad] : plain)
      EXPECT_LE((grad - checkpointed.at(param)).abs().max().item<double>(), 1e-5 * grad.abs().max().item<double>())
          << param;
    model->for_each_parameter([](const std::string& p, at::Tensor& t) { EXPECT_FALSE(t.grad().defined()) << p; });
  }
}

TEST(Lora, InspectCountsWhatTrainingAllocates) {
  for (const auto& [targets, r] : std::vector<std::pair<std::vector<std::string>, int64_t>>{
           {{}, 4}, {{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, 16}}) {
    auto model = tiny_model("tiny-qwen2");
    auto adapters = apply_lora(*model, lora(r, targets), 0);
    AdamW optimizer(*adapters, OptimizerConfig{});
    std::ostringstream out;
    InspectOptions options;
    options.lora_r = r;
    options.lora_targets = targets;
    inspect_model(test::source_path("configs/models/tiny-qwen2"), options, out);
    std::string count = std::to_string(optimizer.trainable_parameters());
    if (count.size() > 3) count.insert(count.size() - 3, ",");
    EXPECT_NE(out.str().find(count + " trainable parameters"), std::string::npos) << count << "\n" << out.str();
    EXPECT_EQ(optimizer.state_bytes(), 8 * optimizer.trainable_parameters());
  }
}

// ---- LoRA on a mixture of experts' experts (lora.target_parameters, PEFT's ParamWrapper layout) --------------------

namespace {

// A tiny mixture of experts with random weights: Qwen3-MoE (layer 1 dense) or Mixtral (w1/w3/w2 under
// block_sparse_moe), 4 experts of width 16, 2 per token.
std::unique_ptr<LanguageModel> tiny_moe(const std::string& model_type) {
  nlohmann::json c = {{"model_type", model_type}, {"vocab_size", 256}, {"hidden_size", 32},
                      {"intermediate_size", 16}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6},
                      {"num_experts_per_tok", 2}, {"tie_word_embeddings", false}};
  if (model_type == "mixtral") {
    c["num_local_experts"] = 4;
  } else {
    c["num_experts"] = 4;
    c["moe_intermediate_size"] = 16;
    c["head_dim"] = 8;
    c["mlp_only_layers"] = {1};
    c["intermediate_size"] = 48;
  }
  auto model = build_model(c, at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(5);
  model->init_weights();
  model->train(false);
  return model;
}

LoraConfig expert_lora(std::vector<std::string> parameters) {
  auto c = lora(2, {"q_proj"});
  c.target_parameters = std::move(parameters);
  return c;
}

void perturb_experts(LoraAdapters& adapters, uint64_t seed) {
  at::manual_seed(seed);
  at::NoGradGuard no_grad;
  for (const auto& [path, experts] : adapters.experts()) experts->lora_B.normal_(0.0, 0.3);
  perturb(adapters, seed + 1);
}

std::string usage_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return std::string(e.what()) + " | hint: " + e.hint();
  }
  return "(no error)";
}

}  // namespace

TEST(LoraExperts, TargetParametersSelectTheStackedExpertsNestedAsPeftNamesThem) {
  auto model = tiny_moe("qwen3_moe");
  auto both = apply_lora(*model, expert_lora({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}), 0);
  ASSERT_EQ(both->experts().size(), 2u);  // layer 1 is dense
  // PEFT wraps gate_up_proj first and down_proj around it: gate_up_proj's weights sit under base_layer.
  EXPECT_EQ(both->experts()[0].first, "model.layers.0.mlp.experts.base_layer");
  EXPECT_EQ(both->experts()[1].first, "model.layers.0.mlp.experts");
  const auto& gate_up = *both->experts()[0].second;
  const auto& down = *both->experts()[1].second;
  EXPECT_EQ(gate_up.lora_A.sizes(), (at::IntArrayRef{2 * 4, 32}));  // (r E, D)
  EXPECT_EQ(gate_up.lora_B.sizes(), (at::IntArrayRef{2 * 16, 2 * 4}));  // (2I, r E)
  EXPECT_EQ(down.lora_A.sizes(), (at::IntArrayRef{2 * 4, 16}));
  EXPECT_EQ(down.lora_B.sizes(), (at::IntArrayRef{32, 2 * 4}));
  std::set<std::string> names;
  both->for_each_parameter([&](const std::string& name, at::Tensor&) { names.insert(name); });
  EXPECT_TRUE(names.contains("model.layers.0.mlp.experts.base_layer.lora_A.weight"));
  EXPECT_TRUE(names.contains("model.layers.0.mlp.experts.lora_B.weight"));
  // q_proj (2 layers) + the experts: 2 x 2 x (32 + 32) + (8 x 32 + 32 x 8) + (8 x 16 + 32 x 8)
  EXPECT_EQ(both->trainable_parameters(), 2 * 2 * 64 + 512 + 384);
  // One parameter alone is not nested; a last name selects it too (PEFT: equal, or ends with "." + target).
  auto other = tiny_moe("qwen3_moe");
  auto one = apply_lora(*other, expert_lora({"down_proj"}), 0);
  ASSERT_EQ(one->experts().size(), 1u);
  EXPECT_EQ(one->experts()[0].first, "model.layers.0.mlp.experts");
  EXPECT_EQ(one->experts()[0].second->in_features(), 16);
  // Mixtral: transformers 5 names the block mlp (the files: block_sparse_moe.experts.E.w1 / w3 / w2).
  auto mixtral = tiny_moe("mixtral");
  auto adapters = apply_lora(*mixtral, expert_lora({"mlp.experts.gate_up_proj"}), 0);
  ASSERT_EQ(adapters->experts().size(), 2u);
  EXPECT_EQ(adapters->experts()[1].first, "model.layers.1.mlp.experts");
}

TEST(LoraExperts, EachExpertComputesPeftsDeltaOfTheStackedParameter) {
  auto model = tiny_moe("mixtral");
  auto config = expert_lora({"gate_up_proj", "down_proj"});
  config.alpha = 6;
  auto adapters = apply_lora(*model, config, 0);
  perturb_experts(*adapters, 3);
  const auto groups = model->stacked_expert_layers();
  at::manual_seed(4);
  const at::Tensor x = at::randn({5, 32}), h = at::randn({5, 16});
  at::NoGradGuard no_grad;
  for (const auto& [path, experts] : adapters->experts()) {
    SCOPED_TRACE(path);
    const bool gate_up = path.ends_with(".base_layer");
    const auto& group = groups[path.starts_with("model.layers.0.") ? 0 : 1];
    const int64_t E = 4, r = 2, out = experts->out_features(), in = experts->in_features();
    // PEFT's get_delta_weight for a 3D parameter (E, out, in): einsum("o r e, e r i -> e o i", B, A) * scaling.
    const at::Tensor delta = at::einsum("ore,eri->eoi", {experts->lora_B.view({out, r, E}),
                                                         experts->lora_A.view({E, r, in})}) * 3.0;
    for (int64_t e = 0; e < E; ++e) {
      if (gate_up) {
        Linear& gate = *group.gate[e];
        Linear& up = *group.up[e];
        EXPECT_TRUE(at::allclose(gate.forward(x), at::linear(x, gate.weight + delta[e].narrow(0, 0, 16)), 1e-5, 1e-5));
        EXPECT_TRUE(at::allclose(up.forward(x), at::linear(x, up.weight + delta[e].narrow(0, 16, 16)), 1e-5, 1e-5));
      } else {
        Linear& down = *group.down[e];
        EXPECT_TRUE(at::allclose(down.forward(h), at::linear(h, down.weight + delta[e]), 1e-5, 1e-5));
      }
    }
  }
}

TEST(LoraExperts, GradientsReachTheSharedTensorsAndMergingGivesTheAdaptedFunction) {
  auto model = tiny_moe("qwen3_moe");
  auto adapters = apply_lora(*model, expert_lora({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}), 0);
  perturb_experts(*adapters, 5);
  const Batch batch = padded_batch(false);
  const at::Tensor adapted = logits_of(*model, batch);
  model->train(true);
  forward_loss(*model, batch).loss_sum.backward();
  model->train(false);
  for (const auto& [path, experts] : adapters->experts()) {
    ASSERT_TRUE(experts->lora_A.grad().defined() && experts->lora_B.grad().defined()) << path;
    // Every expert gets tokens in this batch: each one's slices (A's rows, B's interleaved columns) have gradients.
    const at::Tensor grad_B = experts->lora_B.grad().view({experts->out_features(), 2, 4});
    for (int64_t e = 0; e < 4; ++e) {
      EXPECT_GT(experts->lora_A.grad().narrow(0, e * 2, 2).abs().max().item<double>(), 0.0) << path << " " << e;
      EXPECT_GT(grad_B.select(2, e).abs().max().item<double>(), 0.0) << path << " " << e;
    }
  }
  {
    AdaptersOff off(adapters.get());
    EXPECT_FALSE(at::allclose(logits_of(*model, batch), adapted, 1e-3, 1e-3)) << "the expert adapters change nothing";
  }
  merge_lora(*adapters);
  for (const auto& group : model->stacked_expert_layers())
    for (const Linear* gate : group.gate) EXPECT_FALSE(gate->has_output_hook());
  const at::Tensor merged = logits_of(*model, batch);
  EXPECT_TRUE(at::allclose(merged, adapted, 1e-4, 1e-4)) << (merged - adapted).abs().max().item<double>();
}

TEST(LoraExperts, ActivationCheckpointingGivesTheSameExpertGradients) {
  auto model = tiny_moe("mixtral");
  auto adapters = apply_lora(*model, expert_lora({"gate_up_proj", "down_proj"}), 0);
  perturb_experts(*adapters, 9);
  model->train(true);
  const Batch batch = padded_batch(false);
  forward_loss(*model, batch).loss_sum.backward();
  const auto plain = adapter_grads(*adapters);
  apply_activation_checkpointing(*model);
  forward_loss(*model, batch).loss_sum.backward();
  const auto checkpointed = adapter_grads(*adapters);
  ASSERT_EQ(plain.size(), checkpointed.size());
  for (const auto& [param, grad] : plain) {
    ASSERT_GT(grad.abs().max().item<double>(), 0.0) << param;
    EXPECT_LE((grad - checkpointed.at(param)).abs().max().item<double>(), 1e-5 * grad.abs().max().item<double>())
        << param;
  }
  EXPECT_TRUE(plain.contains("model.layers.0.mlp.experts.base_layer.lora_B.weight"));
}

TEST(LoraExperts, PeftFilesRoundTripWithTargetParameters) {
  test::TempDir dir;
  auto model = tiny_moe("qwen3_moe");
  const auto config = expert_lora({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"});
  auto adapters = apply_lora(*model, config, 0);
  perturb_experts(*adapters, 6);
  const Batch batch = padded_batch(false);
  const at::Tensor adapted = logits_of(*model, batch);
  write_peft_adapter(dir.path().string(), to_peft_adapter(*adapters, *model, "/models/moe"));
  nlohmann::json saved;
  std::ifstream(dir.file(kAdapterConfigName)) >> saved;
  EXPECT_EQ(saved["target_parameters"], nlohmann::json(config.target_parameters));
  EXPECT_EQ(saved["lora_dropout"], 0.0);
  const auto file = SafetensorsFile::open(dir.file(kAdapterWeightsName));
  EXPECT_NE(file.find("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"), nullptr);
  EXPECT_NE(file.find("base_model.model.model.layers.0.mlp.experts.lora_B.weight"), nullptr);

  const PeftAdapter read = read_peft_adapter(dir.path().string());
  EXPECT_EQ(read.config.target_parameters, config.target_parameters);
  auto fresh = tiny_moe("qwen3_moe");
  auto loaded = apply_peft_adapter(*fresh, read, dir.path().string());
  EXPECT_EQ(loaded->experts().size(), 2u);
  EXPECT_TRUE(at::equal(adapted, logits_of(*fresh, batch)));
  auto resumed_model = tiny_moe("qwen3_moe");
  auto resumed = apply_lora(*resumed_model, config, 99);
  load_lora_weights(*resumed, read, dir.path().string());
  EXPECT_TRUE(at::equal(adapted, logits_of(*resumed_model, batch)));
  // Adapters applied without the experts do not take it: the error names the experts' tensors.
  auto attention_only = tiny_moe("qwen3_moe");
  auto fewer = apply_lora(*attention_only, expert_lora({}), 0);
  try {
    load_lora_weights(*fewer, read, "ckpt");
    FAIL() << "expert weights were dropped silently";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.experts"), std::string::npos) << e.what();
  }
  // Its target_parameters must fit the base: a dense model has no experts.
  auto dense = tiny_model("tiny-qwen2");
  EXPECT_THROW(apply_peft_adapter(*dense, read, dir.path().string()), DataError);
}

TEST(LoraExperts, ExpertTargetsThatPeftCannotLoadAreUsageErrorsNamingTheFix) {
  // A target_modules name that reaches experts only: transformers 5 has no such modules.
  auto model = tiny_moe("mixtral");
  auto error = usage_error_of([&] { apply_lora(*model, lora(2, {"w1"}), 0); });
  EXPECT_NE(error.find("lora.target_modules: w1"), std::string::npos) << error;
  EXPECT_NE(error.find("lora.target_parameters"), std::string::npos) << error;
  // A name that reaches the dense MLP and the experts adapts the dense MLP alone, as PEFT does.
  auto qwen = tiny_moe("qwen3_moe");
  auto dense_only = apply_lora(*qwen, lora(2, {"gate_proj"}), 0);
  EXPECT_EQ(layer_paths(*dense_only), std::vector<std::string>{"model.layers.1.mlp.gate_proj"});
  EXPECT_TRUE(dense_only->experts().empty());
  // target_parameters names a parameter, not an expert's projection.
  auto other = tiny_moe("qwen3_moe");
  error = usage_error_of([&] { apply_lora(*other, expert_lora({"experts.0.gate_proj"}), 0); });
  EXPECT_NE(error.find("gate_up_proj and down_proj"), std::string::npos) << error;
  error = usage_error_of([&] { apply_lora(*other, expert_lora({"block_sparse_moe.experts.down_proj"}), 0); });
  EXPECT_NE(error.find("match(es) no parameter"), std::string::npos) << error;
  EXPECT_NE(error.find("model.layers.0.mlp.experts.gate_up_proj"), std::string::npos) << error;
  // Dropout: PEFT refuses it on parameters.
  auto config = expert_lora({"down_proj"});
  config.dropout = 0.05;
  error = usage_error_of([&] { apply_lora(*other, config, 0); });
  EXPECT_NE(error.find("lora.dropout"), std::string::npos) << error;
  EXPECT_NE(error.find("lora.dropout=0"), std::string::npos) << error;
  // A dense model has no experts.
  auto dense = tiny_model("tiny-qwen2");
  error = usage_error_of([&] { apply_lora(*dense, expert_lora({"down_proj"}), 0); });
  EXPECT_NE(error.find("no experts"), std::string::npos) << error;
}

}  // namespace trainer
