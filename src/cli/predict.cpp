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
#include "data/image_preprocess.h"
#include "models/image_model.h"
#include "trainer/errors.h"

namespace trainer {

int run_predict(const PredictOptions& options, std::ostream& out) {
  if (options.images.empty()) throw UsageError("predict needs at least one --image FILE");
  if (options.top_k < 1) throw UsageError("--top-k must be at least 1, got " + std::to_string(options.top_k));
  auto model = load_image_classifier(options.model_dir, ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  const auto spec = image_processor_for(options.model_dir, *model);
  const auto [height, width] = spec.output_size();
  const int64_t k = std::min<int64_t>(options.top_k, model->num_labels());
  constexpr std::size_t kBatch = 16;
  at::NoGradGuard no_grad;
  for (std::size_t first = 0; first < options.images.size(); first += kBatch) {
    const std::size_t count = std::min(kBatch, options.images.size() - first);
    at::Tensor pixels = at::empty({static_cast<int64_t>(count), 3, height, width}, at::kFloat);
    for (std::size_t i = 0; i < count; ++i)
      data::preprocess_image(data::load_image_file(options.images[first + i]), spec,
                             pixels[static_cast<int64_t>(i)].data_ptr<float>());
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
