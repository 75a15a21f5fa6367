// The Jinja evaluator: walks the parsed tree against a render context (variables in frames, output buffers, the
// {% generation %} spans, the limits), with Python's and jinja2's semantics for each expression and statement.
#include <algorithm>
#include <iterator>

#include "chat/jinja_internal.h"

namespace trainer::chat::jinja {

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

// ---- Expressions -------------------------------------------------------------------------------------------------

Value Literal::eval(Context&) const {
  return value;
}

Value Name::eval(Context& ctx) const {
  return ctx.lookup(name);
}

Value ListExpr::eval(Context& ctx) const {
  List out;
  for (const auto& item : items) out.push_back(item->eval(ctx));
  return Value::from_list(std::move(out), tuple);
}

Value DictExpr::eval(Context& ctx) const {
  auto d = std::make_shared<Dict>();
  for (const auto& [key_expr, value_expr] : items) {
    Value key = key_expr->eval(ctx);
    if (key.type != Type::kString) fail(Kind::kRender, "dict keys must be strings in chat templates", pos);
    d->set(key.text, value_expr->eval(ctx));
  }
  return Value::from_dict(std::move(d));
}

Value GetAttr::eval(Context& ctx) const {
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

Value GetItem::eval(Context& ctx) const {
  ctx.step(pos);
  Value obj = object->eval(ctx);
  return get_item(obj, key->eval(ctx), pos);
}

Value SliceExpr::eval(Context& ctx) const {
  ctx.step(pos);
  Value obj = object->eval(ctx);
  auto value_of = [&](const ExprPtr& e) { return e ? e->eval(ctx) : Value::none(); };
  return slice(obj, value_of(start), value_of(stop), value_of(step), pos);
}

Value BinOp::eval(Context& ctx) const {
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

Value UnaryOp::eval(Context& ctx) const {
  Value v = operand->eval(ctx);
  if (op == "not") return Value::from_bool(!truthy(v));
  if (!v.is_number()) fail(Kind::kRender, std::string("bad operand type for unary ") + op + ": " + type_name(v), pos);
  if (op == "+") return v.type == Type::kBool ? Value::from_int(v.as_int()) : v;
  return v.type == Type::kFloat ? Value::from_float(-v.number) : Value::from_int(-v.as_int());
}

Value CondExpr::eval(Context& ctx) const {
  if (truthy(condition->eval(ctx))) return then->eval(ctx);
  return otherwise ? otherwise->eval(ctx) : Value::undefined("else");
}

Args CallArgs::eval(Context& ctx, Pos pos) const {
  Args args;
  args.pos = pos;
  for (const auto& e : positional) args.positional.push_back(e->eval(ctx));
  for (const auto& [name, e] : named) args.named.emplace_back(name, e->eval(ctx));
  return args;
}

Value Call::eval(Context& ctx) const {
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

Value FilterExpr::apply(Context& ctx, const Value& v) const {
  ctx.step(pos);
  Args a = args.eval(ctx, pos);
  return filter(ctx, v, a);
}

Value FilterExpr::eval(Context& ctx) const {
  return apply(ctx, value->eval(ctx));
}

Value TestExpr::eval(Context& ctx) const {
  ctx.step(pos);
  Value v = value->eval(ctx);
  Args a = args.eval(ctx, pos);
  return Value::from_bool(test(ctx, v, a) != negated);
}

// ---- Statements --------------------------------------------------------------------------------------------------

void TextStmt::exec(Context& ctx) const {
  ctx.write(text, pos);
}

void OutputStmt::exec(Context& ctx) const {
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

void IfStmt::exec(Context& ctx) const {
  ctx.step(pos);
  for (const auto& [condition, body] : branches) {
    if (truthy(condition->eval(ctx))) {
      exec_body(body, ctx);
      return;
    }
  }
  exec_body(otherwise, ctx);
}

namespace {

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

}  // namespace

void ForStmt::exec(Context& ctx) const {
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

void SetStmt::exec(Context& ctx) const {
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

void FilterBlock::exec(Context& ctx) const {
  Value v = Value::from_string(ctx.capture(body));
  for (const auto& f : filters) v = f->apply(ctx, v);
  ctx.write(to_str(v), pos);
}

void MacroStmt::exec(Context& ctx) const {
  const MacroStmt* self = this;
  ctx.assign(name, Value::from_callable(name, [self](Context& c, Args& args) { return self->call(c, args); }));
}

Value MacroStmt::call(Context& ctx, Args& args) const {
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

void GenerationStmt::exec(Context& ctx) const {
  std::string text = ctx.capture(body);
  // transformers records the span against the text rendered so far at the top level.
  std::size_t start = 0;
  for (const auto& b : ctx.buffers) start += b.size();
  ctx.spans.emplace_back(start, start + text.size());
  ctx.write(text, pos);
}

void BreakStmt::exec(Context&) const {
  throw BreakSignal{};
}

void ContinueStmt::exec(Context&) const {
  throw ContinueSignal{};
}

}  // namespace trainer::chat::jinja
