// The Jinja interpreter for chat templates: lexer (with jinja2's whitespace rules), parser to a tree, and a
// tree-walking evaluator whose values, filters, tests and methods follow Python's and jinja2's behaviour.
#include "chat/jinja.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <optional>

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

namespace {

using Kind = TemplateError::Kind;

struct Pos {
  int line = 1;
  int column = 1;
};

[[noreturn]] void fail(Kind kind, const std::string& message, Pos pos, std::string hint = {}) {
  throw TemplateError(kind, message, pos.line, pos.column, std::move(hint));
}

// ---- UTF-8: Python strings index code points, so length, indexing and slicing do too ---------------------------

std::vector<std::size_t> code_point_offsets(const std::string& s) {
  std::vector<std::size_t> offsets;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) offsets.push_back(i);
  }
  return offsets;
}

std::size_t code_point_count(const std::string& s) {
  std::size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// ---- Values -----------------------------------------------------------------------------------------------------

struct Value;
struct Context;
using List = std::vector<Value>;
struct Dict;

struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> named;
  Pos pos;
  const Value* get(std::size_t index, const char* name) const;
};

struct Callable {
  std::string name;
  std::function<Value(Context&, Args&)> fn;
};

enum class Type { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };

struct Value {
  Type type = Type::kUndefined;
  bool boolean = false;
  bool is_tuple = false;
  std::int64_t integer = 0;
  double number = 0;
  std::string text;  // kString; for kUndefined, the name that was missing
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;  // kDict (never mutated after building) and kNamespace (mutable, shared)
  std::shared_ptr<const Callable> callable;

  static Value none() { Value v; v.type = Type::kNone; return v; }
  static Value undefined(std::string name) { Value v; v.text = std::move(name); return v; }
  static Value from_bool(bool b) { Value v; v.type = Type::kBool; v.boolean = b; return v; }
  static Value from_int(std::int64_t i) { Value v; v.type = Type::kInt; v.integer = i; return v; }
  static Value from_float(double d) { Value v; v.type = Type::kFloat; v.number = d; return v; }
  static Value from_string(std::string s) { Value v; v.type = Type::kString; v.text = std::move(s); return v; }
  static Value from_list(List items, bool tuple = false) {
    Value v;
    v.type = Type::kList;
    v.is_tuple = tuple;
    v.list = std::make_shared<const List>(std::move(items));
    return v;
  }
  static Value from_dict(std::shared_ptr<Dict> d) { Value v; v.type = Type::kDict; v.dict = std::move(d); return v; }
  static Value from_callable(std::string name, std::function<Value(Context&, Args&)> fn) {
    Value v;
    v.type = Type::kCallable;
    v.callable = std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)});
    return v;
  }

  bool is_undefined() const { return type == Type::kUndefined; }
  bool is_number() const { return type == Type::kInt || type == Type::kFloat || type == Type::kBool; }
  double as_double() const {
    return type == Type::kFloat ? number : type == Type::kBool ? (boolean ? 1.0 : 0.0) : static_cast<double>(integer);
  }
  std::int64_t as_int() const { return type == Type::kBool ? (boolean ? 1 : 0) : integer; }
};

// Keys are strings (what JSON gives and templates build); insertion order is kept, as in Python.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& key) const {
    for (const auto& item : items) {
      if (item.first == key) return &item.second;
    }
    return nullptr;
  }
  void set(const std::string& key, Value value) {
    for (auto& item : items) {
      if (item.first == key) {
        item.second = std::move(value);
        return;
      }
    }
    items.emplace_back(key, std::move(value));
  }
};

const Value* Args::get(std::size_t index, const char* name) const {
  if (index < positional.size()) return &positional[index];
  for (const auto& [key, value] : named) {
    if (key == name) return &value;
  }
  return nullptr;
}

const char* type_name(const Value& v) {
  switch (v.type) {
    case Type::kUndefined: return "undefined";
    case Type::kNone: return "none";
    case Type::kBool: return "bool";
    case Type::kInt: return "int";
    case Type::kFloat: return "float";
    case Type::kString: return "string";
    case Type::kList: return v.is_tuple ? "tuple" : "list";
    case Type::kDict: return "dict";
    case Type::kNamespace: return "namespace";
    case Type::kCallable: return "function";
  }
  return "value";
}

bool truthy(const Value& v) {
  switch (v.type) {
    case Type::kUndefined:
    case Type::kNone: return false;
    case Type::kBool: return v.boolean;
    case Type::kInt: return v.integer != 0;
    case Type::kFloat: return v.number != 0.0;
    case Type::kString: return !v.text.empty();
    case Type::kList: return !v.list->empty();
    case Type::kDict: return !v.dict->items.empty();
    default: return true;
  }
}

// Python's repr of a float: the shortest digits that read back to the same double.
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[40];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  // buf is d.ddde[+-]XX; rebuild it the way Python's float_repr_style 'short' does.
  std::string s(buf);
  bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  std::size_t e = s.find('e');
  int exponent = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (std::size_t i = 0; i < e; ++i) {
    if (s[i] != '.') digits += s[i];
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exponent < -4 || exponent >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += ebuf;
  } else if (exponent < 0) {
    out = "0." + std::string(static_cast<std::size_t>(-exponent - 1), '0') + digits;
  } else {
    auto point = static_cast<std::size_t>(exponent + 1);
    if (digits.size() <= point) {
      out = digits + std::string(point - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, point) + "." + digits.substr(point);
    }
  }
  return negative ? "-" + out : out;
}

std::vector<std::pair<std::uint32_t, std::size_t>> code_points(const std::string& s);

// Characters Python's repr() escapes (str.isprintable() false): controls, separators other than the space, and the
// common format characters. Unassigned code points, which need Unicode tables, print as they are.
bool repr_escapes(std::uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) ||
         (cp >= 0x2028 && cp <= 0x202F) || (cp >= 0x205F && cp <= 0x2064) || (cp >= 0x2066 && cp <= 0x206F) ||
         cp == 0x3000 || cp == 0xFEFF || (cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0xE000 && cp <= 0xF8FF) ||
         (cp >= 0xFFF9 && cp <= 0xFFFB);
}

std::string string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (const auto& [cp, offset] : code_points(s)) {
    if (cp == static_cast<unsigned char>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (repr_escapes(cp)) {
      char buf[16];
      if (cp < 0x100) std::snprintf(buf, sizeof buf, "\\x%02x", cp);
      else if (cp < 0x10000) std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      else std::snprintf(buf, sizeof buf, "\\U%08x", cp);
      out += buf;
    } else {
      std::size_t n = 1;
      while (offset + n < s.size() && (static_cast<unsigned char>(s[offset + n]) & 0xC0) == 0x80) ++n;
      out.append(s, offset, n);
    }
  }
  out += quote;
  return out;
}

std::string repr(const Value& v);

// Python's str(): what {{ value }} prints.
std::string to_str(const Value& v) {
  switch (v.type) {
    case Type::kUndefined: return "";
    case Type::kString: return v.text;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.type) {
    case Type::kUndefined: return "";
    case Type::kNone: return "None";
    case Type::kBool: return v.boolean ? "True" : "False";
    case Type::kInt: return std::to_string(v.integer);
    case Type::kFloat: return float_repr(v.number);
    case Type::kString: return string_repr(v.text);
    case Type::kList: {
      std::string out = v.is_tuple ? "(" : "[";
      for (std::size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += ", ";
        out += repr((*v.list)[i]);
      }
      if (v.is_tuple && v.list->size() == 1) out += ",";
      return out + (v.is_tuple ? ")" : "]");
    }
    case Type::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [key, value] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += string_repr(key) + ": " + repr(value);
      }
      return out + "}";
    }
    case Type::kNamespace: return "<Namespace>";
    case Type::kCallable: return "<function " + v.callable->name + ">";
  }
  return "";
}

// ---- JSON in and out: json.dumps(ensure_ascii=False) as transformers' tojson filter calls it ---------------------

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::from_bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::from_int(j.get<std::int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::from_int(static_cast<std::int64_t>(j.get<std::uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::from_float(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::from_string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::from_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      for (const auto& [key, item] : j.items()) d->items.emplace_back(key, from_json(item));
      return Value::from_dict(std::move(d));
    }
    default: return Value::none();
  }
}


struct JsonStyle {
  int indent = -1;  // -1: none (one line)
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

void to_json(const Value& v, const JsonStyle& style, int depth, std::string& out, Pos pos) {
  auto newline = [&](int level) {
    out += '\n';
    out.append(static_cast<std::size_t>(style.indent * level), ' ');
  };
  switch (v.type) {
    case Type::kNone: out += "null"; return;
    case Type::kBool: out += v.boolean ? "true" : "false"; return;
    case Type::kInt: out += std::to_string(v.integer); return;
    case Type::kFloat:
      out += std::isnan(v.number) ? "NaN" : std::isinf(v.number) ? (v.number > 0 ? "Infinity" : "-Infinity")
                                                                  : float_repr(v.number);
      return;
    case Type::kString: append_json_string(out, v.text); return;
    case Type::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (std::size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += style.item_separator;
        if (style.indent >= 0) newline(depth + 1);
        to_json((*v.list)[i], style, depth + 1, out, pos);
      }
      if (style.indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Type::kDict:
    case Type::kNamespace: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.dict->items) items.push_back(&item);
      if (style.sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (i) out += style.item_separator;
        if (style.indent >= 0) newline(depth + 1);
        append_json_string(out, items[i]->first);
        out += style.key_separator;
        to_json(items[i]->second, style, depth + 1, out, pos);
      }
      if (style.indent >= 0) newline(depth);
      out += '}';
      return;
    }
    default:
      fail(Kind::kRender, std::string("Object of type ") + type_name(v) + " is not JSON serializable", pos,
           "is a variable misspelled or missing from the messages?");
  }
}

// ---- Lexer: jinja2's tokenizer with trim_blocks=True and lstrip_blocks=True -------------------------------------

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  Pos pos;
};

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // jinja2 normalises newlines and, without keep_trailing_newline, drops one newline at the very end.
    src_.reserve(source.size());
    for (std::size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r' && i + 1 < source.size() && source[i + 1] == '\n') continue;
      src_ += source[i] == '\r' ? '\n' : source[i];
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    for (std::size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> run() {
    std::size_t pos = 0;
    bool strip_next = false;
    while (pos <= src_.size()) {
      std::size_t tag = find_tag(pos);
      std::string text = src_.substr(pos, tag == std::string::npos ? std::string::npos : tag - pos);
      Pos text_pos = position(pos);
      std::size_t text_start = pos;
      if (strip_next) {
        std::size_t first = 0;
        while (first < text.size() && is_space(text[first])) ++first;
        text.erase(0, first);
        text_start += first;
        text_pos = position(text_start);
        strip_next = false;
      }
      if (tag == std::string::npos) {
        if (!text.empty()) tokens_.push_back({Tok::kText, text, text_pos});
        break;
      }
      char kind = src_[tag + 1];
      char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (sign == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (sign != '+' && (kind == '%' || kind == '#')) {
        // lstrip_blocks: whitespace from the start of the line to a block or comment tag goes.
        std::size_t newline = text.rfind('\n');
        std::size_t line_start = newline == std::string::npos ? 0 : newline + 1;
        bool at_line_start = newline != std::string::npos || pos == 0 || src_[pos - 1] == '\n';
        if (at_line_start &&
            std::all_of(text.begin() + static_cast<std::ptrdiff_t>(line_start), text.end(),
                        [](char c) { return c == ' ' || c == '\t'; })) {
          text.erase(line_start);
        }
      }
      if (!text.empty()) tokens_.push_back({Tok::kText, text, text_pos});
      std::size_t inner = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        std::size_t end = src_.find("#}", inner);
        if (end == std::string::npos) fail(Kind::kSyntax, "unclosed comment: missing '#}'", position(tag));
        bool minus = end > inner && src_[end - 1] == '-';
        pos = end + 2;
        if (minus) strip_next = true;
        else if (pos < src_.size() && src_[pos] == '\n') ++pos;  // trim_blocks applies to comments too
        continue;
      }
      bool block = kind == '%';
      tokens_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, "", position(tag)});
      std::size_t first_token = tokens_.size();
      pos = lex_inside(inner, block, strip_next, tag);
      if (block && tokens_.size() > first_token + 1 && tokens_[first_token].type == Tok::kName &&
          tokens_[first_token].text == "raw") {
        pos = lex_raw(pos, tag);
      }
    }
    tokens_.push_back({Tok::kEof, "", position(src_.size())});
    return std::move(tokens_);
  }

 private:
  Pos position(std::size_t offset) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    std::size_t line_index = static_cast<std::size_t>(it - line_starts_.begin()) - 1;
    std::size_t column = code_point_count(src_.substr(line_starts_[line_index], offset - line_starts_[line_index]));
    return {static_cast<int>(line_index + 1), static_cast<int>(column + 1)};
  }

  std::size_t find_tag(std::size_t from) const {
    for (std::size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  // Tokens of one {{ }} or {% %}; returns the offset after the closing delimiter.
  std::size_t lex_inside(std::size_t i, bool block, bool& strip_next, std::size_t tag) {
    int depth = 0;
    const char close = block ? '%' : '}';
    while (true) {
      while (i < src_.size() && is_space(src_[i])) ++i;
      if (i >= src_.size()) fail(Kind::kSyntax, block ? "unclosed tag: missing '%}'" : "unclosed '{{': missing '}}'",
                                 position(tag));
      if (depth == 0) {
        std::size_t j = i;
        char sign = '\0';
        if ((src_[j] == '-' || src_[j] == '+') && j + 1 < src_.size() && src_[j + 1] == close) sign = src_[j++];
        if (j + 1 < src_.size() && src_[j] == close && src_[j + 1] == '}') {
          tokens_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, "", position(i)});
          std::size_t after = j + 2;
          if (sign == '-') strip_next = true;
          else if (block && sign != '+' && after < src_.size() && src_[after] == '\n') ++after;  // trim_blocks
          return after;
        }
      }
      Pos here = position(i);
      char c = src_[i];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        std::size_t j = i;
        while (j < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        tokens_.push_back({Tok::kName, src_.substr(i, j - i), here});
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        std::size_t j = i;
        bool is_float = false;
        while (j < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        if (j + 1 < src_.size() && src_[j] == '.' && std::isdigit(static_cast<unsigned char>(src_[j + 1]))) {
          is_float = true;
          ++j;
          while (j < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        }
        if (j < src_.size() && (src_[j] == 'e' || src_[j] == 'E')) {
          std::size_t k = j + 1;
          if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
          if (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) {
            is_float = true;
            j = k;
            while (j < src_.size() && std::isdigit(static_cast<unsigned char>(src_[j]))) ++j;
          }
        }
        std::string digits;
        for (std::size_t k = i; k < j; ++k) {
          if (src_[k] != '_') digits += src_[k];
        }
        tokens_.push_back({is_float ? Tok::kFloat : Tok::kInt, digits, here});
        i = j;
      } else if (c == '\'' || c == '"') {
        i = lex_string(i, here);
      } else {
        static const char* const kTwo[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* two : kTwo) {
          if (src_.compare(i, 2, two) == 0) op = two;
        }
        if (op.size() == 1 && std::string("+-*/%~<>=()[]{},.:|!").find(c) == std::string::npos) {
          fail(Kind::kSyntax, std::string("unexpected character '") + c + "'", here);
        }
        if (c == '(' || c == '[' || c == '{') ++depth;
        if (c == ')' || c == ']' || c == '}') --depth;
        tokens_.push_back({Tok::kOp, op, here});
        i += op.size();
      }
    }
  }

  std::size_t lex_string(std::size_t i, Pos here) {
    char quote = src_[i++];
    std::string value;
    while (true) {
      if (i >= src_.size()) fail(Kind::kSyntax, "unterminated string", here);
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\' || i + 1 >= src_.size()) {
        value += c;
        ++i;
        continue;
      }
      char e = src_[i + 1];
      i += 2;
      auto hex = [&](int count) {
        if (i + static_cast<std::size_t>(count) > src_.size()) fail(Kind::kSyntax, "truncated escape in string", here);
        std::uint32_t cp = static_cast<std::uint32_t>(
            std::stoul(src_.substr(i, static_cast<std::size_t>(count)), nullptr, 16));
        i += static_cast<std::size_t>(count);
        append_utf8(value, cp);
      };
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case '0': value += '\0'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case '\n': break;
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default:
          value += '\\';
          value += e;
      }
    }
    tokens_.push_back({Tok::kString, value, here});
    return i + 1;
  }

  // {% raw %}...{% endraw %}: the text between is output as it stands.
  std::size_t lex_raw(std::size_t pos, std::size_t tag) {
    for (std::size_t i = src_.find("{%", pos); i != std::string::npos; i = src_.find("{%", i + 2)) {
      std::size_t j = i + 2;
      bool minus_before = j < src_.size() && src_[j] == '-';
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
      while (j < src_.size() && is_space(src_[j])) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && is_space(src_[j])) ++j;
      bool minus_after = j < src_.size() && src_[j] == '-';
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
      if (src_.compare(j, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos, i - pos);
      if (minus_before) {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      }
      if (!text.empty()) tokens_.push_back({Tok::kText, text, position(pos)});
      tokens_.push_back({Tok::kBlockBegin, "", position(i)});
      tokens_.push_back({Tok::kName, "endraw", position(i)});
      tokens_.push_back({Tok::kBlockEnd, "", position(j)});
      std::size_t after = j + 2;
      if (minus_after) {
        while (after < src_.size() && is_space(src_[after])) ++after;
      } else if (after < src_.size() && src_[after] == '\n') {
        ++after;
      }
      return after;
    }
    fail(Kind::kSyntax, "missing {% endraw %}", position(tag));
  }

  std::string src_;
  std::vector<std::size_t> line_starts_{0};
  std::vector<Token> tokens_;
};

// ---- The tree ----------------------------------------------------------------------------------------------------

struct Expr {
  Pos pos;
  virtual ~Expr() = default;
  virtual Value eval(Context& ctx) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt {
  Pos pos;
  virtual ~Stmt() = default;
  virtual void exec(Context& ctx) const = 0;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct BreakSignal {};
struct ContinueSignal {};

// A frame's variables: a handful each, so a flat list searched in order is faster than hashing every name.
class Vars {
 public:
  const Value* find(const std::string& name) const {
    for (const auto& [key, value] : entries_) {
      if (key == name) return &value;
    }
    return nullptr;
  }
  Value& operator[](const std::string& name) {
    for (auto& [key, value] : entries_) {
      if (key == name) return value;
    }
    return entries_.emplace_back(name, Value()).second;
  }

 private:
  std::vector<std::pair<std::string, Value>> entries_;
};

struct Frame {
  Vars vars;
  bool macro_barrier = false;  // a macro sees its own frame and the template's top level, not its caller's
};

struct Context {
  std::vector<Frame> frames;
  std::vector<std::string> buffers;
  std::vector<Span> spans;
  RenderLimits limits;
  std::int64_t steps = 0;
  int call_depth = 0;

  void step(Pos pos) {
    if (++steps > limits.max_steps) {
      fail(Kind::kLimit, "the template ran more than " + std::to_string(limits.max_steps) + " steps", pos,
           "does the template loop without end?");
    }
  }
  void write(const std::string& s, Pos pos) {
    std::string& out = buffers.back();
    std::size_t total = s.size();
    for (const auto& b : buffers) total += b.size();
    if (total > limits.max_output_bytes) {
      fail(Kind::kLimit, "the template's output grew past " + std::to_string(limits.max_output_bytes) + " bytes",
           pos, "does the template repeat text without end?");
    }
    out += s;
  }
  Value lookup(const std::string& name) const {
    for (std::size_t i = frames.size(); i-- > 0;) {
      if (const Value* found = frames[i].vars.find(name)) return *found;
      if (frames[i].macro_barrier) {
        const Value* top = frames[0].vars.find(name);
        return top ? *top : global(name);
      }
    }
    return global(name);
  }
  static Value global(const std::string& name);
  void assign(const std::string& name, Value value) { frames.back().vars[name] = std::move(value); }
  std::string capture(const Body& body);
};

void exec_body(const Body& body, Context& ctx) {
  for (const auto& stmt : body) stmt->exec(ctx);
}

std::string Context::capture(const Body& body) {
  // The capture buffer goes however the body ends: an error leaves the enclosing buffer current again.
  struct PopBuffer {
    std::vector<std::string>& buffers;
    ~PopBuffer() { buffers.pop_back(); }
  };
  buffers.emplace_back();
  const PopBuffer pop{buffers};
  exec_body(body, *this);
  return std::move(buffers.back());
}

// ---- Operations shared by expressions, filters and tests ---------------------------------------------------------

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.type == Type::kFloat || b.type == Type::kFloat) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.type != b.type) return false;
  switch (a.type) {
    case Type::kUndefined:
    case Type::kNone: return true;
    case Type::kString: return a.text == b.text;
    case Type::kList:
      if (a.list->size() != b.list->size()) return false;
      for (std::size_t i = 0; i < a.list->size(); ++i) {
        if (!equal((*a.list)[i], (*b.list)[i])) return false;
      }
      return true;
    case Type::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [key, value] : a.dict->items) {
        const Value* other = b.dict->find(key);
        if (!other || !equal(value, *other)) return false;
      }
      return true;
    default: return a.dict == b.dict && a.callable == b.callable;
  }
}

// Python ordering: numbers with numbers, strings with strings, lists element-wise.
int compare(const Value& a, const Value& b, Pos pos) {
  if (a.is_number() && b.is_number()) {
    double x = a.as_double(), y = b.as_double();
    if (a.type != Type::kFloat && b.type != Type::kFloat) {
      return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    }
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.type == Type::kString && b.type == Type::kString) return a.text < b.text ? -1 : a.text > b.text ? 1 : 0;
  if (a.type == Type::kList && b.type == Type::kList) {
    for (std::size_t i = 0; i < std::min(a.list->size(), b.list->size()); ++i) {
      int c = compare((*a.list)[i], (*b.list)[i], pos);
      if (c) return c;
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  fail(Kind::kRender, std::string("cannot compare ") + type_name(a) + " with " + type_name(b), pos);
}

// The items a for loop or a filter iterates: list items, dict keys, string characters.
List iterate(const Value& v, Pos pos) {
  switch (v.type) {
    case Type::kUndefined:
    case Type::kNone:
      if (v.type == Type::kNone) fail(Kind::kRender, "'NoneType' object is not iterable", pos);
      return {};
    case Type::kList: return *v.list;
    case Type::kDict: {
      List keys;
      for (const auto& item : v.dict->items) keys.push_back(Value::from_string(item.first));
      return keys;
    }
    case Type::kString: {
      List chars;
      auto offsets = code_point_offsets(v.text);
      for (std::size_t i = 0; i < offsets.size(); ++i) {
        std::size_t end = i + 1 < offsets.size() ? offsets[i + 1] : v.text.size();
        chars.push_back(Value::from_string(v.text.substr(offsets[i], end - offsets[i])));
      }
      return chars;
    }
    default: fail(Kind::kRender, std::string("'") + type_name(v) + "' object is not iterable", pos);
  }
}

std::int64_t length(const Value& v, Pos pos) {
  switch (v.type) {
    case Type::kUndefined: return 0;
    case Type::kString: return static_cast<std::int64_t>(code_point_count(v.text));
    case Type::kList: return static_cast<std::int64_t>(v.list->size());
    case Type::kDict: return static_cast<std::int64_t>(v.dict->items.size());
    default: fail(Kind::kRender, std::string("object of type '") + type_name(v) + "' has no len()", pos);
  }
}

bool contains(const Value& container, const Value& item, Pos pos) {
  switch (container.type) {
    case Type::kUndefined: return false;
    case Type::kString:
      if (item.type != Type::kString) fail(Kind::kRender, "'in <string>' requires string as left operand", pos);
      return container.text.find(item.text) != std::string::npos;
    case Type::kList:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& x) { return equal(x, item); });
    case Type::kDict:
    case Type::kNamespace: return item.type == Type::kString && container.dict->find(item.text) != nullptr;
    default: fail(Kind::kRender, std::string("argument of type '") + type_name(container) + "' is not iterable", pos);
  }
}

// Attribute or item access, as jinja2's sandbox resolves obj.name and obj[key] for plain data.
Value get_item(const Value& obj, const Value& key, Pos pos) {
  if (obj.type == Type::kUndefined) {
    fail(Kind::kRender, "'" + obj.text + "' is undefined", pos, "check the variable's name and that the data has it");
  }
  if ((obj.type == Type::kDict || obj.type == Type::kNamespace) && key.type == Type::kString) {
    const Value* v = obj.dict->find(key.text);
    return v ? *v : Value::undefined(key.text);
  }
  if ((obj.type == Type::kList || obj.type == Type::kString) && (key.type == Type::kInt || key.type == Type::kBool)) {
    std::int64_t n = obj.type == Type::kList ? static_cast<std::int64_t>(obj.list->size())
                                             : static_cast<std::int64_t>(code_point_count(obj.text));
    std::int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undefined("[" + std::to_string(key.as_int()) + "]");
    if (obj.type == Type::kList) return (*obj.list)[static_cast<std::size_t>(i)];
    auto offsets = code_point_offsets(obj.text);
    std::size_t begin = offsets[static_cast<std::size_t>(i)];
    std::size_t end = static_cast<std::size_t>(i + 1) < offsets.size() ? offsets[static_cast<std::size_t>(i + 1)]
                                                                         : obj.text.size();
    return Value::from_string(obj.text.substr(begin, end - begin));
  }
  return Value::undefined(key.type == Type::kString ? key.text : repr(key));
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v, Pos pos) {
  auto opt = [&](const Value& v) -> std::optional<std::int64_t> {
    if (v.type == Type::kUndefined || v.type == Type::kNone) return std::nullopt;
    if (v.type != Type::kInt && v.type != Type::kBool) fail(Kind::kRender, "slice indices must be integers", pos);
    return v.as_int();
  };
  std::int64_t step = opt(step_v).value_or(1);
  if (step == 0) fail(Kind::kRender, "slice step cannot be zero", pos);
  std::vector<std::size_t> offsets;
  std::int64_t n;
  if (obj.type == Type::kString) {
    offsets = code_point_offsets(obj.text);
    n = static_cast<std::int64_t>(offsets.size());
  } else if (obj.type == Type::kList) {
    n = static_cast<std::int64_t>(obj.list->size());
  } else {
    fail(Kind::kRender, std::string("cannot slice a ") + type_name(obj), pos);
  }
  // Python's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<std::int64_t> v, std::int64_t if_missing) {
    if (!v) return if_missing;
    std::int64_t i = *v;
    if (i < 0) {
      i += n;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= n) {
      i = step < 0 ? n - 1 : n;
    }
    return i;
  };
  std::int64_t start = adjust(opt(start_v), step < 0 ? n - 1 : 0);
  std::int64_t stop = adjust(opt(stop_v), step < 0 ? -1 : n);
  std::vector<std::size_t> indices;
  for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) indices.push_back(static_cast<std::size_t>(i));
  if (obj.type == Type::kList) {
    List out;
    for (std::size_t i : indices) out.push_back((*obj.list)[i]);
    return Value::from_list(std::move(out), obj.is_tuple);
  }
  std::string out;
  for (std::size_t i : indices) {
    std::size_t end = i + 1 < offsets.size() ? offsets[i + 1] : obj.text.size();
    out += obj.text.substr(offsets[i], end - offsets[i]);
  }
  return Value::from_string(out);
}

std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, Pos pos) {
  if (op == "~") return Value::from_string(to_str(a) + to_str(b));
  if (a.is_undefined() || b.is_undefined()) {
    fail(Kind::kRender, "'" + (a.is_undefined() ? a.text : b.text) + "' is undefined", pos);
  }
  if (op == "+") {
    if (a.type == Type::kString && b.type == Type::kString) return Value::from_string(a.text + b.text);
    if (a.type == Type::kList && b.type == Type::kList) {
      List out = *a.list;
      out.insert(out.end(), b.list->begin(), b.list->end());
      return Value::from_list(std::move(out), a.is_tuple);
    }
  }
  if (op == "*" && (a.type == Type::kString || a.type == Type::kList) && (b.type == Type::kInt)) {
    std::int64_t times = std::max<std::int64_t>(0, b.integer);
    if (a.type == Type::kString && static_cast<std::uint64_t>(times) * a.text.size() > (1u << 30)) {
      fail(Kind::kLimit, "string repetition too large", pos);
    }
    if (a.type == Type::kString) {
      std::string out;
      for (std::int64_t i = 0; i < times; ++i) out += a.text;
      return Value::from_string(out);
    }
    List out;
    for (std::int64_t i = 0; i < times && out.size() < (1u << 24); ++i) out.insert(out.end(), a.list->begin(), a.list->end());
    return Value::from_list(std::move(out));
  }
  if (!a.is_number() || !b.is_number()) {
    fail(Kind::kRender, "unsupported operand types for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'",
         pos);
  }
  bool floating = a.type == Type::kFloat || b.type == Type::kFloat;
  if (op == "/") {
    if (b.as_double() == 0.0) fail(Kind::kRender, "division by zero", pos);
    return Value::from_float(a.as_double() / b.as_double());
  }
  if (floating) {
    double x = a.as_double(), y = b.as_double();
    if (op == "+") return Value::from_float(x + y);
    if (op == "-") return Value::from_float(x - y);
    if (op == "*") return Value::from_float(x * y);
    if (op == "**") return Value::from_float(std::pow(x, y));
    if (y == 0.0) fail(Kind::kRender, "division by zero", pos);
    if (op == "//") return Value::from_float(std::floor(x / y));
    double r = std::fmod(x, y);
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    return Value::from_float(r);
  }
  std::int64_t x = a.as_int(), y = b.as_int();
  if (op == "+") return Value::from_int(x + y);
  if (op == "-") return Value::from_int(x - y);
  if (op == "*") return Value::from_int(x * y);
  if (op == "**") {
    if (y < 0) return Value::from_float(std::pow(static_cast<double>(x), static_cast<double>(y)));
    std::int64_t r = 1;
    for (std::int64_t i = 0; i < y && i < 64; ++i) r *= x;
    return Value::from_int(r);
  }
  if (y == 0) fail(Kind::kRender, "integer division or modulo by zero", pos);
  if (op == "//") return Value::from_int(floor_div(x, y));
  return Value::from_int(x - floor_div(x, y) * y);
}

// ---- Expressions -------------------------------------------------------------------------------------------------

struct Literal : Expr {
  Value value;
  Value eval(Context&) const override { return value; }
};

struct Name : Expr {
  std::string name;
  Value eval(Context& ctx) const override { return ctx.lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Context& ctx) const override {
    List out;
    for (const auto& item : items) out.push_back(item->eval(ctx));
    return Value::from_list(std::move(out), tuple);
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Context& ctx) const override {
    auto d = std::make_shared<Dict>();
    for (const auto& [key_expr, value_expr] : items) {
      Value key = key_expr->eval(ctx);
      if (key.type != Type::kString) fail(Kind::kRender, "dict keys must be strings in chat templates", pos);
      d->set(key.text, value_expr->eval(ctx));
    }
    return Value::from_dict(std::move(d));
  }
};

struct GetAttr : Expr {
  ExprPtr object;
  std::string name;
  Value eval(Context& ctx) const override {
    ctx.step(pos);
    Value obj = object->eval(ctx);
    if (obj.type == Type::kUndefined) {
      fail(Kind::kRender, "'" + obj.text + "' is undefined", pos, "check the variable's name and that the data has it");
    }
    if (!name.empty() && name[0] == '_') return Value::undefined(name);  // the sandbox hides internals
    if (obj.type == Type::kDict || obj.type == Type::kNamespace) {  // get_item's dict case, without a key Value
      const Value* v = obj.dict->find(name);
      return v ? *v : Value::undefined(name);
    }
    return get_item(obj, Value::from_string(name), pos);
  }
};

struct GetItem : Expr {
  ExprPtr object;
  ExprPtr key;
  Value eval(Context& ctx) const override {
    ctx.step(pos);
    Value obj = object->eval(ctx);
    return get_item(obj, key->eval(ctx), pos);
  }
};

struct SliceExpr : Expr {
  ExprPtr object, start, stop, step;
  Value eval(Context& ctx) const override {
    ctx.step(pos);
    Value obj = object->eval(ctx);
    auto value_of = [&](const ExprPtr& e) { return e ? e->eval(ctx) : Value::none(); };
    return slice(obj, value_of(start), value_of(stop), value_of(step), pos);
  }
};

struct BinOp : Expr {
  enum class Code { kAnd, kOr, kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn, kAdd, kArithmetic };
  std::string op;
  Code code = Code::kArithmetic;  // resolved once from op, so evaluation does not compare strings
  ExprPtr left, right;

  void resolve() {
    static const std::pair<const char*, Code> kCodes[] = {
        {"and", Code::kAnd}, {"or", Code::kOr}, {"==", Code::kEq}, {"!=", Code::kNe}, {"<", Code::kLt},
        {"<=", Code::kLe},   {">", Code::kGt},  {">=", Code::kGe}, {"in", Code::kIn}, {"notin", Code::kNotIn}, {"+", Code::kAdd}};
    for (const auto& [name, c] : kCodes) {
      if (op == name) code = c;
    }
  }

  Value eval(Context& ctx) const override {
    ctx.step(pos);
    if (code == Code::kAnd) {
      Value l = left->eval(ctx);
      return truthy(l) ? right->eval(ctx) : l;
    }
    if (code == Code::kOr) {
      Value l = left->eval(ctx);
      return truthy(l) ? l : right->eval(ctx);
    }
    Value l = left->eval(ctx);
    Value r = right->eval(ctx);
    switch (code) {
      case Code::kEq: return Value::from_bool(equal(l, r));
      case Code::kNe: return Value::from_bool(!equal(l, r));
      case Code::kLt: return Value::from_bool(compare(l, r, pos) < 0);
      case Code::kLe: return Value::from_bool(compare(l, r, pos) <= 0);
      case Code::kGt: return Value::from_bool(compare(l, r, pos) > 0);
      case Code::kGe: return Value::from_bool(compare(l, r, pos) >= 0);
      case Code::kIn: return Value::from_bool(contains(r, l, pos));
      case Code::kNotIn: return Value::from_bool(!contains(r, l, pos));
      case Code::kAdd:
        // str + str appends to the left operand (a temporary here) instead of building a third string.
        if (l.type == Type::kString && r.type == Type::kString) {
          l.text += r.text;
          return l;
        }
        return arithmetic(op, l, r, pos);
      default: return arithmetic(op, l, r, pos);
    }
  }
};

struct UnaryOp : Expr {
  std::string op;
  ExprPtr operand;
  Value eval(Context& ctx) const override {
    Value v = operand->eval(ctx);
    if (op == "not") return Value::from_bool(!truthy(v));
    if (!v.is_number()) fail(Kind::kRender, std::string("bad operand type for unary ") + op + ": " + type_name(v), pos);
    if (op == "+") return v.type == Type::kBool ? Value::from_int(v.as_int()) : v;
    return v.type == Type::kFloat ? Value::from_float(-v.number) : Value::from_int(-v.as_int());
  }
};

struct CondExpr : Expr {
  ExprPtr condition, then, otherwise;
  Value eval(Context& ctx) const override {
    if (truthy(condition->eval(ctx))) return then->eval(ctx);
    return otherwise ? otherwise->eval(ctx) : Value::undefined("else");
  }
};

struct CallArgs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> named;
  Args eval(Context& ctx, Pos pos) const {
    Args args;
    args.pos = pos;
    for (const auto& e : positional) args.positional.push_back(e->eval(ctx));
    for (const auto& [name, e] : named) args.named.emplace_back(name, e->eval(ctx));
    return args;
  }
};

Value call_method(Context& ctx, const Value& obj, const std::string& name, Args& args);
Value apply_filter(Context& ctx, const std::string& name, const Value& value, Args& args);
bool apply_test(Context& ctx, const std::string& name, const Value& value, Args& args);

struct Call : Expr {
  ExprPtr callee;
  CallArgs args;
  Value eval(Context& ctx) const override {
    ctx.step(pos);
    if (auto* attr = dynamic_cast<const GetAttr*>(callee.get())) {
      // obj.method(...): string, dict and list methods run here; a dict entry that holds a function is called.
      Value obj = attr->object->eval(ctx);
      if (obj.type == Type::kUndefined) fail(Kind::kRender, "'" + obj.text + "' is undefined", pos);
      if ((obj.type == Type::kDict || obj.type == Type::kNamespace)) {
        const Value* member = obj.dict->find(attr->name);
        if (member && member->type == Type::kCallable) {
          Args a = args.eval(ctx, pos);
          return member->callable->fn(ctx, a);
        }
      }
      Args a = args.eval(ctx, pos);
      return call_method(ctx, obj, attr->name, a);
    }
    Value fn = callee->eval(ctx);
    if (fn.type != Type::kCallable) {
      std::string what = fn.is_undefined() ? "'" + fn.text + "' is undefined" : std::string("'") + type_name(fn) +
                                                                                     "' object is not callable";
      fail(Kind::kRender, what, pos);
    }
    Args a = args.eval(ctx, pos);
    return fn.callable->fn(ctx, a);
  }
};

struct FilterExpr : Expr {
  ExprPtr value;  // null inside a {% filter %} block, where the block's text is the value
  std::string name;
  CallArgs args;
  Value apply(Context& ctx, const Value& v) const {
    ctx.step(pos);
    Args a = args.eval(ctx, pos);
    return apply_filter(ctx, name, v, a);
  }
  Value eval(Context& ctx) const override { return apply(ctx, value->eval(ctx)); }
};

struct TestExpr : Expr {
  ExprPtr value;
  std::string name;
  CallArgs args;
  bool negated = false;
  Value eval(Context& ctx) const override {
    ctx.step(pos);
    Value v = value->eval(ctx);
    Args a = args.eval(ctx, pos);
    return Value::from_bool(apply_test(ctx, name, v, a) != negated);
  }
};

// ---- Statements --------------------------------------------------------------------------------------------------

struct TextStmt : Stmt {
  std::string text;
  void exec(Context& ctx) const override { ctx.write(text, pos); }
};

struct OutputStmt : Stmt {
  ExprPtr expr;
  void exec(Context& ctx) const override {
    ctx.step(pos);
    // A string literal is written as it is; a string value without the copy to_str makes.
    if (const auto* literal = dynamic_cast<const Literal*>(expr.get()); literal && literal->value.type == Type::kString) {
      ctx.write(literal->value.text, pos);
      return;
    }
    const Value v = expr->eval(ctx);
    if (v.type == Type::kString) ctx.write(v.text, pos);
    else ctx.write(to_str(v), pos);
  }
};

struct IfStmt : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void exec(Context& ctx) const override {
    ctx.step(pos);
    for (const auto& [condition, body] : branches) {
      if (truthy(condition->eval(ctx))) {
        exec_body(body, ctx);
        return;
      }
    }
    exec_body(otherwise, ctx);
  }
};

// Binds a for or set target: one name, or a tuple of names that unpacks a sequence.
void bind_targets(Context& ctx, const std::vector<std::string>& names, const Value& value, Pos pos) {
  if (names.size() == 1) {
    ctx.assign(names[0], value);
    return;
  }
  List items = iterate(value, pos);
  if (items.size() != names.size()) {
    fail(Kind::kRender, "cannot unpack " + std::to_string(items.size()) + " values into " +
                            std::to_string(names.size()) + " names", pos);
  }
  for (std::size_t i = 0; i < names.size(); ++i) ctx.assign(names[i], items[i]);
}

struct ForStmt : Stmt {
  std::vector<std::string> targets;
  ExprPtr iterable;
  ExprPtr condition;  // for x in xs if cond
  Body body, otherwise;
  void exec(Context& ctx) const override {
    ctx.step(pos);
    // A list is iterated where it is (lists are never changed in place); dicts and strings give a new list.
    const Value iterated = iterable->eval(ctx);
    List made;
    const List* iterating = &made;
    if (iterated.type == Type::kList) iterating = iterated.list.get();
    else made = iterate(iterated, pos);
    ctx.frames.emplace_back();
    struct PopFrame {
      Context& c;
      ~PopFrame() { c.frames.pop_back(); }
    } pop{ctx};
    if (condition) {
      List kept;
      for (const auto& item : *iterating) {
        bind_targets(ctx, targets, item, pos);
        if (truthy(condition->eval(ctx))) kept.push_back(item);
      }
      made = std::move(kept);
      iterating = &made;
    }
    const List& items = *iterating;
    if (items.empty()) {
      exec_body(otherwise, ctx);
      return;
    }
    auto n = static_cast<std::int64_t>(items.size());
    // One loop object for the whole loop, advanced in place, as jinja2's LoopContext is one object that advances.
    auto loop = std::make_shared<Dict>();
    // Built in place (an initializer list would copy each entry).
    static const char* const kLoopKeys[] = {"index",  "index0", "revindex", "revindex0", "first",    "last",
                                            "length", "depth",  "depth0",   "previtem",  "nextitem", "cycle"};
    loop->items.reserve(std::size(kLoopKeys));
    for (const char* key : kLoopKeys) loop->items.emplace_back(key, Value());
    loop->items[6].second = Value::from_int(n);
    loop->items[7].second = Value::from_int(1);
    loop->items[8].second = Value::from_int(0);
    std::weak_ptr<Dict> weak_loop = loop;
    loop->items[11].second = Value::from_callable("cycle", [weak_loop](Context&, Args& args) {
      if (args.positional.empty()) fail(Kind::kRender, "no items for cycling given", args.pos);
      auto self = weak_loop.lock();
      std::int64_t index0 = self ? self->items[1].second.integer : 0;
      return args.positional[static_cast<std::size_t>(index0) % args.positional.size()];
    });
    Value loop_value;
    loop_value.type = Type::kDict;
    loop_value.dict = loop;
    ctx.assign("loop", loop_value);
    for (std::int64_t i = 0; i < n; ++i) {
      ctx.step(pos);
      auto& entries = loop->items;
      entries[0].second = Value::from_int(i + 1);
      entries[1].second = Value::from_int(i);
      entries[2].second = Value::from_int(n - i);
      entries[3].second = Value::from_int(n - i - 1);
      entries[4].second = Value::from_bool(i == 0);
      entries[5].second = Value::from_bool(i == n - 1);
      entries[9].second = i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value::undefined("previtem");
      entries[10].second = i + 1 < n ? items[static_cast<std::size_t>(i + 1)] : Value::undefined("nextitem");
      bind_targets(ctx, targets, items[static_cast<std::size_t>(i)], pos);
      try {
        exec_body(body, ctx);
      } catch (const BreakSignal&) {
        break;
      } catch (const ContinueSignal&) {
        continue;
      }
    }
  }
};

struct SetStmt : Stmt {
  std::vector<std::string> targets;
  std::string attribute;  // {% set ns.attr = ... %}: targets[0] is the namespace
  ExprPtr value;
  Body body;  // block set
  std::vector<std::unique_ptr<FilterExpr>> filters;
  void exec(Context& ctx) const override {
    ctx.step(pos);
    Value v;
    if (value) {
      v = value->eval(ctx);
    } else {
      v = Value::from_string(ctx.capture(body));
      for (const auto& f : filters) v = f->apply(ctx, v);
    }
    if (!attribute.empty()) {
      Value ns = ctx.lookup(targets[0]);
      if (ns.type != Type::kNamespace) {
        fail(Kind::kRender, "cannot assign attribute on non-namespace object '" + targets[0] + "'", pos,
             "create it with {% set " + targets[0] + " = namespace(" + attribute + "=...) %}");
      }
      if (attribute[0] == '_') fail(Kind::kRender, "namespace attributes cannot start with '_'", pos);
      ns.dict->set(attribute, v);
      return;
    }
    bind_targets(ctx, targets, v, pos);
  }
};

struct FilterBlock : Stmt {
  std::vector<std::unique_ptr<FilterExpr>> filters;
  Body body;
  void exec(Context& ctx) const override {
    Value v = Value::from_string(ctx.capture(body));
    for (const auto& f : filters) v = f->apply(ctx, v);
    ctx.write(to_str(v), pos);
  }
};

struct MacroStmt : Stmt {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // aligned with params; null where there is none
  Body body;
  void exec(Context& ctx) const override {
    const MacroStmt* self = this;
    ctx.assign(name, Value::from_callable(name, [self](Context& c, Args& args) { return self->call(c, args); }));
  }
  Value call(Context& ctx, Args& args) const {
    if (ctx.call_depth >= ctx.limits.max_call_depth) {
      fail(Kind::kLimit, "macro calls nested deeper than " + std::to_string(ctx.limits.max_call_depth), args.pos,
           "does a macro call itself without end?");
    }
    if (args.positional.size() > params.size()) {
      fail(Kind::kRender, "macro '" + name + "' takes " + std::to_string(params.size()) + " arguments", args.pos);
    }
    Frame frame;
    frame.macro_barrier = true;
    ctx.frames.push_back(std::move(frame));
    ++ctx.call_depth;
    struct Restore {
      Context& c;
      ~Restore() {
        c.frames.pop_back();
        --c.call_depth;
      }
    } restore{ctx};
    List varargs;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Value* given = args.get(i, params[i].c_str());
      Value v = given ? *given : defaults[i] ? defaults[i]->eval(ctx) : Value::undefined(params[i]);
      ctx.assign(params[i], v);
    }
    for (const auto& [key, v] : args.named) {
      if (std::find(params.begin(), params.end(), key) == params.end()) {
        fail(Kind::kRender, "macro '" + name + "' takes no keyword argument '" + key + "'", args.pos);
      }
    }
    return Value::from_string(ctx.capture(body));
  }
};

struct GenerationStmt : Stmt {
  Body body;
  void exec(Context& ctx) const override {
    std::string text = ctx.capture(body);
    // transformers records the span against the text rendered so far at the top level.
    std::size_t start = 0;
    for (const auto& b : ctx.buffers) start += b.size();
    ctx.spans.emplace_back(start, start + text.size());
    ctx.write(text, pos);
  }
};

struct BreakStmt : Stmt {
  void exec(Context&) const override { throw BreakSignal{}; }
};
struct ContinueStmt : Stmt {
  void exec(Context&) const override { throw ContinueSignal{}; }
};

// ---- Parser ------------------------------------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  const Token& peek(std::size_t ahead = 0) const { return tokens_[std::min(i_ + ahead, tokens_.size() - 1)]; }
  const Token& next() { return tokens_[std::min(i_++, tokens_.size() - 1)]; }
  bool is_op(const char* op, std::size_t ahead = 0) const {
    return peek(ahead).type == Tok::kOp && peek(ahead).text == op;
  }
  bool is_name(const char* name, std::size_t ahead = 0) const {
    return peek(ahead).type == Tok::kName && peek(ahead).text == name;
  }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case Tok::kEof: return "end of template";
      case Tok::kBlockEnd: return "end of statement block";
      case Tok::kVarEnd: return "end of print statement";
      case Tok::kText: return "text";
      default: return "'" + t.text + "'";
    }
  }
  [[noreturn]] void unexpected(const std::string& expected) const {
    fail(Kind::kSyntax, "expected " + expected + ", got " + describe(peek()), peek().pos);
  }
  void expect_op(const char* op) {
    if (!is_op(op)) unexpected(std::string("'") + op + "'");
    next();
  }
  void expect_block_end() {
    if (peek().type != Tok::kBlockEnd) unexpected("end of statement block");
    next();
  }
  std::string expect_name() {
    if (peek().type != Tok::kName) unexpected("a name");
    return next().text;
  }

  // Statements until one of end_tags (whose name is returned in found, the tag's {% and name consumed).
  Body parse_body(const std::vector<std::string>& end_tags, std::string& found) {
    Body body;
    Pos start = peek().pos;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kEof) {
        if (end_tags.empty()) return body;
        fail(Kind::kSyntax, "unexpected end of template: missing {% " + end_tags.back() + " %}", start,
             "every block statement needs its end tag");
      }
      if (t.type == Tok::kText) {
        auto s = std::make_unique<TextStmt>();
        s->pos = t.pos;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::kVarBegin) {
        auto s = std::make_unique<OutputStmt>();
        s->pos = next().pos;
        s->expr = parse_tuple_expression();
        if (peek().type != Tok::kVarEnd) unexpected("end of print statement");
        next();
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        const Token& name = peek(1);
        if (name.type != Tok::kName) {
          next();
          unexpected("a statement name");
        }
        if (std::find(end_tags.begin(), end_tags.end(), name.text) != end_tags.end()) {
          next();
          next();
          found = name.text;
          return body;
        }
        next();
        body.push_back(parse_statement());
      } else {
        unexpected("text or a tag");
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& t = next();
    Pos pos = t.pos;
    const std::string& name = t.text;
    if (name == "if") return parse_if(pos);
    if (name == "for") return parse_for(pos);
    if (name == "set") return parse_set(pos);
    if (name == "macro") return parse_macro(pos);
    if (name == "filter") return parse_filter_block(pos);
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail(Kind::kSyntax, "'" + name + "' outside a loop", pos);
      expect_block_end();
      StmtPtr s = name == "break" ? StmtPtr(std::make_unique<BreakStmt>()) : StmtPtr(std::make_unique<ContinueStmt>());
      s->pos = pos;
      return s;
    }
    if (name == "generation") {
      expect_block_end();
      auto s = std::make_unique<GenerationStmt>();
      s->pos = pos;
      std::string found;
      s->body = parse_body({"endgeneration"}, found);
      expect_block_end();
      return s;
    }
    if (name == "raw") {
      expect_block_end();
      auto s = std::make_unique<IfStmt>();  // a raw block is its text: an always-true branch holds it
      auto truth = std::make_unique<Literal>();
      truth->value = Value::from_bool(true);
      std::string found;
      Body body = parse_body({"endraw"}, found);
      expect_block_end();
      s->pos = pos;
      s->branches.emplace_back(std::move(truth), std::move(body));
      return s;
    }
    fail(Kind::kSyntax, "unknown statement '" + name + "'", pos,
         "chat templates support if, for, set, macro, filter, break, continue, generation and raw");
  }

  StmtPtr parse_if(Pos pos) {
    auto s = std::make_unique<IfStmt>();
    s->pos = pos;
    ExprPtr condition = parse_tuple_expression();
    expect_block_end();
    while (true) {
      std::string found;
      Body body = parse_body({"elif", "else", "endif"}, found);
      s->branches.emplace_back(std::move(condition), std::move(body));
      if (found == "elif") {
        condition = parse_tuple_expression();
        expect_block_end();
        continue;
      }
      expect_block_end();
      if (found == "else") {
        s->otherwise = parse_body({"endif"}, found);
        expect_block_end();
      }
      return s;
    }
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    bool paren = is_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (is_op(",")) {
      next();
      if (peek().type != Tok::kName) break;
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  StmtPtr parse_for(Pos pos) {
    auto s = std::make_unique<ForStmt>();
    s->pos = pos;
    s->targets = parse_targets();
    if (!is_name("in")) unexpected("'in'");
    next();
    s->iterable = parse_tuple_expression(/*with_condexpr=*/false);
    if (is_name("if")) {
      next();
      s->condition = parse_expression();
    }
    if (is_name("recursive")) fail(Kind::kSyntax, "recursive loops are not supported", peek().pos);
    expect_block_end();
    ++loop_depth_;
    std::string found;
    s->body = parse_body({"else", "endfor"}, found);
    --loop_depth_;
    expect_block_end();
    if (found == "else") {
      s->otherwise = parse_body({"endfor"}, found);
      expect_block_end();
    }
    return s;
  }

  StmtPtr parse_set(Pos pos) {
    auto s = std::make_unique<SetStmt>();
    s->pos = pos;
    if (peek().type == Tok::kName && is_op(".", 1)) {
      s->targets.push_back(next().text);
      next();
      s->attribute = expect_name();
    } else {
      s->targets = parse_targets();
    }
    if (is_op("=")) {
      next();
      s->value = parse_tuple_expression();
      expect_block_end();
      return s;
    }
    if (s->targets.size() != 1 || !s->attribute.empty()) unexpected("'='");
    while (is_op("|")) {
      next();
      s->filters.push_back(parse_filter_call(nullptr));
    }
    expect_block_end();
    std::string found;
    s->body = parse_body({"endset"}, found);
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro(Pos pos) {
    auto s = std::make_unique<MacroStmt>();
    s->pos = pos;
    s->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      s->params.push_back(expect_name());
      if (is_op("=")) {
        next();
        s->defaults.push_back(parse_expression());
      } else {
        s->defaults.push_back(nullptr);
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    expect_block_end();
    std::string found;
    int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endmacro"}, found);
    loop_depth_ = saved_loop_depth;
    if (peek().type == Tok::kName) next();  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  StmtPtr parse_filter_block(Pos pos) {
    auto s = std::make_unique<FilterBlock>();
    s->pos = pos;
    s->filters.push_back(parse_filter_call(nullptr));
    while (is_op("|")) {
      next();
      s->filters.push_back(parse_filter_call(nullptr));
    }
    expect_block_end();
    std::string found;
    s->body = parse_body({"endfilter"}, found);
    expect_block_end();
    return s;
  }

  // ---- expressions, in jinja2's precedence order ----

  // `a, b` builds a tuple where jinja2 allows one (print, set, for iterables, if conditions).
  ExprPtr parse_tuple_expression(bool with_condexpr = true) {
    Pos pos = peek().pos;
    ExprPtr first = with_condexpr ? parse_expression() : parse_or();
    if (!is_op(",")) return first;
    auto tuple = std::make_unique<ListExpr>();
    tuple->pos = pos;
    tuple->tuple = true;
    tuple->items.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().type == Tok::kBlockEnd || peek().type == Tok::kVarEnd || is_op(")")) break;
      tuple->items.push_back(with_condexpr ? parse_expression() : parse_or());
    }
    return tuple;
  }

  ExprPtr parse_expression() {
    Pos pos = peek().pos;
    ExprPtr e = parse_or();
    while (is_name("if")) {
      next();
      auto c = std::make_unique<CondExpr>();
      c->pos = pos;
      c->then = std::move(e);
      c->condition = parse_or();
      if (is_name("else")) {
        next();
        c->otherwise = parse_expression();
      }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(std::string op, ExprPtr left, ExprPtr right, Pos pos) {
    auto b = std::make_unique<BinOp>();
    b->pos = pos;
    b->op = std::move(op);
    b->left = std::move(left);
    b->right = std::move(right);
    b->resolve();
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      Pos pos = next().pos;
      e = binary("or", std::move(e), parse_and(), pos);
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      Pos pos = next().pos;
      e = binary("and", std::move(e), parse_not(), pos);
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto u = std::make_unique<UnaryOp>();
      u->pos = next().pos;
      u->op = "not";
      u->operand = parse_not();
      return u;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    while (true) {
      Pos pos = peek().pos;
      std::string op;
      if (peek().type == Tok::kOp &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" ||
           peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "notin";
      } else {
        return e;
      }
      e = binary(op, std::move(e), parse_math1(), pos);
    }
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      e = binary(t.text, std::move(e), parse_concat(), t.pos);
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      Pos pos = next().pos;
      e = binary("~", std::move(e), parse_math2(), pos);
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      e = binary(t.text, std::move(e), parse_pow(), t.pos);
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (is_op("**")) {
      Pos pos = next().pos;
      e = binary("**", std::move(e), parse_unary(), pos);
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter = true) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      auto u = std::make_unique<UnaryOp>();
      u->pos = peek().pos;
      u->op = next().text;
      u->operand = parse_unary(false);
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters_and_tests(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    Pos pos = t.pos;
    auto literal = [&](Value v) {
      auto l = std::make_unique<Literal>();
      l->pos = pos;
      l->value = std::move(v);
      return l;
    };
    switch (t.type) {
      case Tok::kName: {
        std::string name = next().text;
        if (name == "true" || name == "True") return literal(Value::from_bool(true));
        if (name == "false" || name == "False") return literal(Value::from_bool(false));
        if (name == "none" || name == "None") return literal(Value::none());
        auto n = std::make_unique<Name>();
        n->pos = pos;
        n->name = name;
        return n;
      }
      case Tok::kString: {
        std::string s = next().text;
        while (peek().type == Tok::kString) s += next().text;  // adjacent literals join, as in Python
        return literal(Value::from_string(s));
      }
      case Tok::kInt: {
        std::string digits = next().text;
        try {
          return literal(Value::from_int(std::stoll(digits)));
        } catch (const std::out_of_range&) {
          fail(Kind::kSyntax, "integer literal too large: " + digits, pos);
        }
      }
      case Tok::kFloat: return literal(Value::from_float(std::strtod(next().text.c_str(), nullptr)));
      case Tok::kOp:
        if (t.text == "(") {
          next();
          if (is_op(")")) {
            next();
            auto tuple = std::make_unique<ListExpr>();
            tuple->pos = pos;
            tuple->tuple = true;
            return tuple;
          }
          ExprPtr e = parse_expression();
          if (is_op(",")) {
            auto tuple = std::make_unique<ListExpr>();
            tuple->pos = pos;
            tuple->tuple = true;
            tuple->items.push_back(std::move(e));
            while (is_op(",")) {
              next();
              if (is_op(")")) break;
              tuple->items.push_back(parse_expression());
            }
            e = std::move(tuple);
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          auto list = std::make_unique<ListExpr>();
          list->pos = pos;
          while (!is_op("]")) {
            list->items.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return list;
        }
        if (t.text == "{") {
          next();
          auto dict = std::make_unique<DictExpr>();
          dict->pos = pos;
          while (!is_op("}")) {
            ExprPtr key = parse_expression();
            expect_op(":");
            dict->items.emplace_back(std::move(key), parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return dict;
        }
        [[fallthrough]];
      default: unexpected("an expression");
    }
  }

  CallArgs parse_call_args() {
    expect_op("(");
    CallArgs args;
    while (!is_op(")")) {
      if (peek().type == Tok::kName && is_op("=", 1)) {
        std::string name = next().text;
        next();
        args.named.emplace_back(name, parse_expression());
      } else {
        if (!args.named.empty()) fail(Kind::kSyntax, "positional argument after keyword argument", peek().pos);
        args.positional.push_back(parse_expression());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    return args;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      Pos pos = peek().pos;
      if (is_op(".")) {
        next();
        auto g = std::make_unique<GetAttr>();
        g->pos = pos;
        g->object = std::move(e);
        if (peek().type == Tok::kInt) {
          auto item = std::make_unique<GetItem>();
          item->pos = pos;
          item->object = std::move(g->object);
          auto key = std::make_unique<Literal>();
          key->value = Value::from_int(std::stoll(next().text));
          item->key = std::move(key);
          e = std::move(item);
          continue;
        }
        g->name = expect_name();
        e = std::move(g);
      } else if (is_op("[")) {
        next();
        ExprPtr parts[3];
        int colons = 0;
        while (true) {
          if (is_op(":")) {
            next();
            if (++colons > 2) unexpected("']'");
            continue;
          }
          if (is_op("]")) break;
          if (parts[colons]) unexpected("':' or ']'");
          parts[colons] = parse_expression();
        }
        expect_op("]");
        if (colons == 0) {
          if (!parts[0]) fail(Kind::kSyntax, "empty subscript", pos);
          auto item = std::make_unique<GetItem>();
          item->pos = pos;
          item->object = std::move(e);
          item->key = std::move(parts[0]);
          e = std::move(item);
        } else {
          auto s = std::make_unique<SliceExpr>();
          s->pos = pos;
          s->object = std::move(e);
          s->start = std::move(parts[0]);
          s->stop = std::move(parts[1]);
          s->step = std::move(parts[2]);
          e = std::move(s);
        }
      } else if (is_op("(")) {
        auto c = std::make_unique<Call>();
        c->pos = pos;
        c->callee = std::move(e);
        c->args = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::unique_ptr<FilterExpr> parse_filter_call(ExprPtr value) {
    auto f = std::make_unique<FilterExpr>();
    f->pos = peek().pos;
    f->name = expect_name();
    while (is_op(".")) {  // dotted filter names
      next();
      f->name += "." + expect_name();
    }
    if (is_op("(")) f->args = parse_call_args();
    f->value = std::move(value);
    return f;
  }

  ExprPtr parse_filters_and_tests(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        next();
        e = parse_filter_call(std::move(e));
        e = parse_postfix(std::move(e));
      } else if (is_name("is")) {
        auto t = std::make_unique<TestExpr>();
        t->pos = next().pos;
        if (is_name("not")) {
          next();
          t->negated = true;
        }
        t->name = expect_name();
        if (is_op("(")) {
          t->args = parse_call_args();
        } else if (peek().type == Tok::kString || peek().type == Tok::kInt || peek().type == Tok::kFloat ||
                   (peek().type == Tok::kName && !is_name("else") && !is_name("or") && !is_name("and") &&
                    !is_name("if") && !is_name("is") && !is_name("in") && !is_name("not")) ||
                   is_op("[") || is_op("{") || is_op("-")) {
          t->args.positional.push_back(parse_primary());  // `x is equalto 3`: one argument without parentheses
        }
        t->value = std::move(e);
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_postfix(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> tokens_;
  std::size_t i_ = 0;
  int loop_depth_ = 0;
};

// ---- Filters, tests, methods, globals ----------------------------------------------------------------------------

std::string ascii_upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
// Python's str.title on ASCII letters: a letter after a letter is lowered, any other starts a word.
std::string title_case(std::string s) {
  bool previous_letter = false;
  for (char& c : s) {
    auto u = static_cast<unsigned char>(c);
    if (std::isalpha(u)) {
      c = static_cast<char>(previous_letter ? std::tolower(u) : std::toupper(u));
      previous_letter = true;
    } else {
      previous_letter = u >= 0x80 && previous_letter;
    }
  }
  return s;
}
std::string capitalize(std::string s) {
  s = ascii_lower(std::move(s));
  if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
  return s;
}

// (code point, byte offset) of each character; an invalid byte reads as itself, so nothing is lost.
std::vector<std::pair<std::uint32_t, std::size_t>> code_points(const std::string& s) {
  std::vector<std::pair<std::uint32_t, std::size_t>> out;
  for (std::size_t i = 0; i < s.size();) {
    auto b = static_cast<unsigned char>(s[i]);
    std::size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 1;
    if (i + n > s.size()) n = 1;
    std::uint32_t cp = n == 1 ? b : b & (0x7F >> n);
    for (std::size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.emplace_back(cp, i);
    i += n;
  }
  return out;
}

// Python's str.isspace(): what strip(), trim and split() remove, NBSP and ideographic space included.
bool is_unicode_space(std::uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

std::string strip_chars(const std::string& s, const Value* chars, bool left, bool right) {
  const auto cps = code_points(s);
  const bool by_set = chars && chars->type == Type::kString;
  std::vector<std::uint32_t> set;
  if (by_set) {
    for (const auto& [cp, offset] : code_points(chars->text)) set.push_back(cp);
  }
  auto strippable = [&](std::uint32_t cp) {
    return by_set ? std::find(set.begin(), set.end(), cp) != set.end() : is_unicode_space(cp);
  };
  std::size_t begin = 0, end = cps.size();
  if (left) {
    while (begin < end && strippable(cps[begin].first)) ++begin;
  }
  if (right) {
    while (end > begin && strippable(cps[end - 1].first)) --end;
  }
  std::size_t from = begin < cps.size() ? cps[begin].second : s.size();
  std::size_t to = end < cps.size() ? cps[end].second : s.size();
  return s.substr(from, to - from);
}

std::string require_string(const Value& v, const char* what, Pos pos) {
  if (v.type != Type::kString) fail(Kind::kRender, std::string(what) + " needs a string, got " + type_name(v), pos);
  return v.text;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, std::int64_t count) {
  if (from.empty()) {
    std::string out;
    std::int64_t done = 0;
    auto offsets = code_point_offsets(s);
    for (std::size_t i = 0; i < offsets.size(); ++i) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      std::size_t end = i + 1 < offsets.size() ? offsets[i + 1] : s.size();
      out += s.substr(offsets[i], end - offsets[i]);
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  std::string out;
  std::size_t pos = 0;
  std::int64_t done = 0;
  while (count < 0 || done < count) {
    std::size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out += s.substr(pos, hit - pos) + to;
    pos = hit + from.size();
    ++done;
  }
  return out + s.substr(pos);
}

List split(const std::string& s, const Value* sep, std::int64_t maxsplit) {
  List out;
  if (!sep || sep->type == Type::kNone || sep->type == Type::kUndefined) {
    const auto cps = code_points(s);
    auto offset = [&](std::size_t k) { return k < cps.size() ? cps[k].second : s.size(); };
    std::size_t i = 0;
    while (true) {
      while (i < cps.size() && is_unicode_space(cps[i].first)) ++i;
      if (i >= cps.size()) break;
      if (maxsplit >= 0 && static_cast<std::int64_t>(out.size()) >= maxsplit) {
        out.push_back(Value::from_string(s.substr(offset(i))));  // Python keeps the remainder's trailing space
        break;
      }
      std::size_t j = i;
      while (j < cps.size() && !is_unicode_space(cps[j].first)) ++j;
      out.push_back(Value::from_string(s.substr(offset(i), offset(j) - offset(i))));
      i = j;
    }
    return out;
  }
  const std::string& d = sep->text;
  std::size_t pos = 0;
  while (maxsplit < 0 || static_cast<std::int64_t>(out.size()) < maxsplit) {
    std::size_t hit = s.find(d, pos);
    if (hit == std::string::npos) break;
    out.push_back(Value::from_string(s.substr(pos, hit - pos)));
    pos = hit + d.size();
  }
  out.push_back(Value::from_string(s.substr(pos)));
  return out;
}

std::int64_t int_arg(const Value* v, std::int64_t fallback) {
  return v && (v->type == Type::kInt || v->type == Type::kBool) ? v->as_int() : fallback;
}

bool starts_or_ends(const std::string& s, const Value& probe, bool start, Pos pos) {
  auto check = [&](const std::string& p) {
    return p.size() <= s.size() && (start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0);
  };
  if (probe.type == Type::kList) {
    return std::any_of(probe.list->begin(), probe.list->end(),
                       [&](const Value& p) { return check(require_string(p, "startswith/endswith", pos)); });
  }
  return check(require_string(probe, "startswith/endswith", pos));
}

Value call_method(Context& ctx, const Value& obj, const std::string& name, Args& args) {
  Pos pos = args.pos;
  const Value* a0 = args.get(0, "");
  const Value* a1 = args.get(1, "");
  if (obj.type == Type::kString) {
    const std::string& s = obj.text;
    if (name == "strip") return Value::from_string(strip_chars(s, a0, true, true));
    if (name == "lstrip") return Value::from_string(strip_chars(s, a0, true, false));
    if (name == "rstrip") return Value::from_string(strip_chars(s, a0, false, true));
    if (name == "upper") return Value::from_string(ascii_upper(s));
    if (name == "lower") return Value::from_string(ascii_lower(s));
    if (name == "title") return Value::from_string(title_case(s));
    if (name == "capitalize") return Value::from_string(capitalize(s));
    if (name == "startswith" && a0) return Value::from_bool(starts_or_ends(s, *a0, true, pos));
    if (name == "endswith" && a0) return Value::from_bool(starts_or_ends(s, *a0, false, pos));
    if (name == "split") {
      const Value* sep = args.get(0, "sep");
      return Value::from_list(split(s, sep, int_arg(args.get(1, "maxsplit"), -1)));
    }
    if (name == "splitlines") {
      List out;
      std::size_t start = 0;
      for (std::size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\n') {
          out.push_back(Value::from_string(s.substr(start, i - start)));
          start = i + 1;
        }
      }
      if (start < s.size()) out.push_back(Value::from_string(s.substr(start)));
      return Value::from_list(std::move(out));
    }
    if (name == "replace" && a0 && a1) {
      return Value::from_string(replace_all(s, require_string(*a0, "replace", pos), require_string(*a1, "replace", pos),
                                            int_arg(args.get(2, "count"), -1)));
    }
    if (name == "find" && a0) {
      std::size_t hit = s.find(require_string(*a0, "find", pos));
      return Value::from_int(hit == std::string::npos ? -1 : static_cast<std::int64_t>(code_point_count(s.substr(0, hit))));
    }
    if (name == "count" && a0) {
      const std::string sub = require_string(*a0, "count", pos);
      if (sub.empty()) return Value::from_int(static_cast<std::int64_t>(code_point_count(s)) + 1);
      std::int64_t n = 0;
      for (std::size_t hit = s.find(sub); hit != std::string::npos; hit = s.find(sub, hit + sub.size())) ++n;
      return Value::from_int(n);
    }
    if (name == "join" && a0) {
      std::string out;
      List items = iterate(*a0, pos);
      for (std::size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + require_string(items[i], "join", pos);
      return Value::from_string(out);
    }
    if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum") {
      if (s.empty()) return Value::from_bool(false);
      auto ok = [&](unsigned char c) {
        return name == "isdigit" ? std::isdigit(c) : name == "isalpha" ? std::isalpha(c)
                                                    : name == "isspace" ? std::isspace(c) : std::isalnum(c);
      };
      return Value::from_bool(std::all_of(s.begin(), s.end(), [&](char c) { return ok(static_cast<unsigned char>(c)) != 0; }));
    }
    if (name == "format") {
      // Positional "{}" and "{0}" fields only: what templates use str.format for.
      std::string out;
      std::size_t next_index = 0;
      for (std::size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '{') {
          out += '{';
          ++i;
        } else if (s[i] == '}' && i + 1 < s.size() && s[i + 1] == '}') {
          out += '}';
          ++i;
        } else if (s[i] == '{') {
          std::size_t close = s.find('}', i);
          if (close == std::string::npos) fail(Kind::kRender, "single '{' in format string", pos);
          std::string field = s.substr(i + 1, close - i - 1);
          const Value* v = field.empty() ? args.get(next_index++, "")
                           : std::isdigit(static_cast<unsigned char>(field[0]))
                               ? args.get(static_cast<std::size_t>(std::stoul(field)), "")
                               : args.get(static_cast<std::size_t>(-1), field.c_str());
          if (!v) fail(Kind::kRender, "format field {" + field + "} has no argument", pos);
          out += to_str(*v);
          i = close;
        } else {
          out += s[i];
        }
      }
      return Value::from_string(out);
    }
  } else if (obj.type == Type::kDict || obj.type == Type::kNamespace) {
    if (name == "items") {
      List out;
      for (const auto& [key, value] : obj.dict->items) out.push_back(Value::from_list({Value::from_string(key), value}, true));
      return Value::from_list(std::move(out));
    }
    if (name == "keys") {
      List out;
      for (const auto& item : obj.dict->items) out.push_back(Value::from_string(item.first));
      return Value::from_list(std::move(out));
    }
    if (name == "values") {
      List out;
      for (const auto& item : obj.dict->items) out.push_back(item.second);
      return Value::from_list(std::move(out));
    }
    if (name == "get" && a0) {
      const Value* v = a0->type == Type::kString ? obj.dict->find(a0->text) : nullptr;
      return v ? *v : a1 ? *a1 : Value::none();
    }
  } else if (obj.type == Type::kList) {
    if (name == "index" && a0) {
      for (std::size_t i = 0; i < obj.list->size(); ++i) {
        if (equal((*obj.list)[i], *a0)) return Value::from_int(static_cast<std::int64_t>(i));
      }
      fail(Kind::kRender, repr(*a0) + " is not in list", pos);
    }
    if (name == "count" && a0) {
      return Value::from_int(std::count_if(obj.list->begin(), obj.list->end(), [&](const Value& v) { return equal(v, *a0); }));
    }
    if (name == "append" || name == "extend" || name == "pop" || name == "insert" || name == "remove" ||
        name == "clear" || name == "sort" || name == "reverse") {
      fail(Kind::kRender, "lists cannot be modified in a chat template (the sandbox is immutable)", pos,
           "build a new list with + instead");
    }
  }
  (void)ctx;
  fail(Kind::kRender, std::string("'") + type_name(obj) + "' object has no method '" + name + "'", pos);
}

// Resolves a dotted attribute path (map(attribute='function.name')) on an item.
Value attribute_path(const Value& item, const std::string& path, Pos pos) {
  Value v = item;
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (v.is_undefined()) return v;
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    v = get_item(v, numeric ? Value::from_int(std::stoll(part)) : Value::from_string(part), pos);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

Value sorted(Context& ctx, List items, bool reverse, const Value* attribute, bool case_sensitive, Pos pos) {
  auto key = [&](const Value& v) {
    Value k = attribute && attribute->type == Type::kString ? attribute_path(v, attribute->text, pos) : v;
    if (!case_sensitive && k.type == Type::kString) k.text = ascii_lower(k.text);
    return k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    ctx.step(pos);
    int c = compare(key(a), key(b), pos);
    return reverse ? c > 0 : c < 0;
  });
  return Value::from_list(std::move(items));
}

Value apply_filter(Context& ctx, const std::string& name, const Value& value, Args& args) {
  Pos pos = args.pos;
  const Value* a0 = args.get(0, "");
  if (name == "tojson") {
    JsonStyle style;
    if (const Value* indent = args.get(0, "indent"); indent && indent->type != Type::kNone) {
      if (indent->type == Type::kInt) {
        style.indent = static_cast<int>(indent->integer);
      } else {
        fail(Kind::kRender, "tojson indent must be an integer", pos);
      }
      style.item_separator = ",";
    }
    if (const Value* seps = args.get(99, "separators"); seps && seps->type == Type::kList && seps->list->size() == 2) {
      style.item_separator = to_str((*seps->list)[0]);
      style.key_separator = to_str((*seps->list)[1]);
    }
    if (const Value* sort = args.get(99, "sort_keys")) style.sort_keys = truthy(*sort);
    if (const Value* ascii = args.get(99, "ensure_ascii"); ascii && truthy(*ascii)) {
      fail(Kind::kRender, "tojson(ensure_ascii=True) is not supported", pos);
    }
    std::string out;
    to_json(value, style, 0, out, pos);
    return Value::from_string(out);
  }
  if (name == "safe" || name == "string") {
    return name == "safe" ? value : Value::from_string(to_str(value));
  }
  if (name == "e" || name == "escape" || name == "forceescape") {
    std::string out;
    for (char c : to_str(value)) {
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
      }
    }
    return Value::from_string(out);
  }
  if (name == "trim") return Value::from_string(strip_chars(to_str(value), a0, true, true));
  if (name == "upper") return Value::from_string(ascii_upper(to_str(value)));
  if (name == "lower") return Value::from_string(ascii_lower(to_str(value)));
  if (name == "title") return Value::from_string(title_case(to_str(value)));
  if (name == "capitalize") return Value::from_string(capitalize(to_str(value)));
  if (name == "length" || name == "count") return Value::from_int(length(value, pos));
  if (name == "default" || name == "d") {
    bool boolean = args.get(1, "boolean") && truthy(*args.get(1, "boolean"));
    bool use_default = value.is_undefined() || (boolean && !truthy(value));
    const Value* fallback = args.get(0, "default_value");
    return use_default ? (fallback ? *fallback : Value::from_string("")) : value;
  }
  if (name == "first" || name == "last") {
    List items = iterate(value, pos);
    if (items.empty()) return Value::undefined(name);
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") return Value::from_list(iterate(value, pos));
  if (name == "reverse") {
    if (value.type == Type::kString) return slice(value, Value::none(), Value::none(), Value::from_int(-1), pos);
    List items = iterate(value, pos);
    std::reverse(items.begin(), items.end());
    return Value::from_list(std::move(items));
  }
  if (name == "items") {
    if (value.is_undefined()) return Value::from_list({});
    if (value.type != Type::kDict) fail(Kind::kRender, "items filter needs a mapping", pos);
    Args none;
    none.pos = pos;
    return call_method(ctx, value, "items", none);
  }
  if (name == "dictsort") {
    if (value.type != Type::kDict) fail(Kind::kRender, "dictsort needs a mapping", pos);
    List pairs;
    for (const auto& [key, v] : value.dict->items) pairs.push_back(Value::from_list({Value::from_string(key), v}, true));
    bool by_value = args.get(1, "by") && to_str(*args.get(1, "by")) == "value";
    bool case_sensitive = args.get(0, "case_sensitive") && truthy(*args.get(0, "case_sensitive"));
    bool reverse = args.get(2, "reverse") && truthy(*args.get(2, "reverse"));
    Value attribute = Value::from_string(by_value ? "1" : "0");
    return sorted(ctx, std::move(pairs), reverse, &attribute, case_sensitive, pos);
  }
  if (name == "sort") {
    bool reverse = args.get(0, "reverse") && truthy(*args.get(0, "reverse"));
    bool case_sensitive = args.get(1, "case_sensitive") && truthy(*args.get(1, "case_sensitive"));
    return sorted(ctx, iterate(value, pos), reverse, args.get(2, "attribute"), case_sensitive, pos);
  }
  if (name == "unique") {
    List out;
    const Value* attribute = args.get(1, "attribute");
    for (const auto& item : iterate(value, pos)) {
      Value key = attribute && attribute->type == Type::kString ? attribute_path(item, attribute->text, pos) : item;
      bool seen = std::any_of(out.begin(), out.end(), [&](const Value& o) {
        Value other = attribute && attribute->type == Type::kString ? attribute_path(o, attribute->text, pos) : o;
        if (key.type == Type::kString && other.type == Type::kString) return ascii_lower(key.text) == ascii_lower(other.text);
        return equal(key, other);
      });
      if (!seen) out.push_back(item);
    }
    return Value::from_list(std::move(out));
  }
  if (name == "join") {
    std::string separator = a0 && a0->type == Type::kString ? a0->text : "";
    const Value* attribute = args.get(1, "attribute");
    std::string out;
    List items = iterate(value, pos);
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (i) out += separator;
      out += to_str(attribute && attribute->type == Type::kString ? attribute_path(items[i], attribute->text, pos) : items[i]);
    }
    return Value::from_string(out);
  }
  if (name == "map") {
    List out;
    const Value* attribute = args.get(99, "attribute");
    for (const auto& item : iterate(value, pos)) {
      ctx.step(pos);
      if (attribute) {
        Value v = attribute_path(item, to_str(*attribute), pos);
        if (v.is_undefined() && args.get(99, "default")) v = *args.get(99, "default");
        out.push_back(v);
      } else {
        if (!a0 || a0->type != Type::kString) fail(Kind::kRender, "map needs a filter name or attribute=", pos);
        Args rest;
        rest.pos = pos;
        rest.positional.assign(args.positional.begin() + 1, args.positional.end());
        rest.named = args.named;
        out.push_back(apply_filter(ctx, a0->text, item, rest));
      }
    }
    return Value::from_list(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    bool by_attribute = name.size() > 6;
    bool keep_when = name[0] == 's';
    List out;
    std::size_t test_index = by_attribute ? 1 : 0;
    for (const auto& item : iterate(value, pos)) {
      ctx.step(pos);
      Value subject = by_attribute ? attribute_path(item, to_str(args.positional.at(0)), pos) : item;
      bool result;
      if (args.positional.size() > test_index) {
        Args rest;
        rest.pos = pos;
        rest.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(test_index) + 1, args.positional.end());
        result = apply_test(ctx, to_str(args.positional[test_index]), subject, rest);
      } else {
        result = truthy(subject);
      }
      if (result == keep_when) out.push_back(item);
    }
    return Value::from_list(std::move(out));
  }
  if (name == "replace") {
    const Value* a1 = args.get(1, "new");
    if (!a0 || !a1) fail(Kind::kRender, "replace needs two arguments", pos);
    return Value::from_string(replace_all(to_str(value), to_str(*a0), to_str(*a1), int_arg(args.get(2, "count"), -1)));
  }
  if (name == "indent") {
    std::int64_t width = int_arg(args.get(0, "width"), 4);
    std::string pad = a0 && a0->type == Type::kString ? a0->text : std::string(static_cast<std::size_t>(std::max<std::int64_t>(0, width)), ' ');
    bool first = args.get(1, "first") && truthy(*args.get(1, "first"));
    bool blank = args.get(2, "blank") && truthy(*args.get(2, "blank"));
    std::string s = to_str(value), out;
    std::vector<std::string> lines;
    std::size_t start = 0;
    for (std::size_t i = 0; i <= s.size(); ++i) {
      if (i == s.size() || s[i] == '\n') {
        lines.push_back(s.substr(start, i - start));
        start = i + 1;
      }
    }
    // jinja2: a trailing newline stays, unindented; blank lines stay blank unless blank=True.
    bool trailing_newline = !s.empty() && s.back() == '\n';
    if (trailing_newline) lines.pop_back();
    for (std::size_t i = 0; i < lines.size(); ++i) {
      if (i) out += '\n';
      bool indent_this = (i > 0 || first) && (blank || !lines[i].empty());
      if (i > 0 && !blank && lines[i].find_first_not_of(" \t") == std::string::npos) indent_this = false;
      out += (indent_this ? pad : "") + lines[i];
    }
    if (trailing_newline) out += '\n';
    return Value::from_string(out);
  }
  if (name == "int") {
    if (value.is_number()) return Value::from_int(value.type == Type::kFloat ? static_cast<std::int64_t>(value.number) : value.as_int());
    if (value.type == Type::kString) {
      try {
        std::size_t used = 0;
        std::string t = strip_chars(value.text, nullptr, true, true);
        double d = std::stod(t, &used);
        if (used == t.size()) return Value::from_int(static_cast<std::int64_t>(d));
      } catch (const std::exception&) {
      }
    }
    return a0 ? *a0 : Value::from_int(0);
  }
  if (name == "float") {
    if (value.is_number()) return Value::from_float(value.as_double());
    if (value.type == Type::kString) {
      try {
        std::size_t used = 0;
        std::string t = strip_chars(value.text, nullptr, true, true);
        double d = std::stod(t, &used);
        if (used == t.size()) return Value::from_float(d);
      } catch (const std::exception&) {
      }
    }
    return a0 ? *a0 : Value::from_float(0.0);
  }
  if (name == "abs") {
    if (!value.is_number()) fail(Kind::kRender, "abs needs a number", pos);
    return value.type == Type::kFloat ? Value::from_float(std::fabs(value.number)) : Value::from_int(std::llabs(value.as_int()));
  }
  if (name == "round") {
    if (!value.is_number()) fail(Kind::kRender, "round needs a number", pos);
    std::int64_t precision = int_arg(args.get(0, "precision"), 0);
    std::string method = args.get(1, "method") ? to_str(*args.get(1, "method")) : "common";
    double scale = std::pow(10.0, static_cast<double>(precision));
    double x = value.as_double() * scale;
    // Python's round() goes half to even, which nearbyint does in the default rounding mode.
    double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::nearbyint(x);
    return Value::from_float(r / scale);
  }
  if (name == "sum") {
    Value total = args.get(1, "start") ? *args.get(1, "start") : Value::from_int(0);
    const Value* attribute = args.get(0, "attribute");
    for (const auto& item : iterate(value, pos)) {
      total = arithmetic("+", total, attribute ? attribute_path(item, to_str(*attribute), pos) : item, pos);
    }
    return total;
  }
  if (name == "min" || name == "max") {
    List items = iterate(value, pos);
    if (items.empty()) return Value::undefined(name);
    Value best = items[0];
    for (const auto& item : items) {
      int c = compare(item, best, pos);
      if (name == "min" ? c < 0 : c > 0) best = item;
    }
    return best;
  }
  if (name == "wordcount") return Value::from_int(static_cast<std::int64_t>(split(to_str(value), nullptr, -1).size()));
  if (name == "batch" || name == "slice") {
    fail(Kind::kRender, "the '" + name + "' filter is not supported in chat templates", pos);
  }
  fail(Kind::kRender, "no filter named '" + name + "'", pos);
}

bool apply_test(Context& ctx, const std::string& name, const Value& value, Args& args) {
  Pos pos = args.pos;
  const Value* a0 = args.get(0, "");
  (void)ctx;
  if (name == "defined") return !value.is_undefined();
  if (name == "undefined") return value.is_undefined();
  if (name == "none") return value.type == Type::kNone;
  if (name == "string") return value.type == Type::kString;
  if (name == "mapping") return value.type == Type::kDict;
  if (name == "iterable") return value.type == Type::kString || value.type == Type::kList || value.type == Type::kDict;
  if (name == "sequence") return value.type == Type::kString || value.type == Type::kList || value.type == Type::kDict;
  if (name == "number") return value.is_number();
  if (name == "integer") return value.type == Type::kInt;
  if (name == "float") return value.type == Type::kFloat;
  if (name == "boolean") return value.type == Type::kBool;
  if (name == "true") return value.type == Type::kBool && value.boolean;
  if (name == "false") return value.type == Type::kBool && !value.boolean;
  if (name == "callable") return value.type == Type::kCallable;
  if (name == "lower") return value.type == Type::kString && ascii_lower(value.text) == value.text;
  if (name == "upper") return value.type == Type::kString && ascii_upper(value.text) == value.text;
  if (name == "odd" || name == "even") {
    if (value.type != Type::kInt) fail(Kind::kRender, "'" + name + "' test needs an integer", pos);
    return (value.integer % 2 != 0) == (name == "odd");
  }
  if (!a0) fail(Kind::kRender, "test '" + name + "' needs an argument", pos);
  if (name == "divisibleby") return a0->as_int() != 0 && value.as_int() % a0->as_int() == 0;
  if (name == "equalto" || name == "eq" || name == "==") return equal(value, *a0);
  if (name == "ne" || name == "!=") return !equal(value, *a0);
  if (name == "lt" || name == "lessthan" || name == "<") return compare(value, *a0, pos) < 0;
  if (name == "le" || name == "<=") return compare(value, *a0, pos) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(value, *a0, pos) > 0;
  if (name == "ge" || name == ">=") return compare(value, *a0, pos) >= 0;
  if (name == "in") return contains(*a0, value, pos);
  if (name == "sameas") {
    if (value.type != a0->type) return false;
    if (value.type == Type::kNone || value.type == Type::kBool) return equal(value, *a0);
    return value.dict && value.dict == a0->dict;
  }
  fail(Kind::kRender, "no test named '" + name + "'", pos);
}

Value make_namespace(Args& args) {
  auto d = std::make_shared<Dict>();
  for (const auto& v : args.positional) {
    if (v.type != Type::kDict) fail(Kind::kRender, "namespace() takes a mapping or keyword arguments", args.pos);
    for (const auto& [key, item] : v.dict->items) d->set(key, item);
  }
  for (const auto& [key, item] : args.named) {
    if (!key.empty() && key[0] == '_') {
      fail(Kind::kRender, "namespace attributes cannot start with '_' ('" + key + "')", args.pos, "rename the attribute");
    }
    d->set(key, item);
  }
  Value v;
  v.type = Type::kNamespace;
  v.dict = std::move(d);
  return v;
}

void install_globals(Frame& frame);

// The globals are stateless functions: built once, shared by every render (and thread).
Value Context::global(const std::string& name) {
  static const Frame globals = [] {
    Frame frame;
    install_globals(frame);
    return frame;
  }();
  const Value* found = globals.vars.find(name);
  return found ? *found : Value::undefined(name);
}

void install_globals(Frame& frame) {
  frame.vars["raise_exception"] = Value::from_callable("raise_exception", [](Context&, Args& args) -> Value {
    fail(Kind::kRaised, args.positional.empty() ? std::string() : to_str(args.positional[0]), args.pos);
  });
  frame.vars["strftime_now"] = Value::from_callable("strftime_now", [](Context&, Args& args) {
    if (args.positional.empty() || args.positional[0].type != Type::kString) {
      fail(Kind::kRender, "strftime_now needs a format string", args.pos);
    }
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[512];
    std::size_t n = std::strftime(buf, sizeof buf, args.positional[0].text.c_str(), &local);
    return Value::from_string(std::string(buf, n));
  });
  frame.vars["namespace"] = Value::from_callable("namespace", [](Context&, Args& args) { return make_namespace(args); });
  frame.vars["dict"] = Value::from_callable("dict", [](Context&, Args& args) {
    auto d = std::make_shared<Dict>();
    for (const auto& v : args.positional) {
      if (v.type != Type::kDict) fail(Kind::kRender, "dict() takes a mapping or keyword arguments", args.pos);
      for (const auto& [key, item] : v.dict->items) d->set(key, item);
    }
    for (const auto& [key, item] : args.named) d->set(key, item);
    return Value::from_dict(std::move(d));
  });
  frame.vars["range"] = Value::from_callable("range", [](Context& ctx, Args& args) {
    std::vector<std::int64_t> n;
    for (const auto& v : args.positional) {
      if (v.type != Type::kInt) fail(Kind::kRender, "range() takes integers", args.pos);
      n.push_back(v.integer);
    }
    if (n.empty() || n.size() > 3) fail(Kind::kRender, "range() takes 1 to 3 arguments", args.pos);
    std::int64_t start = n.size() > 1 ? n[0] : 0, stop = n.size() > 1 ? n[1] : n[0], step = n.size() > 2 ? n[2] : 1;
    if (step == 0) fail(Kind::kRender, "range() step must not be zero", args.pos);
    List out;
    for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      ctx.step(args.pos);
      out.push_back(Value::from_int(i));
    }
    return Value::from_list(std::move(out));
  });
}

}  // namespace

struct Template::Impl {
  Body body;
};

struct TemplateValue::Impl {
  Value value;
};

TemplateValue::TemplateValue(const nlohmann::ordered_json& value) {
  auto impl = std::make_shared<Impl>();
  impl->value = from_json(value);
  impl_ = std::move(impl);
}

TemplateValue TemplateValue::first(std::size_t n) const {
  const Value& value = impl_->value;
  if (value.type != Type::kList || n >= value.list->size()) return *this;
  auto impl = std::make_shared<Impl>();
  impl->value = Value::from_list(List(value.list->begin(), value.list->begin() + static_cast<std::ptrdiff_t>(n)),
                                 value.is_tuple);
  return TemplateValue(std::move(impl));
}

Template::Template(std::string_view source) {
  auto impl = std::make_shared<Impl>();
  impl->body = Parser(Lexer(source).run()).parse_template();
  impl_ = std::move(impl);
}

RenderResult Template::render(const nlohmann::ordered_json& variables, const RenderLimits& limits) const {
  if (!variables.is_object() && !variables.is_null()) {
    throw TemplateError(Kind::kRender, "template variables must be a JSON object", 1, 1);
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
  Context ctx;
  ctx.limits = limits;
  ctx.frames.emplace_back();
  for (const auto& [key, value] : variables) ctx.frames[0].vars[key] = value.impl_->value;
  ctx.buffers.emplace_back();
  try {
    exec_body(impl_->body, ctx);
  } catch (const BreakSignal&) {
  } catch (const ContinueSignal&) {
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
