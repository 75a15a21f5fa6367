// Chat rendering as transformers' apply_chat_template(tokenize=False) does it: the model's template found in its
// directory, the variables it is given, and the assistant spans a loss mask needs.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/jinja.h"

namespace trainer::chat {

struct ChatOptions {
  bool add_generation_prompt = false;
  nlohmann::ordered_json tools;  // a list of JSON function schemas, or null for none (the template sees none)
  // bos_token, eos_token, pad_token, ...: strings, passed to the template as transformers passes special_tokens_map.
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  // Further template variables (date_string, enable_thinking, ...); they override special tokens of the same name.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  RenderLimits limits;
};

struct ChatRendering {
  std::string text;
  std::vector<Span> generation_spans;  // byte ranges of text that {% generation %} blocks rendered
};

// Renders messages (a JSON list of message objects). Throws TemplateError.
ChatRendering render_chat(const Template& chat_template, const nlohmann::ordered_json& messages,
                          const ChatOptions& options);
ChatRendering render_chat(std::string_view template_text, const nlohmann::ordered_json& messages,
                          const ChatOptions& options);

// How the assistant spans of a conversation were found (trainer data --dump names it).
enum class SpanMethod { kPrefix, kProbe };
const char* span_method_name(SpanMethod method);  // "prefix", "probe"

struct AssistantSpans {
  std::vector<Span> spans;
  SpanMethod method = SpanMethod::kPrefix;
};

// One conversation converted for the interpreter once, for several renders: the whole conversation, and the
// prefixes assistant_spans_by_prefix renders. `messages` and `options` must outlive it. Throws TemplateError when
// messages is not a list.
class Conversation {
 public:
  Conversation(const nlohmann::ordered_json& messages, const ChatOptions& options);
  // render_chat(chat_template, messages, options).
  ChatRendering render(const Template& chat_template);
  // assistant_spans_by_prefix(chat_template, messages, options, full).
  std::vector<Span> assistant_spans_by_prefix(const Template& chat_template, std::string_view full);
  // assistant_spans_by_probe(chat_template, messages, options, full).
  std::vector<Span> assistant_spans_by_probe(const Template& chat_template, std::string_view full);
  // assistant_spans(chat_template, messages, options, full).
  AssistantSpans assistant_spans(const Template& chat_template, std::string_view full);

 private:
  ChatRendering render_first(const Template& chat_template, std::size_t count, bool add_generation_prompt);
  ChatRendering render_first(const Template& chat_template, const TemplateValue& messages, std::size_t count,
                             bool add_generation_prompt);
  Span probe_span(const Template& chat_template, std::size_t index, std::string_view full);
  Span probe_span(const Template& chat_template, std::size_t index, std::string_view full, bool keep_tool_calls);
  // What the template writes between the generation prompt and assistant message `index`'s content when the message
  // ends the conversation (Qwen3's "<think>\n\n</think>\n\n", Mistral's " "): the model writes it, not the prompt.
  std::string opener_of(const Template& chat_template, std::size_t index, std::string_view last_before);

  const nlohmann::ordered_json& messages_json_;
  TemplateValue messages_;
  std::size_t message_count_;
  const ChatOptions& options_;
  Template::Variables variables_;
  std::size_t messages_index_ = 0;
};

// The chat template of a model directory and the special tokens its tokenizer_config.json names.
struct ModelChatTemplate {
  std::string source;  // the template's text
  std::string origin;  // where it came from, for messages: "DIR/chat_template.jinja", "DIR/tokenizer_config.json"
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
};

// Finds the template as transformers does: chat_template.jinja (and chat_templates/NAME.jinja) beside
// tokenizer_config.json take priority over its chat_template entry, which is a string or a list of
// {"name", "template"} objects. With several templates, "tool_use" is picked when with_tools, else "default".
// Throws Error (kExitData) naming the directory when there is no template, with a hint.
ModelChatTemplate load_chat_template(const std::filesystem::path& model_dir, bool with_tools);

// Special tokens from a tokenizer_config.json object: every "*_token" key whose value is a string or an
// AddedToken object ({"content": ...}).
nlohmann::ordered_json special_tokens_from_config(const nlohmann::ordered_json& tokenizer_config);

// For templates without {% generation %}: each assistant message's span, found by rendering prefix by prefix.
// For assistant message i, messages[:i] rendered with add_generation_prompt=true (the prompt) must be a prefix of
// messages[:i+1] rendered without it (the turn); the span is what the turn adds after the prompt (the content and
// the end-of-turn marker), cut where the whole conversation's rendering (options.add_generation_prompt as given)
// stops agreeing with the turn, since a template may close a conversation with text that is not part of the turn
// (Phi-3's eos_token). Spans are byte ranges of the whole conversation's rendering. Throws Error (kExitData) with
// a hint (data.train_on=all, or a template with {% generation %}) when the renderings are not prefixes.
std::vector<Span> assistant_spans_by_prefix(const Template& chat_template, const nlohmann::ordered_json& messages,
                                            const ChatOptions& options);
// The same when the whole conversation's rendering (render_chat with `options`) is at hand: it is not rendered again.
std::vector<Span> assistant_spans_by_prefix(const Template& chat_template, const nlohmann::ordered_json& messages,
                                            const ChatOptions& options, std::string_view full);

// For templates that rendering prefix by prefix cannot split (they render earlier turns differently once the
// conversation goes on): each assistant message's span found in the whole conversation's rendering by probing.
// Message i is replaced by a probe message (its role and other fields, its content a probe string, none of the
// reasoning the model writes: reasoning_content, reasoning, thinking; its tool_calls kept first, and where that fails
// left out too), rendered with two different probe strings: what differs between the two renderings is the content's
// place, the text before it (P) and after it (S) is the template's. The span is the whole rendering's text between P
// and S: the message as the template renders it in this conversation (reasoning and tool calls included, what the
// template drops for earlier turns not), widened
//  - at its start by what the template writes between the generation prompt and the content when the message ends
//    the conversation (Qwen3's "<think>\n\n</think>\n\n", Mistral's " "), when P ends with that text: the model
//    writes it, the prompt does not (found from the messages before it, or else from a one-turn conversation);
//  - at its end by the end-of-turn text: what follows the content when the message ends the conversation, as far as
//    it agrees with S (<|im_end|>\n, <end_of_turn>\n, </s>, <|eot_id|> ...; the tool calls a template writes after
//    the content, when they were kept).
// Trusted only when the probe behaves: each probe rendering is P + probe + S (the content rendered once, unchanged,
// and nothing else depends on it); the whole rendering ends with S (no later turn depends on the message) and agrees
// with P up to the span's start (no earlier text depends on it); kept tool calls come after the content; the span's
// text is what the template writes for the message when the conversation ends with it (no later message's text);
// the spans follow each other. Otherwise throws Error (kExitData) naming the message and the check that failed,
// with the same hint as assistant_spans_by_prefix.
std::vector<Span> assistant_spans_by_probe(const Template& chat_template, const nlohmann::ordered_json& messages,
                                           const ChatOptions& options, std::string_view full);

// The assistant spans of a template without {% generation %}: prefix by prefix, else by probing (for the spans of a
// template with {% generation %} see ChatRendering). Throws Error (kExitData) saying why both failed, with the hint.
AssistantSpans assistant_spans(const Template& chat_template, const nlohmann::ordered_json& messages,
                               const ChatOptions& options, std::string_view full);

}  // namespace trainer::chat
