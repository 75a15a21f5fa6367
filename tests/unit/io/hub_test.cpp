// The pure parts of Hub ids (trainer/hub.h): id parsing, the cache's paths from the environment, SHA-256 against the
// standard's vectors, and offline resolution in a cache laid out by hand as huggingface_hub lays it out. The
// protocol itself is tested against a stand-in Hub and huggingface_hub in tests/parity/test_hub.py.
#include "trainer/hub.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>

#include <gtest/gtest.h>

#include "trainer/errors.h"

namespace trainer::hub {
namespace {

namespace fs = std::filesystem;

Getenv fake_environment(const std::map<std::string, std::string>& values) {
  return [values](const char* name) -> const char* {
    const auto it = values.find(name);
    return it == values.end() ? nullptr : it->second.c_str();
  };
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("hub_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(reinterpret_cast<std::uintptr_t>(this)));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

void write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

}  // namespace

TEST(IoHub, ParsesIdsWithAndWithoutRevision) {
  EXPECT_EQ(parse_hub_id("google/flan-t5-xl"), (HubId{"google/flan-t5-xl", "main"}));
  EXPECT_EQ(parse_hub_id("gpt2"), (HubId{"gpt2", "main"}));
  EXPECT_EQ(parse_hub_id("Qwen/Qwen2.5-7B-Instruct@v1.0"), (HubId{"Qwen/Qwen2.5-7B-Instruct", "v1.0"}));
  EXPECT_EQ(parse_hub_id("org/name@refs/pr/1"), (HubId{"org/name", "refs/pr/1"}));
  const std::string commit(40, 'a');
  EXPECT_EQ(parse_hub_id("org/name@" + commit), (HubId{"org/name", commit}));
}

TEST(IoHub, RefusesMalformedIds) {
  for (const char* bad : {"", "org/", "/name", "org//name", "org/na me", "org/-name", "org/name.", "org/na--me",
                          "org/na..me", "org/name@", "org/name@a b", "org/name@../x", "a/b/c"})
    EXPECT_FALSE(parse_hub_id(bad).has_value()) << bad;
  EXPECT_FALSE(parse_hub_id(std::string(97, 'a')).has_value());
}

TEST(IoHub, TellsPathsFromIds) {
  for (const char* path : {"/models/flan-t5-xl", "./model", "../model", "~/model", ".", "..", "a/b/c", "runs/x/final"})
    EXPECT_TRUE(looks_like_path(path)) << path;
  for (const char* id : {"google/flan-t5-xl", "gpt2", "org/name@refs/pr/1"}) EXPECT_FALSE(looks_like_path(id)) << id;
}

TEST(IoHub, NamesCacheFoldersAsHuggingfaceHub) {
  EXPECT_EQ(repo_folder_name("google/flan-t5-xl"), "models--google--flan-t5-xl");
  EXPECT_EQ(repo_folder_name("gpt2"), "models--gpt2");
  EXPECT_TRUE(is_commit_hash(std::string(40, 'f')));
  EXPECT_FALSE(is_commit_hash(std::string(40, 'F')));
  EXPECT_FALSE(is_commit_hash("main"));
  const auto origin = snapshot_origin("/c/hub/models--google--flan-t5-xl/snapshots/" + std::string(40, 'b'));
  ASSERT_TRUE(origin.has_value());
  EXPECT_EQ(origin->repo_id, "google/flan-t5-xl");
  EXPECT_EQ(origin->commit, std::string(40, 'b'));
  EXPECT_FALSE(snapshot_origin("/models/flan-t5-xl").has_value());
}

TEST(IoHub, ReadsDatasetIdsInTheSpellingsOfLoadDatasetAndHfPaths) {
  EXPECT_EQ(repo_folder_name("trl-lib/ultrafeedback_binarized", RepoType::kDataset),
            "datasets--trl-lib--ultrafeedback_binarized");
  auto ref = parse_dataset_ref("trl-lib/Capybara", "train");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->id, "trl-lib/Capybara");
  EXPECT_EQ(ref->split, "train");
  EXPECT_EQ(ref->config, "");
  ref = parse_dataset_ref("HuggingFaceH4/ultrachat_200k@main:train_sft", "train");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->id, "HuggingFaceH4/ultrachat_200k@main");
  EXPECT_EQ(ref->split, "train_sft");
  ref = parse_dataset_ref("org/name:en:test", "validation");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->config, "en");
  EXPECT_EQ(ref->split, "test");
  ref = parse_dataset_ref("hf://datasets/org/name@v1/data/train-*.parquet", "train");
  ASSERT_TRUE(ref.has_value());
  EXPECT_EQ(ref->id, "org/name@v1");
  EXPECT_EQ(ref->include, std::vector<std::string>{"data/train-*.parquet"});
  // Paths, globs, data files and malformed names are never dataset ids.
  for (const char* name : {"data/train.jsonl", "data/*.parquet", "runs/a/b", "/abs/dir:train", "./dir", "gpt2",
                           "org/name:a:b:c", "org/name:", "org/x.parquet", "hf://datasets/onlyname"})
    EXPECT_FALSE(parse_dataset_ref(name, "train").has_value()) << name;
  TempDir dir;
  std::filesystem::create_directories(dir.path / "local" / "saved");
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path);
  EXPECT_FALSE(parse_dataset_ref("local/saved:train", "train").has_value());  // a datasets folder here
  EXPECT_FALSE(parse_dataset_ref("local/saved", "train").has_value());
  std::filesystem::current_path(cwd);
}

TEST(IoHub, FindsTheCacheAsHuggingfaceHubDoes) {
  EXPECT_EQ(settings_from_environment(fake_environment({{"HOME", "/home/u"}})).cache_dir,
            "/home/u/.cache/huggingface/hub");
  EXPECT_EQ(settings_from_environment(fake_environment({{"HOME", "/home/u"}, {"XDG_CACHE_HOME", "/x"}})).cache_dir,
            "/x/huggingface/hub");
  EXPECT_EQ(settings_from_environment(fake_environment({{"XDG_CACHE_HOME", "/x"}, {"HF_HOME", "/h"}})).cache_dir,
            "/h/hub");
  EXPECT_EQ(settings_from_environment(fake_environment({{"HF_HOME", "/h"}, {"HF_HUB_CACHE", "/c"}})).cache_dir, "/c");
  const auto old_name = fake_environment({{"HF_HOME", "/h"}, {"HUGGINGFACE_HUB_CACHE", "/old"}});
  EXPECT_EQ(settings_from_environment(old_name).cache_dir, "/old");
  const auto defaults = settings_from_environment(fake_environment({{"HOME", "/home/u"}}));
  EXPECT_EQ(defaults.endpoint, "https://huggingface.co");
  EXPECT_FALSE(defaults.offline);
  EXPECT_EQ(settings_from_environment(fake_environment({{"HF_ENDPOINT", "http://127.0.0.1:9/"}})).endpoint,
            "http://127.0.0.1:9");
  EXPECT_TRUE(settings_from_environment(fake_environment({{"HF_HUB_OFFLINE", "1"}})).offline);
  EXPECT_TRUE(settings_from_environment(fake_environment({{"TRANSFORMERS_OFFLINE", "true"}})).offline);
  EXPECT_FALSE(settings_from_environment(fake_environment({{"HF_HUB_OFFLINE", "0"}})).offline);
  EXPECT_THROW(settings_from_environment(fake_environment({{"HF_HUB_DOWNLOAD_TIMEOUT", "soon"}})), UsageError);
}

TEST(IoHub, ReadsTheTokenFromTheEnvironmentThenTheTokenFile) {
  TempDir dir;
  write(dir.path / "token", "hf_from_file\n");
  write(dir.path / "other", "  hf_from_path  \n");
  const std::string home = dir.path.string();
  EXPECT_EQ(settings_from_environment(fake_environment({{"HF_HOME", home}})).token, "hf_from_file");
  EXPECT_EQ(settings_from_environment(fake_environment({{"HF_HOME", home}, {"HF_TOKEN_PATH", home + "/other"}})).token,
            "hf_from_path");
  EXPECT_EQ(settings_from_environment(fake_environment({{"HF_HOME", home}, {"HF_TOKEN", "hf_env"}})).token, "hf_env");
  EXPECT_EQ(settings_from_environment(fake_environment({{"HF_HOME", home + "/none"}})).token, "");
}

TEST(IoHub, Sha256MatchesTheStandardVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  TempDir dir;
  std::string bytes;
  for (int i = 0; i < 3 * 1024 * 1024 + 17; ++i) bytes += static_cast<char>(i * 31 % 251);
  write(dir.path / "blob", bytes);
  EXPECT_EQ(sha256_file_hex((dir.path / "blob").string()), sha256_hex(bytes));
}

TEST(IoHub, ResolvesOfflineFromACacheLaidOutByHuggingfaceHub) {
  TempDir dir;
  const std::string commit = "0123456789abcdef0123456789abcdef01234567";
  const fs::path repo = dir.path / "models--org--tiny";
  write(repo / "blobs" / "abc", "{}");
  write(repo / "refs" / "main", commit);
  fs::create_directories(repo / "snapshots" / commit);
  fs::create_symlink("../../blobs/abc", repo / "snapshots" / commit / "config.json");
  HubSettings settings;
  settings.cache_dir = dir.path.string();
  settings.offline = true;
  settings.endpoint = "http://127.0.0.1:9";  // nothing listens: offline must not ask

  const Resolved by_branch = resolve("org/tiny", {}, settings);
  EXPECT_TRUE(by_branch.from_hub);
  EXPECT_EQ(by_branch.commit, commit);
  EXPECT_EQ(fs::path(by_branch.local_path), repo / "snapshots" / commit);
  EXPECT_TRUE(fs::exists(fs::path(by_branch.local_path) / "config.json"));
  EXPECT_EQ(resolve("org/tiny@" + commit, {}, settings).commit, commit);

  EXPECT_THROW(resolve("org/tiny@v2", {}, settings), UsageError);  // no refs/v2
  try {
    ResolveOptions options;
    options.what = "model.path";
    resolve("org/absent", options, settings);
    FAIL() << "no error for a model the cache lacks";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("org/absent"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("HF_HUB_OFFLINE"), std::string::npos) << e.what();
    EXPECT_NE(e.hint().find("local"), std::string::npos) << e.hint();
  }
}

TEST(IoHub, LocalPathsWinAndPathLikeNamesStayPaths) {
  TempDir dir;
  HubSettings settings;
  settings.cache_dir = (dir.path / "cache").string();
  settings.offline = true;
  const std::string local = (dir.path / "model").string();
  fs::create_directories(local);
  EXPECT_FALSE(resolve(local, {}, settings).from_hub);
  EXPECT_EQ(resolve(local, {}, settings).local_path, local);
  EXPECT_EQ(resolve("./no/such/model", {}, settings).local_path, "./no/such/model");
  EXPECT_FALSE(resolve("/models/flan-t5-xl", {}, settings).from_hub);
  EXPECT_FALSE(resolve("not an id", {}, settings).from_hub);
}

}  // namespace trainer::hub
