// SentencePiece models (T5, FLAN-T5, Llama-2: spiece.model / tokenizer.model) through libsentencepiece, so ids
// are exactly those of Python's sentencepiece. Special ids come from the model (T5: pad 0, eos 1, unk 2).
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <unordered_map>

#include <sentencepiece_processor.h>

#include "tokenizer/tokenizer_files.h"
#include "trainer/errors.h"

namespace trainer::tokenizer_detail {
namespace {

std::optional<std::int32_t> valid_id(int id) {
  if (id < 0) return std::nullopt;
  return static_cast<std::int32_t>(id);
}

constexpr std::string_view kMetaSpace = "\xe2\x96\x81";  // U+2581, sentencepiece's escaped whitespace

// Printable ASCII and the space: the texts the word cache takes.
bool is_plain_ascii(std::string_view text) {
  for (const char c : text)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

// A word -> ids cache per worker thread, for one tokenizer at a time (`owner` is the tokenizer's serial
// number, never reused). Bounded: it is cleared when it reaches kMaxWords.
struct WordCache {
  static constexpr std::size_t kMaxWords = 1 << 16;
  std::uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<std::int32_t>> words;
};
thread_local WordCache word_cache;
std::atomic<std::uint64_t> next_serial{1};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& file, const SideFiles& side) : source_(file) {
    const auto status = processor_.Load(file);
    if (!status.ok())
      throw DataError("cannot read SentencePiece model " + file + ": " + status.ToString(),
                      "a SentencePiece tokenizer is a spiece.model or tokenizer.model file (protobuf); for a "
                      "tokenizer.json set tokenizer.kind=bpe");
    eos_ = valid_id(processor_.eos_id());
    pad_ = valid_id(processor_.pad_id());
    bos_ = valid_id(processor_.bos_id());
    unk_ = valid_id(processor_.unk_id());
    if (auto token = config_token(side, "pad_token"); token && !pad_) pad_ = token_to_id(*token);

    // transformers: T5Tokenizer appends </s>; LlamaTokenizer prepends <s> (add_bos_token=True,
    // add_eos_token=False); tokenizer_config.json may say otherwise.
    const bool is_t5 = std::filesystem::path(file).filename() == "spiece.model" ||
                       (side.model_config.is_object() && side.model_config.value("model_type", "") == "t5");
    const bool add_bos = config_flag(side, "add_bos_token").value_or(!is_t5);
    const bool add_eos = config_flag(side, "add_eos_token").value_or(is_t5);
    if (add_bos && bos_) template_.prefix.push_back(*bos_);
    if (add_eos && eos_) template_.suffix.push_back(*eos_);
    words_are_independent_ = words_are_independent();
  }

  // Plain ASCII text goes word by word through a cache when the model allows it (see words_are_independent):
  // Encode builds a protobuf message with two strings per piece, which is most of its cost, and a corpus
  // repeats its words. Anything else, and any word with an unknown piece, takes the whole-text path.
  std::vector<std::int32_t> encode(std::string_view text) const override {
    if (!words_are_independent_ || !is_plain_ascii(text)) return encode_whole(text);
    if (word_cache.owner != serial_) {
      word_cache.words.clear();
      word_cache.owner = serial_;
    }
    std::vector<std::int32_t> ids;
    std::size_t begin = 0;
    while (begin < text.size()) {
      if (text[begin] == ' ') {
        ++begin;
        continue;
      }
      const std::size_t end = std::min(text.find(' ', begin), text.size());
      const std::string word(text.substr(begin, end - begin));
      auto found = word_cache.words.find(word);
      if (found == word_cache.words.end()) {
        auto word_ids = encode_whole(word);
        if (unk_ && std::find(word_ids.begin(), word_ids.end(), *unk_) != word_ids.end()) return encode_whole(text);
        if (word_cache.words.size() >= WordCache::kMaxWords) word_cache.words.clear();
        found = word_cache.words.emplace(word, std::move(word_ids)).first;
      }
      ids.insert(ids.end(), found->second.begin(), found->second.end());
      begin = end;
    }
    if (ids.empty()) return encode_whole(text);
    return ids;
  }

  std::string decode(std::span<const std::int32_t> ids, bool skip_special) const override {
    std::vector<int> known;
    known.reserve(ids.size());
    bool has_control = false;
    for (const std::int32_t id : ids) {
      if (id < 0 || id >= processor_.GetPieceSize()) continue;
      known.push_back(id);
      has_control = has_control || processor_.IsControl(id);
    }
    if (skip_special || !has_control) {
      std::string text;
      const auto status = processor_.Decode(known, &text);
      if (!status.ok()) throw DataError("SentencePiece (" + source_ + ") cannot decode: " + status.ToString());
      return text;
    }
    // sentencepiece drops control symbols (</s>, <pad>); spell them out where they stand, as transformers does.
    const auto proto = processor_.DecodeIdsAsImmutableProto(known);
    std::string text;
    for (std::size_t i = 0; i < proto.pieces_size(); ++i) {
      const auto piece = proto.pieces(static_cast<int>(i));
      text += processor_.IsControl(static_cast<int>(piece.id())) ? piece.piece() : piece.surface();
    }
    return text;
  }

  std::int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::optional<std::int32_t> eos_id() const override { return eos_; }
  std::optional<std::int32_t> pad_id() const override { return pad_; }
  std::optional<std::int32_t> bos_id() const override { return bos_; }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    const int id = processor_.PieceToId(token);
    if (id == processor_.unk_id() && token != processor_.IdToPiece(id)) return std::nullopt;
    return id;
  }
  SpecialTokenTemplate special_token_template() const override { return template_; }
  const std::string& source() const override { return source_; }

 private:
  std::vector<std::int32_t> encode_whole(std::string_view text) const {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw DataError("SentencePiece (" + source_ + ") cannot encode a text: " + status.ToString());
    return {ids.begin(), ids.end()};
  }

  // Whether the ids of a plain ASCII text are the ids of its space-separated words, each encoded alone. Two
  // things make it so. (1) No piece holds U+2581 (an escaped space) except as its first character: every
  // segmentation then breaks before each space, and the best one (unigram Viterbi, or BPE merges, which never
  // cross a space) is the best one of each word, put together. (2) The normalizer escapes each run of spaces
  // as one U+2581 before every word (add_dummy_prefix, remove_extra_whitespaces) and maps each character on
  // its own: checked on probes, because the normalizer's settings are not readable through the library's API.
  // Llama-2 style models (spaces kept, pieces of several U+2581) fail (1) or (2) and keep the whole-text path.
  bool words_are_independent() const {
    for (int id = 0; id < processor_.GetPieceSize(); ++id)
      if (processor_.IdToPiece(id).find(kMetaSpace, 1) != std::string::npos) return false;
    std::vector<std::string> words;
    for (char c = 0x21; c <= 0x7e; ++c) words.emplace_back(1, c);
    words.insert(words.end(), {"ab", "Hello", "world.", "1,", "x"});
    std::string spaced = "  ";
    std::vector<std::int32_t> joined;
    for (const auto& word : words) {
      const auto ids = encode_whole(word);
      if (unk_ && std::find(ids.begin(), ids.end(), *unk_) != ids.end()) continue;  // such words take the slow path
      spaced += word + (word.size() % 2 ? " " : "   ");
      joined.insert(joined.end(), ids.begin(), ids.end());
    }
    return encode_whole(spaced) == joined && encode_whole("Hello world") == encode_whole(" Hello  world ");
  }

  sentencepiece::SentencePieceProcessor processor_;
  std::string source_;
  std::optional<std::int32_t> eos_, pad_, bos_, unk_;
  SpecialTokenTemplate template_;
  bool words_are_independent_ = false;
  std::uint64_t serial_ = next_serial++;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& file, const SideFiles& side) {
  return std::make_unique<SentencePieceTokenizer>(file, side);
}

}  // namespace trainer::tokenizer_detail
