// Image preprocessing that reproduces transformers' image processors on Pillow (see image_preprocess.h).
#include "data/image_preprocess.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"

namespace trainer::data {
namespace {

// ---- Pillow's filters (the kernels of Resample.c, as functions of the distance in source pixels) -------------

double box_kernel(double x) { return x > -0.5 && x <= 0.5 ? 1.0 : 0.0; }
double bilinear_kernel(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}
double bicubic_kernel(double x) {  // Keys' cubic convolution with a = -0.5
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}
double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return std::sin(x) / x;
}
double lanczos_kernel(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3.0) : 0.0; }
double hamming_kernel(double x) {
  x = std::fabs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x *= M_PI;
  // Pillow computes the window's constants in single precision (0.54f, 0.46f); so do we.
  return std::sin(x) / x * (static_cast<double>(0.54f) + static_cast<double>(0.46f) * std::cos(x));
}

struct Filter {
  double (*kernel)(double);
  double support;  // in source pixels at scale 1
};

Filter filter_of(Resample resample) {
  switch (resample) {
    case Resample::kBox: return {box_kernel, 0.5};
    case Resample::kBilinear: return {bilinear_kernel, 1.0};
    case Resample::kHamming: return {hamming_kernel, 1.0};
    case Resample::kBicubic: return {bicubic_kernel, 2.0};
    case Resample::kLanczos: return {lanczos_kernel, 3.0};
    case Resample::kNearest: break;
  }
  throw UsageError("image resampling NEAREST (resample = 0) is not supported",
                   "use bilinear (2) or bicubic (3) in preprocessor_config.json");
}

constexpr int kPrecisionBits = 32 - 8 - 2;  // fixed-point fraction bits: room for 8-bit values and overshoot

// For each output position along one axis: the first source index and the fixed-point weights over the source
// pixels it reads. The filter is stretched by the downscale factor (antialiasing), weights normalised to sum 1.
struct AxisCoefficients {
  std::vector<int> first, count;
  std::vector<std::int32_t> weights;  // out_size x taps
  int taps = 0;
};

AxisCoefficients axis_coefficients(int in_size, int out_size, const Filter& filter) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter.support * filter_scale;
  AxisCoefficients c;
  c.taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(static_cast<std::size_t>(out_size) * c.taps, 0);
  std::vector<double> w(c.taps);
  const double inverse_scale = 1.0 / filter_scale;  // multiplied, not divided, as Pillow does (the same bits)
  for (int o = 0; o < out_size; ++o) {
    const double center = (o + 0.5) * scale;
    // Bounds rounded as Pillow rounds them (truncation of value + 0.5), clamped to the image.
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
    const int n = hi - lo;
    double total = 0.0;
    for (int i = 0; i < n; ++i) {
      w[i] = filter.kernel((i + lo - center + 0.5) * inverse_scale);
      total += w[i];
    }
    for (int i = 0; i < n; ++i) {
      const double normalised = total != 0.0 ? w[i] / total : w[i];
      const double fixed = normalised * (1 << kPrecisionBits);
      c.weights[static_cast<std::size_t>(o) * c.taps + i] =
          static_cast<std::int32_t>(normalised < 0 ? fixed - 0.5 : fixed + 0.5);  // truncation towards zero
    }
    c.first[o] = lo;
    c.count[o] = n;
  }
  return c;
}

std::uint8_t clip_fixed(std::int32_t sum) {
  const std::int32_t value = sum >> kPrecisionBits;  // arithmetic shift: floor, as Pillow's lookup index
  return static_cast<std::uint8_t>(value < 0 ? 0 : value > 255 ? 255 : value);
}

// Horizontal pass over rows [row_begin, row_end) of `in` (width in_width) into `out` (width out_width).
void resample_rows(const std::uint8_t* in, int in_width, int row_begin, int row_end, std::uint8_t* out,
                   int out_width, const AxisCoefficients& c) {
  for (int y = row_begin; y < row_end; ++y) {
    const std::uint8_t* src = in + static_cast<std::size_t>(y) * in_width * 3;
    std::uint8_t* dst = out + static_cast<std::size_t>(y - row_begin) * out_width * 3;
    for (int x = 0; x < out_width; ++x) {
      const std::int32_t* k = &c.weights[static_cast<std::size_t>(x) * c.taps];
      std::int32_t s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
      const std::uint8_t* p = src + static_cast<std::size_t>(c.first[x]) * 3;
      for (int i = 0; i < c.count[x]; ++i) {
        s0 += p[i * 3 + 0] * k[i];
        s1 += p[i * 3 + 1] * k[i];
        s2 += p[i * 3 + 2] * k[i];
      }
      dst[x * 3 + 0] = clip_fixed(s0);
      dst[x * 3 + 1] = clip_fixed(s1);
      dst[x * 3 + 2] = clip_fixed(s2);
    }
  }
}

// Vertical pass: `in` rows start at source row `row_offset`.
void resample_columns(const std::uint8_t* in, int width, int row_offset, std::uint8_t* out, int out_height,
                      const AxisCoefficients& c) {
  const std::size_t stride = static_cast<std::size_t>(width) * 3;
  for (int y = 0; y < out_height; ++y) {
    const std::int32_t* k = &c.weights[static_cast<std::size_t>(y) * c.taps];
    const std::uint8_t* base = in + static_cast<std::size_t>(c.first[y] - row_offset) * stride;
    std::uint8_t* dst = out + static_cast<std::size_t>(y) * stride;
    for (std::size_t x = 0; x < stride; ++x) {
      std::int32_t s = 1 << (kPrecisionBits - 1);
      for (int i = 0; i < c.count[y]; ++i) s += base[i * stride + x] * k[i];
      dst[x] = clip_fixed(s);
    }
  }
}

int json_int(const nlohmann::json& value, const std::string& file, const std::string& key) {
  if (!value.is_number_integer() || value.get<std::int64_t>() <= 0 || value.get<std::int64_t>() > 65536)
    throw DataError(file + ": " + key + " must be a positive integer, got " + value.dump());
  return value.get<int>();
}

// size / crop_size: an int (square, or the short side for size in CLIP's old format) or an object.
void read_size(const nlohmann::json& value, const std::string& file, const std::string& key, int& height, int& width,
               int* shortest_edge) {
  if (value.is_number_integer()) {
    const int n = json_int(value, file, key);
    if (shortest_edge != nullptr && *shortest_edge > 0) {
      *shortest_edge = n;
    } else {
      height = width = n;
    }
    return;
  }
  if (!value.is_object()) throw DataError(file + ": " + key + " must be an integer or an object, got " + value.dump());
  if (value.contains("shortest_edge") && shortest_edge != nullptr) {
    *shortest_edge = json_int(value["shortest_edge"], file, key + ".shortest_edge");
    return;
  }
  if (!value.contains("height") || !value.contains("width"))
    throw DataError(file + ": " + key + " needs \"height\" and \"width\"" +
                        (shortest_edge ? " or \"shortest_edge\"" : "") + ", got " + value.dump(),
                    "shortest_edge + longest_edge and max_height/max_width sizes are not supported");
  if (shortest_edge != nullptr) *shortest_edge = 0;
  height = json_int(value["height"], file, key + ".height");
  width = json_int(value["width"], file, key + ".width");
}

}  // namespace

std::pair<int, int> ImageProcessorSpec::output_size() const {
  if (do_center_crop) return {crop_height, crop_width};
  if (do_resize && shortest_edge == 0) return {resize_height, resize_width};
  throw UsageError(type + " resizes the shortest edge without a center crop, so image sizes differ",
                   "set do_center_crop with a crop_size, or a fixed size {\"height\", \"width\"}, in "
                   "preprocessor_config.json");
}

ImageProcessorSpec default_image_processor(const std::string& type) {
  ImageProcessorSpec spec;
  spec.type = type;
  if (type.rfind("CLIPImageProcessor", 0) == 0) {
    spec.shortest_edge = 224;
    spec.resample = Resample::kBicubic;
    spec.do_center_crop = true;
    spec.image_mean = {0.48145466, 0.4578275, 0.40821073};
    spec.image_std = {0.26862954, 0.26130258, 0.27577711};
  }
  return spec;
}

std::string image_processor_json(const ImageProcessorSpec& spec) {
  nlohmann::json j;
  j["image_processor_type"] = spec.type;
  j["do_resize"] = spec.do_resize;
  if (spec.shortest_edge > 0) j["size"] = {{"shortest_edge", spec.shortest_edge}};
  else j["size"] = {{"height", spec.resize_height}, {"width", spec.resize_width}};
  j["resample"] = static_cast<int>(spec.resample);
  j["do_center_crop"] = spec.do_center_crop;
  if (spec.do_center_crop) j["crop_size"] = {{"height", spec.crop_height}, {"width", spec.crop_width}};
  j["do_rescale"] = spec.do_rescale;
  j["rescale_factor"] = spec.rescale_factor;
  j["do_normalize"] = spec.do_normalize;
  j["image_mean"] = spec.image_mean;
  j["image_std"] = spec.image_std;
  return j.dump(2) + "\n";
}

ImageProcessorSpec read_image_processor(const std::string& model_dir, const std::string& fallback_type) {
  const std::string file = (std::filesystem::path(model_dir) / "preprocessor_config.json").string();
  std::ifstream in(file);
  if (!in) return default_image_processor(fallback_type);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(file + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw DataError(file + ": expected a JSON object");
  const std::string type = j.value("image_processor_type", fallback_type);
  ImageProcessorSpec spec = default_image_processor(type);
  auto flag = [&](const char* key, bool& out) {
    if (!j.contains(key)) return;
    if (!j[key].is_boolean()) throw DataError(file + ": " + key + " must be true or false, got " + j[key].dump());
    out = j[key].get<bool>();
  };
  flag("do_resize", spec.do_resize);
  flag("do_center_crop", spec.do_center_crop);
  flag("do_rescale", spec.do_rescale);
  flag("do_normalize", spec.do_normalize);
  if (j.contains("size")) read_size(j["size"], file, "size", spec.resize_height, spec.resize_width, &spec.shortest_edge);
  if (j.contains("crop_size") && !j["crop_size"].is_null())
    read_size(j["crop_size"], file, "crop_size", spec.crop_height, spec.crop_width, nullptr);
  if (j.contains("resample")) {
    if (!j["resample"].is_number_integer() || j["resample"].get<int>() < 0 || j["resample"].get<int>() > 5)
      throw DataError(file + ": resample must be one of Pillow's filters 0..5, got " + j["resample"].dump());
    spec.resample = static_cast<Resample>(j["resample"].get<int>());
    if (spec.resample == Resample::kNearest) filter_of(spec.resample);  // throws with the reason
  }
  if (j.contains("rescale_factor")) {
    if (!j["rescale_factor"].is_number()) throw DataError(file + ": rescale_factor must be a number");
    spec.rescale_factor = j["rescale_factor"].get<double>();
  }
  auto triple = [&](const char* key, std::array<double, 3>& out) {
    if (!j.contains(key)) return;
    const auto& v = j[key];
    if (v.is_number()) {
      out.fill(v.get<double>());
      return;
    }
    if (!v.is_array() || v.size() != 3 || !v[0].is_number() || !v[1].is_number() || !v[2].is_number())
      throw DataError(file + ": " + key + " must be 3 numbers (R, G, B), got " + v.dump());
    for (int c = 0; c < 3; ++c) out[c] = v[c].get<double>();
  };
  triple("image_mean", spec.image_mean);
  triple("image_std", spec.image_std);
  for (double s : spec.image_std)
    if (s == 0.0) throw DataError(file + ": image_std has a zero (division by zero in normalisation)");
  return spec;
}

RgbImage resize_image(const RgbImage& image, int width, int height, Resample resample) {
  const Filter filter = filter_of(resample);
  if (width <= 0 || height <= 0) throw UsageError("image resize to " + std::to_string(width) + " x " +
                                                  std::to_string(height) + ": sizes must be positive");
  if (width == image.width && height == image.height) return image;  // Pillow copies
  const bool need_horizontal = width != image.width, need_vertical = height != image.height;
  const AxisCoefficients vertical = axis_coefficients(image.height, height, filter);
  const AxisCoefficients across = axis_coefficients(image.width, width, filter);
  // Pillow (>= 12) runs the vertical pass first when the height shrinks by more than twice what the width does;
  // the order changes the 8-bit rounding between the passes, so we follow it.
  const int height_drop = image.height - height, width_drop = image.width - width;
  const bool horizontal_first = !(height_drop > 0 && height_drop > width_drop * 2);
  RgbImage out{width, height, std::vector<std::uint8_t>(static_cast<std::size_t>(width) * height * 3)};
  if (horizontal_first) {
    // Only the source rows the vertical pass reads go through the horizontal pass.
    const int row_begin = vertical.first.front();
    const int row_end = vertical.first.back() + vertical.count.back();
    if (!need_vertical) {
      resample_rows(image.rgb.data(), image.width, 0, image.height, out.rgb.data(), width, across);
      return out;
    }
    const std::uint8_t* rows = image.rgb.data();
    int rows_offset = 0;
    std::vector<std::uint8_t> temp;
    if (need_horizontal) {
      temp.resize(static_cast<std::size_t>(row_end - row_begin) * width * 3);
      resample_rows(image.rgb.data(), image.width, row_begin, row_end, temp.data(), width, across);
      rows = temp.data();
      rows_offset = row_begin;
    }
    resample_columns(rows, width, rows_offset, out.rgb.data(), height, vertical);
    return out;
  }
  // Vertical first (need_vertical holds: the height shrinks).
  if (!need_horizontal) {
    resample_columns(image.rgb.data(), image.width, 0, out.rgb.data(), height, vertical);
    return out;
  }
  std::vector<std::uint8_t> temp(static_cast<std::size_t>(image.width) * height * 3);
  resample_columns(image.rgb.data(), image.width, 0, temp.data(), height, vertical);
  resample_rows(temp.data(), image.width, 0, height, out.rgb.data(), width, across);
  return out;
}

std::pair<int, int> resize_target(const ImageProcessorSpec& spec, int height, int width) {
  if (spec.shortest_edge == 0) return {spec.resize_height, spec.resize_width};
  const int short_side = std::min(height, width), long_side = std::max(height, width);
  const int new_short = spec.shortest_edge;
  const int new_long = static_cast<int>(static_cast<double>(new_short) * long_side / short_side);
  return width <= height ? std::pair{new_long, new_short} : std::pair{new_short, new_long};
}

RgbImage center_crop(const RgbImage& image, int height, int width) {
  auto floor_half = [](int n) { return n >= 0 ? n / 2 : -((-n + 1) / 2); };
  const int top = floor_half(image.height - height), left = floor_half(image.width - width);
  RgbImage out{width, height, std::vector<std::uint8_t>(static_cast<std::size_t>(width) * height * 3, 0)};
  for (int y = 0; y < height; ++y) {
    const int sy = top + y;
    if (sy < 0 || sy >= image.height) continue;
    for (int x = 0; x < width; ++x) {
      const int sx = left + x;
      if (sx < 0 || sx >= image.width) continue;
      std::memcpy(&out.rgb[(static_cast<std::size_t>(y) * width + x) * 3],
                  &image.rgb[(static_cast<std::size_t>(sy) * image.width + sx) * 3], 3);
    }
  }
  return out;
}

RgbImage resize_and_crop(const RgbImage& image, const ImageProcessorSpec& spec) {
  RgbImage out;
  const RgbImage* current = &image;
  if (spec.do_resize) {
    const auto [height, width] = resize_target(spec, image.height, image.width);
    out = resize_image(image, width, height, spec.resample);
    current = &out;
  }
  if (spec.do_center_crop) return center_crop(*current, spec.crop_height, spec.crop_width);
  return current == &out ? out : image;
}

void preprocess_image(const RgbImage& image, const ImageProcessorSpec& spec, float* out) {
  const RgbImage ready = resize_and_crop(image, spec);
  const auto [height, width] = spec.output_size();
  if (ready.height != height || ready.width != width)
    throw UsageError("preprocessed image is " + std::to_string(ready.width) + " x " + std::to_string(ready.height) +
                     ", expected " + std::to_string(width) + " x " + std::to_string(height));
  const std::size_t plane = static_cast<std::size_t>(height) * width;
  for (int c = 0; c < 3; ++c) {
    // Per channel: value = (pixel * rescale - mean) / std, in double then rounded once to float.
    const double scale = spec.do_rescale ? spec.rescale_factor : 1.0;
    const double mean = spec.do_normalize ? spec.image_mean[c] : 0.0;
    const double inv_std = spec.do_normalize ? 1.0 / spec.image_std[c] : 1.0;
    float* dst = out + c * plane;
    for (std::size_t i = 0; i < plane; ++i)
      dst[i] = static_cast<float>((ready.rgb[i * 3 + c] * scale - mean) * inv_std);
  }
}

}  // namespace trainer::data
