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

// Whether `path_or_dir` is a tokenizer file, or a directory holding one load_tokenizer would take for `kind`.
bool has_tokenizer(const std::string& path_or_dir, TokenizerKind kind = TokenizerKind::kAuto);

// For pre-tokenized data (records with input_ids) and a model directory without tokenizer files: a Tokenizer with
// no vocabulary whose ids come from the model's config.json, then generation_config.json: vocab_size, eos_token_id
// and pad_token_id (a list's first id; pad falls back to EOS as with a tokenizer that has none). encode() and
// decode() throw UsageError saying that text needs a tokenizer and how to give one. Throws DataError naming the
// files and keys when neither gives a pad or an EOS id (collation needs one to pad with).
std::unique_ptr<Tokenizer> ids_only_tokenizer(const std::string& model_dir);
// Whether `tokenizer` is an ids_only_tokenizer (it cannot encode or decode text).
bool is_ids_only(const Tokenizer& tokenizer);

// The tokenizer of a run (`trainer train`, `trainer data`): tokenizer.path, else model.path's; when model.path has
// no tokenizer files and tokenizer.path is unset, the ids_only_tokenizer (pre-tokenized records only; logged).
// With `samples` (training), evaluation.sample_prompts need a real tokenizer: UsageError saying so otherwise.
std::unique_ptr<Tokenizer> load_run_tokenizer(const Config& config, bool samples);

// The ids of one training text under the family's convention: special_token_template() around encode(text).
// With add_eos, the sequence ends in EOS even when transformers' template adds none (Qwen2, Llama-3 base): a
// causal model must see EOS to learn to stop, which is what TRL's SFTTrainer appends too. Without add_eos,
// a trailing EOS from the template (T5's </s>) is left off; a BOS prefix is always kept.
std::vector<std::int32_t> encode_for_training(const Tokenizer& tokenizer, std::string_view text, bool add_eos);

}  // namespace trainer
