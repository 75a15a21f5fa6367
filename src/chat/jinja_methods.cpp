// The methods of values chat templates call (str.split, dict.items, list.index, ...), a name -> function table per
// receiver type, and the Python str helpers (strip, split, replace, case) that the filters share.
#include <algorithm>
#include <cctype>
#include <string_view>
#include <unordered_map>

#include "chat/jinja_internal.h"

namespace trainer::chat::jinja {

// ---- Python str helpers -----------------------------------------------------------------------------------------

std::string ascii_upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
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

// ---- Methods: str, dict (and namespace), list -------------------------------------------------------------------

namespace {

// Methods have the filters' signature: (context, the object called on, the arguments).
using MethodFn = FilterFn;
using MethodTable = std::unordered_map<std::string_view, MethodFn>;

std::string require_string(const Value& v, const char* what, Pos pos) {
  if (v.type != Type::kString) fail(Kind::kRender, std::string(what) + " needs a string, got " + type_name(v), pos);
  return v.text;
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

[[noreturn]] void no_method(const Value& obj, std::string_view name, Pos pos) {
  fail(Kind::kRender, std::string("'") + type_name(obj) + "' object has no method '" + std::string(name) + "'", pos);
}

// The positional argument a method cannot do without; called without it, the method is reported as missing (what
// the chains of ifs this table replaced did, so the message is unchanged).
const Value& method_arg(const Value& obj, const char* method, const Args& args, std::size_t index) {
  const Value* v = args.get(index, "");
  if (!v) no_method(obj, method, args.pos);
  return *v;
}

Value str_strip(Context&, const Value& obj, Args& args) {
  return Value::from_string(strip_chars(obj.text, args.get(0, ""), true, true));
}
Value str_lstrip(Context&, const Value& obj, Args& args) {
  return Value::from_string(strip_chars(obj.text, args.get(0, ""), true, false));
}
Value str_rstrip(Context&, const Value& obj, Args& args) {
  return Value::from_string(strip_chars(obj.text, args.get(0, ""), false, true));
}
Value str_upper(Context&, const Value& obj, Args&) { return Value::from_string(ascii_upper(obj.text)); }
Value str_lower(Context&, const Value& obj, Args&) { return Value::from_string(ascii_lower(obj.text)); }
Value str_title(Context&, const Value& obj, Args&) { return Value::from_string(title_case(obj.text)); }
Value str_capitalize(Context&, const Value& obj, Args&) { return Value::from_string(capitalize(obj.text)); }

Value str_startswith(Context&, const Value& obj, Args& args) {
  return Value::from_bool(starts_or_ends(obj.text, method_arg(obj, "startswith", args, 0), true, args.pos));
}
Value str_endswith(Context&, const Value& obj, Args& args) {
  return Value::from_bool(starts_or_ends(obj.text, method_arg(obj, "endswith", args, 0), false, args.pos));
}

Value str_split(Context&, const Value& obj, Args& args) {
  const Value* sep = args.get(0, "sep");
  return Value::from_list(split(obj.text, sep, int_arg(args.get(1, "maxsplit"), -1)));
}

Value str_splitlines(Context&, const Value& obj, Args&) {
  const std::string& s = obj.text;
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

Value str_replace(Context&, const Value& obj, Args& args) {
  const Value& from = method_arg(obj, "replace", args, 0);
  const Value& to = method_arg(obj, "replace", args, 1);
  return Value::from_string(replace_all(obj.text, require_string(from, "replace", args.pos),
                                        require_string(to, "replace", args.pos), int_arg(args.get(2, "count"), -1)));
}

Value str_find(Context&, const Value& obj, Args& args) {
  const std::string& s = obj.text;
  std::size_t hit = s.find(require_string(method_arg(obj, "find", args, 0), "find", args.pos));
  return Value::from_int(hit == std::string::npos ? -1 : static_cast<std::int64_t>(code_point_count(s.substr(0, hit))));
}

Value str_count(Context&, const Value& obj, Args& args) {
  const std::string& s = obj.text;
  const std::string sub = require_string(method_arg(obj, "count", args, 0), "count", args.pos);
  if (sub.empty()) return Value::from_int(static_cast<std::int64_t>(code_point_count(s)) + 1);
  std::int64_t n = 0;
  for (std::size_t hit = s.find(sub); hit != std::string::npos; hit = s.find(sub, hit + sub.size())) ++n;
  return Value::from_int(n);
}

Value str_join(Context&, const Value& obj, Args& args) {
  const std::string& s = obj.text;
  std::string out;
  List items = iterate(method_arg(obj, "join", args, 0), args.pos);
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + require_string(items[i], "join", args.pos);
  return Value::from_string(out);
}

// str.isdigit() and its kin on ASCII: true when the string is not empty and every byte passes.
template <typename Predicate>
Value all_bytes(const std::string& s, Predicate ok) {
  if (s.empty()) return Value::from_bool(false);
  return Value::from_bool(std::all_of(s.begin(), s.end(), [&](char c) { return ok(static_cast<unsigned char>(c)); }));
}
Value str_isdigit(Context&, const Value& obj, Args&) {
  return all_bytes(obj.text, [](unsigned char c) { return std::isdigit(c) != 0; });
}
Value str_isalpha(Context&, const Value& obj, Args&) {
  return all_bytes(obj.text, [](unsigned char c) { return std::isalpha(c) != 0; });
}
Value str_isspace(Context&, const Value& obj, Args&) {
  return all_bytes(obj.text, [](unsigned char c) { return std::isspace(c) != 0; });
}
Value str_isalnum(Context&, const Value& obj, Args&) {
  return all_bytes(obj.text, [](unsigned char c) { return std::isalnum(c) != 0; });
}

Value str_format(Context&, const Value& obj, Args& args) {
  // Positional "{}" and "{0}" fields only: what templates use str.format for.
  const std::string& s = obj.text;
  Pos pos = args.pos;
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

Value dict_items(Context&, const Value& obj, Args&) {
  List out;
  for (const auto& [key, value] : obj.dict->items) out.push_back(Value::from_list({Value::from_string(key), value}, true));
  return Value::from_list(std::move(out));
}

Value dict_keys(Context&, const Value& obj, Args&) {
  List out;
  for (const auto& item : obj.dict->items) out.push_back(Value::from_string(item.first));
  return Value::from_list(std::move(out));
}

Value dict_values(Context&, const Value& obj, Args&) {
  List out;
  for (const auto& item : obj.dict->items) out.push_back(item.second);
  return Value::from_list(std::move(out));
}

Value dict_get(Context&, const Value& obj, Args& args) {
  const Value& key = method_arg(obj, "get", args, 0);
  const Value* fallback = args.get(1, "");
  const Value* v = key.type == Type::kString ? obj.dict->find(key.text) : nullptr;
  return v ? *v : fallback ? *fallback : Value::none();
}

Value list_index(Context&, const Value& obj, Args& args) {
  const Value& wanted = method_arg(obj, "index", args, 0);
  for (std::size_t i = 0; i < obj.list->size(); ++i) {
    if (equal((*obj.list)[i], wanted)) return Value::from_int(static_cast<std::int64_t>(i));
  }
  fail(Kind::kRender, repr(wanted) + " is not in list", args.pos);
}

Value list_count(Context&, const Value& obj, Args& args) {
  const Value& wanted = method_arg(obj, "count", args, 0);
  return Value::from_int(
      std::count_if(obj.list->begin(), obj.list->end(), [&](const Value& v) { return equal(v, wanted); }));
}

// append, pop and the other methods that change a list in place.
Value list_modify(Context&, const Value&, Args& args) {
  fail(Kind::kRender, "lists cannot be modified in a chat template (the sandbox is immutable)", args.pos,
       "build a new list with + instead");
}

const MethodTable& string_methods() {
  static const MethodTable table = {
      {"strip", str_strip},
      {"lstrip", str_lstrip},
      {"rstrip", str_rstrip},
      {"upper", str_upper},
      {"lower", str_lower},
      {"title", str_title},
      {"capitalize", str_capitalize},
      {"startswith", str_startswith},
      {"endswith", str_endswith},
      {"split", str_split},
      {"splitlines", str_splitlines},
      {"replace", str_replace},
      {"find", str_find},
      {"count", str_count},
      {"join", str_join},
      {"isdigit", str_isdigit},
      {"isalpha", str_isalpha},
      {"isspace", str_isspace},
      {"isalnum", str_isalnum},
      {"format", str_format},
  };
  return table;
}

const MethodTable& dict_methods() {
  static const MethodTable table = {
      {"items", dict_items},
      {"keys", dict_keys},
      {"values", dict_values},
      {"get", dict_get},
  };
  return table;
}

const MethodTable& list_methods() {
  static const MethodTable table = {
      {"index", list_index},
      {"count", list_count},
      {"append", list_modify},
      {"extend", list_modify},
      {"pop", list_modify},
      {"insert", list_modify},
      {"remove", list_modify},
      {"clear", list_modify},
      {"sort", list_modify},
      {"reverse", list_modify},
  };
  return table;
}

}  // namespace

Value call_method(Context& ctx, const Value& obj, const std::string& name, Args& args) {
  const MethodTable* table = nullptr;
  if (obj.type == Type::kString) table = &string_methods();
  else if (obj.type == Type::kDict || obj.type == Type::kNamespace) table = &dict_methods();
  else if (obj.type == Type::kList) table = &list_methods();
  if (table) {
    if (auto it = table->find(name); it != table->end()) return it->second(ctx, obj, args);
  }
  no_method(obj, name, args.pos);
}

}  // namespace trainer::chat::jinja
