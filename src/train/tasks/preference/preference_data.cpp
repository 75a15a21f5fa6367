// Preference records -> tokenized pairs, as TRL's DPOTrainer makes them (see preference_data.h).
#include "train/tasks/preference/preference_data.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "data/chat_record.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

using nlohmann::ordered_json;
using data::Outcome;
using data::OutcomeKind;

constexpr const char* kPrompt = "prompt";
constexpr const char* kChosen = "chosen";
constexpr const char* kRejected = "rejected";

Outcome bad(std::string what, std::string hint = {}, bool fatal = false) {
  return data::bad_record(std::move(what), std::move(hint), fatal);
}
Outcome overlength(std::string what) { return data::overlength_skipped(std::move(what)); }

// A conversation as TRL's is_conversational sees one: a list whose first item is an object with "role" and
// "content". What is wrong with its messages, or nothing.
bool looks_conversational(const ordered_json& value) {
  return value.is_array() && !value.empty() && value[0].is_object() && value[0].contains("role") &&
         value[0].contains("content");
}
std::string check_messages(const ordered_json& messages, const char* field) {
  if (!messages.is_array()) return std::string("field \"") + field + "\" must be a list of messages";
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ordered_json& m = messages[i];
    const std::string at = std::string(field) + "[" + std::to_string(i) + "]";
    if (!m.is_object()) return at + " must be an object with \"role\" and \"content\"";
    if (!m.contains("role") || !m["role"].is_string()) return at + " has no \"role\" string";
    if (!m.contains("content") || m["content"].is_null()) return at + " has no \"content\"";
  }
  return {};
}

std::size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const std::size_t n = std::min(a.size(), b.size());
  std::size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// TRL's extract_prompt: the longest common prefix of chosen and rejected (whole messages, or characters), without a
// space just before where they differ. Nothing when they share no prefix at all.
template <class Value>
std::optional<std::size_t> shared_prompt_length(const Value& chosen, const Value& rejected) {
  const std::size_t n = std::min(chosen.size(), rejected.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (chosen[i] == rejected[i]) continue;
    if (i == 0) return std::nullopt;
    if constexpr (std::is_same_v<Value, std::string>) {
      if (chosen[i - 1] == ' ') return i - 1;
    }
    return i;
  }
  // One is a prefix of the other: TRL's loop ends on its last index, so the prompt stops one item short of it.
  if (n == 0) return std::nullopt;
  return n - 1;
}

ordered_json concat(const ordered_json& a, const ordered_json& b) {
  ordered_json out = a;
  for (const auto& item : b) out.push_back(item);
  return out;
}

// The pair's ids: the prompt's and each prompt + completion's.
struct PairIds {
  std::vector<int32_t> prompt, prompt_chosen, prompt_rejected;
  std::string prompt_text, chosen_text, rejected_text;  // as rendered (keep_text)
  // A side whose rendering does not begin with the prompt's: its labels on the whole prompt + completion ids.
  std::optional<std::vector<int32_t>> chosen_labels, rejected_labels;
};

// The labels of prompt + completion (`messages`, `rendered` as `ids`) from the completion's assistant spans, found by
// the rule of chat records (prefix by prefix, else by probing the template; chat_template.h): for a template that
// renders the prompt otherwise once an answer follows (Mistral v3 writes the system message into the last user turn
// only when that turn ends the conversation), where the tokens after the prompt's would hold the prompt's own text.
// Throws Error when the spans cannot be found or placed on tokens.
std::vector<int32_t> completion_labels(const chat::Template& chat_template, const ordered_json& messages,
                                       std::size_t prompt_messages, const chat::ChatOptions& options,
                                       const std::string& rendered, const std::vector<int32_t>& ids,
                                       const Tokenizer& tokenizer) {
  std::vector<chat::Span> spans = chat::assistant_spans(chat_template, messages, options, rendered).spans;
  std::size_t earlier = 0;  // the prompt's assistant messages: one span each
  for (std::size_t i = 0; i < prompt_messages; ++i) earlier += messages[i].value("role", "") == "assistant";
  spans.erase(spans.begin(), spans.begin() + static_cast<std::ptrdiff_t>(std::min(earlier, spans.size())));
  const auto ranges = data::token_byte_ranges(tokenizer, rendered, ids);
  if (!ranges) {
    throw DataError("the tokens of " + tokenizer.source() + " do not decode back to the rendered conversation, so the "
                    "completion's text cannot be placed on tokens",
                    "use the model's byte-level tokenizer.json");
  }
  const std::vector<bool> trained = data::tokens_in_spans(*ranges, spans);
  std::vector<int32_t> labels(ids.size(), -100);
  for (std::size_t t = 0; t < trained.size(); ++t)
    if (trained[t]) labels[t] = ids[t];
  return labels;
}

std::vector<int32_t> with_template(const Tokenizer& tokenizer, std::string_view text) {
  const SpecialTokenTemplate special = tokenizer.special_token_template();
  std::vector<int32_t> ids = special.prefix;
  const auto body = tokenizer.encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.insert(ids.end(), special.suffix.begin(), special.suffix.end());
  return ids;
}

// Builds one sequence of the pair: prompt then completion, cut to max_length; labels -100 on the prompt.
void fill(const std::vector<int32_t>& prompt, const std::vector<int32_t>& whole, std::size_t prompt_length,
          std::size_t max_length, std::vector<int32_t>& ids, std::vector<int32_t>& labels) {
  ids.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(prompt_length));
  ids.insert(ids.end(), whole.begin() + static_cast<std::ptrdiff_t>(prompt_length), whole.end());
  labels = ids;
  std::fill(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(prompt_length), -100);
  if (ids.size() > max_length) {
    ids.resize(max_length);
    labels.resize(max_length);
  }
}

}  // namespace

PreferenceSpec preference_spec(const Config& config, const Tokenizer& tokenizer) {
  PreferenceSpec spec;
  spec.max_length = config.data.max_length;
  spec.on_overlength = config.data.on_overlength;
  if (const auto eos = tokenizer.eos_id(); eos && !is_ids_only(tokenizer))
    spec.eos_text = tokenizer.decode(std::vector<int32_t>{*eos}, /*skip_special=*/false);
  spec.chat = data::load_chat_setup(config);
  return spec;
}

Outcome map_preference(std::string_view line, const PreferenceSpec& spec, const Tokenizer& tokenizer) {
  if (const std::size_t at = data::find_invalid_utf8(line); at != std::string_view::npos)
    return bad("invalid UTF-8 at byte " + std::to_string(at + 1) + " of the line");
  ordered_json record = ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (record.is_discarded()) return bad("invalid JSON");
  if (!record.is_object()) return bad(std::string("the record is a JSON ") + record.type_name() + ", not an object");
  const char* hint =
      "a preference record is {\"prompt\", \"chosen\", \"rejected\"} (strings, or lists of messages), or "
      "{\"chosen\", \"rejected\"} sharing the prompt at their start";
  for (const char* key : {kChosen, kRejected})
    if (!record.contains(key)) return bad(std::string("no \"") + key + "\" field", hint);
  ordered_json prompt = record.contains(kPrompt) ? record[kPrompt] : ordered_json();
  ordered_json chosen = record[kChosen], rejected = record[kRejected];
  // TRL decides the format from the first field it finds; all three must then agree.
  const bool conversational = looks_conversational(prompt.is_null() ? chosen : prompt);
  for (const auto& [key, value] : {std::pair{kPrompt, &prompt}, {kChosen, &chosen}, {kRejected, &rejected}}) {
    if (value->is_null() && std::string_view(key) == kPrompt) continue;
    if (conversational) {
      if (std::string problem = check_messages(*value, key); !problem.empty())
        return bad(problem + " (the record is conversational: every field is a list of messages)", hint);
    } else if (!value->is_string()) {
      return bad(std::string("field \"") + key + "\" must be a string (the record is standard text), not " +
                     value->type_name(),
                 hint);
    }
  }
  if (prompt.is_null()) {  // the implicit prompt
    std::optional<std::size_t> shared;
    if (conversational) {
      shared = shared_prompt_length(chosen, rejected);
    } else {
      shared = shared_prompt_length(chosen.get<std::string>(), rejected.get<std::string>());
    }
    if (!shared)
      return bad("\"chosen\" and \"rejected\" share no prompt at their start",
                 "give the prompt as its own \"prompt\" field");
    if (conversational) {
      prompt = ordered_json(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(*shared));
      chosen = ordered_json(chosen.begin() + static_cast<std::ptrdiff_t>(*shared), chosen.end());
      rejected = ordered_json(rejected.begin() + static_cast<std::ptrdiff_t>(*shared), rejected.end());
    } else {
      const std::string c = chosen.get<std::string>(), r = rejected.get<std::string>();
      prompt = c.substr(0, *shared);
      chosen = c.substr(*shared);
      rejected = r.substr(*shared);
    }
  }

  PairIds ids;
  if (conversational) {
    if (!spec.chat || !spec.chat->error.empty())
      return bad(spec.chat ? spec.chat->error : "no chat template", spec.chat ? spec.chat->hint : "", /*fatal=*/true);
    const data::ChatSetup& setup = *spec.chat;
    chat::ChatOptions options;
    if (const auto tools = record.find("tools"); tools != record.end() && !tools->is_null()) {
      if (!tools->is_array()) return bad("field \"tools\" must be a list of function schemas");
      options.tools = *tools;
    }
    const chat::Template& chat_template = options.tools.is_null() ? *setup.plain : *setup.with_tools;
    const std::string& origin = options.tools.is_null() ? setup.plain_origin : setup.tools_origin;
    options.special_tokens = setup.special_tokens;
    try {
      chat::ChatOptions prompt_options = options;
      prompt_options.add_generation_prompt = true;
      ids.prompt_text = chat::render_chat(chat_template, prompt, prompt_options).text;
      ids.chosen_text = chat::render_chat(chat_template, concat(prompt, chosen), options).text;
      ids.rejected_text = chat::render_chat(chat_template, concat(prompt, rejected), options).text;
    } catch (const chat::TemplateError& e) {
      if (e.kind() == chat::TemplateError::Kind::kRaised)
        return bad(e.what(), "the template refuses this conversation (" + origin + "); fix the record or skip it");
      return bad(origin + ": " + e.what());
    }
    ids.prompt = tokenizer.encode(ids.prompt_text);
    ids.prompt_chosen = tokenizer.encode(ids.chosen_text);
    ids.prompt_rejected = tokenizer.encode(ids.rejected_text);
    // DPOTrainer's completion is what follows the prompt's tokens; where the pair's rendering does not begin with
    // the prompt's, that would train the prompt's own text, so the completion's assistant spans are trained instead
    // (a template with {% generation %} keeps DPOTrainer's rule).
    const bool generation = options.tools.is_null() ? setup.plain_marks_generation : setup.tools_marks_generation;
    try {
      if (!generation && !ids.chosen_text.starts_with(ids.prompt_text)) {
        ids.chosen_labels = completion_labels(chat_template, concat(prompt, chosen), prompt.size(), options,
                                              ids.chosen_text, ids.prompt_chosen, tokenizer);
      }
      if (!generation && !ids.rejected_text.starts_with(ids.prompt_text)) {
        ids.rejected_labels = completion_labels(chat_template, concat(prompt, rejected), prompt.size(), options,
                                                ids.rejected_text, ids.prompt_rejected, tokenizer);
      }
    } catch (const Error& e) {
      return bad("the chat template of " + setup.model + " (" + origin + ") renders the prompt otherwise once the "
                 "completion follows, and the completion's span: " + e.what(),
                 e.hint());
    }
  } else {
    if (spec.eos_text.empty())
      return bad("standard preference records end each completion with the EOS token, but the tokenizer " +
                     tokenizer.source() + " has none",
                 "use a tokenizer with an EOS token, or conversational records", /*fatal=*/true);
    std::string c = chosen.get<std::string>(), r = rejected.get<std::string>();
    if (!c.ends_with(spec.eos_text)) c += spec.eos_text;
    if (!r.ends_with(spec.eos_text)) r += spec.eos_text;
    const std::string p = prompt.get<std::string>();
    ids.prompt_text = p;
    ids.chosen_text = p + c;
    ids.rejected_text = p + r;
    ids.prompt = with_template(tokenizer, p);
    ids.prompt_chosen = with_template(tokenizer, ids.chosen_text);
    ids.prompt_rejected = with_template(tokenizer, ids.rejected_text);
  }

  const std::size_t prompt_length =
      std::min(common_prefix(ids.prompt, ids.prompt_chosen), common_prefix(ids.prompt, ids.prompt_rejected));
  const auto max_length = static_cast<std::size_t>(spec.max_length);
  if (prompt_length >= max_length)
    return overlength("the prompt alone has " + std::to_string(prompt_length) + " tokens, data.max_length = " +
                      std::to_string(max_length) + ": no completion token would be left to train on");
  const std::size_t longest = std::max(ids.prompt_chosen.size(), ids.prompt_rejected.size());
  if (longest > max_length && spec.on_overlength == OverlengthPolicy::kSkip)
    return overlength(std::to_string(longest) + " tokens, more than data.max_length = " + std::to_string(max_length));
  Outcome outcome;
  Example& pair = outcome.example;
  fill(ids.prompt, ids.prompt_chosen, prompt_length, max_length, pair.input_ids, pair.labels);
  fill(ids.prompt, ids.prompt_rejected, prompt_length, max_length, pair.rejected_ids, pair.rejected_labels);
  // fill's ids are the whole prompt + completion ids (they agree with the prompt's for prompt_length tokens).
  for (auto [labels, side, size] : {std::tuple{&ids.chosen_labels, &pair.labels, pair.input_ids.size()},
                                    std::tuple{&ids.rejected_labels, &pair.rejected_labels, pair.rejected_ids.size()}}) {
    if (!*labels) continue;
    *side = std::move(**labels);
    side->resize(size);
  }
  outcome.truncated = longest > max_length;
  if (spec.keep_text)
    outcome.chat_text = ordered_json{{kPrompt, ids.prompt_text}, {kChosen, ids.chosen_text},
                                     {kRejected, ids.rejected_text}}
                            .dump();
  return outcome;
}

RecordMapper preference_mapper(const Config& config, const Tokenizer& tokenizer, bool keep_text) {
  auto spec = std::make_shared<PreferenceSpec>(preference_spec(config, tokenizer));
  spec->keep_text = keep_text;
  const Tokenizer* tok = &tokenizer;
  return [spec, tok](std::string_view line) { return map_preference(line, *spec, *tok); };
}

}  // namespace trainer
