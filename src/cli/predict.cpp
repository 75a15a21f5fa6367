// `trainer predict` (see predict.h).
#include "cli/predict.h"

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <ostream>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "data/image.h"
#include "data/image_loader.h"
#include "data/image_preprocess.h"
#include "models/image/clip.h"
#include "models/image/clip_zero_shot.h"
#include "models/image/image_model.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace {

constexpr std::size_t kBatch = 16;

// Images [first, first + count) preprocessed into one (count, 3, H, W) fp32 batch.
at::Tensor pixel_batch(const PredictOptions& options, std::size_t first, std::size_t count,
                       const data::ImageProcessorSpec& spec) {
  const auto [height, width] = spec.output_size();
  at::Tensor pixels = at::empty({static_cast<int64_t>(count), 3, height, width}, at::kFloat);
  for (std::size_t i = 0; i < count; ++i)
    data::preprocess_image(data::load_image_file(options.images[first + i]), spec,
                           pixels[static_cast<int64_t>(i)].data_ptr<float>());
  return pixels;
}

// A CLIPModel directory: each image against every --text.
int predict_texts(const PredictOptions& options, std::ostream& out) {
  if (!has_tokenizer(options.model_dir))
    throw UsageError(options.model_dir + " has no tokenizer (tokenizer.json) for the --text captions",
                     "copy the CLIP checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) into it");
  const auto tokenizer = load_tokenizer(options.model_dir);
  auto model = load_clip(options.model_dir, ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  const auto spec = image_processor_for(options.model_dir, "CLIPImageProcessor", model->image_size());
  const ClipTextBatch texts = clip_tokenize(*tokenizer, options.texts, model->max_text_length());
  at::NoGradGuard no_grad;
  const at::Tensor text_features = model->text_features(texts.input_ids, texts.attention_mask);
  const auto n_texts = static_cast<int64_t>(options.texts.size());
  const int64_t k = options.top_k_given ? std::min<int64_t>(options.top_k, n_texts) : n_texts;
  for (std::size_t first = 0; first < options.images.size(); first += kBatch) {
    const std::size_t count = std::min(kBatch, options.images.size() - first);
    const at::Tensor probabilities = clip_probabilities_from_features(
        model->image_features(pixel_batch(options, first, count, spec)), text_features, model->logit_scale());
    const auto [values, indices] = at::topk(probabilities, k, -1);
    for (std::size_t i = 0; i < count; ++i) {
      const std::string& image = options.images[first + i];
      nlohmann::json predictions = nlohmann::json::array();
      if (!options.json) out << image << "\n";
      for (int64_t j = 0; j < k; ++j) {
        const auto id = indices[static_cast<int64_t>(i)][j].item<int64_t>();
        const double p = values[static_cast<int64_t>(i)][j].item<double>();
        const std::string& text = options.texts[static_cast<std::size_t>(id)];
        if (options.json) {
          predictions.push_back({{"text", text}, {"id", id}, {"probability", p}});
        } else {
          out << "  " << std::fixed << std::setprecision(4) << p << "  " << text << "\n";
        }
      }
      if (options.json) out << nlohmann::json{{"image", image}, {"predictions", predictions}}.dump() << "\n";
    }
  }
  return kExitOk;
}

}  // namespace

bool is_clip_model_dir(const std::string& dir) {
  const auto path = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::exists(path)) return false;
  const nlohmann::json config = read_json_file(path.string());
  if (config.value("model_type", "") != "clip") return false;
  const auto architectures = config.find("architectures");
  if (architectures == config.end() || !architectures->is_array()) return false;
  return std::any_of(architectures->begin(), architectures->end(),
                     [](const nlohmann::json& a) { return a.is_string() && a.get<std::string>() == "CLIPModel"; });
}

int run_predict(const PredictOptions& options, std::ostream& out) {
  if (options.images.empty()) throw UsageError("predict needs at least one --image FILE");
  if (options.top_k < 1) throw UsageError("--top-k must be at least 1, got " + std::to_string(options.top_k));
  const bool clip = is_clip_model_dir(options.model_dir);
  if (clip && options.texts.empty())
    throw UsageError(options.model_dir + " is a CLIPModel (image and text towers, no classification head): "
                         "predict scores each image against texts you give",
                     "add --text \"a photo of a cat\" --text \"a photo of a dog\" (one --text per candidate)");
  if (!clip && !options.texts.empty())
    throw UsageError("--text needs a CLIPModel directory; " + options.model_dir +
                         " is an image classifier (its classes come from config.json's id2label)",
                     "drop --text to get its top classes, or pass a CLIPModel directory with --model");
  if (clip) return predict_texts(options, out);
  auto model = load_image_classifier(options.model_dir, ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  const auto spec = image_processor_for(options.model_dir, *model);
  const int64_t k = std::min<int64_t>(options.top_k, model->num_labels());
  at::NoGradGuard no_grad;
  for (std::size_t first = 0; first < options.images.size(); first += kBatch) {
    const std::size_t count = std::min(kBatch, options.images.size() - first);
    const at::Tensor pixels = pixel_batch(options, first, count, spec);
    const at::Tensor probabilities = at::softmax(model->forward(pixels).to(at::kFloat), -1);
    const auto [values, indices] = at::topk(probabilities, k, -1);
    for (std::size_t i = 0; i < count; ++i) {
      const std::string& image = options.images[first + i];
      nlohmann::json predictions = nlohmann::json::array();
      if (!options.json) out << image << "\n";
      for (int64_t j = 0; j < k; ++j) {
        const auto id = indices[static_cast<int64_t>(i)][j].item<int64_t>();
        const double p = values[static_cast<int64_t>(i)][j].item<double>();
        const std::string& label = model->labels()[static_cast<std::size_t>(id)];
        if (options.json) {
          predictions.push_back({{"label", label}, {"id", id}, {"probability", p}});
        } else {
          out << "  " << std::left << std::setw(24) << label << std::right << std::fixed << std::setprecision(4) << p
              << "\n";
        }
      }
      if (options.json) out << nlohmann::json{{"image", image}, {"predictions", predictions}}.dump() << "\n";
    }
  }
  return kExitOk;
}

}  // namespace trainer
