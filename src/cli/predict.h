// `trainer predict`: class probabilities of image files under an image classifier (a ViT directory), preprocessed
// from its preprocessor_config.json exactly as transformers' image processor would.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace trainer {

struct PredictOptions {
  std::string model_dir;
  std::vector<std::string> images;
  int64_t top_k = 5;
  bool json = false;  // one JSON object a line instead of the table
};

// Prints, for each image, its top_k classes with probabilities. A bad image is a DataError naming the file.
int run_predict(const PredictOptions& options, std::ostream& out);

}  // namespace trainer
