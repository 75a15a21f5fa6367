// One JSONL record -> one tokenized Example: field mapping, validation, tokenization and the length policy.
// Pure and thread-safe (the tokenizer's encode is const): the loader's worker threads call map_record
// concurrently. No LibTorch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer::data {

struct ChatSetup;  // data/chat_record.h: the chat template that renders "messages" records

struct MappingSpec {
  DataFamily family = DataFamily::kSeq2Seq;
  std::string input_field = "input", target_field = "target";
  std::string text_field = "text", prompt_field = "prompt", completion_field = "completion";
  std::int64_t max_input_length = 512, max_target_length = 128, max_length = 1024;
  OverlengthPolicy on_overlength = OverlengthPolicy::kTruncate;
  bool add_eos = true;
  // Chat records ("messages"): the template, its special tokens and data.train_on; loaded by mapping_spec for
  // causal models (a missing or unparsable template is reported at the first chat record, not before).
  std::shared_ptr<const ChatSetup> chat;
  bool keep_chat_text = false;  // fill Outcome::chat_text (trainer data --dump); training leaves it off
};
MappingSpec mapping_spec(const Config& config, DataFamily family);

enum class OutcomeKind { kExample, kBadRecord, kOverlengthSkipped };

struct Outcome {
  OutcomeKind kind = OutcomeKind::kExample;
  Example example;         // kExample
  bool truncated = false;  // kExample cut to the maximum length
  std::string problem;     // kBadRecord, kOverlengthSkipped: what is wrong, without the file:line
  std::string hint;        // kBadRecord: the likely fix, when it is not the generic one
  bool fatal = false;      // kBadRecord that every record of its kind would have (no chat template): stop even
                           // with data.on_bad_record = skip
  std::string chat_text;   // chat records with MappingSpec::keep_chat_text: the rendered conversation
  // Chat records with MappingSpec::keep_chat_text: how the loss mask was made: "all" (data.train_on=all),
  // "generation" (the template's {% generation %} blocks), "training_template" (trainer's training version of a
  // template it recognises), "prefix" (rendering prefix by prefix) or "probe" (probing the template).
  std::string chat_mask;
};

// A bad record (`hint`: the likely fix when it is not the generic one; `fatal`: every record of its kind would have
// it, so it stops the run even with data.on_bad_record = skip), and a record skipped for its length.
Outcome bad_record(std::string what, std::string hint = {}, bool fatal = false);
Outcome overlength_skipped(std::string what);

// Maps one record (a line of JSON, without its newline). Never throws for bad data: a bad record is an Outcome,
// so the loader decides (in record order) whether to stop or to count and skip it.
Outcome map_record(std::string_view line, const MappingSpec& spec, const Tokenizer& tokenizer);

class TableRows;  // data/table_file.h

// Maps row `row` of a Parquet/Arrow row group as map_record maps its JSON text, but from the Arrow values (no text
// rendered and parsed again); chat rows, and rows whose values the direct path refuses (TableRows::object), go
// through the text (`scratch`), so every outcome and message is map_record's.
Outcome map_table_row(const TableRows& rows, std::uint64_t row, std::string& scratch, const MappingSpec& spec,
                      const Tokenizer& tokenizer);

// The length policy for causal examples (data.max_length, data.on_overlength): cut at the end, labels with their
// tokens; skipped when nothing trained is left.
Outcome finish_causal(Example example, const MappingSpec& spec);

// The byte offset of the first invalid UTF-8 sequence (overlong forms and surrogates included), or npos.
std::size_t find_invalid_utf8(std::string_view text);

}  // namespace trainer::data
