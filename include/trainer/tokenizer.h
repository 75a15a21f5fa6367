// Text <-> token ids: one interface over SentencePiece models (T5, FLAN-T5, Llama-2) and Hugging Face
// tokenizer.json byte-level BPE (Qwen2, Llama-3, GPT-2), plus the model family's special-token convention.
// Needs no LibTorch: the data pipeline's worker threads call encode() concurrently (it is const and thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/config.h"

namespace trainer {

// The special tokens transformers' `tokenizer(text)` (add_special_tokens=True) puts around one sequence.
struct SpecialTokenTemplate {
  std::vector<std::int32_t> prefix;  // e.g. Llama's <s> / <|begin_of_text|>
  std::vector<std::int32_t> suffix;  // e.g. T5's </s>
  bool operator==(const SpecialTokenTemplate&) const = default;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The ids of `text`, no special tokens added. Special tokens written in the text are recognised as the
  // library the file comes from does (tokenizers: added tokens are split out; sentencepiece: only its
  // user-defined symbols).
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // The text of `ids`; with skip_special, special tokens (control symbols, special added tokens) are left out.
  // Ids outside the vocabulary are skipped.
  virtual std::string decode(std::span<const std::int32_t> ids, bool skip_special = true) const = 0;

  // One past the largest id the tokenizer can produce (added tokens included).
  virtual std::int64_t vocab_size() const = 0;
  virtual std::optional<std::int32_t> eos_id() const = 0;
  virtual std::optional<std::int32_t> pad_id() const = 0;
  virtual std::optional<std::int32_t> bos_id() const = 0;
  // The id of one whole token (a special or added token, or a vocabulary entry), if there is one.
  virtual std::optional<std::int32_t> token_to_id(std::string_view token) const = 0;
  // What transformers adds around a single sequence for this tokenizer (see load_tokenizer for the rules).
  virtual SpecialTokenTemplate special_token_template() const = 0;
  // The file the tokenizer was loaded from, for messages.
  virtual const std::string& source() const = 0;
};

// Loads a tokenizer from a file or a model directory.
// kind auto: a directory with spiece.model or tokenizer.model uses it (sentencepiece; the original of a T5 or
// Llama-2 tokenizer, whose tokenizer.json is Unigram or Metaspace BPE), else tokenizer.json (byte-level BPE);
// a file is read as tokenizer.json when its name ends in .json, else as a sentencepiece model.
// Special ids and the special-token template also read tokenizer_config.json (and config.json) beside the file:
//   - sentencepiece: T5 (spiece.model, or model_type t5) appends </s>; otherwise (Llama-2) prepends <s>;
//     tokenizer_config.json's add_bos_token / add_eos_token override either.
//   - tokenizer.json: the post_processor (TemplateProcessing's single template, RobertaProcessing,
//     BertProcessing; ByteLevel adds nothing, as for Qwen2); tokenizer_config.json's add_bos_token /
//     add_eos_token, when present, replace it with bos? $A eos? as transformers' update_post_processor does.
// Throws DataError naming the file, with what is supported, when the file is missing or cannot be used.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path_or_dir, TokenizerKind kind = TokenizerKind::kAuto);

// The ids of one training text under the family's convention: special_token_template() around encode(text).
// With add_eos, the sequence ends in EOS even when transformers' template adds none (Qwen2, Llama-3 base): a
// causal model must see EOS to learn to stop, which is what TRL's SFTTrainer appends too. Without add_eos,
// a trailing EOS from the template (T5's </s>) is left off; a BOS prefix is always kept.
std::vector<std::int32_t> encode_for_training(const Tokenizer& tokenizer, std::string_view text, bool add_eos);

}  // namespace trainer
