// Image preprocessing as transformers' image processors do it (ViTImageProcessor, CLIPImageProcessor and their
// Pil variants), read from a model directory's preprocessor_config.json: resize with Pillow's resampling
// (reproduced from Pillow 13: separable two-pass convolution in its order, the filter's support widened by the downscale factor, 22-bit
// fixed-point coefficients, 8-bit clipping after each pass), center crop (zero padding when the crop is larger),
// rescale and normalise into channel-first float32. Pure and thread-safe; no LibTorch.
#pragma once

#include <array>
#include <string>
#include <utility>

#include "data/image.h"

namespace trainer::data {

// Pillow's resampling filters, numbered as `PIL.Image.Resampling` (the values preprocessor_config.json stores).
enum class Resample { kNearest = 0, kLanczos = 1, kBilinear = 2, kBicubic = 3, kBox = 4, kHamming = 5 };

struct ImageProcessorSpec {
  std::string type = "ViTImageProcessor";  // image_processor_type, for messages
  bool do_resize = true;
  int resize_height = 224, resize_width = 224;  // size {"height", "width"}
  int shortest_edge = 0;                        // size {"shortest_edge"}: > 0 resizes the short side to it
  Resample resample = Resample::kBilinear;
  bool do_center_crop = false;
  int crop_height = 224, crop_width = 224;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean{0.5, 0.5, 0.5};
  std::array<double, 3> image_std{0.5, 0.5, 0.5};

  // (height, width) of every preprocessed image; throws UsageError when it depends on the image (shortest_edge
  // resizing without a center crop), which a batch cannot hold.
  std::pair<int, int> output_size() const;
};

// The spec of `model_dir`/preprocessor_config.json; without that file, the defaults of `fallback_type`
// ("ViTImageProcessor" or "CLIPImageProcessor"). Throws DataError naming the file and key for bad values.
ImageProcessorSpec read_image_processor(const std::string& model_dir,
                                        const std::string& fallback_type = "ViTImageProcessor");
// preprocessor_config.json for `spec` (what read_image_processor reads back), as transformers writes it.
std::string image_processor_json(const ImageProcessorSpec& spec);
// The defaults transformers' processor class of that name has.
ImageProcessorSpec default_image_processor(const std::string& type);

// Pillow's `Image.resize((width, height), resample)` of an RGB image (kNearest is not supported: UsageError).
RgbImage resize_image(const RgbImage& image, int width, int height, Resample resample);

// (height, width) an image of (height, width) is resized to: fixed, or the short side to `shortest_edge` with the
// long side int(shortest_edge * long / short), as transformers' get_resize_output_image_size.
std::pair<int, int> resize_target(const ImageProcessorSpec& spec, int height, int width);

// transformers' center_crop: the window starts at floor((size - crop) / 2); outside the image is zero.
RgbImage center_crop(const RgbImage& image, int height, int width);

// The whole pipeline: resize, crop, then rescale and normalise into `out` (3 x H x W float32, channel-first,
// H x W = spec.output_size()).
void preprocess_image(const RgbImage& image, const ImageProcessorSpec& spec, float* out);

// Resize and crop only (the 8-bit image before rescaling), for tests and `trainer data`.
RgbImage resize_and_crop(const RgbImage& image, const ImageProcessorSpec& spec);

}  // namespace trainer::data
