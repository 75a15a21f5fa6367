// The image-classification loader: the training (or validation) records in a seeded order per epoch, grouped into
// effective batches of training.batch_size images, decoded and preprocessed (augmented for training with
// data.augment) on data.num_workers threads. Its position is the same LoaderCursor the text loader has, so a
// resume continues with the next unseen image and the same augmentation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/image_dataset.h"
#include "data/image_preprocess.h"
#include "trainer/config.h"
#include "trainer/data.h"

namespace trainer {

class ImageClassifier;

// One effective batch of images: kept.size() x 3 x H x W float32 pixels (channel-first), a label per image, and
// per image its index in the epoch's order (what its dropout masks and augmentation are keyed by does not change
// with the split).
struct ImageBatch {
  std::vector<float> pixels;
  std::vector<int64_t> labels;
  std::vector<std::size_t> records;  // each image's record in the dataset (an image-caption pair's caption)
  int64_t height = 0, width = 0;
  int64_t epoch = 0;
  // Data parallelism: this batch is one rank's share of the effective batch; `first` is its first image's index in
  // the effective batch's decoded images, `total` their number on all ranks (one process: 0 and size()).
  int64_t first = 0;
  int64_t total = 0;
  int64_t size() const { return static_cast<int64_t>(labels.size()); }
};

// Data parallelism: the loader decodes only this rank's share of each effective batch (equal record counts, the
// first ranks taking one more when it does not divide: distributed::share_of's split), and learns from
// `gather_kept` how many images every rank kept (a collective: every rank calls it once per effective batch, with
// its own count, and gets all counts in rank order), so images are numbered as in one process and an effective
// batch no rank kept an image of is passed over by all. world 1: the whole batch.
struct ImageShard {
  int rank = 0;
  int world = 1;
  std::function<std::vector<int64_t>(int64_t kept)> gather_kept;
};

struct ImageLoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;
  int64_t epochs = 1;  // < 0: without end
  int workers = 0;
  uint64_t seed = 0;
  bool skip_bad = false;
  bool augment = false;
  ImageShard shard;  // data parallelism: this rank's share of each effective batch
};

class ImageLoader {
 public:
  ImageLoader(std::shared_ptr<const data::ImageDataset> dataset, data::ImageProcessorSpec spec,
              ImageLoaderOptions options);
  // The next effective batch (images that fail to decode are counted and left out with skip_bad); nothing when
  // the configured epochs are done.
  std::optional<ImageBatch> next();
  LoaderCursor cursor() const { return cursor_; }
  void restore(const LoaderCursor& cursor) { cursor_ = cursor; }
  DataStats stats() const { return stats_; }
  uint64_t examples_per_epoch() const { return dataset_->records.size(); }
  const data::ImageDataset& dataset() const { return *dataset_; }

 private:
  // This rank's records [begin, begin + count) of an effective batch of `count` records.
  std::pair<uint64_t, uint64_t> share_range(uint64_t count) const;

  std::shared_ptr<const data::ImageDataset> dataset_;
  data::ImageProcessorSpec spec_;
  ImageLoaderOptions options_;
  LoaderCursor cursor_;
  DataStats stats_;
};

// The image data a run trains on, stored as train_state.json's "data_fingerprint": the classes, the number of
// records and one FNV-1a hash over every record's path, label and file size (and caption, for image-caption pairs).
// A resume compares it, so other data (which would replay another epoch order under the same cursor) is refused.
nlohmann::json image_data_fingerprint(const data::ImageDataset& dataset);

// Training and validation images of the config (data.train_files / validation_files: image folders or JSONL
// listings). The classes come from `classes` (a pretrained classifier's labels) or from the training data.
std::shared_ptr<const data::ImageDataset> open_training_images(const Config& config,
                                                               const std::vector<std::string>& classes);
std::unique_ptr<ImageLoader> make_image_train_loader(const Config& config,
                                                     std::shared_ptr<const data::ImageDataset> dataset,
                                                     const data::ImageProcessorSpec& spec, ImageShard shard = {});
// One pass in file order, no augmentation; nothing when data.validation_files is empty.
std::unique_ptr<ImageLoader> make_image_validation_loader(const Config& config, const std::vector<std::string>& classes,
                                                          const data::ImageProcessorSpec& spec, int64_t batch_size,
                                                          ImageShard shard = {});
// Image-caption pairs (training.objective=contrastive): training (`training`: shuffled, augmented with data.augment,
// training.epochs or without end for training.max_steps) or one validation pass, in batches of `batch_size`. With
// data parallelism (`shard`), each rank decodes only its share of each effective batch (the captions of
// ImageBatch::records are tokenized by the run, so the same share).
std::unique_ptr<ImageLoader> make_caption_loader(const Config& config,
                                                 std::shared_ptr<const data::ImageDataset> dataset,
                                                 const data::ImageProcessorSpec& spec, bool training,
                                                 int64_t batch_size, ImageShard shard = {});

// The preprocessing of a model directory: its preprocessor_config.json, else the model's processor defaults
// (image_processor_type()) at the model's own image size, not 224: ViT resizes to it, CLIP resizes the short side to
// it and crops the centre square.
data::ImageProcessorSpec image_processor_for(const std::string& dir, const ImageClassifier& model);
// The same from dir/config.json alone, without building the model (`trainer data`).
data::ImageProcessorSpec image_processor_for(const std::string& dir);
// The same for any image model: `processor_type`'s defaults (e.g. "CLIPImageProcessor") at `image_size`.
data::ImageProcessorSpec image_processor_for(const std::string& dir, const std::string& processor_type,
                                             int64_t image_size);

}  // namespace trainer
