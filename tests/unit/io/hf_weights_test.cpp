// Model directory weights: single-file and sharded save/load round trips, the index checks, re-saving over an
// older file set, and check_state_dict's report.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/temp_dir.h"
#include "trainer/errors.h"
#include "trainer/hf_weights.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// 5 tensors of 400 bytes + one of 40 bytes: with max_shard_bytes 1000 they go 2 + 2 + 1 + (1 joins the last).
NamedTensors small_model() {
  NamedTensors tensors;
  for (int i = 0; i < 5; ++i) tensors.emplace_back("layers." + std::to_string(i) + ".weight", at::randn({10, 10}));
  tensors.emplace_back("norm.weight", at::randn({10}));
  return tensors;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void expect_same(const StateDict& loaded, const NamedTensors& saved) {
  ASSERT_EQ(loaded.size(), saved.size());
  for (const auto& [name, tensor] : saved) {
    ASSERT_TRUE(loaded.count(name)) << name;
    EXPECT_TRUE(at::equal(loaded.at(name), tensor)) << name;
  }
}

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(std::ifstream(path)); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no DataError";
  return {};
}

TEST(ModelDirWeights, SingleFileWhenItFits) {
  TempDir dir;
  const auto tensors = small_model();
  EXPECT_EQ(save_state_dict(dir.path().string(), tensors), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(listing(dir.path()), std::vector<std::string>{"model.safetensors"});
  expect_same(load_state_dict(dir.path().string()), tensors);
  EXPECT_EQ(SafetensorsFile::open(dir.file("model.safetensors")).metadata().at("format"), "pt");
}

TEST(ModelDirWeights, ShardedRoundTripWithIndex) {
  TempDir dir;
  const auto tensors = small_model();
  const auto files = save_state_dict(dir.path().string(), tensors, 1000);
  const std::vector<std::string> expected_files = {"model-00001-of-00003.safetensors",
                                                   "model-00002-of-00003.safetensors",
                                                   "model-00003-of-00003.safetensors"};
  EXPECT_EQ(files, expected_files);
  auto expected_listing = expected_files;
  expected_listing.push_back("model.safetensors.index.json");
  EXPECT_EQ(listing(dir.path()), expected_listing) << "no temporary files left behind";

  const auto index = read_json(dir.path() / "model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"], 5 * 400 + 40);
  EXPECT_EQ(index["weight_map"]["layers.0.weight"], "model-00001-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.2.weight"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["norm.weight"], "model-00003-of-00003.safetensors");
  expect_same(load_state_dict(dir.path().string()), tensors);

  const auto bf16 = load_state_dict(dir.path().string(), at::kBFloat16);
  EXPECT_EQ(bf16.at("norm.weight").scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(bf16.at("layers.3.weight"), tensors[3].second.to(at::kBFloat16)));
}

TEST(ModelDirWeights, TensorLargerThanTheLimitGetsItsOwnShard) {
  TempDir dir;
  const NamedTensors tensors = {{"a", at::ones({10})}, {"big", at::ones({100})}, {"b", at::ones({10})}};
  save_state_dict(dir.path().string(), tensors, 100);
  const auto index = read_json(dir.path() / "model.safetensors.index.json");
  // huggingface_hub's split: "big" is appended as its own shard before the running shard {a, b} is closed.
  EXPECT_EQ(index["weight_map"]["big"], "model-00001-of-00002.safetensors");
  EXPECT_EQ(index["weight_map"]["a"], "model-00002-of-00002.safetensors");
  EXPECT_EQ(index["weight_map"]["b"], "model-00002-of-00002.safetensors");
  expect_same(load_state_dict(dir.path().string()), tensors);
}

// Streamed (fully sharded weights): the same files from tensors fetched one file at a time, each fetch's buffer
// reused by the next (so the writer must hold its own copies: the fetch gives one); a rank that does not write
// fetches the same tensors in the same order and writes nothing.
TEST(ModelDirWeights, StreamedWritingFetchesFileByFileTheSameFilesAsAWholeSave) {
  TempDir whole, streamed, nothing;
  const auto tensors = small_model();
  save_state_dict(whole.path().string(), tensors, 1000);
  NamedTensors planned;
  for (const auto& [name, t] : tensors) planned.emplace_back(name, at::empty(t.sizes(), t.options().device(at::kMeta)));
  auto write = [&](const fs::path& dir, bool writes) {
    std::vector<std::size_t> order;
    at::Tensor buffer = at::empty({1000}, at::kFloat);
    save_state_dict_streamed(dir.string(), planned, [&](std::size_t i) {
      order.push_back(i);
      at::Tensor view = buffer.narrow(0, 0, tensors[i].second.numel()).view(tensors[i].second.sizes());
      view.copy_(tensors[i].second);
      return view.clone();  // the next fetch overwrites `buffer`
    }, 1000, writes);
    return order;
  };
  const auto order = write(streamed.path(), true);
  EXPECT_EQ(order.size(), tensors.size());
  EXPECT_EQ(listing(streamed.path()), listing(whole.path()));
  EXPECT_EQ(read_json(streamed.path() / "model.safetensors.index.json"),
            read_json(whole.path() / "model.safetensors.index.json"));
  expect_same(load_state_dict(streamed.path().string()), tensors);
  EXPECT_EQ(write(nothing.path(), false), order);
  EXPECT_TRUE(listing(nothing.path()).empty());
}

TEST(ModelDirWeights, ResavingReplacesTheOldFileSet) {
  TempDir dir;
  const auto root = dir.path().string();
  test::write_file(dir.file("config.json"), "{}");
  save_state_dict(root, small_model(), 1000);  // 3 shards
  auto tensors = small_model();
  save_state_dict(root, tensors, 1000);  // same names: overwrites the shards
  expect_same(load_state_dict(root), tensors);

  tensors = small_model();
  save_state_dict(root, tensors, 1500);  // 2 shards: the third must go
  EXPECT_EQ(listing(dir.path()), (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors",
                                                           "model.safetensors.index.json"}));
  expect_same(load_state_dict(root), tensors);

  tensors = small_model();
  save_state_dict(root, tensors);  // single file: index and shards go
  EXPECT_EQ(listing(dir.path()), (std::vector<std::string>{"config.json", "model.safetensors"}));
  expect_same(load_state_dict(root), tensors);

  tensors = small_model();
  save_state_dict(root, tensors, 1000);  // sharded again: the single file goes
  EXPECT_FALSE(fs::exists(dir.path() / "model.safetensors"));
  expect_same(load_state_dict(root), tensors);
}

TEST(ModelDirWeights, IndexThatDoesNotMatchItsShards) {
  TempDir dir;
  save_state_dict(dir.path().string(), small_model(), 1000);
  auto index = read_json(dir.path() / "model.safetensors.index.json");
  index["weight_map"].erase("layers.1.weight");                                   // in a shard, not in the index
  index["weight_map"]["ghost.weight"] = "model-00002-of-00003.safetensors";       // in the index, in no shard
  index["weight_map"]["layers.3.weight"] = "model-00001-of-00003.safetensors";    // in the wrong shard
  std::ofstream(dir.path() / "model.safetensors.index.json") << index.dump();
  const auto message = error_of([&] { load_state_dict(dir.path().string()); });
  EXPECT_NE(message.find("model.safetensors.index.json does not match its shards: 2 tensors missing, 2 unexpected"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("missing: ghost.weight (in model-00002-of-00003.safetensors)"), std::string::npos) << message;
  EXPECT_NE(message.find("missing: layers.3.weight (in model-00001-of-00003.safetensors)"), std::string::npos);
  EXPECT_NE(message.find("unexpected: layers.1.weight (in model-00001-of-00003.safetensors, not in the index)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("unexpected: layers.3.weight (in model-00002-of-00003.safetensors, the index says "
                         "model-00001-of-00003.safetensors)"),
            std::string::npos)
      << message;
}

TEST(ModelDirWeights, MissingShardOrHostileIndex) {
  TempDir dir;
  save_state_dict(dir.path().string(), small_model(), 1000);
  fs::remove(dir.path() / "model-00002-of-00003.safetensors");
  auto message = error_of([&] { load_state_dict(dir.path().string()); });
  EXPECT_NE(message.find("1 shard files it names are missing"), std::string::npos) << message;
  EXPECT_NE(message.find("model-00002-of-00003.safetensors (2 tensors)"), std::string::npos) << message;

  std::ofstream(dir.path() / "model.safetensors.index.json") << R"({"weight_map": {"w": "../../etc/passwd"}})";
  message = error_of([&] { load_state_dict(dir.path().string()); });
  EXPECT_NE(message.find("is not a file in the model directory"), std::string::npos) << message;

  std::ofstream(dir.path() / "model.safetensors.index.json") << R"({"metadata": {}})";
  message = error_of([&] { load_state_dict(dir.path().string()); });
  EXPECT_NE(message.find("no \"weight_map\" object"), std::string::npos) << message;

  fs::remove(dir.path() / "model.safetensors.index.json");
  message = error_of([&] { load_state_dict(dir.path().string()); });
  EXPECT_NE(message.find("holds no model.safetensors"), std::string::npos) << message;
}

TEST(ModelDirWeights, SameTensorInTwoFiles) {
  TempDir dir;
  write_safetensors(dir.file("a.safetensors"), {{"w", at::ones({2})}});
  write_safetensors(dir.file("b.safetensors"), {{"w", at::ones({2})}});
  const auto message = error_of([&] { load_state_dict_files({dir.file("a.safetensors"), dir.file("b.safetensors")}); });
  EXPECT_NE(message.find("tensor \"w\" is in both"), std::string::npos) << message;
}

TEST(ModelDirCheck, PassesWhenNamesAndShapesMatch) {
  TempDir dir;
  const auto tensors = small_model();
  save_state_dict(dir.path().string(), tensors);
  ShapeMap expected;
  for (const auto& [name, tensor] : tensors) expected[name] = tensor.sizes().vec();
  EXPECT_NO_THROW(check_state_dict(expected, shapes_of(load_state_dict(dir.path().string())), dir.path().string()));
}

TEST(ModelDirCheck, ListsMissingUnexpectedAndWrongShapes) {
  const ShapeMap expected = {{"a", {2, 3}}, {"b", {4}}, {"c", {}}, {"d", {1}}};
  const ShapeMap got = {{"a", {3, 2}}, {"b", {4}}, {"x", {5}}, {"c", {1}}};
  const auto message = error_of([&] { check_state_dict(expected, got, "models/m"); });
  EXPECT_NE(message.find("models/m: the weights do not match the model: 1 missing, 1 unexpected, 2 with the wrong "
                         "shape"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("missing: d"), std::string::npos) << message;
  EXPECT_NE(message.find("unexpected: x"), std::string::npos) << message;
  EXPECT_NE(message.find("a: expected [2, 3], got [3, 2]"), std::string::npos) << message;
  EXPECT_NE(message.find("c: expected [], got [1]"), std::string::npos) << message;
}

TEST(ModelDirCheck, LongListsAreCut) {
  ShapeMap expected;
  for (int i = 0; i < 50; ++i) expected["w" + std::to_string(i)] = {1};
  const auto message = error_of([&] { check_state_dict(expected, {}, "m"); });
  EXPECT_NE(message.find("50 missing"), std::string::npos);
  EXPECT_NE(message.find("... and 30 more"), std::string::npos) << message;
}

}  // namespace
}  // namespace trainer
