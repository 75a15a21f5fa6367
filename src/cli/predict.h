// `trainer predict`: class probabilities of image files under an image classifier (a ViT or CLIP classifier
// directory), or, for a CLIPModel directory, each image's probabilities over the given texts (zero-shot: the
// softmax over the texts of CLIP's logits_per_image); images preprocessed from preprocessor_config.json exactly as
// transformers' image processor would.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace trainer {

struct PredictOptions {
  std::string model_dir;
  std::vector<std::string> images;
  std::vector<std::string> texts;  // --text: for a CLIPModel directory (and only there)
  int64_t top_k = 5;
  bool top_k_given = false;  // with texts, every text is shown unless --top-k is given
  bool json = false;         // one JSON object a line instead of the table
};

// Whether `dir`'s config.json is a whole CLIP (architectures CLIPModel: both towers), not an image classifier.
bool is_clip_model_dir(const std::string& dir);

// Prints, for each image, its top_k classes with probabilities; with texts (a CLIPModel directory), every text
// (or the top_k given) sorted by probability. A CLIPModel directory without texts, or texts for a classifier, is a
// UsageError saying which to use; a bad image is a DataError naming the file.
int run_predict(const PredictOptions& options, std::ostream& out);

}  // namespace trainer
