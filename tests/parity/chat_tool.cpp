// The chat template tests' helper (tests/parity/test_chat_templates.py): one JSON request a line on stdin, one JSON
// answer a line on stdout, so one process renders a whole suite.
//
// Request: {"template": str (or "model_dir": str, whose template and special tokens are loaded), "messages": [...], "tools": [...] | null, "add_generation_prompt": bool,
//           "bos_token": str, "eos_token": str, "special_tokens": {...}, "extra": {...},
//           "prefix_spans": bool, "probe_spans": bool, "spans": bool, "max_steps": int, "max_output_bytes": int,
//           "repeat": int (render this many times more and report "seconds_per_render": a benchmark)}
// Answer:  {"text": str, "origin": str (with model_dir), "generation_spans": [[b, e], ...],
//           "prefix_spans" / "probe_spans": [[b, e], ...] | {"error": str, "hint": str},
//           "spans": {"spans": [[b, e], ...], "method": "prefix" | "probe"} | {"error": str, "hint": str}}
//          or {"error": str, "kind": "syntax" | "render" | "raised" | "limit" | "other", "message": str,
//              "line": int, "column": int}
// Spans are byte offsets into the UTF-8 text.
#include <chrono>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"

namespace {

using nlohmann::ordered_json;
using trainer::chat::TemplateError;

const char* kind_name(TemplateError::Kind kind) {
  switch (kind) {
    case TemplateError::Kind::kSyntax: return "syntax";
    case TemplateError::Kind::kRender: return "render";
    case TemplateError::Kind::kRaised: return "raised";
    case TemplateError::Kind::kLimit: return "limit";
  }
  return "other";
}

ordered_json spans_json(const std::vector<trainer::chat::Span>& spans) {
  ordered_json out = ordered_json::array();
  for (const auto& [begin, end] : spans) out.push_back({begin, end});
  return out;
}

ordered_json answer(const ordered_json& request, std::string& cached_source,
                    std::unique_ptr<trainer::chat::Template>& cached) {
  trainer::chat::ModelChatTemplate loaded;
  const bool from_model_dir = request.contains("model_dir");
  if (from_model_dir) {
    const bool with_tools = request.contains("tools") && !request["tools"].is_null();
    loaded = trainer::chat::load_chat_template(request["model_dir"].get<std::string>(), with_tools);
  }
  const std::string source = from_model_dir ? loaded.source : request.at("template").get<std::string>();
  if (!cached || source != cached_source) {
    cached.reset();
    cached = std::make_unique<trainer::chat::Template>(source);
    cached_source = source;
  }
  trainer::chat::ChatOptions options;
  options.add_generation_prompt = request.value("add_generation_prompt", false);
  if (request.contains("tools")) options.tools = request["tools"];
  if (from_model_dir) options.special_tokens = loaded.special_tokens;
  if (request.contains("special_tokens")) options.special_tokens.update(request["special_tokens"]);
  for (const char* key : {"bos_token", "eos_token"}) {
    if (request.contains(key)) options.special_tokens[key] = request[key];
  }
  if (request.contains("extra")) options.extra = request["extra"];
  if (request.contains("max_steps")) options.limits.max_steps = request["max_steps"].get<std::int64_t>();
  if (request.contains("max_output_bytes")) options.limits.max_output_bytes = request["max_output_bytes"].get<std::size_t>();
  const ordered_json& messages = request.at("messages");

  auto rendering = trainer::chat::render_chat(*cached, messages, options);
  ordered_json out = ordered_json::object();
  if (const auto repeat = request.value("repeat", 0); repeat > 0) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat; ++i) trainer::chat::render_chat(*cached, messages, options);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    out["seconds_per_render"] = took.count() / repeat;
  }
  out["text"] = rendering.text;
  if (from_model_dir) out["origin"] = loaded.origin;
  out["generation_spans"] = spans_json(rendering.generation_spans);
  if (request.value("prefix_spans", false)) {
    try {
      out["prefix_spans"] = spans_json(trainer::chat::assistant_spans_by_prefix(*cached, messages, options));
    } catch (const trainer::Error& e) {
      out["prefix_spans"] = {{"error", std::string(e.what())}, {"hint", e.hint()}};
    }
  }
  if (request.value("probe_spans", false)) {
    try {
      out["probe_spans"] =
          spans_json(trainer::chat::assistant_spans_by_probe(*cached, messages, options, rendering.text));
    } catch (const trainer::Error& e) {
      out["probe_spans"] = {{"error", std::string(e.what())}, {"hint", e.hint()}};
    }
  }
  if (request.value("spans", false)) {
    try {
      const auto found = trainer::chat::assistant_spans(*cached, messages, options, rendering.text);
      out["spans"] = {{"spans", spans_json(found.spans)},
                      {"method", trainer::chat::span_method_name(found.method)}};
    } catch (const trainer::Error& e) {
      out["spans"] = {{"error", std::string(e.what())}, {"hint", e.hint()}};
    }
  }
  return out;
}

}  // namespace

int main() {
  std::ios::sync_with_stdio(false);
  std::string line;
  std::string cached_source;
  std::unique_ptr<trainer::chat::Template> cached;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    ordered_json out;
    try {
      out = answer(ordered_json::parse(line), cached_source, cached);
    } catch (const TemplateError& e) {
      out = {{"error", std::string(e.what())}, {"kind", kind_name(e.kind())}, {"message", e.template_message()},
             {"line", e.line()}, {"column", e.column()}, {"hint", e.hint()}};
    } catch (const std::exception& e) {
      out = {{"error", std::string(e.what())}, {"kind", "other"}};
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n' << std::flush;
  }
  return 0;
}
