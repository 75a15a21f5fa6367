// The image loader: seeded augmentation keyed by (seed, epoch, index), the cursor (a restored loader gives the
// same batches, augmentation included), and skip counting.
#include <barrier>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/image_loader.h"
#include "support/paths.h"
#include "support/temp_dir.h"

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

namespace trainer {

// Contrastive runs under data parallelism (make_caption_loader with a shard): two ranks, run at once and exchanging
// their kept counts for real, decode disjoint shares whose concatenation is one process's batch byte for byte
// (augmented pixels, records and so captions), numbered (first, total) as in one process; a bad image skipped in one
// rank's share is counted by both, and every rank's counts are the whole batch's.
TEST(ImageLoader, CaptionLoaderRankSharesConcatenateToTheSingleProcessBatch) {
  test::TempDir dir;
  std::ofstream(dir.path() / "bad.jpg") << "not an image";
  {
    std::ofstream listing(dir.path() / "pairs.jsonl");
    std::ifstream demo(test::source_path("data/demo/images/validation-captions.jsonl"));
    const std::string root = test::source_path("data/demo/images") + "/";
    int line_number = 0;
    for (std::string line; std::getline(demo, line); ++line_number) {
      if (line_number == 10)
        listing << nlohmann::json{{"image", (dir.path() / "bad.jpg").string()}, {"caption", "broken"}}.dump() << "\n";
      auto record = nlohmann::json::parse(line);
      record["image"] = root + record["image"].get<std::string>();
      listing << record.dump() << "\n";
    }
  }
  const auto dataset = std::make_shared<const data::ImageDataset>(
      data::open_caption_dataset({(dir.path() / "pairs.jsonl").string()}, {}, true));
  Config config;
  config.data.augment = true;
  config.data.shuffle = true;
  config.data.on_bad_record = BadRecordPolicy::kSkip;
  config.data.num_workers = 2;
  config.training.seed = 3;
  config.training.max_steps = 100;  // without end
  constexpr int kBatches = 12;       // two epochs of 41 records in batches of 7 (the last of 6)
  auto whole = make_caption_loader(config, dataset, tiny_spec(), true, 7);
  std::vector<ImageBatch> one;
  for (int i = 0; i < kBatches; ++i) one.push_back(*whole->next());

  std::barrier sync(2);
  std::vector<int64_t> kept(2, 0);
  std::vector<std::vector<ImageBatch>> shares(2);
  std::vector<DataStats> stats(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      ImageShard shard{r, 2, [&, r](int64_t mine) {
                         kept[static_cast<std::size_t>(r)] = mine;
                         sync.arrive_and_wait();
                         const auto all = kept;
                         sync.arrive_and_wait();
                         return all;
                       }};
      auto loader = make_caption_loader(config, dataset, tiny_spec(), true, 7, shard);
      for (int i = 0; i < kBatches; ++i) shares[static_cast<std::size_t>(r)].push_back(*loader->next());
      stats[static_cast<std::size_t>(r)] = loader->stats();
    });
  for (auto& t : ranks) t.join();
  int64_t short_batches = 0;
  for (int i = 0; i < kBatches; ++i) {
    const auto& a = shares[0][static_cast<std::size_t>(i)];
    const auto& b = shares[1][static_cast<std::size_t>(i)];
    const auto& whole_batch = one[static_cast<std::size_t>(i)];
    EXPECT_EQ(a.first, 0);
    EXPECT_EQ(b.first, a.size()) << "batch " << i;
    EXPECT_EQ(a.total, whole_batch.size());
    EXPECT_EQ(b.total, whole_batch.size());
    EXPECT_LE(a.size(), 4);
    EXPECT_LE(b.size(), 3);  // the shares are 4 and 3 records (3 and 3 in an epoch's last batch of 6)
    short_batches += whole_batch.size() < 7;
    std::vector<float> pixels = a.pixels;
    pixels.insert(pixels.end(), b.pixels.begin(), b.pixels.end());
    EXPECT_EQ(pixels, whole_batch.pixels) << "batch " << i;
    std::vector<std::size_t> records = a.records;
    records.insert(records.end(), b.records.begin(), b.records.end());
    EXPECT_EQ(records, whole_batch.records) << "batch " << i;
  }
  EXPECT_GE(short_batches, 2);  // the bad record's batches, once per epoch (and each epoch's short last batch)
  EXPECT_EQ(whole->stats().bad_records_skipped, 2);  // the bad record, once per epoch
  for (const auto& s : stats) {
    EXPECT_EQ(s.bad_records_skipped, whole->stats().bad_records_skipped);
    EXPECT_EQ(s.examples, whole->stats().examples);
    EXPECT_EQ(s.records_read, whole->stats().records_read);
  }
}

}  // namespace trainer
