// Unit tests of the tokenizers: loading and its errors, special tokens in text, empty input, decoding with and
// without special tokens, and the training convention. Exact ids against the Python libraries are the parity
// test's job (tests/parity/test_tokenizers.py); here the ids come from the shipped files and are checked for
// behaviour, not against numbers copied from Python.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "support/paths.h"
#include "trainer/errors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

// A scratch directory removed after the test.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("trainer_tokenizer_test_" + std::to_string(::getpid()) + "_" +
                                         std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
    return (path_ / name).string();
  }
  std::string path() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::string qwen2_dir() { return test::source_path("configs/models/tiny-qwen2"); }
std::string t5_dir() { return test::source_path("configs/models/tiny-t5"); }
std::string asset(const std::string& name) { return test::source_path("tests/assets/tokenizers/" + name); }

// Runs `load` and returns the DataError's message (fails the test when nothing is thrown).
template <class F>
std::string data_error_of(F load) {
  try {
    load();
  } catch (const DataError& error) {
    return error.what();
  }
  ADD_FAILURE() << "no DataError thrown";
  return {};
}

TEST(TokenizerLoad, MissingPathNamesIt) {
  const std::string message = data_error_of([] { load_tokenizer("/nonexistent/tokenizer.json"); });
  EXPECT_NE(message.find("/nonexistent/tokenizer.json"), std::string::npos) << message;
}

TEST(TokenizerLoad, DirectoryWithoutTokenizerSaysWhatItLooksFor) {
  TempDir dir;
  const std::string message = data_error_of([&] { load_tokenizer(dir.path()); });
  EXPECT_NE(message.find(dir.path()), std::string::npos) << message;
  EXPECT_NE(message.find("tokenizer.json"), std::string::npos) << message;
  EXPECT_NE(message.find("spiece.model"), std::string::npos) << message;
}

TEST(TokenizerLoad, InvalidJsonNamesTheFile) {
  TempDir dir;
  const std::string file = dir.write("tokenizer.json", "{\"model\": {\"type\": \"BPE\", ");
  const std::string message = data_error_of([&] { load_tokenizer(file); });
  EXPECT_NE(message.find(file), std::string::npos) << message;
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;
}

TEST(TokenizerLoad, WordPieceIsRejectedWithWhatIsSupported) {
  TempDir dir;
  const std::string file = dir.write(
      "tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": {"[UNK]": 0}}, "pre_tokenizer": null})");
  const std::string message = data_error_of([&] { load_tokenizer(dir.path(), TokenizerKind::kBpe); });
  EXPECT_NE(message.find(file), std::string::npos) << message;
  EXPECT_NE(message.find("WordPiece"), std::string::npos) << message;
  EXPECT_NE(message.find("BPE"), std::string::npos) << message;
}

TEST(TokenizerLoad, MergeOutsideTheVocabularyIsAnError) {
  TempDir dir;
  const std::string file = dir.write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1},
      "merges": ["a b"]}, "pre_tokenizer": {"type": "ByteLevel"}})");
  const std::string message = data_error_of([&] { load_tokenizer(file); });
  EXPECT_NE(message.find("a b"), std::string::npos) << message;
}

TEST(TokenizerLoad, UnsupportedPreTokenizerIsAnError) {
  TempDir dir;
  const std::string file = dir.write(
      "tokenizer.json", R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}})");
  const std::string message = data_error_of([&] { load_tokenizer(file); });
  EXPECT_NE(message.find("Metaspace"), std::string::npos) << message;
}

TEST(TokenizerLoad, NotASentencePieceModelNamesTheFile) {
  TempDir dir;
  const std::string file = dir.write("spiece.model", "this is not a protobuf");
  const std::string message = data_error_of([&] { load_tokenizer(file); });
  EXPECT_NE(message.find(file), std::string::npos) << message;
}

TEST(TokenizerLoad, AutoPicksByDirectoryContents) {
  const auto t5 = load_tokenizer(t5_dir());
  EXPECT_NE(t5->source().find("spiece.model"), std::string::npos);
  const auto qwen = load_tokenizer(qwen2_dir());
  EXPECT_NE(qwen->source().find("tokenizer.json"), std::string::npos);
  EXPECT_THROW(load_tokenizer(t5_dir(), TokenizerKind::kBpe), DataError);
}

TEST(SentencePiece, T5SpecialIdsAndTemplate) {
  const auto tokenizer = load_tokenizer(t5_dir());
  EXPECT_EQ(tokenizer->pad_id(), 0);
  EXPECT_EQ(tokenizer->eos_id(), 1);
  EXPECT_EQ(tokenizer->bos_id(), std::nullopt);
  EXPECT_EQ(tokenizer->vocab_size(), 207);  // pieces in spiece.model (config.json pads to 256)
  EXPECT_EQ(tokenizer->special_token_template(), (SpecialTokenTemplate{{}, {1}}));
  EXPECT_EQ(tokenizer->token_to_id("</s>"), 1);
  EXPECT_EQ(tokenizer->token_to_id("no such piece"), std::nullopt);
}

TEST(SentencePiece, EmptyTextAndRoundTrip) {
  const auto tokenizer = load_tokenizer(t5_dir());
  EXPECT_TRUE(tokenizer->encode("").empty());
  EXPECT_EQ(tokenizer->decode(std::vector<std::int32_t>{}), "");
  const std::string text = "Whisk the eggs until smooth.";
  EXPECT_EQ(tokenizer->decode(tokenizer->encode(text)), text);
}

TEST(SentencePiece, DecodeWithAndWithoutSpecialTokens) {
  const auto tokenizer = load_tokenizer(t5_dir());
  auto ids = encode_for_training(*tokenizer, "Whisk the eggs.", true);
  ASSERT_EQ(ids.back(), 1);
  ids.push_back(0);  // pad
  EXPECT_EQ(tokenizer->decode(ids, true), "Whisk the eggs.");
  EXPECT_EQ(tokenizer->decode(ids, false), "Whisk the eggs.</s><pad>");
}

TEST(SentencePiece, LlamaStyleModelPrependsBos) {
  const auto tokenizer = load_tokenizer(asset("spm-bpe"));
  EXPECT_EQ(tokenizer->bos_id(), 1);
  EXPECT_EQ(tokenizer->eos_id(), 2);
  EXPECT_EQ(tokenizer->special_token_template(), (SpecialTokenTemplate{{1}, {}}));
  const auto ids = encode_for_training(*tokenizer, "hello", true);
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(ids.back(), 2);
}

TEST(Bpe, SpecialTokensInTextAreSplitOut) {
  const auto tokenizer = load_tokenizer(qwen2_dir());
  const auto eos = tokenizer->token_to_id("<|endoftext|>");
  const auto im_start = tokenizer->token_to_id("<|im_start|>");
  ASSERT_TRUE(eos && im_start);
  EXPECT_EQ(tokenizer->eos_id(), eos);
  EXPECT_EQ(tokenizer->pad_id(), eos);
  const auto ids = tokenizer->encode("<|im_start|>Whisk<|endoftext|>eggs<|endoftext|>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), *im_start);
  EXPECT_EQ(ids.back(), *eos);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *eos), 2);
  EXPECT_EQ(tokenizer->encode("<|endoftext|>"), std::vector<std::int32_t>{*eos});
  // A partial special token is plain text.
  const auto partial = tokenizer->encode("<|endoftext");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), *eos), 0);
}

TEST(Bpe, EmptyTextAndRoundTrip) {
  const auto tokenizer = load_tokenizer(qwen2_dir());
  EXPECT_TRUE(tokenizer->encode("").empty());
  EXPECT_EQ(tokenizer->decode(std::vector<std::int32_t>{}), "");
  for (const std::string text : {"Whisk the eggs until smooth.", "  two  spaces\tand\ttabs\n\n", "東京 😀 café",
                                 "I'M SURE it's fine"})
    EXPECT_EQ(tokenizer->decode(tokenizer->encode(text)), text) << text;
}

TEST(Bpe, DecodeWithAndWithoutSpecialTokens) {
  const auto tokenizer = load_tokenizer(qwen2_dir());
  const auto ids = tokenizer->encode("<|im_start|>Whisk the eggs.<|im_end|>");
  EXPECT_EQ(tokenizer->decode(ids, true), "Whisk the eggs.");
  EXPECT_EQ(tokenizer->decode(ids, false), "<|im_start|>Whisk the eggs.<|im_end|>");
  // Ids outside the vocabulary are skipped, as tokenizers does.
  std::vector<std::int32_t> with_unknown = ids;
  with_unknown.push_back(1'000'000);
  with_unknown.push_back(-5);
  EXPECT_EQ(tokenizer->decode(with_unknown, false), "<|im_start|>Whisk the eggs.<|im_end|>");
}

TEST(Bpe, InvalidUtf8IsADataError) {
  const auto tokenizer = load_tokenizer(qwen2_dir());
  EXPECT_THROW(tokenizer->encode("bad \xFF byte"), DataError);
  // After and between long ASCII runs (checked eight bytes at a time).
  EXPECT_THROW(tokenizer->encode("0123456789abcdef\xc0\xaf"), DataError);
  EXPECT_THROW(tokenizer->encode("0123456789abcdef \xed\xa0\x80 0123456789abcdef"), DataError);
  EXPECT_THROW(tokenizer->encode("0123456789a\xe2\x82"), DataError);
  EXPECT_NO_THROW(tokenizer->encode("0123456\xc3\xa9 0123456789abcdef \xf0\x9f\x8d\xb2 tail"));
}

TEST(Bpe, TrainingConventionAppendsEosOnce) {
  const auto tokenizer = load_tokenizer(qwen2_dir());
  const auto eos = *tokenizer->eos_id();
  EXPECT_EQ(tokenizer->special_token_template(), SpecialTokenTemplate{});  // Qwen2: the post_processor adds nothing
  const auto body = tokenizer->encode("Whisk.");
  auto expected = body;
  expected.push_back(eos);
  EXPECT_EQ(encode_for_training(*tokenizer, "Whisk.", true), expected);
  EXPECT_EQ(encode_for_training(*tokenizer, "Whisk.", false), body);
  EXPECT_EQ(encode_for_training(*tokenizer, "Whisk.<|endoftext|>", true), expected);
}

TEST(Bpe, LlamaThreeTemplatePrependsBeginOfText) {
  const auto tokenizer = load_tokenizer(asset("llama3-style"));
  const auto bos = tokenizer->token_to_id("<|begin_of_text|>");
  ASSERT_TRUE(bos);
  EXPECT_EQ(tokenizer->bos_id(), bos);
  EXPECT_EQ(tokenizer->special_token_template(), (SpecialTokenTemplate{{*bos}, {}}));
  const auto ids = encode_for_training(*tokenizer, "hi", true);
  EXPECT_EQ(ids.front(), *bos);
  EXPECT_EQ(ids.back(), tokenizer->eos_id());
}

// CLIP's pipeline: whitespace runs collapse and case folds before splitting, each word ends in an
// end-of-word-suffixed token, and the RobertaProcessing template wraps a text in <|startoftext|> ... <|endoftext|>.
TEST(Bpe, ClipStyleLowercasesCollapsesWhitespaceAndMarksWordEnds) {
  const auto tokenizer = load_tokenizer(asset("clip-style"));
  const auto bos = tokenizer->token_to_id("<|startoftext|>"), eos = tokenizer->token_to_id("<|endoftext|>");
  ASSERT_TRUE(bos && eos);
  EXPECT_EQ(tokenizer->special_token_template(), (SpecialTokenTemplate{{*bos}, {*eos}}));
  const auto ids = tokenizer->encode("the photo");
  EXPECT_EQ(tokenizer->encode("THE   Photo"), ids);
  EXPECT_EQ(tokenizer->encode("\tthe\n photo "), ids);
  EXPECT_EQ(tokenizer->decode(ids, true), "the</w>photo</w>");  // as tokenizers' ByteLevel decoder gives it
  const auto the = tokenizer->token_to_id("the</w>");
  ASSERT_TRUE(the);
  EXPECT_EQ(ids.front(), *the);
}

TEST(Bpe, AddEosTokenInTokenizerConfigOverridesThePostProcessor) {
  TempDir dir;
  fs::copy_file(qwen2_dir() + "/tokenizer.json", dir.path() + "/tokenizer.json");
  dir.write("tokenizer_config.json", R"({"eos_token": "<|endoftext|>", "add_eos_token": true})");
  const auto tokenizer = load_tokenizer(dir.path());
  EXPECT_EQ(tokenizer->special_token_template(), (SpecialTokenTemplate{{}, {*tokenizer->eos_id()}}));
}

TEST(Bpe, EncodeIsThreadSafe) {
  const auto tokenizer = load_tokenizer(qwen2_dir());
  const std::string text = "Whisk the eggs until smooth, then fold in 250 g of flour. ";
  const auto expected = tokenizer->encode(text);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches = 0;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i)
        if (tokenizer->encode(text) != expected) ++mismatches;
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches, 0);
}

// A tokenizer's ids for `text`, loaded and encoded on a thread of its own (so with a fresh per-thread word cache).
std::vector<std::int32_t> encoded_on_a_new_thread(const std::string& dir, const std::string& text) {
  std::vector<std::int32_t> ids;
  std::thread([&] { ids = load_tokenizer(dir)->encode(text); }).join();
  return ids;
}

// Each thread keeps a cache of recent words per tokenizer: tokenizers that split and merge the same words
// differently, used in turn on one thread (and one loaded again where another was freed), keep their own ids.
TEST(Bpe, TokenizersUsedInTurnOnOneThreadKeepTheirOwnIds) {
  const std::string text = "the photo of THE eggs, the photo of the flour";
  const auto qwen2_ids = encoded_on_a_new_thread(qwen2_dir(), text);
  const auto clip_ids = encoded_on_a_new_thread(asset("clip-style"), text);
  const auto gpt2_ids = encoded_on_a_new_thread(asset("gpt2-bytelevel"), text);
  ASSERT_NE(qwen2_ids, clip_ids);
  const auto qwen2 = load_tokenizer(qwen2_dir());
  for (int round = 0; round < 3; ++round) {
    auto other = load_tokenizer(asset(round % 2 == 0 ? "clip-style" : "gpt2-bytelevel"));
    EXPECT_EQ(qwen2->encode(text), qwen2_ids) << round;
    EXPECT_EQ(other->encode(text), round % 2 == 0 ? clip_ids : gpt2_ids) << round;
    EXPECT_EQ(qwen2->encode(text), qwen2_ids) << round;
  }
}

}  // namespace
}  // namespace trainer
