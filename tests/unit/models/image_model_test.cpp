// Image classifiers (ViT, the CLIP vision classifier) and CLIP's towers: gradients accumulated over micro-batches of
// one image equal the batch's. (A parameter broadcast through a view once gave one gradient buffer to the class and
// position embeddings when the batch held one image, so accumulation corrupted both.)
#include <map>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/image/clip.h"
#include "models/image/image_model.h"
#include "models/image/vit.h"
#include "support/temp_dir.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

using Grads = std::map<std::string, at::Tensor>;

Grads take_grads(Module& model) {
  Grads grads;
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) grads[name] = p.grad().clone();
    p.mutable_grad() = at::Tensor();
  });
  return grads;
}

void expect_same(const Grads& a, const Grads& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, grad] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    // Summation order only: 1e-5 plus 1e-6 of the largest gradient. CLIP's text embeddings' gradients reach 29
    // (positions) and 18 (tokens) here; an AVX-512/AMX Xeon's kernels put them 2.1e-5 and 1.5e-5 apart (one or two
    // fp32 ulps at that size), an AVX2 EPYC's under 1e-5.
    const double scale = b.at(name).abs().max().item<double>();
    EXPECT_LT((grad - b.at(name)).abs().max().item<double>(), 1e-5 + 1e-6 * scale) << name << " (largest " << scale << ")";
  }
}

// forward(rows) -> (B, K); the batch's backward of <forward, g> against one row at a time.
template <class Forward>
void expect_rows_accumulate_the_batch(Module& model, const at::Tensor& inputs, Forward forward, int64_t k) {
  model.train(false);
  model.for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const int64_t b = inputs.size(0);
  const at::Tensor g = at::randn({b, k});
  forward(inputs).backward(g);
  const Grads batch = take_grads(model);
  for (int64_t i = 0; i < b; ++i) forward(inputs.slice(0, i, i + 1)).backward(g.slice(0, i, i + 1));
  expect_same(take_grads(model), batch);
}

nlohmann::json clip_config() {
  return {{"model_type", "clip"},
          {"projection_dim", 6},
          {"num_labels", 3},
          {"text_config",
           {{"hidden_size", 8}, {"intermediate_size", 12}, {"num_attention_heads", 2}, {"num_hidden_layers", 1},
            {"vocab_size", 20}, {"max_position_embeddings", 8}, {"eos_token_id", 19}}},
          {"vision_config",
           {{"hidden_size", 8}, {"intermediate_size", 12}, {"num_attention_heads", 2}, {"num_hidden_layers", 1},
            {"image_size", 8}, {"patch_size", 4}}}};
}

TEST(ImageModels, VitMicroBatchesOfOneAccumulateTheBatchGradient) {
  const nlohmann::json config = {{"model_type", "vit"}, {"hidden_size", 8}, {"num_hidden_layers", 1},
                                 {"num_attention_heads", 2}, {"intermediate_size", 12}, {"image_size", 8},
                                 {"patch_size", 4}, {"num_labels", 3}};
  VitForImageClassification model(config, at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(1);
  model.init_weights();
  const at::Tensor pixels = at::randn({3, 3, 8, 8});
  expect_rows_accumulate_the_batch(model, pixels, [&](const at::Tensor& x) { return model.forward(x); }, 3);
  // Interpolated positions (another image size) take the same path through the class and position embeddings.
  expect_rows_accumulate_the_batch(model, at::randn({3, 3, 12, 8}), [&](const at::Tensor& x) { return model.forward(x); }, 3);
}

TEST(ImageModels, ClipClassifierAndTowersMicroBatchesOfOneAccumulateTheBatchGradient) {
  ClipVisionClassifier classifier(clip_config(), at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(2);
  classifier.init_weights();
  const at::Tensor pixels = at::randn({3, 3, 8, 8});
  expect_rows_accumulate_the_batch(classifier, pixels, [&](const at::Tensor& x) { return classifier.forward(x); }, 3);

  ClipModel clip(clip_config(), at::TensorOptions().dtype(at::kFloat));
  clip.init_weights();
  expect_rows_accumulate_the_batch(clip, pixels, [&](const at::Tensor& x) { return clip.image_features(x); }, 6);
  at::Tensor ids = at::randint(2, 19, {3, 5}, at::kLong);
  ids.select(1, 4).fill_(19);
  expect_rows_accumulate_the_batch(clip, ids, [&](const at::Tensor& x) { return clip.text_features(x); }, 6);
}

TEST(ImageModels, ClipDirectoriesLoadSaveAndNameWhatIsWrong) {
  test::TempDir dir;
  test::write_file(dir.file("config.json"), clip_config().dump());
  // init = random needs config.json alone; what save_clip writes loads back the same.
  auto model = load_clip(dir.path().string(), ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 4);
  save_clip(*model, dir.path().string());
  auto loaded = load_clip(dir.path().string(), ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  const auto original = model->named_parameters();
  const auto reloaded = loaded->named_parameters();
  ASSERT_EQ(original.size(), reloaded.size());
  for (std::size_t i = 0; i < original.size(); ++i) EXPECT_TRUE(at::equal(original[i].second, reloaded[i].second));
  // The same directory as an image classifier: its vision tower, a new head for the classes asked for.
  auto classifier = load_image_classifier(dir.path().string(), ModelInit::kPretrained,
                                          at::TensorOptions().dtype(at::kFloat), 1, {"a", "b", "c", "d"});
  EXPECT_EQ(classifier->model_type(), "clip");
  EXPECT_EQ(classifier->num_labels(), 4);
  EXPECT_EQ(classifier->image_processor_type(), "CLIPImageProcessor");
  // A tensor missing from the checkpoint: one DataError naming it and the directory.
  NamedTensors without_scale;
  for (const auto& [name, tensor] : original)
    if (name != "logit_scale") without_scale.emplace_back(name, tensor.detach());
  write_safetensors(dir.file("model.safetensors"), without_scale, {{"format", "pt"}});
  try {
    load_clip(dir.path().string(), ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("logit_scale"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir.path().string()), std::string::npos) << e.what();
  }
  // Not an image model: the error names the file and what is supported.
  test::write_file(dir.file("config.json"), R"({"model_type": "clip_text_model"})");
  try {
    load_image_classifier(dir.path().string(), ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
    EXPECT_NE(e.hint().find("clip_vision_model"), std::string::npos) << e.hint();
  }
}

}  // namespace
}  // namespace trainer
