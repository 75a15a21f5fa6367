// The interpreter's values as Python sees them: UTF-8 strings indexed by code point, type names, str() and repr(),
// JSON in and out (the tojson filter), and the operations expressions, filters and tests share (==, <, in, [],
// slices, arithmetic).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "chat/jinja_internal.h"

namespace trainer::chat::jinja {

void fail(Kind kind, const std::string& message, Pos pos, std::string hint) {
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

bool is_unicode_space(std::uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// ---- Values -----------------------------------------------------------------------------------------------------

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

namespace {

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

}  // namespace

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

namespace {

std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

}  // namespace

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

}  // namespace trainer::chat::jinja
