// Chat rendering over the Jinja interpreter: the variables transformers passes, the template lookup in a model
// directory, and assistant spans by rendering prefix by prefix.
#include "chat/chat_template.h"
#include "chat/training_templates.h"

#include <algorithm>
#include <fstream>
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

}  // namespace

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
  static const TemplateValue kTrue(nlohmann::ordered_json(true)), kFalse(nlohmann::ordered_json(false));
  variables_[messages_index_].second = messages_.first(count);
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
  const std::string hint =
      "set data.train_on=all, or use a chat template that marks the assistant's text with {% generation %} "
      "(trainer swaps in its own generation-marked version of a model's template it recognises byte for byte: " +
      training_template_families() + "; this template is none of them)";
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
    std::size_t end = prompt.size();
    while (end < turn.size() && end < full.size() && turn[end] == full[end]) ++end;
    // Never end inside a UTF-8 character.
    while (end > prompt.size() && end < full.size() && (static_cast<unsigned char>(full[end]) & 0xC0) == 0x80) --end;
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

}  // namespace trainer::chat
