// The image-classification loader (see image_loader.h).
#include "data/image_loader.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string_view>

#include <nlohmann/json.hpp>

#include "data/permutation.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

constexpr uint64_t kImageEpochSalt = 0x51A3E7C0D94B2F61ull;
constexpr std::size_t kProblemsKept = 10;

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
    std::vector<std::size_t> indices;
    for (uint64_t k = cursor_.position; k < cursor_.position + count; ++k)
      indices.push_back(static_cast<std::size_t>(options_.shuffle ? order(k) : k));
    const data::ImageAugment augment{cursor_.seed, cursor_.epoch};
    auto decoded = data::decode_images(*dataset_, indices, spec_, options_.workers, options_.skip_bad,
                                       options_.augment ? &augment : nullptr);
    cursor_.position += count;
    stats_.records_read += static_cast<int64_t>(count);
    stats_.examples += static_cast<int64_t>(decoded.kept.size());
    stats_.bad_records_skipped += static_cast<int64_t>(decoded.problems.size());
    for (auto& problem : decoded.problems)
      if (stats_.first_problems.size() < kProblemsKept) stats_.first_problems.push_back(std::move(problem));
    if (decoded.kept.empty()) continue;
    ImageBatch batch;
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

nlohmann::json image_data_fingerprint(const data::ImageDataset& dataset) {
  uint64_t hash = 14695981039346656037ull;
  const auto mix = [&hash](std::string_view bytes) {
    for (const unsigned char c : bytes) hash = (hash ^ c) * 1099511628211ull;
    hash = (hash ^ 0xffu) * 1099511628211ull;  // a separator, so ("ab", "c") and ("a", "bc") differ
  };
  for (const auto& record : dataset.records) {
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
      config.data.train_files, classes, config.data.on_bad_record == BadRecordPolicy::kSkip));
}

std::unique_ptr<ImageLoader> make_image_train_loader(const Config& config,
                                                     std::shared_ptr<const data::ImageDataset> dataset,
                                                     const data::ImageProcessorSpec& spec) {
  ImageLoaderOptions options;
  options.batch_size = config.training.batch_size;
  options.shuffle = config.data.shuffle;
  options.epochs = config.training.max_steps > 0 ? -1 : config.training.epochs;
  options.workers = static_cast<int>(std::max<int64_t>(1, config.data.num_workers));
  options.seed = static_cast<uint64_t>(config.training.seed);
  options.skip_bad = config.data.on_bad_record == BadRecordPolicy::kSkip;
  options.augment = config.data.augment;
  return std::make_unique<ImageLoader>(std::move(dataset), spec, options);
}

std::unique_ptr<ImageLoader> make_image_validation_loader(const Config& config, const std::vector<std::string>& classes,
                                                          const data::ImageProcessorSpec& spec, int64_t batch_size) {
  if (config.data.validation_files.empty()) return nullptr;
  const bool skip = config.data.on_bad_record == BadRecordPolicy::kSkip;
  auto dataset = std::make_shared<const data::ImageDataset>(
      data::open_image_dataset(config.data.validation_files, classes, skip));
  ImageLoaderOptions options;
  options.batch_size = batch_size;
  options.workers = static_cast<int>(std::max<int64_t>(1, config.data.num_workers));
  options.skip_bad = skip;
  return std::make_unique<ImageLoader>(std::move(dataset), spec, options);
}

}  // namespace trainer
