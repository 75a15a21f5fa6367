// The Jinja parser: tokens to the tree of statements and expressions, in jinja2's grammar and operator precedence,
// with every syntax error (an unknown filter or test included) reported at its line and column.
#include <algorithm>
#include <cstdlib>

#include "chat/jinja_internal.h"

namespace trainer::chat::jinja {

void BinOp::resolve() {
  static const std::pair<const char*, Code> kCodes[] = {
      {"and", Code::kAnd}, {"or", Code::kOr}, {"==", Code::kEq}, {"!=", Code::kNe}, {"<", Code::kLt},
      {"<=", Code::kLe},   {">", Code::kGt},  {">=", Code::kGe}, {"in", Code::kIn}, {"notin", Code::kNotIn}, {"+", Code::kAdd}};
  for (const auto& [name, c] : kCodes) {
    if (op == name) code = c;
  }
}

namespace {

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

  // Filters and tests are looked up here, once, so that a misspelled name stops the template when it is loaded,
  // not on the one record whose conversation reaches that branch. Every name jinja2 knows is in the tables, those
  // we do not implement included (an error only if a render reaches them), so only a name jinja2 lacks too is
  // refused. jinja2 itself defers such a name inside an {% if %} or an inline if to the render; we refuse it there
  // as well: the branch would fail in transformers too, on whichever record takes it.
  std::unique_ptr<FilterExpr> parse_filter_call(ExprPtr value) {
    auto f = std::make_unique<FilterExpr>();
    f->pos = peek().pos;
    f->name = expect_name();
    while (is_op(".")) {  // dotted filter names
      next();
      f->name += "." + expect_name();
    }
    f->filter = find_filter(f->name);
    if (!f->filter) {
      fail(Kind::kSyntax, "no filter named '" + f->name + "'", f->pos,
           "is the name misspelled? chat templates have jinja2's built-in filters");
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
        const Pos name_pos = peek().pos;
        t->name = expect_name();
        t->test = find_test(t->name);
        if (!t->test) {
          fail(Kind::kSyntax, "no test named '" + t->name + "'", name_pos,
               "is the name misspelled? chat templates have jinja2's built-in tests");
        }
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

}  // namespace

Body parse(std::vector<Token> tokens) { return Parser(std::move(tokens)).parse_template(); }

}  // namespace trainer::chat::jinja
