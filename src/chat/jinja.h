// A sandboxed interpreter for the Jinja subset that Hugging Face chat templates use, configured as transformers
// configures jinja2 for them (trim_blocks, lstrip_blocks, loopcontrols, the {% generation %} tracker).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"

namespace trainer::chat {

// Every error a template causes: a syntax error (with the template's line and column), an error while rendering
// (with the line and column of the expression), a raise_exception() from the template, or a limit reached.
class TemplateError : public Error {
 public:
  enum class Kind { kSyntax, kRender, kRaised, kLimit };

  TemplateError(Kind kind, std::string template_message, int line, int column, std::string hint = {});

  Kind kind() const { return kind_; }
  int line() const { return line_; }
  int column() const { return column_; }
  // The message alone, without the location prefix what() carries: for raise_exception, the template's own text,
  // so a caller can prefix the record's file:line.
  const std::string& template_message() const { return template_message_; }
  ExitCode exit_code() const override { return kExitData; }

 private:
  Kind kind_;
  std::string template_message_;
  int line_;
  int column_;
};

// Bounds that stop a template which loops or grows without end, instead of hanging or exhausting memory.
struct RenderLimits {
  std::int64_t max_steps = 20'000'000;              // statements and expressions evaluated
  std::size_t max_output_bytes = 64u * 1024 * 1024;  // rendered text, captures (set blocks, macros) included
  int max_call_depth = 200;                          // nested macro calls
};

// A half-open byte range [begin, end) of the rendered UTF-8 text.
using Span = std::pair<std::size_t, std::size_t>;

struct RenderResult {
  std::string text;
  // What each {% generation %} block rendered, in order, as byte offsets into text.
  std::vector<Span> generation_spans;
};

// A JSON value converted once into the interpreter's own form, so that several renders (a conversation's
// prefixes) share it instead of converting or copying the JSON again. Immutable; a list can be cut to its first
// items without copying them.
class TemplateValue {
 public:
  explicit TemplateValue(const nlohmann::ordered_json& value);
  // The first n items of a list value (all of them when n is larger); a value that is not a list, unchanged.
  TemplateValue first(std::size_t n) const;

  struct Impl;

 private:
  explicit TemplateValue(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
  friend class Template;
};

// A parsed template; parse once, render many times (rendering is const and may run on several threads).
class Template {
 public:
  // Throws TemplateError (kSyntax) naming the line and column of the first syntax error.
  explicit Template(std::string_view source);

  // Renders with the given variables (a JSON object; key order is kept, as Python dicts keep it) besides the
  // globals transformers provides: raise_exception, strftime_now, namespace, dict, range.
  RenderResult render(const nlohmann::ordered_json& variables, const RenderLimits& limits = {}) const;

  // The same with variables given by reference, so large values (messages, tools) are not copied into a JSON
  // object first; a later entry of the same name replaces an earlier one.
  using VariableRefs = std::vector<std::pair<std::string, const nlohmann::ordered_json*>>;
  RenderResult render(const VariableRefs& variables, const RenderLimits& limits = {}) const;

  // The same with variables converted beforehand (TemplateValue), for renders that share them.
  using Variables = std::vector<std::pair<std::string, TemplateValue>>;
  RenderResult render(const Variables& variables, const RenderLimits& limits = {}) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// Appends `text` (valid UTF-8) as a JSON string the way Python's json.dumps(ensure_ascii=False) and nlohmann's
// dump() write it: quotes, backslashes and control characters escaped ("\n", "\u001b"), everything else as it is.
// The interpreter's `tojson` writes strings with it; so does `trainer data --dump`.
void append_json_string(std::string& out, std::string_view text);

}  // namespace trainer::chat
