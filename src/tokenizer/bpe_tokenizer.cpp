// Hugging Face tokenizer.json with a byte-level BPE model (Qwen2, Llama-3, GPT-2, CLIP), reproducing the Rust
// `tokenizers` pipeline: added tokens are split out of the raw text (then, for `normalized` ones, out of the
// normalized text), the normalizer runs (Unicode forms, Replace, Lowercase), the pre-tokenizers split words
// (Split regex, ByteLevel), each word's bytes become GPT-2's byte alphabet (the last one with the model's
// end-of-word suffix, the others with its continuing-subword prefix) and are merged by rank, and decoding maps
// the alphabet back to bytes.
#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <forward_list>
#include <fstream>
#include <limits>
#include <queue>
#include <shared_mutex>
#include <unordered_map>

#include "tokenizer/regex.h"
#include "tokenizer/token_bytes.h"
#include "tokenizer/tokenizer_files.h"
#include "tokenizer/unicode.h"
#include "trainer/errors.h"

namespace trainer::tokenizer_detail {
namespace {

using json = nlohmann::json;

// GPT-2's split pattern, used by ByteLevel when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::size_t kMaxCacheEntries = 200'000;
constexpr std::size_t kMaxCachedWordBytes = 256;
constexpr std::size_t kHeapMergeThreshold = 48;  // symbols
constexpr std::size_t kThreadCacheSlots = 4096;   // a power of two

// Each tokenizer's number, so a thread's word cache knows whose words it holds (an address could be reused).
std::atomic<std::uint64_t> next_tokenizer_number{1};

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct AddedToken {
  std::string content;
  std::string pattern;  // what is matched: the content, normalized for `normalized` tokens (as tokenizers does)
  std::int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// A piece of text on its way through the pipeline, or an added token already recognised.
struct Piece {
  std::string_view text;
  std::int32_t token_id = -1;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One normalizer of the sequence: a Unicode normal form, a Replace (regex or string -> content) or Lowercase.
struct NormalizerStep {
  enum class Kind { kForm, kReplace, kLowercase } kind = Kind::kForm;
  NormalForm form = NormalForm::kNfc;
  std::unique_ptr<Regex> pattern;
  std::string content;
};

struct PreTokenizerStep {
  bool byte_level = false;
  bool add_prefix_space = false;
  std::unique_ptr<Regex> regex;  // null: ByteLevel without use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

// Leftmost-longest, non-overlapping matching of a set of added tokens, as tokenizers' Aho-Corasick does.
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token) {
    if (token->pattern.empty()) return;
    auto& bucket = by_first_byte_[static_cast<unsigned char>(token->pattern[0])];
    bucket.push_back(token);
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
    empty_ = false;
  }

  // Splits `text` into added tokens (with single_word, lstrip and rstrip applied) and the text between them.
  void split(std::string_view text, std::vector<Piece>& out) const {
    if (empty_) {
      if (!text.empty()) out.push_back({text});
      return;
    }
    std::size_t done = 0, pos = 0;
    while (pos < text.size()) {
      const AddedToken* found = nullptr;
      for (const AddedToken* token : by_first_byte_[static_cast<unsigned char>(text[pos])])
        if (text.compare(pos, token->pattern.size(), token->pattern) == 0) {
          found = token;
          break;
        }
      if (!found) {
        ++pos;
        continue;
      }
      std::size_t start = pos, stop = pos + found->pattern.size();
      pos = stop;
      if (found->single_word && !(is_word_boundary_before(text, start) && is_word_boundary_after(text, stop)))
        continue;
      if (found->lstrip) {
        while (start > done) {
          std::size_t previous = 0;
          if (!is_whitespace(previous_code_point(text, start, &previous))) break;
          start = previous;
        }
      }
      if (found->rstrip) {
        while (stop < text.size()) {
          std::size_t next = stop;
          if (!is_whitespace(next_code_point(text, next))) break;
          stop = next;
        }
        pos = stop;
      }
      if (start > done) out.push_back({text.substr(done, start - done)});
      out.push_back({text.substr(start, stop - start), found->id});
      done = stop;
    }
    if (done < text.size()) out.push_back({text.substr(done)});
  }

 private:
  static bool is_word_char(char32_t c) { return c == U'_' || is_alphanumeric(c); }
  static bool is_word_boundary_before(std::string_view text, std::size_t start) {
    return start == 0 || !is_word_char(previous_code_point(text, start));
  }
  static bool is_word_boundary_after(std::string_view text, std::size_t stop) {
    if (stop >= text.size()) return true;
    return !is_word_char(next_code_point(text, stop));
  }

  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
  bool empty_ = true;
};

// Splits one piece by a pattern, the way tokenizers' NormalizedString::split does for each behavior.
void split_by_pattern(std::string_view piece, const PreTokenizerStep& step, std::vector<std::string_view>& out) {
  thread_local std::vector<std::pair<std::size_t, std::size_t>> matches;  // reused: no allocation per piece
  matches.clear();
  step.regex->find_all(piece, matches);
  std::size_t previous = 0;
  if (step.behavior == SplitBehavior::kIsolated) {  // every match and every gap, in order (inverted or not)
    for (const auto& [begin, end] : matches) {
      if (begin > previous) out.push_back(piece.substr(previous, begin - previous));
      out.push_back(piece.substr(begin, end - begin));
      previous = end;
    }
    if (previous < piece.size()) out.push_back(piece.substr(previous));
    return;
  }
  struct Span {
    std::size_t begin, end;
    bool is_match;
  };
  std::vector<Span> spans;
  for (const auto& [begin, end] : matches) {
    if (begin > previous) spans.push_back({previous, begin, step.invert});
    spans.push_back({begin, end, !step.invert});
    previous = end;
  }
  if (previous < piece.size()) spans.push_back({previous, piece.size(), step.invert});

  std::vector<Span> merged;
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::kIsolated:
      merged = spans;
      break;
    case SplitBehavior::kRemoved:
      for (const Span& span : spans)
        if (!span.is_match) merged.push_back(span);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& span : spans) {
        if (span.is_match && !previous_match && !merged.empty()) merged.back().end = span.end;
        else merged.push_back(span);
        previous_match = span.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !merged.empty()) merged.back().begin = it->begin;
        else merged.push_back(*it);
        previous_match = it->is_match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Span& span : spans) {
        if (span.is_match == previous_match && !merged.empty()) merged.back().end = span.end;
        else merged.push_back(span);
        previous_match = span.is_match;
      }
      break;
  }
  for (const Span& span : merged)
    if (span.end > span.begin) out.push_back(piece.substr(span.begin, span.end - span.begin));
}

bool is_ascii(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(const std::string& file, const SideFiles& side) : source_(file) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw DataError("cannot open tokenizer " + file, "check the path and its permissions");
    const json root = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded() || !root.is_object())
      throw DataError(file + " is not valid JSON",
                      "a tokenizer.json is written by Hugging Face tokenizers (tokenizer.save or save_pretrained)");
    if (!root.contains("model") || !root["model"].is_object())
      throw DataError(file + " has no \"model\" object", "is this a Hugging Face tokenizer.json?");
    try {
      read_model(root["model"]);
      read_added_tokens(root.value("added_tokens", json::array()));
      read_normalizer(root.value("normalizer", json()));
      normalizers_only_forms_ = std::all_of(normalizers_.begin(), normalizers_.end(), [](const NormalizerStep& step) {
        return step.kind == NormalizerStep::Kind::kForm;
      });
      index_added_tokens();
      read_pre_tokenizer(root.value("pre_tokenizer", json()));
      if (pre_steps_.empty() || !pre_steps_.back().byte_level)
        unsupported("a pre-tokenizer without ByteLevel", "ByteLevel as the last pre-tokenizer (byte-level BPE)");
      read_decoder(root.value("decoder", json()));
      read_post_processor(root.value("post_processor", json()));
    } catch (const json::exception& error) {
      invalid(std::string("unexpected JSON: ") + error.what());
    }
    read_special_ids(side);
    decode_tokens();
  }

  std::vector<std::int32_t> encode(std::string_view text) const override {
    if (!is_valid_utf8(text))
      throw DataError("text is not valid UTF-8 (tokenizer " + source_ + ")", "fix the encoding of the data file");
    std::vector<std::int32_t> ids;
    ids.reserve(text.size() / 3 + 8);
    // Reused from call to call on this thread (the views in them are dropped before the call returns).
    thread_local std::vector<Piece> raw_pieces, pieces;
    thread_local std::vector<std::string_view> words;
    raw_pieces.clear();
    raw_token_matcher_.split(text, raw_pieces);
    std::forward_list<std::string> storage;  // normalized texts and prefixed words the views point into
    for (const Piece& raw : raw_pieces) {
      if (raw.token_id >= 0) {
        ids.push_back(raw.token_id);
        continue;
      }
      std::string_view normalized = raw.text;
      // Unicode forms leave ASCII text as it is: no normalized copy of it.
      if (!normalizers_.empty() && !(normalizers_only_forms_ && is_ascii(raw.text)))
        normalized = storage.emplace_front(apply_normalizers(raw.text));
      pieces.clear();
      normalized_token_matcher_.split(normalized, pieces);
      for (const Piece& piece : pieces) {
        if (piece.token_id >= 0) {
          ids.push_back(piece.token_id);
          continue;
        }
        words.clear();
        pre_tokenize(piece.text, storage, words);
        for (const std::string_view word : words) encode_word(word, ids);
      }
    }
    raw_pieces.clear();
    pieces.clear();
    words.clear();
    return ids;
  }

  std::string decode(std::span<const std::int32_t> ids, bool skip_special) const override {
    std::string bytes;
    for (const std::int32_t id : ids) {
      if (id < 0 || static_cast<std::size_t>(id) >= id_to_token_.size() || !has_token_[id]) continue;
      if (skip_special && is_special_[id]) continue;
      bytes += token_bytes_[static_cast<std::size_t>(id)];
    }
    return utf8_lossy(bytes);
  }

  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(id_to_token_.size()); }
  std::optional<std::int32_t> eos_id() const override { return eos_; }
  std::optional<std::int32_t> pad_id() const override { return pad_; }
  std::optional<std::int32_t> bos_id() const override { return bos_; }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    for (const AddedToken& added : added_tokens_)
      if (added.content == token || added.pattern == token) return added.id;
    if (const auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }
  SpecialTokenTemplate special_token_template() const override { return template_; }
  const std::string& source() const override { return source_; }
  const std::vector<std::string>& token_bytes() const { return token_bytes_; }

 private:
  [[noreturn]] void unsupported(const std::string& what, const std::string& supported) const {
    throw DataError(source_ + ": " + what + " is not supported; supported: " + supported,
                    "trainer reads byte-level BPE tokenizer.json files (Qwen2, Llama-3, GPT-2, CLIP); for T5 or "
                    "Llama-2 use the spiece.model / tokenizer.model SentencePiece file (tokenizer.kind=sentencepiece)");
  }
  [[noreturn]] void invalid(const std::string& what) const {
    throw DataError(source_ + ": " + what, "the file looks damaged: save it again with Hugging Face tokenizers");
  }

  // The bytes of every token, as decode() joins them: tokenizers' ByteLevel decoder maps each character back to its
  // byte; a token with a character outside the alphabet (an added token with a space, say) is taken as it is.
  void decode_tokens() {
    token_bytes_.assign(id_to_token_.size(), std::string());
    for (std::size_t id = 0; id < id_to_token_.size(); ++id) {
      const std::string& token = id_to_token_[id];
      if (!has_token_[id] || !byte_level_decoder_) {
        token_bytes_[id] = token;
        continue;
      }
      std::string bytes;
      bool all_mapped = true;
      for (std::size_t pos = 0; pos < token.size();) {
        const char32_t c = next_code_point(token, pos);
        const auto it = unicode_to_byte_.find(c);
        if (it == unicode_to_byte_.end()) {
          all_mapped = false;
          break;
        }
        bytes += static_cast<char>(it->second);
      }
      token_bytes_[id] = all_mapped ? bytes : token;
    }
  }

  void set_token(std::int32_t id, const std::string& token) {
    if (id < 0) invalid("negative token id " + std::to_string(id) + " for \"" + token + "\"");
    const auto index = static_cast<std::size_t>(id);
    if (index >= id_to_token_.size()) {
      id_to_token_.resize(index + 1);
      has_token_.resize(index + 1, false);
      is_special_.resize(index + 1, false);
    }
    id_to_token_[index] = token;
    has_token_[index] = true;
  }

  void read_model(const json& model) {
    const std::string type = model.value("type", std::string("BPE"));
    if (type != "BPE") unsupported("model type \"" + type + "\"", "BPE (byte-level)");
    if (model.contains("dropout") && model["dropout"].is_number() && model["dropout"].get<double>() > 0.0)
      unsupported("BPE dropout", "dropout null or 0");
    if (model.value("byte_fallback", false))
      unsupported("BPE with byte_fallback (Llama-2 style)", "byte-level BPE");
    if (model.contains("continuing_subword_prefix") && model["continuing_subword_prefix"].is_string())
      subword_prefix_ = model["continuing_subword_prefix"].get<std::string>();
    if (model.contains("end_of_word_suffix") && model["end_of_word_suffix"].is_string())
      word_suffix_ = model["end_of_word_suffix"].get<std::string>();
    if (model.value("fuse_unk", false)) unsupported("BPE with fuse_unk", "fuse_unk false");
    ignore_merges_ = model.value("ignore_merges", false);
    if (!model.contains("vocab") || !model["vocab"].is_object()) invalid("model.vocab is not an object");
    for (const auto& [token, id] : model["vocab"].items()) {
      if (!id.is_number_integer()) invalid("model.vocab[\"" + token + "\"] is not an integer");
      vocab_.emplace(token, id.get<std::int32_t>());
      set_token(id.get<std::int32_t>(), token);
    }
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const auto it = vocab_.find(model["unk_token"].get<std::string>());
      if (it != vocab_.end()) unk_id_ = it->second;
    }
    const auto& alphabet = byte_to_unicode();
    const auto id_of = [&](const std::string& token) {
      const auto it = vocab_.find(token);
      return it == vocab_.end() ? -1 : it->second;
    };
    // A word's symbols before merging: its first byte bare, later ones with the continuing-subword prefix, the
    // last one with the end-of-word suffix (a one-byte word: bare + suffix), as tokenizers' BPE::merge_word.
    for (int b = 0; b < 256; ++b) {
      const auto& character = alphabet[static_cast<std::size_t>(b)];
      const auto index = static_cast<std::size_t>(b);
      byte_ids_[index] = id_of(character);
      inner_byte_ids_[index] = id_of(subword_prefix_ + character);
      last_byte_ids_[index] = id_of(subword_prefix_ + character + word_suffix_);
      only_byte_ids_[index] = id_of(character + word_suffix_);
      std::size_t pos = 0;
      unicode_to_byte_.emplace(next_code_point(character, pos), static_cast<unsigned char>(b));
    }
    const json merges = model.value("merges", json::array());
    if (!merges.is_array()) invalid("model.merges is not an array");
    std::int32_t rank = 0;
    for (const auto& merge : merges) {
      std::string left, right;
      if (merge.is_string()) {
        const std::string text = merge.get<std::string>();
        const auto space = text.find(' ');
        if (space == std::string::npos) invalid("merge \"" + text + "\" is not two tokens separated by a space");
        left = text.substr(0, space);
        right = text.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      } else {
        invalid("merge " + merge.dump() + " is neither \"a b\" nor [\"a\", \"b\"]");
      }
      // The merged token drops the right side's continuing-subword prefix ("a" + "##b" -> "ab").
      const std::string joined =
          left + (right.starts_with(subword_prefix_) ? right.substr(subword_prefix_.size()) : right);
      const auto a = vocab_.find(left), b = vocab_.find(right), merged = vocab_.find(joined);
      if (a == vocab_.end() || b == vocab_.end() || merged == vocab_.end())
        invalid("merge \"" + left + " " + right + "\" uses a token that is not in the vocabulary");
      merges_.emplace(pair_key(a->second, b->second), Merge{rank++, merged->second});
    }
  }

  void read_added_tokens(const json& added) {
    if (!added.is_array()) invalid("added_tokens is not an array");
    for (const auto& entry : added) {
      if (!entry.is_object() || !entry.contains("id") || !entry.contains("content"))
        invalid("added token " + entry.dump() + " needs \"id\" and \"content\"");
      AddedToken token;
      token.id = entry["id"].get<std::int32_t>();
      token.content = entry["content"].get<std::string>();
      token.single_word = entry.value("single_word", false);
      token.lstrip = entry.value("lstrip", false);
      token.rstrip = entry.value("rstrip", false);
      token.special = entry.value("special", false);
      token.normalized = entry.value("normalized", !token.special);
      added_tokens_.push_back(token);
    }
    for (const AddedToken& token : added_tokens_) {
      set_token(token.id, token.content);
      is_special_[static_cast<std::size_t>(token.id)] = token.special;
    }
  }

  // After the normalizer is known: `normalized` tokens are matched in their normalized form.
  void index_added_tokens() {
    for (AddedToken& token : added_tokens_) {
      token.pattern = token.content;
      if (token.normalized) {
        token.pattern = apply_normalizers(token.pattern);
        id_to_token_[static_cast<std::size_t>(token.id)] = token.pattern;  // tokenizers decodes it normalized too
      }
      (token.normalized ? normalized_token_matcher_ : raw_token_matcher_).add(&token);
    }
  }

  // A {"Regex": ...} or {"String": ...} pattern of a Replace normalizer or a Split pre-tokenizer (`what`).
  std::unique_ptr<Regex> read_pattern(const json& pattern, const std::string& what) const {
    try {
      if (pattern.contains("Regex")) return std::make_unique<Regex>(pattern["Regex"].get<std::string>(), false);
      if (pattern.contains("String")) return std::make_unique<Regex>(pattern["String"].get<std::string>(), true);
    } catch (const std::invalid_argument& error) {
      invalid(what + " pattern: " + error.what());
    }
    invalid(what + " without a {\"Regex\": ...} or {\"String\": ...} pattern");
  }

  void read_normalizer(const json& normalizer) {
    if (normalizer.is_null()) return;
    const std::string type = normalizer.value("type", std::string());
    if (type == "Sequence") {
      for (const auto& step : normalizer.value("normalizers", json::array())) read_normalizer(step);
      return;
    }
    static const std::pair<const char*, NormalForm> kForms[] = {
        {"NFC", NormalForm::kNfc}, {"NFD", NormalForm::kNfd}, {"NFKC", NormalForm::kNfkc}, {"NFKD", NormalForm::kNfkd}};
    NormalizerStep step;
    for (const auto& [name, form] : kForms)
      if (type == name) {
        step.form = form;
        normalizers_.push_back(std::move(step));
        return;
      }
    if (type == "Lowercase") {
      step.kind = NormalizerStep::Kind::kLowercase;
      normalizers_.push_back(std::move(step));
      return;
    }
    if (type == "Replace") {
      step.kind = NormalizerStep::Kind::kReplace;
      step.pattern = read_pattern(normalizer.value("pattern", json()), "Replace normalizer");
      step.content = normalizer.value("content", std::string());
      normalizers_.push_back(std::move(step));
      return;
    }
    unsupported("normalizer \"" + type + "\"", "none, NFC, NFD, NFKC, NFKD, Replace, Lowercase, or a Sequence of them");
  }

  std::string apply_normalizers(std::string_view text) const {
    std::string current(text);
    for (const NormalizerStep& step : normalizers_) {
      switch (step.kind) {
        case NormalizerStep::Kind::kForm: current = normalize(current, step.form); break;
        case NormalizerStep::Kind::kLowercase: current = to_lowercase(current); break;
        case NormalizerStep::Kind::kReplace: {
          std::string replaced;
          std::size_t done = 0;
          for (const auto& [begin, end] : step.pattern->find_all(current)) {
            replaced.append(current, done, begin - done);
            replaced += step.content;
            done = end;
          }
          replaced.append(current, done);
          current = std::move(replaced);
          break;
        }
      }
    }
    return current;
  }

  void read_pre_tokenizer(const json& pre_tokenizer) {
    if (pre_tokenizer.is_null()) unsupported("a tokenizer without pre_tokenizer", "ByteLevel (last) after Split");
    const std::string type = pre_tokenizer.value("type", std::string());
    if (type == "Sequence") {
      for (const auto& step : pre_tokenizer.value("pretokenizers", json::array())) read_pre_tokenizer(step);
    } else if (!pre_steps_.empty() && pre_steps_.back().byte_level) {
      unsupported("pre-tokenizer \"" + type + "\" after ByteLevel", "ByteLevel as the last pre-tokenizer");
    } else if (type == "ByteLevel") {
      PreTokenizerStep step;
      step.byte_level = true;
      step.add_prefix_space = pre_tokenizer.value("add_prefix_space", false);
      if (pre_tokenizer.value("use_regex", true)) step.regex = std::make_unique<Regex>(kGpt2Pattern, false);
      pre_steps_.push_back(std::move(step));
    } else if (type == "Split") {
      PreTokenizerStep step;
      step.regex = read_pattern(pre_tokenizer.value("pattern", json()), "Split pre-tokenizer");
      static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
          {"Removed", SplitBehavior::kRemoved},
          {"Isolated", SplitBehavior::kIsolated},
          {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
          {"MergedWithNext", SplitBehavior::kMergedWithNext},
          {"Contiguous", SplitBehavior::kContiguous}};
      const std::string behavior = pre_tokenizer.value("behavior", std::string("Isolated"));
      bool known = false;
      for (const auto& [name, value] : kBehaviors)
        if (behavior == name) step.behavior = value, known = true;
      if (!known) invalid("Split behavior \"" + behavior + "\" is unknown");
      step.invert = pre_tokenizer.value("invert", false);
      pre_steps_.push_back(std::move(step));
    } else {
      unsupported("pre-tokenizer \"" + type + "\"", "Split (regex or string) and ByteLevel, alone or in a Sequence");
    }
  }

  void read_decoder(const json& decoder) {
    if (decoder.is_null()) return;
    const std::string type = decoder.value("type", std::string());
    if (type == "ByteLevel") {
      byte_level_decoder_ = true;
      return;
    }
    unsupported("decoder \"" + type + "\"", "ByteLevel or none");
  }

  std::optional<std::int32_t> special_token_id(const std::string& name, const json& special_tokens) const {
    if (special_tokens.is_object() && special_tokens.contains(name)) {
      const auto& ids = special_tokens[name].value("ids", json::array());
      if (ids.size() == 1 && ids[0].is_number_integer()) return ids[0].get<std::int32_t>();
    }
    return token_to_id(name);
  }

  void read_post_processor(const json& processor) {
    if (processor.is_null()) return;
    const std::string type = processor.value("type", std::string());
    if (type == "ByteLevel") return;  // offsets only
    if (type == "Sequence") {
      for (const auto& step : processor.value("processors", json::array())) read_post_processor(step);
      return;
    }
    if (type == "RobertaProcessing" || type == "BertProcessing") {
      // "cls": ["<s>", 0], "sep": ["</s>", 2]
      for (const char* key : {"cls", "sep"})
        if (!processor.contains(key) || !processor[key].is_array() || processor[key].size() != 2)
          invalid(type + " post_processor without \"" + key + "\": [token, id]");
      template_.prefix.push_back(processor["cls"][1].get<std::int32_t>());
      template_.suffix.push_back(processor["sep"][1].get<std::int32_t>());
      return;
    }
    if (type == "TemplateProcessing") {
      bool seen_sequence = false;
      for (const auto& item : processor.value("single", json::array())) {
        if (item.contains("Sequence")) {
          seen_sequence = true;
        } else if (item.contains("SpecialToken")) {
          const std::string name = item["SpecialToken"].value("id", std::string());
          const auto id = special_token_id(name, processor.value("special_tokens", json()));
          if (!id) invalid("TemplateProcessing names special token \"" + name + "\", which has no id");
          (seen_sequence ? template_.suffix : template_.prefix).push_back(*id);
        }
      }
      return;
    }
    unsupported("post_processor \"" + type + "\"",
                "none, ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing, or a Sequence of them");
  }

  void read_special_ids(const SideFiles& side) {
    const auto id_of = [&](const char* key) -> std::optional<std::int32_t> {
      const auto token = config_token(side, key);
      if (!token) return std::nullopt;
      const auto id = token_to_id(*token);
      if (!id)
        throw DataError(side.tokenizer_config_path + ": " + key + " \"" + *token + "\" is not a token of " + source_,
                        "the tokenizer_config.json belongs to another tokenizer?");
      return id;
    };
    eos_ = id_of("eos_token");
    pad_ = id_of("pad_token");
    bos_ = id_of("bos_token");
    // transformers replaces the post_processor with `bos? $A eos?` when add_bos_token/add_eos_token are given.
    const auto add_bos = config_flag(side, "add_bos_token");
    const auto add_eos = config_flag(side, "add_eos_token");
    if (add_bos || add_eos) {
      template_ = {};
      if (add_bos.value_or(false) && bos_) template_.prefix.push_back(*bos_);
      if (add_eos.value_or(false) && eos_) template_.suffix.push_back(*eos_);
    }
  }

  // Splits one normalized piece into words with every pre-tokenizer step in turn.
  void pre_tokenize(std::string_view text, std::forward_list<std::string>& storage,
                    std::vector<std::string_view>& words) const {
    words.push_back(text);
    thread_local std::vector<std::string_view> next;  // reused: no allocation per piece
    for (const PreTokenizerStep& step : pre_steps_) {
      next.clear();
      for (std::string_view word : words) {
        if (step.add_prefix_space && (word.empty() || word.front() != ' '))
          word = storage.emplace_front(" " + std::string(word));
        if (step.regex) split_by_pattern(word, step, next);
        else if (!word.empty()) next.push_back(word);
      }
      words.swap(next);
    }
    next.clear();
  }

  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  // The BPE ids of one word (raw bytes; the byte alphabet is applied here).
  void encode_word(std::string_view word, std::vector<std::int32_t>& ids) const {
    const auto& alphabet = byte_to_unicode();
    if (ignore_merges_) {
      std::string mapped;
      for (const char byte : word) mapped += alphabet[static_cast<unsigned char>(byte)];
      if (const auto it = vocab_.find(mapped); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    const bool cacheable = word.size() <= kMaxCachedWordBytes;
    // A thread's own direct-mapped cache of recent words in front of the shared one: no lock, no bucket chain.
    struct CachedWord {
      std::string word;
      std::vector<std::int32_t> ids;
    };
    struct ThreadCache {
      std::uint64_t owner = 0;  // the tokenizer's number
      std::vector<CachedWord> slots;
    };
    thread_local ThreadCache thread_cache;
    CachedWord* slot = nullptr;
    if (cacheable) {
      if (thread_cache.owner != number_) {
        thread_cache.slots.assign(kThreadCacheSlots, CachedWord{});
        thread_cache.owner = number_;
      }
      slot = &thread_cache.slots[StringHash{}(word) & (kThreadCacheSlots - 1)];
      if (!slot->ids.empty() && slot->word == word) {
        ids.insert(ids.end(), slot->ids.begin(), slot->ids.end());
        return;
      }
      std::shared_lock lock(cache_mutex_);
      if (const auto it = cache_.find(word); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        slot->word.assign(word);
        slot->ids = it->second;
        return;
      }
    }
    std::vector<std::int32_t> symbols;
    symbols.reserve(word.size());
    for (std::size_t i = 0; i < word.size(); ++i) {
      const auto byte = static_cast<unsigned char>(word[i]);
      const bool first = i == 0, last = i + 1 == word.size();
      const std::int32_t id = first ? (last ? only_byte_ids_[byte] : byte_ids_[byte])
                                    : (last ? last_byte_ids_[byte] : inner_byte_ids_[byte]);
      if (id >= 0) symbols.push_back(id);
      else if (unk_id_) symbols.push_back(*unk_id_);  // tokenizers drops a missing byte when there is no unk
    }
    merge(symbols);
    ids.insert(ids.end(), symbols.begin(), symbols.end());
    if (slot) {
      slot->word.assign(word);
      slot->ids = symbols;
    }
    if (cacheable) {
      std::unique_lock lock(cache_mutex_);
      if (cache_.size() < kMaxCacheEntries) cache_.emplace(std::string(word), std::move(symbols));
    }
  }

  // Repeatedly merges the lowest-ranked adjacent pair (leftmost on ties): tokenizers' priority-queue order.
  // Short words scan for the best pair each round; long ones (a minified line is one \p{L}+ word) use a heap.
  void merge(std::vector<std::int32_t>& symbols) const {
    if (symbols.size() > kHeapMergeThreshold) return merge_with_heap(symbols);
    while (symbols.size() > 1) {
      std::int32_t best_rank = std::numeric_limits<std::int32_t>::max(), best_id = -1;
      std::size_t best_pos = 0;
      for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto it = merges_.find(pair_key(symbols[i], symbols[i + 1]));
        if (it != merges_.end() && it->second.rank < best_rank) {
          best_rank = it->second.rank;
          best_id = it->second.id;
          best_pos = i;
        }
      }
      if (best_id < 0) return;
      symbols[best_pos] = best_id;
      symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best_pos) + 1);
    }
  }

  void merge_with_heap(std::vector<std::int32_t>& symbols) const {
    const auto n = static_cast<std::int64_t>(symbols.size());
    std::vector<std::int64_t> next(static_cast<std::size_t>(n)), previous(static_cast<std::size_t>(n));
    std::vector<bool> alive(static_cast<std::size_t>(n), true);
    for (std::int64_t i = 0; i < n; ++i) {
      next[static_cast<std::size_t>(i)] = i + 1 < n ? i + 1 : -1;
      previous[static_cast<std::size_t>(i)] = i - 1;
    }
    struct Candidate {
      std::int32_t rank;
      std::int64_t pos;
      std::int32_t left, right;
      bool operator>(const Candidate& other) const {
        return rank != other.rank ? rank > other.rank : pos > other.pos;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    const auto push = [&](std::int64_t pos) {
      if (pos < 0) return;
      const std::int64_t right = next[static_cast<std::size_t>(pos)];
      if (right < 0) return;
      const std::int32_t a = symbols[static_cast<std::size_t>(pos)], b = symbols[static_cast<std::size_t>(right)];
      if (const auto it = merges_.find(pair_key(a, b)); it != merges_.end()) heap.push({it->second.rank, pos, a, b});
    };
    for (std::int64_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Candidate top = heap.top();
      heap.pop();
      const auto pos = static_cast<std::size_t>(top.pos);
      const std::int64_t right = next[pos];
      if (!alive[pos] || right < 0 || symbols[pos] != top.left ||
          symbols[static_cast<std::size_t>(right)] != top.right)
        continue;  // stale: one side was merged since
      symbols[pos] = merges_.at(pair_key(top.left, top.right)).id;
      alive[static_cast<std::size_t>(right)] = false;
      next[pos] = next[static_cast<std::size_t>(right)];
      if (next[pos] >= 0) previous[static_cast<std::size_t>(next[pos])] = top.pos;
      push(previous[pos]);
      push(top.pos);
    }
    std::size_t kept = 0;
    for (std::size_t i = 0; i < symbols.size(); ++i)
      if (alive[i]) symbols[kept++] = symbols[i];
    symbols.resize(kept);
  }

  struct Merge {
    std::int32_t rank;
    std::int32_t id;
  };

  std::string source_;
  StringMap<std::int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<std::string> token_bytes_;  // what decode() writes for each id (decode_tokens)
  std::vector<bool> has_token_, is_special_;
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::array<std::int32_t, 256> byte_ids_{}, inner_byte_ids_{}, last_byte_ids_{}, only_byte_ids_{};
  std::string subword_prefix_, word_suffix_;  // BPE continuing_subword_prefix and end_of_word_suffix (CLIP: "</w>")
  std::unordered_map<char32_t, unsigned char> unicode_to_byte_;
  std::optional<std::int32_t> unk_id_;
  bool ignore_merges_ = false;
  std::deque<AddedToken> added_tokens_;  // stable addresses for the matchers
  AddedTokenMatcher raw_token_matcher_, normalized_token_matcher_;
  std::vector<NormalizerStep> normalizers_;
  bool normalizers_only_forms_ = false;  // NFC, NFD, NFKC, NFKD only: ASCII text is its own normalization
  std::vector<PreTokenizerStep> pre_steps_;
  bool byte_level_decoder_ = false;
  SpecialTokenTemplate template_;
  std::optional<std::int32_t> eos_, pad_, bos_;

  const std::uint64_t number_ = next_tokenizer_number.fetch_add(1);
  mutable std::shared_mutex cache_mutex_;
  mutable StringMap<std::vector<std::int32_t>> cache_;
};

}  // namespace

const std::vector<std::string>* decoded_token_bytes(const Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(&tokenizer);
  return bpe ? &bpe->token_bytes() : nullptr;
}

std::unique_ptr<Tokenizer> load_bpe_json(const std::string& file, const SideFiles& side) {
  return std::make_unique<BpeTokenizer>(file, side);
}

}  // namespace trainer::tokenizer_detail
