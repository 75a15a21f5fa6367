// The image-classification loader (see image_loader.h).
#include "data/image_loader.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string_view>

#include <nlohmann/json.hpp>

#include "data/jsonl.h"
#include "data/permutation.h"
#include "models/hf_config.h"
#include "models/image/image_model.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

constexpr uint64_t kImageEpochSalt = 0x51A3E7C0D94B2F61ull;

}  // namespace

ImageLoader::ImageLoader(std::shared_ptr<const data::ImageDataset> dataset, data::ImageProcessorSpec spec,
                         ImageLoaderOptions options)
    : dataset_(std::move(dataset)), spec_(std::move(spec)), options_(options) {
  cursor_.seed = options_.seed;
  stats_.bad_records_skipped = dataset_->bad_records_skipped;
}

std::optional<ImageBatch> ImageLoader::next() {
  const uint64_t size = dataset_->records.size();
  for (;;) {
    if (options_.epochs >= 0 && cursor_.epoch >= options_.epochs) return std::nullopt;
    if (size == 0) return std::nullopt;
    if (cursor_.position >= size) {
      ++cursor_.epoch;
      cursor_.position = 0;
      continue;
    }
    const data::Permutation order(size, data::mix_seed(cursor_.seed, kImageEpochSalt,
                                                       static_cast<uint64_t>(cursor_.epoch)));
    const uint64_t count = std::min<uint64_t>(static_cast<uint64_t>(options_.batch_size), size - cursor_.position);
    // This rank's records of the effective batch (all of them in one process). Augmentation is keyed by the record,
    // so a share is augmented as in one process.
    const auto [share_begin, share_count] = share_range(count);
    std::vector<std::size_t> indices;
    for (uint64_t k = cursor_.position + share_begin; k < cursor_.position + share_begin + share_count; ++k)
      indices.push_back(static_cast<std::size_t>(options_.shuffle ? order(k) : k));
    const data::ImageAugment augment{cursor_.seed, cursor_.epoch};
    auto decoded = data::decode_images(*dataset_, indices, spec_, options_.workers, options_.skip_bad,
                                       options_.augment ? &augment : nullptr);
    cursor_.position += count;
    const auto kept = static_cast<int64_t>(decoded.kept.size());
    int64_t first = 0, total = kept;
    if (options_.shard.world > 1) {
      const auto counts = options_.shard.gather_kept(kept);
      total = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        if (static_cast<int>(r) < options_.shard.rank) first += counts[r];
        total += counts[r];
      }
    }
    // Counts of the whole effective batch (every rank's); the problems named are this rank's.
    stats_.records_read += static_cast<int64_t>(count);
    stats_.examples += total;
    stats_.bad_records_skipped += static_cast<int64_t>(count) - total;
    for (auto& problem : decoded.problems)
      if (stats_.first_problems.size() < DataStats::kProblemsKept) stats_.first_problems.push_back(std::move(problem));
    if (total == 0) continue;
    ImageBatch batch;
    batch.first = first;
    batch.total = total;
    const auto [height, width] = spec_.output_size();
    batch.height = height;
    batch.width = width;
    batch.epoch = cursor_.epoch;
    batch.pixels = std::move(decoded.pixels);
    batch.labels = std::move(decoded.labels);
    for (const std::size_t k : decoded.kept) batch.records.push_back(indices[k]);
    return batch;
  }
}

std::pair<uint64_t, uint64_t> ImageLoader::share_range(uint64_t count) const {
  const auto world = static_cast<uint64_t>(std::max(1, options_.shard.world));
  const auto rank = static_cast<uint64_t>(options_.shard.rank);
  const uint64_t base = count / world, extra = count % world;
  auto begin_of = [&](uint64_t r) { return r * base + std::min(r, extra); };
  return {begin_of(rank), begin_of(rank + 1) - begin_of(rank)};
}

nlohmann::json image_data_fingerprint(const data::ImageDataset& dataset) {
  uint64_t hash = 14695981039346656037ull;
  const auto mix = [&hash](std::string_view bytes) {
    for (const unsigned char c : bytes) hash = (hash ^ c) * 1099511628211ull;
    hash = (hash ^ 0xffu) * 1099511628211ull;  // a separator, so ("ab", "c") and ("a", "bc") differ
  };
  for (const auto& record : dataset.records) {
    if (!record.bytes.empty()) {  // a table's image: where it is, and its size
      mix(record.origin);
      mix(std::to_string(record.label));
      mix(std::to_string(record.bytes.size()));
      continue;
    }
    std::error_code error;
    const auto size = fs::file_size(record.path, error);
    mix(fs::absolute(record.path).lexically_normal().string());
    mix(std::to_string(record.label));
    mix(error ? "?" : std::to_string(size));
  }
  for (const auto& caption : dataset.captions) mix(caption);  // image-caption pairs: the captions too
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return {{"classes", dataset.classes}, {"records", dataset.records.size()}, {"fnv1a64", hex}};
}

std::shared_ptr<const data::ImageDataset> open_training_images(const Config& config,
                                                               const std::vector<std::string>& classes) {
  return std::make_shared<const data::ImageDataset>(data::open_image_dataset(
      data::expand_globs(config.data.train_files, "data.train_files"), classes, config.data.on_bad_record == BadRecordPolicy::kSkip));
}

std::unique_ptr<ImageLoader> make_image_train_loader(const Config& config,
                                                     std::shared_ptr<const data::ImageDataset> dataset,
                                                     const data::ImageProcessorSpec& spec, ImageShard shard) {
  ImageLoaderOptions options;
  options.batch_size = config.training.batch_size;
  options.shuffle = config.data.shuffle;
  options.epochs = config.training.max_steps > 0 ? -1 : config.training.epochs;
  options.workers = static_cast<int>(std::max<int64_t>(1, config.data.num_workers));
  options.seed = static_cast<uint64_t>(config.training.seed);
  options.skip_bad = config.data.on_bad_record == BadRecordPolicy::kSkip;
  options.augment = config.data.augment;
  options.shard = std::move(shard);
  return std::make_unique<ImageLoader>(std::move(dataset), spec, options);
}

std::unique_ptr<ImageLoader> make_image_validation_loader(const Config& config, const std::vector<std::string>& classes,
                                                          const data::ImageProcessorSpec& spec, int64_t batch_size,
                                                          ImageShard shard) {
  if (config.data.validation_files.empty()) return nullptr;
  const bool skip = config.data.on_bad_record == BadRecordPolicy::kSkip;
  auto dataset = std::make_shared<const data::ImageDataset>(
      data::open_image_dataset(data::expand_globs(config.data.validation_files, "data.validation_files"), classes, skip));
  ImageLoaderOptions options;
  options.batch_size = batch_size;
  options.workers = static_cast<int>(std::max<int64_t>(1, config.data.num_workers));
  options.skip_bad = skip;
  options.shard = std::move(shard);
  return std::make_unique<ImageLoader>(std::move(dataset), spec, options);
}

std::unique_ptr<ImageLoader> make_caption_loader(const Config& config,
                                                 std::shared_ptr<const data::ImageDataset> dataset,
                                                 const data::ImageProcessorSpec& spec, bool training,
                                                 int64_t batch_size, ImageShard shard) {
  ImageLoaderOptions options;
  options.batch_size = batch_size;
  options.workers = static_cast<int>(std::max<int64_t>(1, config.data.num_workers));
  options.skip_bad = config.data.on_bad_record == BadRecordPolicy::kSkip;
  options.shard = std::move(shard);
  if (training) {
    options.shuffle = config.data.shuffle;
    options.epochs = config.training.max_steps > 0 ? -1 : config.training.epochs;
    options.seed = static_cast<uint64_t>(config.training.seed);
    options.augment = config.data.augment;
  }
  return std::make_unique<ImageLoader>(std::move(dataset), spec, options);
}

data::ImageProcessorSpec image_processor_for(const std::string& dir, const ImageClassifier& model) {
  return image_processor_for(dir, model.image_processor_type(), model.image_size());
}

data::ImageProcessorSpec image_processor_for(const std::string& dir, const std::string& processor_type,
                                             int64_t image_size) {
  auto spec = data::read_image_processor(dir, processor_type);
  if (!std::filesystem::exists(std::filesystem::path(dir) / "preprocessor_config.json")) {
    const auto size = static_cast<int>(image_size);
    if (spec.shortest_edge > 0) {
      spec.shortest_edge = spec.crop_height = spec.crop_width = size;
    } else {
      spec.resize_height = spec.resize_width = size;
    }
  }
  return spec;
}

data::ImageProcessorSpec image_processor_for(const std::string& dir) {
  const nlohmann::json config = read_json_file((std::filesystem::path(dir) / "config.json").string());
  const std::string type = hf::get_string(config, "model_type", "");
  if (type == "clip" || type == "clip_vision_model") {
    const nlohmann::json vision = type == "clip" ? config.value("vision_config", nlohmann::json::object()) : config;
    return image_processor_for(dir, "CLIPImageProcessor", hf::get_int(vision, "image_size", 224));
  }
  return image_processor_for(dir, "ViTImageProcessor", hf::get_int(config, "image_size", 224));
}

}  // namespace trainer
