// What the Jinja interpreter's files share (private to src/chat): values and the operations on them, tokens, the
// tree the parser builds and the evaluator walks, the render context, and the lookups of the builtin tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/jinja.h"

namespace trainer::chat::jinja {

using Kind = TemplateError::Kind;

struct Pos {
  int line = 1;
  int column = 1;
};

[[noreturn]] void fail(Kind kind, const std::string& message, Pos pos, std::string hint = {});

// ---- UTF-8: Python strings index code points, so length, indexing and slicing do too (jinja_value.cpp) ---------

std::vector<std::size_t> code_point_offsets(const std::string& s);
std::size_t code_point_count(const std::string& s);
// (code point, byte offset) of each character; an invalid byte reads as itself, so nothing is lost.
std::vector<std::pair<std::uint32_t, std::size_t>> code_points(const std::string& s);
void append_utf8(std::string& out, std::uint32_t cp);
// Python's str.isspace(): what strip(), trim and split() remove, NBSP and ideographic space included.
bool is_unicode_space(std::uint32_t cp);
inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// ---- Values (jinja_value.cpp) -----------------------------------------------------------------------------------

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

// Defined here, not in jinja_value.cpp, so that the evaluator and the builtins, which call them for nearly every
// value, can inline them.
inline const Value* Args::get(std::size_t index, const char* name) const {
  if (index < positional.size()) return &positional[index];
  for (const auto& [key, value] : named) {
    if (key == name) return &value;
  }
  return nullptr;
}

inline bool truthy(const Value& v) {
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

const char* type_name(const Value& v);
// Python's repr of a float: the shortest digits that read back to the same double.
std::string float_repr(double d);
// Python's str(): what {{ value }} prints.
std::string to_str(const Value& v);
std::string repr(const Value& v);

// ---- JSON in and out: json.dumps(ensure_ascii=False) as transformers' tojson filter calls it (jinja_value.cpp) --

Value from_json(const nlohmann::ordered_json& j);

struct JsonStyle {
  int indent = -1;  // -1: none (one line)
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

void to_json(const Value& v, const JsonStyle& style, int depth, std::string& out, Pos pos);

// ---- Operations shared by expressions, filters and tests (jinja_value.cpp) -------------------------------------

bool equal(const Value& a, const Value& b);
// Python ordering: numbers with numbers, strings with strings, lists element-wise.
int compare(const Value& a, const Value& b, Pos pos);
// The items a for loop or a filter iterates: list items, dict keys, string characters.
List iterate(const Value& v, Pos pos);
std::int64_t length(const Value& v, Pos pos);
bool contains(const Value& container, const Value& item, Pos pos);
// Attribute or item access, as jinja2's sandbox resolves obj.name and obj[key] for plain data.
Value get_item(const Value& obj, const Value& key, Pos pos);
Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v, Pos pos);
Value arithmetic(const std::string& op, const Value& a, const Value& b, Pos pos);

// ---- Lexer (jinja_lexer.cpp) ------------------------------------------------------------------------------------

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  Pos pos;
};

// The template's tokens, ending with kEof; throws TemplateError (kSyntax) for an unclosed tag, string or comment.
std::vector<Token> lex(std::string_view source);

// ---- The render context (jinja_eval.cpp) ------------------------------------------------------------------------

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
  // raise_exception, strftime_now, namespace, dict, range (jinja_builtins.cpp); undefined for any other name.
  static Value global(const std::string& name);
  void assign(const std::string& name, Value value) { frames.back().vars[name] = std::move(value); }
  std::string capture(const Body& body);
};

void exec_body(const Body& body, Context& ctx);

// ---- Builtins: name -> function tables (jinja_builtins.cpp, jinja_methods.cpp) ---------------------------------

using FilterFn = Value (*)(Context& ctx, const Value& value, Args& args);
using TestFn = bool (*)(Context& ctx, const Value& value, Args& args);

// The function of a filter or test by name, or null when there is none. The parser resolves each {{ x | f }} and
// `x is t` once, so an unknown name is a syntax error with its line and column.
FilterFn find_filter(std::string_view name);
TestFn find_test(std::string_view name);
// By a name only known while rendering (map('upper'), select('odd')): a render error when there is none.
Value apply_filter(Context& ctx, const std::string& name, const Value& value, Args& args);
bool apply_test(Context& ctx, const std::string& name, const Value& value, Args& args);
// obj.name(args) (jinja_methods.cpp): a table per receiver type (str, dict, list). Which table depends on obj's type,
// known only while rendering, so an unknown method is a render error, not a syntax error.
Value call_method(Context& ctx, const Value& obj, const std::string& name, Args& args);

// Python's str methods on the interpreter's strings (jinja_methods.cpp), shared by the methods and the filters.
std::string ascii_upper(std::string s);
std::string ascii_lower(std::string s);
// Python's str.title on ASCII letters: a letter after a letter is lowered, any other starts a word.
std::string title_case(std::string s);
std::string capitalize(std::string s);
// str.strip(chars), lstrip and rstrip: chars (a string) or, when it is missing or not a string, Unicode whitespace.
std::string strip_chars(const std::string& s, const Value* chars, bool left, bool right);
// str.replace(from, to, count), count < 0 for all.
std::string replace_all(const std::string& s, const std::string& from, const std::string& to, std::int64_t count);
// str.split(sep, maxsplit): by whitespace runs when sep is missing or none, maxsplit < 0 for no limit.
List split(const std::string& s, const Value* sep, std::int64_t maxsplit);
// An integer argument, or fallback when it is missing or not an integer.
std::int64_t int_arg(const Value* v, std::int64_t fallback);

// ---- The tree: built by the parser (jinja_parser.cpp), evaluated by jinja_eval.cpp -----------------------------

struct Literal : Expr {
  Value value;
  Value eval(Context& ctx) const override;
};

struct Name : Expr {
  std::string name;
  Value eval(Context& ctx) const override;
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Context& ctx) const override;
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Context& ctx) const override;
};

struct GetAttr : Expr {
  ExprPtr object;
  std::string name;
  Value eval(Context& ctx) const override;
};

struct GetItem : Expr {
  ExprPtr object;
  ExprPtr key;
  Value eval(Context& ctx) const override;
};

struct SliceExpr : Expr {
  ExprPtr object, start, stop, step;
  Value eval(Context& ctx) const override;
};

struct BinOp : Expr {
  enum class Code { kAnd, kOr, kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn, kAdd, kArithmetic };
  std::string op;
  Code code = Code::kArithmetic;  // resolved once from op, so evaluation does not compare strings
  ExprPtr left, right;
  void resolve();
  Value eval(Context& ctx) const override;
};

struct UnaryOp : Expr {
  std::string op;
  ExprPtr operand;
  Value eval(Context& ctx) const override;
};

struct CondExpr : Expr {
  ExprPtr condition, then, otherwise;
  Value eval(Context& ctx) const override;
};

struct CallArgs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> named;
  Args eval(Context& ctx, Pos pos) const;
};

struct Call : Expr {
  ExprPtr callee;
  CallArgs args;
  Value eval(Context& ctx) const override;
};

struct FilterExpr : Expr {
  ExprPtr value;  // null inside a {% filter %} block, where the block's text is the value
  std::string name;
  FilterFn filter = nullptr;  // find_filter(name), never null once parsed
  CallArgs args;
  Value apply(Context& ctx, const Value& v) const;
  Value eval(Context& ctx) const override;
};

struct TestExpr : Expr {
  ExprPtr value;
  std::string name;
  TestFn test = nullptr;  // find_test(name), never null once parsed
  CallArgs args;
  bool negated = false;
  Value eval(Context& ctx) const override;
};

struct TextStmt : Stmt {
  std::string text;
  void exec(Context& ctx) const override;
};

struct OutputStmt : Stmt {
  ExprPtr expr;
  void exec(Context& ctx) const override;
};

struct IfStmt : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void exec(Context& ctx) const override;
};

struct ForStmt : Stmt {
  std::vector<std::string> targets;
  ExprPtr iterable;
  ExprPtr condition;  // for x in xs if cond
  Body body, otherwise;
  void exec(Context& ctx) const override;
};

struct SetStmt : Stmt {
  std::vector<std::string> targets;
  std::string attribute;  // {% set ns.attr = ... %}: targets[0] is the namespace
  ExprPtr value;
  Body body;  // block set
  std::vector<std::unique_ptr<FilterExpr>> filters;
  void exec(Context& ctx) const override;
};

struct FilterBlock : Stmt {
  std::vector<std::unique_ptr<FilterExpr>> filters;
  Body body;
  void exec(Context& ctx) const override;
};

struct MacroStmt : Stmt {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // aligned with params; null where there is none
  Body body;
  void exec(Context& ctx) const override;
  Value call(Context& ctx, Args& args) const;
};

struct GenerationStmt : Stmt {
  Body body;
  void exec(Context& ctx) const override;
};

struct BreakStmt : Stmt {
  void exec(Context& ctx) const override;
};
struct ContinueStmt : Stmt {
  void exec(Context& ctx) const override;
};

// ---- Parser (jinja_parser.cpp) ----------------------------------------------------------------------------------

// The template's statements; throws TemplateError (kSyntax) with the line and column of the first error.
Body parse(std::vector<Token> tokens);

}  // namespace trainer::chat::jinja
