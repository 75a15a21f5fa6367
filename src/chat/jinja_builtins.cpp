// The filters, tests and globals chat templates call by name: jinja2's filters and tests, and the globals
// transformers provides, each registered by name in one table.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <string_view>
#include <unordered_map>

#include "chat/jinja_internal.h"

namespace trainer::chat::jinja {

namespace {

using FilterTable = std::unordered_map<std::string_view, FilterFn>;
using TestTable = std::unordered_map<std::string_view, TestFn>;

// ---- Filters ----------------------------------------------------------------------------------------------------

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

// A filter jinja2 has and chat templates do not use: known to the parser, so a template that names it in a branch
// it never renders still loads, and an error when a render reaches it.
[[noreturn]] void unsupported_filter(const char* name, Pos pos) {
  fail(Kind::kRender, std::string("the '") + name + "' filter is not supported in chat templates", pos);
}

Value filter_tojson(Context&, const Value& value, Args& args) {
  Pos pos = args.pos;
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

Value filter_safe(Context&, const Value& value, Args&) { return value; }
Value filter_string(Context&, const Value& value, Args&) { return Value::from_string(to_str(value)); }

Value filter_escape(Context&, const Value& value, Args&) {
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

Value filter_trim(Context&, const Value& value, Args& args) {
  return Value::from_string(strip_chars(to_str(value), args.get(0, ""), true, true));
}
Value filter_upper(Context&, const Value& value, Args&) { return Value::from_string(ascii_upper(to_str(value))); }
Value filter_lower(Context&, const Value& value, Args&) { return Value::from_string(ascii_lower(to_str(value))); }
Value filter_title(Context&, const Value& value, Args&) { return Value::from_string(title_case(to_str(value))); }
Value filter_capitalize(Context&, const Value& value, Args&) {
  return Value::from_string(capitalize(to_str(value)));
}
Value filter_length(Context&, const Value& value, Args& args) { return Value::from_int(length(value, args.pos)); }

Value filter_default(Context&, const Value& value, Args& args) {
  bool boolean = args.get(1, "boolean") && truthy(*args.get(1, "boolean"));
  bool use_default = value.is_undefined() || (boolean && !truthy(value));
  const Value* fallback = args.get(0, "default_value");
  return use_default ? (fallback ? *fallback : Value::from_string("")) : value;
}

Value filter_first(Context&, const Value& value, Args& args) {
  List items = iterate(value, args.pos);
  return items.empty() ? Value::undefined("first") : items.front();
}
Value filter_last(Context&, const Value& value, Args& args) {
  List items = iterate(value, args.pos);
  return items.empty() ? Value::undefined("last") : items.back();
}

Value filter_list(Context&, const Value& value, Args& args) { return Value::from_list(iterate(value, args.pos)); }

Value filter_reverse(Context&, const Value& value, Args& args) {
  if (value.type == Type::kString) return slice(value, Value::none(), Value::none(), Value::from_int(-1), args.pos);
  List items = iterate(value, args.pos);
  std::reverse(items.begin(), items.end());
  return Value::from_list(std::move(items));
}

Value filter_items(Context& ctx, const Value& value, Args& args) {
  if (value.is_undefined()) return Value::from_list({});
  if (value.type != Type::kDict) fail(Kind::kRender, "items filter needs a mapping", args.pos);
  Args none;
  none.pos = args.pos;
  return call_method(ctx, value, "items", none);
}

Value filter_dictsort(Context& ctx, const Value& value, Args& args) {
  if (value.type != Type::kDict) fail(Kind::kRender, "dictsort needs a mapping", args.pos);
  List pairs;
  for (const auto& [key, v] : value.dict->items) pairs.push_back(Value::from_list({Value::from_string(key), v}, true));
  bool by_value = args.get(1, "by") && to_str(*args.get(1, "by")) == "value";
  bool case_sensitive = args.get(0, "case_sensitive") && truthy(*args.get(0, "case_sensitive"));
  bool reverse = args.get(2, "reverse") && truthy(*args.get(2, "reverse"));
  Value attribute = Value::from_string(by_value ? "1" : "0");
  return sorted(ctx, std::move(pairs), reverse, &attribute, case_sensitive, args.pos);
}

Value filter_sort(Context& ctx, const Value& value, Args& args) {
  bool reverse = args.get(0, "reverse") && truthy(*args.get(0, "reverse"));
  bool case_sensitive = args.get(1, "case_sensitive") && truthy(*args.get(1, "case_sensitive"));
  return sorted(ctx, iterate(value, args.pos), reverse, args.get(2, "attribute"), case_sensitive, args.pos);
}

Value filter_unique(Context&, const Value& value, Args& args) {
  Pos pos = args.pos;
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

Value filter_join(Context&, const Value& value, Args& args) {
  Pos pos = args.pos;
  const Value* a0 = args.get(0, "");
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

Value filter_map(Context& ctx, const Value& value, Args& args) {
  Pos pos = args.pos;
  const Value* a0 = args.get(0, "");
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

// select, reject, selectattr and rejectattr: keep the items whose test (or truth) is keep_when; by_attribute tests
// the attribute named by the first argument instead of the item.
Value select_items(Context& ctx, const Value& value, Args& args, bool by_attribute, bool keep_when) {
  Pos pos = args.pos;
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
Value filter_select(Context& ctx, const Value& value, Args& args) { return select_items(ctx, value, args, false, true); }
Value filter_reject(Context& ctx, const Value& value, Args& args) { return select_items(ctx, value, args, false, false); }
Value filter_selectattr(Context& ctx, const Value& value, Args& args) {
  return select_items(ctx, value, args, true, true);
}
Value filter_rejectattr(Context& ctx, const Value& value, Args& args) {
  return select_items(ctx, value, args, true, false);
}

Value filter_replace(Context&, const Value& value, Args& args) {
  const Value* a0 = args.get(0, "");
  const Value* a1 = args.get(1, "new");
  if (!a0 || !a1) fail(Kind::kRender, "replace needs two arguments", args.pos);
  return Value::from_string(replace_all(to_str(value), to_str(*a0), to_str(*a1), int_arg(args.get(2, "count"), -1)));
}

Value filter_indent(Context&, const Value& value, Args& args) {
  const Value* a0 = args.get(0, "");
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

Value filter_int(Context&, const Value& value, Args& args) {
  const Value* a0 = args.get(0, "");
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

Value filter_float(Context&, const Value& value, Args& args) {
  const Value* a0 = args.get(0, "");
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

Value filter_abs(Context&, const Value& value, Args& args) {
  if (!value.is_number()) fail(Kind::kRender, "abs needs a number", args.pos);
  return value.type == Type::kFloat ? Value::from_float(std::fabs(value.number)) : Value::from_int(std::llabs(value.as_int()));
}

Value filter_round(Context&, const Value& value, Args& args) {
  if (!value.is_number()) fail(Kind::kRender, "round needs a number", args.pos);
  std::int64_t precision = int_arg(args.get(0, "precision"), 0);
  std::string method = args.get(1, "method") ? to_str(*args.get(1, "method")) : "common";
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = value.as_double() * scale;
  // Python's round() goes half to even, which nearbyint does in the default rounding mode.
  double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::nearbyint(x);
  return Value::from_float(r / scale);
}

Value filter_sum(Context&, const Value& value, Args& args) {
  Pos pos = args.pos;
  Value total = args.get(1, "start") ? *args.get(1, "start") : Value::from_int(0);
  const Value* attribute = args.get(0, "attribute");
  for (const auto& item : iterate(value, pos)) {
    total = arithmetic("+", total, attribute ? attribute_path(item, to_str(*attribute), pos) : item, pos);
  }
  return total;
}

// min and max: the first item that no other item is below (min) or above (max).
Value extreme(const Value& value, Pos pos, bool min) {
  List items = iterate(value, pos);
  if (items.empty()) return Value::undefined(min ? "min" : "max");
  Value best = items[0];
  for (const auto& item : items) {
    int c = compare(item, best, pos);
    if (min ? c < 0 : c > 0) best = item;
  }
  return best;
}
Value filter_min(Context&, const Value& value, Args& args) { return extreme(value, args.pos, true); }
Value filter_max(Context&, const Value& value, Args& args) { return extreme(value, args.pos, false); }

Value filter_wordcount(Context&, const Value& value, Args&) {
  return Value::from_int(static_cast<std::int64_t>(split(to_str(value), nullptr, -1).size()));
}

// Every filter jinja2 3.1 has (jinja2.defaults.DEFAULT_FILTERS; tojson as transformers replaces it), one entry
// each; an alias points at the same function.
const FilterTable& filters() {
  static const FilterTable table = {
      {"abs", filter_abs},
      {"capitalize", filter_capitalize},
      {"count", filter_length},
      {"d", filter_default},
      {"default", filter_default},
      {"dictsort", filter_dictsort},
      {"e", filter_escape},
      {"escape", filter_escape},
      {"first", filter_first},
      {"float", filter_float},
      {"forceescape", filter_escape},
      {"indent", filter_indent},
      {"int", filter_int},
      {"items", filter_items},
      {"join", filter_join},
      {"last", filter_last},
      {"length", filter_length},
      {"list", filter_list},
      {"lower", filter_lower},
      {"map", filter_map},
      {"max", filter_max},
      {"min", filter_min},
      {"reject", filter_reject},
      {"rejectattr", filter_rejectattr},
      {"replace", filter_replace},
      {"reverse", filter_reverse},
      {"round", filter_round},
      {"safe", filter_safe},
      {"select", filter_select},
      {"selectattr", filter_selectattr},
      {"sort", filter_sort},
      {"string", filter_string},
      {"sum", filter_sum},
      {"title", filter_title},
      {"tojson", filter_tojson},
      {"trim", filter_trim},
      {"unique", filter_unique},
      {"upper", filter_upper},
      {"wordcount", filter_wordcount},
      // Known, not implemented: an error if a render reaches one.
      {"attr", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("attr", a.pos); }},
      {"batch", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("batch", a.pos); }},
      {"center", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("center", a.pos); }},
      {"filesizeformat", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("filesizeformat", a.pos); }},
      {"format", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("format", a.pos); }},
      {"groupby", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("groupby", a.pos); }},
      {"pprint", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("pprint", a.pos); }},
      {"random", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("random", a.pos); }},
      {"slice", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("slice", a.pos); }},
      {"striptags", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("striptags", a.pos); }},
      {"truncate", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("truncate", a.pos); }},
      {"urlencode", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("urlencode", a.pos); }},
      {"urlize", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("urlize", a.pos); }},
      {"wordwrap", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("wordwrap", a.pos); }},
      {"xmlattr", [](Context&, const Value&, Args& a) -> Value { unsupported_filter("xmlattr", a.pos); }},
  };
  return table;
}

// ---- Tests ------------------------------------------------------------------------------------------------------

// The argument a comparison test needs (`x is divisibleby 3`, `x is eq(y)`).
const Value& test_arg(const char* name, const Args& args) {
  const Value* a0 = args.get(0, "");
  if (!a0) fail(Kind::kRender, std::string("test '") + name + "' needs an argument", args.pos);
  return *a0;
}

[[noreturn]] void unsupported_test(const char* name, Pos pos) {
  fail(Kind::kRender, std::string("the '") + name + "' test is not supported in chat templates", pos);
}

bool test_defined(Context&, const Value& v, Args&) { return !v.is_undefined(); }
bool test_undefined(Context&, const Value& v, Args&) { return v.is_undefined(); }
bool test_none(Context&, const Value& v, Args&) { return v.type == Type::kNone; }
bool test_string(Context&, const Value& v, Args&) { return v.type == Type::kString; }
bool test_mapping(Context&, const Value& v, Args&) { return v.type == Type::kDict; }
// iterable and sequence: strings, lists and dicts alike.
bool test_iterable(Context&, const Value& v, Args&) {
  return v.type == Type::kString || v.type == Type::kList || v.type == Type::kDict;
}
bool test_number(Context&, const Value& v, Args&) { return v.is_number(); }
bool test_integer(Context&, const Value& v, Args&) { return v.type == Type::kInt; }
bool test_float(Context&, const Value& v, Args&) { return v.type == Type::kFloat; }
bool test_boolean(Context&, const Value& v, Args&) { return v.type == Type::kBool; }
bool test_true(Context&, const Value& v, Args&) { return v.type == Type::kBool && v.boolean; }
bool test_false(Context&, const Value& v, Args&) { return v.type == Type::kBool && !v.boolean; }
bool test_callable(Context&, const Value& v, Args&) { return v.type == Type::kCallable; }
bool test_lower(Context&, const Value& v, Args&) { return v.type == Type::kString && ascii_lower(v.text) == v.text; }
bool test_upper(Context&, const Value& v, Args&) { return v.type == Type::kString && ascii_upper(v.text) == v.text; }

bool test_odd(Context&, const Value& v, Args& args) {
  if (v.type != Type::kInt) fail(Kind::kRender, "'odd' test needs an integer", args.pos);
  return v.integer % 2 != 0;
}
bool test_even(Context&, const Value& v, Args& args) {
  if (v.type != Type::kInt) fail(Kind::kRender, "'even' test needs an integer", args.pos);
  return v.integer % 2 == 0;
}

bool test_divisibleby(Context&, const Value& v, Args& args) {
  const Value& n = test_arg("divisibleby", args);
  return n.as_int() != 0 && v.as_int() % n.as_int() == 0;
}
bool test_in(Context&, const Value& v, Args& args) { return contains(test_arg("in", args), v, args.pos); }

// The comparison tests, registered once under each of their names (eq, equalto, ==, ...) so that a missing
// argument is reported under the name the template wrote.
bool equal_to(const char* name, const Value& v, const Args& args) { return equal(v, test_arg(name, args)); }
int compared_to(const char* name, const Value& v, const Args& args) {
  return compare(v, test_arg(name, args), args.pos);
}

bool test_sameas(Context&, const Value& v, Args& args) {
  const Value& other = test_arg("sameas", args);
  if (v.type != other.type) return false;
  if (v.type == Type::kNone || v.type == Type::kBool) return equal(v, other);
  return v.dict && v.dict == other.dict;
}

// Every test jinja2 3.1 has (jinja2.defaults.DEFAULT_TESTS), one entry each; an alias points at the same function.
const TestTable& tests() {
  static const TestTable table = {
      {"boolean", test_boolean},
      {"callable", test_callable},
      {"defined", test_defined},
      {"divisibleby", test_divisibleby},
      {"even", test_even},
      {"false", test_false},
      {"float", test_float},
      {"in", test_in},
      {"integer", test_integer},
      {"iterable", test_iterable},
      {"lower", test_lower},
      {"mapping", test_mapping},
      {"none", test_none},
      {"number", test_number},
      {"odd", test_odd},
      {"sameas", test_sameas},
      {"sequence", test_iterable},
      {"string", test_string},
      {"true", test_true},
      {"undefined", test_undefined},
      {"upper", test_upper},
      {"eq", [](Context&, const Value& v, Args& a) { return equal_to("eq", v, a); }},
      {"equalto", [](Context&, const Value& v, Args& a) { return equal_to("equalto", v, a); }},
      {"==", [](Context&, const Value& v, Args& a) { return equal_to("==", v, a); }},
      {"ne", [](Context&, const Value& v, Args& a) { return !equal_to("ne", v, a); }},
      {"!=", [](Context&, const Value& v, Args& a) { return !equal_to("!=", v, a); }},
      {"lt", [](Context&, const Value& v, Args& a) { return compared_to("lt", v, a) < 0; }},
      {"lessthan", [](Context&, const Value& v, Args& a) { return compared_to("lessthan", v, a) < 0; }},
      {"<", [](Context&, const Value& v, Args& a) { return compared_to("<", v, a) < 0; }},
      {"le", [](Context&, const Value& v, Args& a) { return compared_to("le", v, a) <= 0; }},
      {"<=", [](Context&, const Value& v, Args& a) { return compared_to("<=", v, a) <= 0; }},
      {"gt", [](Context&, const Value& v, Args& a) { return compared_to("gt", v, a) > 0; }},
      {"greaterthan", [](Context&, const Value& v, Args& a) { return compared_to("greaterthan", v, a) > 0; }},
      {">", [](Context&, const Value& v, Args& a) { return compared_to(">", v, a) > 0; }},
      {"ge", [](Context&, const Value& v, Args& a) { return compared_to("ge", v, a) >= 0; }},
      {">=", [](Context&, const Value& v, Args& a) { return compared_to(">=", v, a) >= 0; }},
      // Known, not implemented: an error if a render reaches one.
      {"escaped", [](Context&, const Value&, Args& a) -> bool { unsupported_test("escaped", a.pos); }},
      {"filter", [](Context&, const Value&, Args& a) -> bool { unsupported_test("filter", a.pos); }},
      {"test", [](Context&, const Value&, Args& a) -> bool { unsupported_test("test", a.pos); }},
  };
  return table;
}

// ---- Globals: what transformers adds to jinja2's environment ----------------------------------------------------

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

FilterFn find_filter(std::string_view name) {
  const auto& table = filters();
  auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

TestFn find_test(std::string_view name) {
  const auto& table = tests();
  auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

Value apply_filter(Context& ctx, const std::string& name, const Value& value, Args& args) {
  FilterFn filter = find_filter(name);
  if (!filter) fail(Kind::kRender, "no filter named '" + name + "'", args.pos);
  return filter(ctx, value, args);
}

bool apply_test(Context& ctx, const std::string& name, const Value& value, Args& args) {
  TestFn test = find_test(name);
  if (!test) fail(Kind::kRender, "no test named '" + name + "'", args.pos);
  return test(ctx, value, args);
}

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

}  // namespace trainer::chat::jinja
