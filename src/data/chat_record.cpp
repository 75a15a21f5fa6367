// Chat records: validation of the messages, rendering by the chat template, tokenization of the whole rendering,
// and the loss mask from the assistant's byte spans (see chat_record.h).
#include "data/chat_record.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <set>
#include <span>
#include <sstream>

#include <spdlog/spdlog.h>

#include "chat/chat_template.h"
#include "chat/training_templates.h"
#include "io/sha256.h"
#include "tokenizer/token_bytes.h"
#include "tokenizer/unicode.h"
#include "trainer/errors.h"

namespace trainer::data {
namespace {

using nlohmann::ordered_json;
namespace fs = std::filesystem;

Outcome chat_problem(std::string what, std::string hint = {}, bool fatal = false) {
  return bad_record(std::move(what), std::move(hint), fatal);
}

bool marks_generation(const std::string& source) {
  static const std::regex generation(R"(\{%-?\s*generation\s*-?%\})");
  return std::regex_search(source, generation);
}

// What is wrong with the messages of a record, or nothing.
std::string check_messages(const ordered_json& messages) {
  const std::string field = std::string("field \"") + kMessagesField + "\"";
  if (!messages.is_array())
    return field + " must be a list of message objects, not " + std::string(messages.type_name());
  if (messages.empty()) return field + " is an empty list";
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ordered_json& message = messages[i];
    const std::string at = std::string(kMessagesField) + "[" + std::to_string(i) + "]";
    if (!message.is_object())
      return at + " must be an object with \"role\" and \"content\", not " + message.type_name();
    const auto role = message.find("role");
    if (role == message.end()) return at + " has no \"role\"";
    if (!role->is_string()) return at + ".role must be a string, not " + std::string(role->type_name());
    const auto tool_calls = message.find("tool_calls");
    const bool has_tool_calls = tool_calls != message.end() && !tool_calls->is_null();
    if (has_tool_calls && !tool_calls->is_array())
      return at + ".tool_calls must be a list, not " + std::string(tool_calls->type_name());
    const auto content = message.find("content");
    if (content == message.end() || content->is_null()) {
      if (has_tool_calls) continue;  // an assistant turn that only calls tools
      return at + " (role \"" + role->get<std::string>() + "\") has no \"content\"";
    }
    if (content->is_string()) continue;
    if (!content->is_array())
      return at + ".content must be a string or a list of content parts, not " + std::string(content->type_name());
    for (std::size_t k = 0; k < content->size(); ++k)
      if (!(*content)[k].is_object())
        return at + ".content[" + std::to_string(k) + "] must be a content part object ({\"type\": \"text\", "
                    "\"text\": ...}), not " + (*content)[k].type_name();
  }
  return {};
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read " + path.string(), "check that the file exists and is readable");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Whether `key` is seen for the first time in this process, for messages logged once per template file: a run loads
// the setup for its training data, its validation data and its resume check, and maps records on several threads.
bool first_time(const std::string& key) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  const std::lock_guard lock(mutex);
  return seen.insert(key).second;
}

// TRL's SFTTrainer(assistant_only_loss=True) swaps a recognised template without {% generation %} for its training
// version and renders with that (the ids change where the version keeps what the original drops, Qwen3's reasoning):
// the same here, for the families of chat/training_templates.h. The model's template is recognised by its exact text.
bool use_training_version(std::string& source, std::string& origin) {
  if (marks_generation(source)) return false;
  hub::Sha256 digest;
  digest.update(source.data(), source.size());
  const chat::TrainingTemplate* found = chat::training_template_for(digest.hex_digest());
  if (!found) return false;
  if (first_time(origin + " (swapped)"))
    spdlog::info("chat template: {} is the {} template; the loss mask comes from trainer's training version of it "
                 "({{% generation %}} around the assistant's text), as TRL's SFTTrainer(assistant_only_loss=True) "
                 "swaps it",
                 origin, found->family);
  source = std::string(found->text);
  origin = "trainer's " + std::string(found->family) + " training template (in place of " + origin + ")";
  return true;
}

// Parses one template into `slot`; a syntax error goes into the setup's error.
void parse_into(ChatSetup& setup, const std::string& source, const std::string& origin,
                std::optional<chat::Template>& slot) {
  try {
    slot.emplace(source);
  } catch (const chat::TemplateError& e) {
    setup.error = origin + ": " + e.what();
    setup.hint = "fix the template, or set data.chat_template to a template file that parses";
  }
}

}  // namespace

std::shared_ptr<const ChatSetup> load_chat_setup(const Config& config) {
  auto setup = std::make_shared<ChatSetup>();
  setup->train_on = config.data.train_on;
  fs::path dir = config.tokenizer.path.empty() ? fs::path(config.model.path) : fs::path(config.tokenizer.path);
  if (fs::is_regular_file(dir)) dir = dir.parent_path();
  setup->model = dir.string();
  try {
    if (!config.data.chat_template.empty()) {
      const fs::path file = config.data.chat_template;
      setup->plain_source = setup->tools_source = read_file(file);
      setup->plain_origin = setup->tools_origin = file.string() + " (data.chat_template)";
      const auto tokenizer_config = dir / "tokenizer_config.json";
      if (fs::is_regular_file(tokenizer_config)) {
        try {
          setup->special_tokens = chat::special_tokens_from_config(ordered_json::parse(read_file(tokenizer_config)));
        } catch (const nlohmann::json::parse_error& e) {
          throw DataError(tokenizer_config.string() + ": invalid JSON: " + e.what(), "is the file complete?");
        }
      }
    } else {
      const chat::ModelChatTemplate plain = chat::load_chat_template(dir, false);
      const chat::ModelChatTemplate tools = chat::load_chat_template(dir, true);
      setup->plain_source = plain.source;
      setup->plain_origin = plain.origin;
      setup->tools_source = tools.source;
      setup->tools_origin = tools.origin;
      setup->special_tokens = plain.special_tokens;
    }
  } catch (const Error& e) {
    setup->error = e.what();
    setup->hint = e.hint();
    return setup;
  }
  // Only where assistant spans are needed: train_on=all trains every token of the model's own rendering, and
  // DPOTrainer renders with the model's template (its completion starts where the prompt's tokens and the pair's
  // part, so it needs no spans).
  if (config.data.train_on != TrainOn::kAll && config.training.objective != TrainingObjective::kDpo) {
    const bool same = setup->tools_source == setup->plain_source;
    setup->plain_swapped = use_training_version(setup->plain_source, setup->plain_origin);
    if (same) {
      setup->tools_source = setup->plain_source;
      setup->tools_origin = setup->plain_origin;
      setup->tools_swapped = setup->plain_swapped;
    } else {
      setup->tools_swapped = use_training_version(setup->tools_source, setup->tools_origin);
    }
  }
  parse_into(*setup, setup->plain_source, setup->plain_origin, setup->plain);
  if (setup->error.empty()) {
    if (setup->tools_source == setup->plain_source) setup->with_tools = setup->plain;
    else parse_into(*setup, setup->tools_source, setup->tools_origin, setup->with_tools);
  }
  setup->plain_marks_generation = marks_generation(setup->plain_source);
  setup->tools_marks_generation = marks_generation(setup->tools_source);
  return setup;
}

std::optional<TokenRanges> token_byte_ranges(const Tokenizer& tokenizer, std::string_view text,
                                             const std::vector<std::int32_t>& ids) {
  TokenRanges ranges;
  ranges.reserve(ids.size());
  std::size_t pos = 0, k = 0;
  // Byte-level BPE: the tokens' bytes, joined, are the text. A token is placed on its bytes; tokens that hold parts
  // of one UTF-8 character are placed together on the whole characters they cover (as transformers' offsets place
  // them), so no decoding is needed, and a text holding U+FFFD itself is placed like any other.
  if (const std::vector<std::string>* table = tokenizer_detail::decoded_token_bytes(tokenizer)) {
    const auto continuation = [&](std::size_t at) {
      return at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80;
    };
    while (k < ids.size()) {
      const std::size_t first = k, begin = pos;
      do {
        if (ids[k] < 0 || static_cast<std::size_t>(ids[k]) >= table->size()) return std::nullopt;
        const std::string& bytes = (*table)[static_cast<std::size_t>(ids[k])];
        if (bytes.empty() || text.compare(pos, bytes.size(), bytes) != 0) return std::nullopt;
        pos += bytes.size();
        ++k;
      } while (continuation(pos) && k < ids.size());
      for (std::size_t j = first; j < k; ++j) ranges.emplace_back(begin, pos);
    }
    if (pos != text.size()) return std::nullopt;
    return ranges;
  }
  // Other tokenizers: decoding. A token that holds part of a UTF-8 character decodes only together with the tokens
  // that complete it (at most four bytes, so at most four tokens).
  const std::span<const std::int32_t> all(ids);
  while (k < ids.size()) {
    bool placed = false;
    for (std::size_t n = 1; n <= 4 && k + n <= ids.size() && !placed; ++n) {
      const std::string piece = tokenizer.decode(all.subspan(k, n), /*skip_special=*/false);
      if (text.compare(pos, piece.size(), piece) != 0) continue;
      for (std::size_t j = 0; j < n; ++j) ranges.emplace_back(pos, pos + piece.size());
      pos += piece.size();
      k += n;
      placed = true;
    }
    if (!placed) return std::nullopt;
  }
  if (pos != text.size()) return std::nullopt;
  return ranges;
}

std::vector<bool> tokens_in_spans(const TokenRanges& token_ranges, const std::vector<chat::Span>& spans) {
  std::vector<bool> mask(token_ranges.size(), false);
  // The token whose bytes hold `byte` (char_to_token), if any.
  const auto token_at = [&](std::size_t byte) -> std::optional<std::size_t> {
    const auto it = std::upper_bound(token_ranges.begin(), token_ranges.end(), byte,
                                     [](std::size_t b, const auto& range) { return b < range.second; });
    if (it == token_ranges.end() || it->first > byte) return std::nullopt;
    return static_cast<std::size_t>(it - token_ranges.begin());
  };
  for (const auto& [begin, end] : spans) {
    if (end <= begin) continue;
    const auto first = token_at(begin);
    if (!first) break;  // past the tokens
    const auto last = token_at(end - 1);
    const std::size_t stop = last ? *last + 1 : mask.size();
    for (std::size_t t = *first; t < stop; ++t) mask[t] = true;
  }
  return mask;
}

Outcome map_chat(const ordered_json& record, const MappingSpec& spec, const Tokenizer& tokenizer) {
  if (spec.family != DataFamily::kCausal || !spec.chat)
    return chat_problem(std::string("a chat record (field \"") + kMessagesField + "\") needs a causal model",
               "train a causal model (Llama, Qwen2, Mistral) on chat records, or write seq2seq records as "
               "input/target");
  const ChatSetup& setup = *spec.chat;
  const ordered_json& messages = record.at(kMessagesField);
  if (std::string problem = check_messages(messages); !problem.empty()) return chat_problem(std::move(problem));

  chat::ChatOptions options;
  if (const auto tools = record.find(kToolsField); tools != record.end() && !tools->is_null()) {
    if (!tools->is_array())
      return chat_problem(std::string("field \"") + kToolsField + "\" must be a list of function schemas, not " +
                 tools->type_name());
    options.tools = *tools;
  }
  if (!setup.error.empty()) return chat_problem(setup.error, setup.hint, /*fatal=*/true);
  const bool with_tools = !options.tools.is_null();
  const chat::Template& chat_template = with_tools ? *setup.with_tools : *setup.plain;
  const std::string& origin = with_tools ? setup.tools_origin : setup.plain_origin;
  const bool generation = with_tools ? setup.tools_marks_generation : setup.plain_marks_generation;
  options.special_tokens = setup.special_tokens;

  // Converted for the interpreter once: the whole conversation's render and the prefix renders share it.
  std::optional<chat::Conversation> conversation;
  chat::ChatRendering rendering;
  try {
    conversation.emplace(messages, options);
    rendering = conversation->render(chat_template);
  } catch (const chat::TemplateError& e) {
    if (e.kind() == chat::TemplateError::Kind::kRaised)
      return chat_problem(e.what(), "the template refuses this conversation (" + origin + "); fix the record or skip it");
    return chat_problem(origin + ": " + e.what());
  }
  Example example;
  example.input_ids = tokenizer.encode(rendering.text);
  if (example.input_ids.empty()) return chat_problem("the chat template rendered the conversation as nothing");

  const char* mask = "all";
  if (setup.train_on == TrainOn::kAll) {
    example.labels = example.input_ids;
  } else {
    // The order: a marked template (the model's own {% generation %} blocks or trainer's training version), then
    // rendering prefix by prefix, then probing (chat_template.h).
    std::vector<chat::Span> spans;
    if (generation) {
      spans = rendering.generation_spans;
      mask = (with_tools ? setup.tools_swapped : setup.plain_swapped) ? "training_template" : "generation";
    } else {
      try {
        chat::AssistantSpans found = conversation->assistant_spans(chat_template, rendering.text);
        spans = std::move(found.spans);
        mask = chat::span_method_name(found.method);
        if (found.method == chat::SpanMethod::kProbe && first_time(origin + " (probed)"))
          spdlog::info("chat template: {} renders earlier turns differently once the conversation goes on; the loss "
                       "mask of such records comes from probing the template (trainer data --dump names each "
                       "record's method)",
                       origin);
      } catch (const Error& e) {
        return chat_problem("the chat template of " + setup.model + " (" + origin + "): " + e.what(),
                   e.hint().empty() ? "set data.train_on=all, or use a chat template that marks the assistant's text "
                                      "with {% generation %}"
                                    : e.hint());
      }
    }
    std::erase_if(spans, [](const chat::Span& s) { return s.second <= s.first; });
    if (setup.train_on == TrainOn::kLastAssistant && spans.size() > 1) spans.erase(spans.begin(), spans.end() - 1);
    if (spans.empty())
      return chat_problem(generation ? "no assistant text to train on: the template's {% generation %} blocks rendered nothing"
                            : "no assistant message to train on",
                 "add the assistant's answer to the conversation, or set data.train_on=all");
    const auto ranges = token_byte_ranges(tokenizer, rendering.text, example.input_ids);
    if (!ranges)
      return chat_problem("the tokens of " + tokenizer.source() +
                     " do not decode back to the rendered conversation, so the assistant's text cannot be placed on "
                     "tokens",
                 "set data.train_on=all (every token trained), or use the model's byte-level tokenizer.json",
                 /*fatal=*/true);
    const std::vector<bool> trained = tokens_in_spans(*ranges, spans);
    example.labels.resize(example.input_ids.size());
    for (std::size_t t = 0; t < trained.size(); ++t) example.labels[t] = trained[t] ? example.input_ids[t] : -100;
  }
  if (target_tokens(example, DataFamily::kCausal) == 0)
    return chat_problem("no token of the assistant's text is trained (it is the conversation's first token)",
               "add the assistant's answer to the conversation, or set data.train_on=all");
  Outcome outcome = finish_causal(std::move(example), spec);
  if (spec.keep_chat_text) {
    outcome.chat_text = std::move(rendering.text);
    outcome.chat_mask = mask;
  }
  return outcome;
}

}  // namespace trainer::data
