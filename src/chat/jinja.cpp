// The Jinja interpreter's public face (chat/jinja.h): TemplateError, and Template and TemplateValue over the
// lexer (jinja_lexer.cpp), parser (jinja_parser.cpp), evaluator (jinja_eval.cpp) and builtins (jinja_builtins.cpp).
#include "chat/jinja.h"

#include "chat/jinja_internal.h"

namespace trainer::chat {

namespace {
std::string located(TemplateError::Kind kind, const std::string& message, int line, int column) {
  switch (kind) {
    case TemplateError::Kind::kRaised:
      return "chat template raised an exception: " + message;
    case TemplateError::Kind::kSyntax:
      return "chat template syntax error at line " + std::to_string(line) + ", column " + std::to_string(column) +
             ": " + message;
    default:
      return "chat template error at line " + std::to_string(line) + ", column " + std::to_string(column) + ": " +
             message;
  }
}
}  // namespace

TemplateError::TemplateError(Kind kind, std::string template_message, int line, int column, std::string hint)
    : Error(located(kind, template_message, line, column), std::move(hint)),
      kind_(kind),
      template_message_(std::move(template_message)),
      line_(line),
      column_(column) {}

struct Template::Impl {
  jinja::Body body;
};

struct TemplateValue::Impl {
  jinja::Value value;
};

TemplateValue::TemplateValue(const nlohmann::ordered_json& value) {
  auto impl = std::make_shared<Impl>();
  impl->value = jinja::from_json(value);
  impl_ = std::move(impl);
}

TemplateValue TemplateValue::first(std::size_t n) const {
  const jinja::Value& value = impl_->value;
  if (value.type != jinja::Type::kList || n >= value.list->size()) return *this;
  auto impl = std::make_shared<Impl>();
  impl->value = jinja::Value::from_list(
      jinja::List(value.list->begin(), value.list->begin() + static_cast<std::ptrdiff_t>(n)), value.is_tuple);
  return TemplateValue(std::move(impl));
}

Template::Template(std::string_view source) {
  auto impl = std::make_shared<Impl>();
  impl->body = jinja::parse(jinja::lex(source));
  impl_ = std::move(impl);
}

RenderResult Template::render(const nlohmann::ordered_json& variables, const RenderLimits& limits) const {
  if (!variables.is_object() && !variables.is_null()) {
    throw TemplateError(TemplateError::Kind::kRender, "template variables must be a JSON object", 1, 1);
  }
  VariableRefs refs;
  if (variables.is_object()) {
    for (const auto& [key, value] : variables.items()) refs.emplace_back(key, &value);
  }
  return render(refs, limits);
}

RenderResult Template::render(const VariableRefs& variables, const RenderLimits& limits) const {
  Variables converted;
  converted.reserve(variables.size());
  for (const auto& [key, value] : variables) converted.emplace_back(key, TemplateValue(*value));
  return render(converted, limits);
}

RenderResult Template::render(const Variables& variables, const RenderLimits& limits) const {
  jinja::Context ctx;
  ctx.limits = limits;
  ctx.frames.emplace_back();
  for (const auto& [key, value] : variables) ctx.frames[0].vars[key] = value.impl_->value;
  ctx.buffers.emplace_back();
  try {
    jinja::exec_body(impl_->body, ctx);
  } catch (const jinja::BreakSignal&) {
  } catch (const jinja::ContinueSignal&) {
  }
  return {std::move(ctx.buffers[0]), std::move(ctx.spans)};
}

void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  std::size_t done = 0;  // text[done, i) is copied as it is, in one append
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(text, done, i - done);
    done = i + 1;
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default: {
        static constexpr char kHex[] = "0123456789abcdef";
        const char escaped[] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 0xF]};
        out.append(escaped, sizeof escaped);
      }
    }
  }
  out.append(text, done);
  out += '"';
}

}  // namespace trainer::chat
