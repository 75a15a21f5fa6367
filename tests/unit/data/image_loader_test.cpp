// The image loader: seeded augmentation keyed by (seed, epoch, index), the cursor (a restored loader gives the
// same batches, augmentation included), and skip counting.
#include <filesystem>

#include <gtest/gtest.h>

#include "data/image_loader.h"
#include "support/paths.h"

namespace trainer {
namespace {

data::ImageProcessorSpec tiny_spec() {
  data::ImageProcessorSpec spec;
  spec.resize_height = spec.resize_width = 32;
  return spec;
}

ImageLoaderOptions options(bool augment) {
  ImageLoaderOptions o;
  o.batch_size = 7;
  o.shuffle = true;
  o.epochs = 3;
  o.workers = 2;
  o.seed = 5;
  o.augment = augment;
  return o;
}

std::shared_ptr<const data::ImageDataset> demo() {
  return std::make_shared<const data::ImageDataset>(
      data::open_image_dataset({test::source_path("data/demo/images/validation")}, {}, false));
}

}  // namespace

TEST(ImageAugment, DrawsDependOnSeedEpochAndIndexOnlyAndStayInside) {
  const data::ImageAugment a{1, 0}, b{1, 1};
  int flips = 0, full = 0;
  for (std::size_t index = 0; index < 200; ++index) {
    const auto d = data::draw_augment(a, index, 97, 61);
    const auto again = data::draw_augment(a, index, 97, 61);
    EXPECT_EQ(d.left, again.left);
    EXPECT_EQ(d.top, again.top);
    EXPECT_EQ(d.width, again.width);
    EXPECT_EQ(d.flip, again.flip);
    EXPECT_GE(d.left, 0);
    EXPECT_GE(d.top, 0);
    EXPECT_LE(d.left + d.width, 97);
    EXPECT_LE(d.top + d.height, 61);
    EXPECT_GT(d.width, 0);
    EXPECT_GT(d.height, 0);
    flips += d.flip;
    full += d.width == 97 && d.height == 61;
    const auto other = data::draw_augment(b, index, 97, 61);
    if (other.left == d.left && other.top == d.top && other.width == d.width && other.flip == d.flip) ++full;
  }
  EXPECT_GT(flips, 60);  // about half
  EXPECT_LT(flips, 140);
  EXPECT_LT(full, 20);   // crops vary, and vary by epoch
}

TEST(ImageLoader, RestoredCursorGivesTheSameAugmentedBatches) {
  const auto dataset = demo();
  ImageLoader straight(dataset, tiny_spec(), options(true));
  std::vector<ImageBatch> all;
  std::optional<LoaderCursor> after_three;
  while (auto batch = straight.next()) {
    all.push_back(std::move(*batch));
    if (all.size() == 3) after_three = straight.cursor();
  }
  const std::size_t per_epoch = (dataset->records.size() + 6) / 7;
  ASSERT_EQ(all.size(), 3 * per_epoch);
  EXPECT_EQ(straight.stats().examples, static_cast<int64_t>(3 * dataset->records.size()));
  // Epochs differ (shuffle and augmentation), batches have the model's size.
  EXPECT_NE(all[0].pixels, all[per_epoch].pixels);
  EXPECT_EQ(all[0].pixels.size(), 7u * 3 * 32 * 32);
  ImageLoader resumed(dataset, tiny_spec(), options(true));
  resumed.restore(*after_three);
  for (std::size_t i = 3; i < all.size(); ++i) {
    auto batch = resumed.next();
    ASSERT_TRUE(batch);
    EXPECT_EQ(batch->labels, all[i].labels) << i;
    EXPECT_EQ(batch->pixels, all[i].pixels) << i;
  }
  EXPECT_FALSE(resumed.next());
}

TEST(ImageLoader, WithoutAugmentationPixelsAreThePreprocessedImages) {
  const auto dataset = demo();
  auto o = options(false);
  o.shuffle = false;
  ImageLoader loader(dataset, tiny_spec(), o);
  const auto batch = loader.next();
  ASSERT_TRUE(batch);
  const auto direct = data::decode_images(*dataset, {0, 1, 2, 3, 4, 5, 6}, tiny_spec(), 1, false);
  EXPECT_EQ(batch->pixels, direct.pixels);
  EXPECT_EQ(batch->labels, direct.labels);
}

}  // namespace trainer

namespace trainer {

// Data parallelism: two ranks' loaders (batches of 7: shares of 4 and 3) decode disjoint shares whose concatenation is
// one process's batch, augmented pixels, labels and records alike, numbered (first, total) as in one process; the
// counts go through `gather_kept` (here every rank kept its whole share, as the other rank would report).
TEST(ImageLoader, RankSharesConcatenateToTheSingleProcessBatch) {
  const auto dataset = demo();
  ImageLoader whole(dataset, tiny_spec(), options(true));
  std::vector<std::unique_ptr<ImageLoader>> ranks;
  int calls = 0;
  for (int r = 0; r < 2; ++r) {
    auto o = options(true);
    o.shard = {r, 2, [&calls](int64_t) {
                 ++calls;
                 return std::vector<int64_t>{4, 3};
               }};
    ranks.push_back(std::make_unique<ImageLoader>(dataset, tiny_spec(), o));
  }
  for (int step = 0; step < 8; ++step) {
    auto one = whole.next();
    auto a = ranks[0]->next(), b = ranks[1]->next();
    ASSERT_TRUE(one && a && b);
    if (one->size() < 7) break;  // an epoch's short last batch would have other shares than {4, 3}
    EXPECT_EQ(a->size(), 4);
    EXPECT_EQ(b->size(), 3);
    EXPECT_EQ(a->first, 0);
    EXPECT_EQ(b->first, 4);
    EXPECT_EQ(a->total, 7);
    EXPECT_EQ(b->total, 7);
    EXPECT_EQ(one->total, 7);
    std::vector<float> pixels = a->pixels;
    pixels.insert(pixels.end(), b->pixels.begin(), b->pixels.end());
    EXPECT_EQ(pixels, one->pixels) << "step " << step;
    std::vector<int64_t> labels = a->labels;
    labels.insert(labels.end(), b->labels.begin(), b->labels.end());
    EXPECT_EQ(labels, one->labels);
    std::vector<std::size_t> records = a->records;
    records.insert(records.end(), b->records.begin(), b->records.end());
    EXPECT_EQ(records, one->records);
    EXPECT_EQ(ranks[0]->cursor().position, whole.cursor().position);
    // The data counts are the whole effective batch's on every rank.
    EXPECT_EQ(ranks[1]->stats().examples, whole.stats().examples);
  }
  EXPECT_GT(calls, 0);
}

}  // namespace trainer
