// Chat rendering over the Jinja interpreter: the variables transformers passes, the template lookup in a model
// directory, and assistant spans by rendering prefix by prefix or by probing.
#include "chat/chat_template.h"
#include "chat/training_templates.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <optional>
#include <sstream>

namespace trainer::chat {

namespace {

class ChatDataError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return kExitData; }
};

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ChatDataError("cannot read " + path.string(), "check the file's permissions");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void require_list(const nlohmann::ordered_json& messages) {
  if (!messages.is_array()) {
    throw TemplateError(TemplateError::Kind::kRender, "messages must be a JSON list of message objects", 1, 1);
  }
}

// Why probing assistant message `message` failed: what() is "cannot find the span of assistant message N by
// probing: why", and assistant_spans puts `why` after the prefix method's reason.
class ProbeRefusal : public ChatDataError {
 public:
  ProbeRefusal(std::size_t message, std::string why, std::string hint)
      : ChatDataError("cannot find the span of assistant message " + std::to_string(message) + " by probing: " + why,
                      std::move(hint)),
        message_(message),
        why_(std::move(why)) {}
  std::size_t message() const { return message_; }
  const std::string& why() const { return why_; }

 private:
  std::size_t message_;
  std::string why_;
};

// What the spans' errors suggest: train on everything, or a template that marks the assistant's text.
std::string span_hint() {
  return "set data.train_on=all, or use a chat template that marks the assistant's text with {% generation %} "
         "(trainer swaps in its own generation-marked version of a model's template it recognises byte for byte: " +
         training_template_families() + "; this template is none of them)";
}

std::size_t common_prefix(std::string_view a, std::string_view b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

std::size_t common_suffix(std::string_view a, std::string_view b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[a.size() - 1 - n] == b[b.size() - 1 - n]) ++n;
  return n;
}

// Moves `end` back to the start of the UTF-8 character it is inside, never below `floor`.
std::size_t character_boundary(std::string_view text, std::size_t end, std::size_t floor) {
  while (end > floor && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return end;
}

// The probe strings: digits, which no filter a template applies to text (trim, upper, lower, title, capitalize,
// escape, tojson) changes, and whose first and last digits differ, so two renderings part exactly where they begin
// and end.
constexpr std::string_view kProbeA = "31415926";
constexpr std::string_view kProbeB = "27182818";
// What the model writes besides the content: the probe message has none of it (its tool calls are kept first), so
// the span covers it as the template renders it.
constexpr std::array<const char*, 4> kModelWritten = {"tool_calls", "reasoning_content", "reasoning", "thinking"};

// The text before and after the probe in two renderings that differ only by the probe string (views into `a`), or
// nothing when they differ elsewhere too or the probe is not there unchanged.
struct ProbeSlot {
  std::string_view before, after;
};
std::optional<ProbeSlot> probe_slot(std::string_view a, std::string_view b) {
  const std::size_t before = common_prefix(a, b);
  const std::size_t after = common_suffix(a.substr(before), b.substr(before));
  if (a.size() != before + kProbeA.size() + after || b.size() != before + kProbeB.size() + after) return std::nullopt;
  if (a.substr(before, kProbeA.size()) != kProbeA || b.substr(before, kProbeB.size()) != kProbeB) return std::nullopt;
  return ProbeSlot{a.substr(0, before), a.substr(a.size() - after)};
}

}  // namespace

const char* span_method_name(SpanMethod method) {
  switch (method) {
    case SpanMethod::kPrefix: return "prefix";
    case SpanMethod::kProbe: return "probe";
  }
  return "prefix";
}

// The same names and precedence as apply_chat_template: special tokens, then keyword arguments over them; then
// messages, tools, documents and add_generation_prompt.
Conversation::Conversation(const nlohmann::ordered_json& messages, const ChatOptions& options)
    : messages_json_(messages),
      messages_(messages),
      message_count_(messages.is_array() ? messages.size() : 0),
      options_(options) {
  require_list(messages);
  static const nlohmann::ordered_json kNone = nullptr;
  for (const auto& [key, value] : options.special_tokens.items()) variables_.emplace_back(key, TemplateValue(value));
  variables_.emplace_back("documents", TemplateValue(kNone));
  for (const auto& [key, value] : options.extra.items()) variables_.emplace_back(key, TemplateValue(value));
  messages_index_ = variables_.size();
  variables_.emplace_back("messages", messages_);
  variables_.emplace_back("tools", TemplateValue(options.tools));
  variables_.emplace_back("add_generation_prompt", TemplateValue(options.add_generation_prompt));
}

ChatRendering Conversation::render_first(const Template& chat_template, std::size_t count,
                                         bool add_generation_prompt) {
  return render_first(chat_template, messages_, count, add_generation_prompt);
}

ChatRendering Conversation::render_first(const Template& chat_template, const TemplateValue& messages,
                                         std::size_t count, bool add_generation_prompt) {
  static const TemplateValue kTrue(nlohmann::ordered_json(true)), kFalse(nlohmann::ordered_json(false));
  variables_[messages_index_].second = messages.first(count);
  variables_.back().second = add_generation_prompt ? kTrue : kFalse;
  RenderResult result = chat_template.render(variables_, options_.limits);
  return {std::move(result.text), std::move(result.generation_spans)};
}

ChatRendering Conversation::render(const Template& chat_template) {
  return render_first(chat_template, message_count_, options_.add_generation_prompt);
}

ChatRendering render_chat(const Template& chat_template, const nlohmann::ordered_json& messages,
                          const ChatOptions& options) {
  return Conversation(messages, options).render(chat_template);
}

ChatRendering render_chat(std::string_view template_text, const nlohmann::ordered_json& messages,
                          const ChatOptions& options) {
  return render_chat(Template(template_text), messages, options);
}

nlohmann::ordered_json special_tokens_from_config(const nlohmann::ordered_json& tokenizer_config) {
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  if (!tokenizer_config.is_object()) return tokens;
  for (const auto& [key, value] : tokenizer_config.items()) {
    if (key.size() < 6 || key.compare(key.size() - 6, 6, "_token") != 0) continue;
    if (value.is_string()) {
      tokens[key] = value;
    } else if (value.is_object() && value.contains("content") && value["content"].is_string()) {
      tokens[key] = value["content"];
    }
  }
  return tokens;
}

ModelChatTemplate load_chat_template(const std::filesystem::path& model_dir, bool with_tools) {
  ModelChatTemplate found;
  const auto config_path = model_dir / "tokenizer_config.json";
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  if (std::filesystem::exists(config_path)) {
    try {
      config = nlohmann::ordered_json::parse(read_text(config_path));
    } catch (const nlohmann::json::parse_error& e) {
      throw ChatDataError(config_path.string() + ": invalid JSON: " + e.what(), "is the file complete?");
    }
    found.special_tokens = special_tokens_from_config(config);
  }

  // Named templates, in the order transformers gathers them: files first, as they take priority.
  std::vector<std::pair<std::string, std::string>> templates;  // (name, text)
  std::vector<std::pair<std::string, std::string>> origins;
  const auto file = model_dir / "chat_template.jinja";
  if (std::filesystem::exists(file)) {
    templates.emplace_back("default", read_text(file));
    origins.emplace_back("default", file.string());
  }
  const auto dir = model_dir / "chat_templates";
  if (std::filesystem::is_directory(dir)) {
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() == ".jinja") files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& path : files) {
      templates.emplace_back(path.stem().string(), read_text(path));
      origins.emplace_back(path.stem().string(), path.string());
    }
  }
  if (templates.empty() && config.contains("chat_template")) {
    const auto& entry = config["chat_template"];
    if (entry.is_string()) {
      templates.emplace_back("default", entry.get<std::string>());
    } else if (entry.is_array()) {
      for (const auto& item : entry) {
        if (!item.is_object() || !item.contains("name") || !item.contains("template") || !item["name"].is_string() ||
            !item["template"].is_string()) {
          throw ChatDataError(config_path.string() + ": chat_template list entries must be {\"name\", \"template\"}",
                              "fix the entry or put the template in chat_template.jinja");
        }
        templates.emplace_back(item["name"].get<std::string>(), item["template"].get<std::string>());
      }
    } else if (!entry.is_null()) {
      throw ChatDataError(config_path.string() + ": chat_template must be a string or a list of named templates",
                          "fix the entry or put the template in chat_template.jinja");
    }
    for (const auto& t : templates) origins.emplace_back(t.first, config_path.string() + " (chat_template)");
  }
  if (templates.empty()) {
    throw ChatDataError("no chat template in " + model_dir.string() +
                            " (neither chat_template.jinja nor a chat_template entry in tokenizer_config.json)",
                        "set data.chat_template to a template file, or use an instruct model's tokenizer files");
  }

  std::size_t pick = templates.size();
  if (templates.size() == 1 && templates[0].first == "default") {
    pick = 0;
  } else {
    for (std::size_t i = 0; i < templates.size(); ++i) {
      if (with_tools && templates[i].first == "tool_use") pick = i;
    }
    for (std::size_t i = 0; i < templates.size() && pick == templates.size(); ++i) {
      if (templates[i].first == "default") pick = i;
    }
  }
  if (pick == templates.size()) {
    std::string names;
    for (const auto& t : templates) names += (names.empty() ? "" : ", ") + t.first;
    throw ChatDataError("the chat templates of " + model_dir.string() + " have no \"default\" (names: " + names + ")",
                        "set data.chat_template to the template file to use");
  }
  found.source = templates[pick].second;
  found.origin = origins[pick].second;
  return found;
}

std::vector<Span> assistant_spans_by_prefix(const Template& chat_template, const nlohmann::ordered_json& messages,
                                            const ChatOptions& options) {
  require_list(messages);
  return assistant_spans_by_prefix(chat_template, messages, options, render_chat(chat_template, messages, options).text);
}

std::vector<Span> assistant_spans_by_prefix(const Template& chat_template, const nlohmann::ordered_json& messages,
                                            const ChatOptions& options, std::string_view full) {
  return Conversation(messages, options).assistant_spans_by_prefix(chat_template, full);
}

std::vector<Span> Conversation::assistant_spans_by_prefix(const Template& chat_template, std::string_view full) {
  const nlohmann::ordered_json& messages = messages_json_;
  const std::string hint = span_hint();
  std::vector<Span> spans;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& message = messages[i];
    if (!message.is_object() || message.value("role", "") != "assistant") continue;
    const std::string prompt = render_first(chat_template, i, /*add_generation_prompt=*/true).text;
    // The last message's turn without the generation prompt is the whole conversation's rendering when that has
    // none either: it is not rendered again.
    const bool turn_is_full = i + 1 == message_count_ && !options_.add_generation_prompt;
    std::string turn_rendered;
    if (!turn_is_full) turn_rendered = render_first(chat_template, i + 1, /*add_generation_prompt=*/false).text;
    const std::string_view turn = turn_is_full ? full : std::string_view(turn_rendered);
    const std::string which = "assistant message " + std::to_string(i);
    if (turn.compare(0, prompt.size(), prompt) != 0 || turn.size() < prompt.size()) {
      throw ChatDataError("cannot find the span of " + which +
                              ": the rendering of the messages before it with add_generation_prompt is not a prefix "
                              "of the rendering that includes it (the template renders earlier turns differently "
                              "once the conversation goes on)",
                          hint);
    }
    // A template may close the conversation after its last turn (Phi-3 writes eos_token then): that tail is not in
    // the longer conversation, so the span ends where this rendering and the whole conversation's part.
    if (full.compare(0, prompt.size(), prompt) != 0 || full.size() < prompt.size()) {
      throw ChatDataError("cannot find the span of " + which +
                              ": the conversation before it is not a prefix of the whole conversation's rendering "
                              "(the template renders earlier turns differently when more messages follow)",
                          hint);
    }
    // Never end inside a UTF-8 character.
    const std::size_t end = character_boundary(
        full, prompt.size() + common_prefix(turn.substr(prompt.size()), full.substr(prompt.size())), prompt.size());
    if (end == prompt.size() && turn.size() > prompt.size()) {
      throw ChatDataError("cannot find the span of " + which +
                              ": the whole conversation's rendering differs from the conversation rendered up to it "
                              "right where the assistant's text begins",
                          hint);
    }
    spans.emplace_back(prompt.size(), end);
  }
  return spans;
}

std::vector<Span> assistant_spans_by_probe(const Template& chat_template, const nlohmann::ordered_json& messages,
                                           const ChatOptions& options, std::string_view full) {
  return Conversation(messages, options).assistant_spans_by_probe(chat_template, full);
}

AssistantSpans assistant_spans(const Template& chat_template, const nlohmann::ordered_json& messages,
                               const ChatOptions& options, std::string_view full) {
  return Conversation(messages, options).assistant_spans(chat_template, full);
}

AssistantSpans Conversation::assistant_spans(const Template& chat_template, std::string_view full) {
  try {
    return {assistant_spans_by_prefix(chat_template, full), SpanMethod::kPrefix};
  } catch (const ChatDataError& by_prefix) {
    try {
      return {assistant_spans_by_probe(chat_template, full), SpanMethod::kProbe};
    } catch (const ProbeRefusal& by_probe) {
      throw ChatDataError(std::string(by_prefix.what()) + "; nor by probing (assistant message " +
                              std::to_string(by_probe.message()) + "): " + by_probe.why(),
                          span_hint());
    }
  }
}

std::vector<Span> Conversation::assistant_spans_by_probe(const Template& chat_template, std::string_view full) {
  std::vector<Span> spans;
  for (std::size_t i = 0; i < message_count_; ++i) {
    const auto& message = messages_json_[i];
    if (!message.is_object() || message.value("role", "") != "assistant") continue;
    const Span span = probe_span(chat_template, i, full);
    if (!spans.empty() && span.first < spans.back().second) {
      throw ProbeRefusal(i, "it would begin inside the span of the assistant message before it", span_hint());
    }
    spans.push_back(span);
  }
  return spans;
}

// Taken from the conversation before message `index` (its rendering with the generation prompt, then the message's
// probed rendering `last_before` goes on), or where that is not a prefix (Mistral v3 writes the system message into
// the last message only when it is the user's), from a one-turn conversation of probes.
std::string Conversation::opener_of(const Template& chat_template, std::size_t index, std::string_view last_before) {
  // A render the template refuses (a one-turn conversation where it wants a system message first) gives no opener.
  const auto rendered = [&](const TemplateValue& messages, std::size_t count,
                            bool add_generation_prompt) -> std::optional<std::string> {
    try {
      return render_first(chat_template, messages, count, add_generation_prompt).text;
    } catch (const TemplateError&) {
      return std::nullopt;
    }
  };
  if (const auto prompt = rendered(messages_, index, /*add_generation_prompt=*/true);
      prompt && last_before.starts_with(*prompt)) {
    return std::string(last_before.substr(prompt->size()));
  }
  static const nlohmann::ordered_json kOneTurn = {{{"role", "user"}, {"content", kProbeA}},
                                                  {{"role", "assistant"}, {"content", kProbeB}}};
  const TemplateValue one_turn(kOneTurn);
  const auto asked = rendered(one_turn, 1, /*add_generation_prompt=*/true);
  const auto answered = rendered(one_turn, 2, /*add_generation_prompt=*/false);
  if (!asked || !answered || !answered->starts_with(*asked)) return {};
  const std::size_t at = answered->find(kProbeB, asked->size());
  return at == std::string::npos ? std::string() : answered->substr(asked->size(), at - asked->size());
}

// A message with tool calls is probed first with them kept (a template may render the tools' answers that follow by
// them, Gemma 4 into the model's turn: they then stay out of the span, and the calls come in with the end-of-turn
// text), then without (a template that writes "\n" between the content and the calls only when there is content).
Span Conversation::probe_span(const Template& chat_template, std::size_t index, std::string_view full) {
  const auto calls = messages_json_[index].find("tool_calls");
  if (calls == messages_json_[index].end() || calls->is_null()) return probe_span(chat_template, index, full, false);
  try {
    return probe_span(chat_template, index, full, /*keep_tool_calls=*/true);
  } catch (const ProbeRefusal&) {
    return probe_span(chat_template, index, full, /*keep_tool_calls=*/false);
  }
}

Span Conversation::probe_span(const Template& chat_template, std::size_t index, std::string_view full,
                              bool keep_tool_calls) {
  const auto refuse = [&](const std::string& why) { return ProbeRefusal(index, why, span_hint()); };
  const auto probed = [&](std::string_view probe, bool keep_calls) {
    nlohmann::ordered_json messages = messages_json_;
    nlohmann::ordered_json& message = messages[index];
    for (const char* field : kModelWritten)
      if (!keep_calls || std::string_view(field) != "tool_calls") message.erase(field);
    message["content"] = std::string(probe);
    return TemplateValue(messages);
  };
  // A template that refuses a conversation the probe needs (it wants what the probe message leaves out, Mistral's
  // tool call ids) cannot be probed.
  const auto render_or_refuse = [&](const TemplateValue& messages, std::size_t count, bool add_generation_prompt) {
    try {
      return render_first(chat_template, messages, count, add_generation_prompt).text;
    } catch (const TemplateError& e) {
      throw refuse(std::string("the template refuses a conversation the probe renders (") + e.what() + ")");
    }
  };
  const TemplateValue with_a = probed(kProbeA, keep_tool_calls), with_b = probed(kProbeB, keep_tool_calls);
  const std::string whole_a = render_or_refuse(with_a, message_count_, options_.add_generation_prompt);
  const std::string whole_b = render_or_refuse(with_b, message_count_, options_.add_generation_prompt);
  const auto slot = probe_slot(whole_a, whole_b);
  if (!slot) {
    throw refuse("with its text replaced by two probe strings, the conversation's renderings differ elsewhere than "
                 "in that text's place (the template renders the text more than once, changes it, or renders other "
                 "messages by it)");
  }
  const std::string last_a = render_or_refuse(with_a, index + 1, false);
  const std::string last_b = render_or_refuse(with_b, index + 1, false);
  const auto last = probe_slot(last_a, last_b);
  if (!last) {
    throw refuse("with its text replaced by two probe strings, the renderings of the conversation that ends with it "
                 "differ elsewhere than in that text's place");
  }
  // Kept tool calls come into the span with the end-of-turn text, so they must come after the content: the
  // rendering without them is the same up to it.
  if (keep_tool_calls && !render_or_refuse(probed(kProbeA, false), index + 1, false)
                              .starts_with(std::string(last->before) + std::string(kProbeA))) {
    throw refuse("the template writes the message's tool calls before its text");
  }
  // What the template writes between the generation prompt and the content belongs to the span where this
  // conversation renders it before the content too.
  const std::string opener = opener_of(chat_template, index, last->before);
  const std::size_t start = slot->before.size() - (slot->before.ends_with(opener) ? opener.size() : 0);
  if (common_prefix(full, slot->before) < start) {
    throw refuse("the conversation's rendering differs from the probed one before the message's place (the template "
                 "renders earlier text by this message)");
  }
  if (!full.ends_with(slot->after) || full.size() - slot->after.size() < start) {
    throw refuse("the conversation's rendering differs from the probed one after the message's place (the template "
                 "renders later messages by this one)");
  }
  const std::size_t content_end = full.size() - slot->after.size();
  // The span's text must be what the template writes for the message when the conversation ends with it (what the
  // model writes there): text that only later messages bring in (Gemma 4 writes the tools' answers into the model's
  // turn) is not the message's.
  const std::string alone = render_or_refuse(messages_, index + 1, false);
  const std::size_t message_from =
      std::min(common_prefix(alone, last->before), last->before.size() - std::min(opener.size(), last->before.size()));
  if (alone.find(full.substr(start, content_end - start), message_from) == std::string::npos) {
    throw refuse("the text between the probed message's neighbours is not what the template writes for the message "
                 "when the conversation ends with it (it holds later messages' text)");
  }
  // The end-of-turn text: what follows the content when the message ends the conversation, as far as the whole
  // conversation goes on with it (<|im_end|>\n before the next turn; Phi-3's eos_token only at the very end).
  const std::size_t end = character_boundary(full, content_end + common_prefix(last->after, slot->after), content_end);
  return {start, end};
}

}  // namespace trainer::chat
