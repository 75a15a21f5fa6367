// Image-classification datasets: folders and JSONL listings, and threaded decoding (see image_dataset.h).
#include "data/image_dataset.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "data/image.h"
#include "data/permutation.h"
#include "data/table_file.h"
#include "trainer/errors.h"

namespace trainer::data {
namespace fs = std::filesystem;
namespace {

constexpr const char* kSkipHint = "fix or remove the record, or set data.on_bad_record = \"skip\" to count and skip "
                                  "bad records";

bool has_image_extension(const fs::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".webp";
}

std::vector<std::string> sorted_subfolders(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder))
    if (entry.is_directory()) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void read_folder(const std::string& folder, std::vector<std::string>& classes, bool fixed_classes, bool skip_bad,
                 ImageDataset& out) {
  const std::vector<std::string> folders = sorted_subfolders(folder);
  if (folders.empty())
    throw DataError(folder + ": an image folder needs one subfolder per class, and this one has none",
                    "put the images of each class in FOLDER/<class name>/, or list them in a JSONL file");
  if (!fixed_classes && classes.empty()) classes = folders;
  for (const auto& name : folders) {
    const auto it = std::find(classes.begin(), classes.end(), name);
    const fs::path class_dir = fs::path(folder) / name;
    if (it == classes.end()) {
      if (!skip_bad)
        throw DataError(class_dir.string() + ": class \"" + name + "\" is not one of the " +
                            std::to_string(classes.size()) + " training classes",
                        "give the validation folder the training folder's class subfolders, or set "
                        "data.on_bad_record = \"skip\"");
      ++out.bad_records_skipped;
      continue;
    }
    const auto label = static_cast<std::int64_t>(it - classes.begin());
    std::vector<std::string> files;
    for (const auto& entry : fs::recursive_directory_iterator(class_dir, fs::directory_options::follow_directory_symlink)) {
      if (!entry.is_regular_file()) continue;
      if (has_image_extension(entry.path())) {
        files.push_back(entry.path().string());
      } else {
        ++out.other_files;
      }
    }
    std::sort(files.begin(), files.end());
    for (auto& file : files) out.records.push_back({file, label, file});
  }
}

// One JSONL record's image path and label (a class name or a number), or the problem with it.
struct JsonlItem {
  std::string image, origin, problem;
  std::optional<std::string> name;
  std::optional<std::int64_t> id;
  std::string bytes;  // a table's encoded image
};

std::vector<JsonlItem> read_jsonl(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw DataError(file + ": cannot open (" + std::string(std::strerror(errno)) + ")",
                           "check the path in data.train_files / data.validation_files");
  const fs::path base = fs::path(file).parent_path();
  std::vector<JsonlItem> items;
  std::string line;
  for (std::int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    JsonlItem item;
    item.origin = file + ":" + std::to_string(number);
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      item.problem = "invalid JSON";
      items.push_back(std::move(item));
      continue;
    }
    if (!record.is_object() || !record.contains("image") || !record["image"].is_string() ||
        record["image"].get<std::string>().empty()) {
      item.problem = "needs \"image\": a path (relative to the JSONL file)";
    } else if (!record.contains("label") || !(record["label"].is_string() || record["label"].is_number_integer())) {
      item.problem = "needs \"label\": a class name or a class number";
    } else {
      const fs::path image = record["image"].get<std::string>();
      item.image = (image.is_absolute() ? image : base / image).lexically_normal().string();
      if (record["label"].is_string()) {
        item.name = record["label"].get<std::string>();
      } else {
        item.id = record["label"].get<std::int64_t>();
      }
    }
    items.push_back(std::move(item));
  }
  return items;
}

// A table's path column: relative paths are taken from the table's folder, as a JSONL file's.
std::string table_image_path(const std::string& table, const std::string& image) {
  const fs::path path = image;
  return (path.is_absolute() ? path : fs::path(table).parent_path() / path).lexically_normal().string();
}

}  // namespace

bool is_image_folder(const std::string& source) {
  if (!fs::is_directory(source)) return false;
  const fs::path dir = source;
  return !fs::exists(dir / "dataset_dict.json") && !fs::exists(dir / "state.json") &&
         !fs::exists(dir / "dataset_info.json");
}

ImageDataset open_image_dataset(const std::vector<std::string>& sources, const std::vector<std::string>& classes,
                                bool skip_bad) {
  ImageDataset out;
  out.classes = classes;
  const bool fixed = !classes.empty();
  std::vector<JsonlItem> items;
  std::vector<std::string> declared;  // a table's ClassLabel names
  for (const auto& source : sources) {
    if (is_image_folder(source)) {
      read_folder(source, out.classes, fixed, skip_bad, out);
    } else if (fs::is_directory(source)) {
      throw DataError(source + ": a folder datasets wrote, not an image folder",
                      "list its data files: data.train_files = [\"" + source + "\"] through trainer, which reads "
                      "its .arrow files (DIR, or DIR:SPLIT for a DatasetDict)");
    } else if (is_table_path(source)) {
      auto table = read_table_images(source, /*label=*/true, /*caption=*/false);
      if (!table.label_names.empty()) {
        if (!declared.empty() && declared != table.label_names)
          throw DataError(source + ": its ClassLabel names differ from those of the tables before it",
                          "give every file the same label feature");
        declared = table.label_names;
      }
      for (auto& row : table.rows) {
        JsonlItem item;
        item.origin = std::move(row.origin);
        item.problem = std::move(row.problem);
        item.bytes = std::move(row.bytes);
        if (!row.path.empty()) item.image = table_image_path(source, row.path);
        if (item.bytes.size() && item.image.empty()) item.image = item.origin;  // named in messages
        item.name = std::move(row.label_name);
        item.id = row.label_id;
        items.push_back(std::move(item));
      }
    } else {
      auto more = read_jsonl(source);
      items.insert(items.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
  }
  if (items.empty()) return out;
  // Without a class list, JSONL classes are its label names sorted, or the numbers 0..max.
  if (out.classes.empty() && !declared.empty()) out.classes = declared;  // the ClassLabel's order, as datasets
  if (out.classes.empty()) {
    std::vector<std::string> names;
    std::int64_t max_id = -1;
    for (const auto& item : items) {
      if (item.name) names.push_back(*item.name);
      if (item.id) max_id = std::max(max_id, *item.id);
    }
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    if (!names.empty() && max_id >= 0)
      throw DataError(sources.front() + ": labels mix class names and class numbers, so the numbers mean nothing",
                      "use names (or numbers) throughout, or give the classes (a model with id2label)");
    if (!names.empty()) {
      out.classes = names;
    } else {
      for (std::int64_t i = 0; i <= max_id; ++i) out.classes.push_back(std::to_string(i));
    }
  }
  std::map<std::string, std::int64_t> ids;
  for (std::size_t i = 0; i < out.classes.size(); ++i) ids[out.classes[i]] = static_cast<std::int64_t>(i);
  const auto count = static_cast<std::int64_t>(out.classes.size());
  for (auto& item : items) {
    std::int64_t label = -1;
    if (item.problem.empty() && item.name) {
      const auto it = ids.find(*item.name);
      if (it == ids.end()) {
        item.problem = "label \"" + *item.name + "\" is not one of the " + std::to_string(count) + " classes";
      } else {
        label = it->second;
      }
    } else if (item.problem.empty() && item.id) {
      if (*item.id < 0 || *item.id >= count) {
        item.problem = "label " + std::to_string(*item.id) + " is outside the classes 0.." + std::to_string(count - 1);
      } else {
        label = *item.id;
      }
    }
    if (!item.problem.empty()) {
      if (!skip_bad) throw DataError(item.origin + ": " + item.problem, kSkipHint);
      ++out.bad_records_skipped;
      continue;
    }
    out.records.push_back({std::move(item.image), label, std::move(item.origin), std::move(item.bytes)});
  }
  return out;
}

ImageDataset open_caption_dataset(const std::vector<std::string>& sources, const std::vector<std::string>& classes,
                                  bool skip_bad) {
  struct Item {
    std::string image, caption, origin, problem, bytes;
    std::optional<std::string> label;
  };
  std::vector<Item> items;
  for (const auto& source : sources) {
    if (is_image_folder(source))
      throw DataError(source + ": an image folder has no captions; training.objective=contrastive reads JSONL files "
                               "of {\"image\": \"path\", \"caption\": \"...\"}, or Parquet / Arrow tables of "
                               "image and caption columns",
                      "list the image-caption pairs in a JSONL file (scripts/make_demo_images.py writes one)");
    if (is_table_path(source)) {
      auto table = read_table_images(source, /*label=*/false, /*caption=*/true);
      for (auto& row : table.rows) {
        Item item;
        item.origin = std::move(row.origin);
        item.problem = std::move(row.problem);
        item.bytes = std::move(row.bytes);
        item.image = row.path.empty() ? item.origin : table_image_path(source, row.path);
        if (row.caption) item.caption = std::move(*row.caption);
        item.label = std::move(row.label_name);
        if (!item.label && row.label_id && item.problem.empty())
          item.problem = "column \"label\": " + std::to_string(*row.label_id) +
                         " is a class number without names (a ClassLabel feature, or class names, give them)";
        items.push_back(std::move(item));
      }
      continue;
    }
    std::ifstream in(source);
    if (!in) throw DataError(source + ": cannot open (" + std::string(std::strerror(errno)) + ")",
                             "check the path in data.train_files / data.validation_files");
    const fs::path base = fs::path(source).parent_path();
    std::string line;
    for (std::int64_t number = 1; std::getline(in, line); ++number) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      Item item;
      item.origin = source + ":" + std::to_string(number);
      nlohmann::json record;
      try {
        record = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception&) {
        item.problem = "invalid JSON";
        items.push_back(std::move(item));
        continue;
      }
      if (!record.is_object() || !record.contains("image") || !record["image"].is_string() ||
          record["image"].get<std::string>().empty()) {
        item.problem = "needs \"image\": a path (relative to the JSONL file)";
      } else if (!record.contains("caption") || !record["caption"].is_string() ||
                 record["caption"].get<std::string>().find_first_not_of(" \t\r\n") == std::string::npos) {
        item.problem = "needs \"caption\": the text that describes the image (a non-empty string)";
      } else if (record.contains("label") && !record["label"].is_string()) {
        item.problem = "\"label\" must be a class name (a string), got " + record["label"].dump();
      } else {
        const fs::path image = record["image"].get<std::string>();
        item.image = (image.is_absolute() ? image : base / image).lexically_normal().string();
        item.caption = record["caption"].get<std::string>();
        if (record.contains("label")) item.label = record["label"].get<std::string>();
      }
      items.push_back(std::move(item));
    }
  }
  ImageDataset out;
  out.classes = classes;
  if (out.classes.empty()) {
    for (const auto& item : items)
      if (item.label) out.classes.push_back(*item.label);
    std::sort(out.classes.begin(), out.classes.end());
    out.classes.erase(std::unique(out.classes.begin(), out.classes.end()), out.classes.end());
  }
  for (auto& item : items) {
    std::int64_t label = -1;
    if (item.problem.empty() && item.label) {
      const auto it = std::find(out.classes.begin(), out.classes.end(), *item.label);
      if (it == out.classes.end()) {
        item.problem = "label \"" + *item.label + "\" is not one of the " + std::to_string(out.classes.size()) +
                       " classes";
      } else {
        label = static_cast<std::int64_t>(it - out.classes.begin());
      }
    }
    if (!item.problem.empty()) {
      if (!skip_bad) throw DataError(item.origin + ": " + item.problem, kSkipHint);
      ++out.bad_records_skipped;
      continue;
    }
    out.records.push_back({std::move(item.image), label, std::move(item.origin), std::move(item.bytes)});
    out.captions.push_back(std::move(item.caption));
  }
  return out;
}

namespace {

// Uniform in [0, 1) from the top 53 bits of a counter-based draw.
double uniform01(std::uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

}  // namespace

AugmentDraw draw_augment(const ImageAugment& augment, std::size_t index, int image_width, int image_height) {
  constexpr std::uint64_t kAugmentSalt = 0xA0C5E11D2B7F4A93ull;
  const std::uint64_t key = mix_seed(augment.seed ^ kAugmentSalt, static_cast<std::uint64_t>(augment.epoch), index);
  std::uint64_t counter = 0;
  auto next = [&] { return mix64(key + 0x9E3779B97F4A7C15ull * ++counter); };
  AugmentDraw draw;
  const double area = static_cast<double>(image_width) * image_height;
  const double log_low = std::log(3.0 / 4.0), log_high = std::log(4.0 / 3.0);
  bool found = false;
  for (int attempt = 0; attempt < 10 && !found; ++attempt) {
    const double target = area * (0.08 + (1.0 - 0.08) * uniform01(next()));
    const double ratio = std::exp(log_low + (log_high - log_low) * uniform01(next()));
    const int w = static_cast<int>(std::lround(std::sqrt(target * ratio)));
    const int h = static_cast<int>(std::lround(std::sqrt(target / ratio)));
    if (w > 0 && h > 0 && w <= image_width && h <= image_height) {
      draw.width = w;
      draw.height = h;
      draw.top = static_cast<int>(next() % static_cast<std::uint64_t>(image_height - h + 1));
      draw.left = static_cast<int>(next() % static_cast<std::uint64_t>(image_width - w + 1));
      found = true;
    }
  }
  if (!found) {  // torchvision's fallback: the whole image, cut to the nearest allowed aspect ratio, centred
    const double in_ratio = static_cast<double>(image_width) / image_height;
    draw.width = image_width;
    draw.height = image_height;
    if (in_ratio < 3.0 / 4.0) draw.height = static_cast<int>(std::lround(image_width / (3.0 / 4.0)));
    else if (in_ratio > 4.0 / 3.0) draw.width = static_cast<int>(std::lround(image_height * (4.0 / 3.0)));
    draw.width = std::clamp(draw.width, 1, image_width);
    draw.height = std::clamp(draw.height, 1, image_height);
    draw.top = (image_height - draw.height) / 2;
    draw.left = (image_width - draw.width) / 2;
  }
  draw.flip = (next() >> 63) != 0;
  return draw;
}

void augment_image(const RgbImage& image, const ImageProcessorSpec& spec, const AugmentDraw& draw, float* out) {
  RgbImage crop;
  crop.width = draw.width;
  crop.height = draw.height;
  crop.rgb.resize(static_cast<std::size_t>(draw.width) * draw.height * 3);
  for (int y = 0; y < draw.height; ++y)
    for (int x = 0; x < draw.width; ++x) {
      const int sx = draw.flip ? draw.left + draw.width - 1 - x : draw.left + x;
      const std::uint8_t* src = &image.rgb[(static_cast<std::size_t>(draw.top + y) * image.width + sx) * 3];
      std::uint8_t* dst = &crop.rgb[(static_cast<std::size_t>(y) * draw.width + x) * 3];
      dst[0] = src[0];
      dst[1] = src[1];
      dst[2] = src[2];
    }
  // The crop is resized straight to the output size (no second crop), then rescaled and normalised as usual.
  ImageProcessorSpec direct = spec;
  const auto [height, width] = spec.output_size();
  direct.do_resize = true;
  direct.shortest_edge = 0;
  direct.resize_height = height;
  direct.resize_width = width;
  direct.do_center_crop = false;
  preprocess_image(crop, direct, out);
}

DecodedImages decode_images(const ImageDataset& dataset, const std::vector<std::size_t>& indices,
                            const ImageProcessorSpec& spec, int threads, bool skip_bad, const ImageAugment* augment) {
  const auto [height, width] = spec.output_size();
  const std::size_t plane = static_cast<std::size_t>(3) * height * width;
  std::vector<float> pixels(indices.size() * plane);
  std::vector<std::string> problems(indices.size());
  std::vector<std::exception_ptr> errors(indices.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next++; i < indices.size(); i = next++) {
      const ImageRecord& record = dataset.records.at(indices[i]);
      try {
        const RgbImage image =
            record.bytes.empty()
                ? load_image_file(record.path)
                : decode_image({reinterpret_cast<const std::uint8_t*>(record.bytes.data()), record.bytes.size()},
                               record.origin + ", column \"image\"");
        if (augment)
          augment_image(image, spec, draw_augment(*augment, indices[i], image.width, image.height),
                        pixels.data() + i * plane);
        else
          preprocess_image(image, spec, pixels.data() + i * plane);
      } catch (const DataError& e) {
        problems[i] = e.what();
        errors[i] = std::current_exception();
      } catch (...) {  // anything else (bad_alloc, ...) is carried to the calling thread and rethrown there
        errors[i] = std::current_exception();
      }
    }
  };
  const int count = std::max(1, std::min<int>(threads, static_cast<int>(indices.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < count; ++t) pool.emplace_back(work);
  work();
  for (auto& thread : pool) thread.join();

  DecodedImages out;
  for (std::size_t i = 0; i < indices.size(); ++i) {
    if (errors[i]) {
      if (!skip_bad || problems[i].empty()) std::rethrow_exception(errors[i]);  // non-data errors always stop
      out.problems.push_back(problems[i]);
      continue;
    }
    out.kept.push_back(i);
    out.labels.push_back(dataset.records[indices[i]].label);
  }
  if (out.kept.size() == indices.size()) {
    out.pixels = std::move(pixels);
  } else {
    out.pixels.reserve(out.kept.size() * plane);
    for (std::size_t i : out.kept)
      out.pixels.insert(out.pixels.end(), pixels.begin() + static_cast<std::ptrdiff_t>(i * plane),
                        pixels.begin() + static_cast<std::ptrdiff_t>((i + 1) * plane));
  }
  return out;
}

}  // namespace trainer::data
