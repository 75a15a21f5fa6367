// Chat records for causal models: {"messages": [...], "tools": [...]} rendered by the model's chat template (as
// transformers' apply_chat_template does), tokenized as one text, and labelled on the assistant's turns
// (data.train_on). No LibTorch; thread-safe like the rest of record mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/jinja.h"
#include "data/record.h"
#include "trainer/config.h"
#include "trainer/tokenizer.h"

namespace trainer::data {

inline constexpr const char* kMessagesField = "messages";
inline constexpr const char* kToolsField = "tools";

// The chat template of a run, parsed once and shared by the worker threads.
struct ChatSetup {
  std::string model;  // the directory the template and special tokens come from (for messages)
  TrainOn train_on = TrainOn::kAssistant;
  std::optional<chat::Template> plain;       // for records without tools
  std::optional<chat::Template> with_tools;  // for records with tools (a "tool_use" template when there is one)
  std::string plain_origin, tools_origin;    // where each came from, for messages
  std::string plain_source, tools_source;    // their text (for the data fingerprint)
  bool plain_marks_generation = false, tools_marks_generation = false;  // {% generation %} in the template
  bool plain_swapped = false, tools_swapped = false;  // trainer's training version replaced the model's template
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  // Why no template can be used (none found, a syntax error): reported at the first chat record, so data without
  // chat records never needs one.
  std::string error, hint;
};

// data.chat_template (a file) or the template of the tokenizer's directory (tokenizer.path, else model.path), the
// special tokens of its tokenizer_config.json, and data.train_on. Never throws: problems go into `error`.
std::shared_ptr<const ChatSetup> load_chat_setup(const Config& config);

// Maps one chat record (parsed with its key order). Bad records are Outcomes (see record.h).
Outcome map_chat(const nlohmann::ordered_json& record, const MappingSpec& spec, const Tokenizer& tokenizer);

// Token k of `ids` covers bytes [ranges[k].first, ranges[k].second) of `text` (tokens that share a UTF-8 character
// cover all of it). Nothing when the tokens do not decode back to the text (a normalizer changed it, or a
// SentencePiece prefix space), so byte spans cannot be placed on tokens.
using TokenRanges = std::vector<std::pair<std::size_t, std::size_t>>;
std::optional<TokenRanges> token_byte_ranges(const Tokenizer& tokenizer, std::string_view text,
                                             const std::vector<std::int32_t>& ids);

// transformers' return_assistant_tokens_mask from byte spans: for each span, the tokens from the one holding its
// first byte through the one holding its last byte. Spans beyond the tokens stop the marking (as there).
std::vector<bool> tokens_in_spans(const TokenRanges& token_ranges, const std::vector<chat::Span>& spans);

}  // namespace trainer::data
