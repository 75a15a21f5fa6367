// Unit tests of the Jinja interpreter's builtin tables (src/chat/jinja_builtins.cpp, jinja_methods.cpp): filters and
// tests resolved by name when the template is parsed, so an unknown one is a syntax error at its line and column.
#include <gtest/gtest.h>

#include <string>

#include "chat/jinja.h"
#include "chat/jinja_internal.h"

namespace trainer::chat {
namespace {

using nlohmann::ordered_json;

std::string render(const std::string& source, const ordered_json& variables = ordered_json::object()) {
  return Template(source).render(variables).text;
}

// The error constructing (parsing) the template throws; fails the test when there is none.
TemplateError parse_error(const std::string& source) {
  try {
    Template t(source);
  } catch (const TemplateError& e) {
    return e;
  }
  ADD_FAILURE() << "expected a syntax error from: " << source;
  return TemplateError(TemplateError::Kind::kRender, "none", 0, 0);
}

TEST(JinjaBuiltins, UnknownFilterIsASyntaxErrorAtItsLineAndColumn) {
  const TemplateError e = parse_error("a\n{{ x | nosuchfilter }}");
  EXPECT_EQ(e.kind(), TemplateError::Kind::kSyntax);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 8);
  const std::string what = e.what();
  EXPECT_NE(what.find("syntax error at line 2, column 8"), std::string::npos) << what;
  EXPECT_NE(what.find("no filter named 'nosuchfilter'"), std::string::npos) << what;
  EXPECT_FALSE(e.hint().empty());
}

TEST(JinjaBuiltins, UnknownFilterIsFoundWithoutRenderingItsBranch) {
  // Parsing alone finds it: in a branch no render takes, after a known filter, in a filter block, in a block set.
  const TemplateError in_branch = parse_error("{% if false %}\n  {{ x | trim | nosuchfilter(1) }}\n{% endif %}");
  EXPECT_EQ(in_branch.kind(), TemplateError::Kind::kSyntax);
  EXPECT_EQ(in_branch.line(), 2);
  EXPECT_EQ(in_branch.column(), 17);
  const TemplateError block = parse_error("{% filter upper | nosuchfilter %}x{% endfilter %}");
  EXPECT_EQ(block.kind(), TemplateError::Kind::kSyntax);
  EXPECT_EQ(block.column(), 19);
  const TemplateError set_block = parse_error("{% set s | nosuchfilter %}x{% endset %}");
  EXPECT_EQ(set_block.kind(), TemplateError::Kind::kSyntax);
  EXPECT_EQ(set_block.column(), 12);
}

TEST(JinjaBuiltins, UnknownTestIsASyntaxErrorAtItsLineAndColumn) {
  const TemplateError e = parse_error("{% for m in messages %}\n{% if m is nosuchtest %}x{% endif %}{% endfor %}");
  EXPECT_EQ(e.kind(), TemplateError::Kind::kSyntax);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 12);
  const std::string what = e.what();
  EXPECT_NE(what.find("syntax error at line 2, column 12"), std::string::npos) << what;
  EXPECT_NE(what.find("no test named 'nosuchtest'"), std::string::npos) << what;
  const TemplateError negated = parse_error("{{ x is not nosuchtest(1) }}");
  EXPECT_EQ(negated.kind(), TemplateError::Kind::kSyntax);
  EXPECT_EQ(negated.column(), 13);
}

TEST(JinjaBuiltins, KnownFiltersInABranchNeverTakenParse) {
  // truncate is a jinja2 filter we do not implement: it parses, and is an error only when a render reaches it.
  const std::string source = "{% if x %}{{ x | upper | truncate(3) }}{{ x is sameas y }}{% endif %}ok";
  EXPECT_EQ(render(source), "ok");
  try {
    render(source, {{"x", "abcdef"}});
    FAIL() << "expected a render error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::kRender);
    EXPECT_EQ(e.line(), 1);
    EXPECT_EQ(e.column(), 26);
    EXPECT_NE(std::string(e.what()).find("the 'truncate' filter is not supported"), std::string::npos) << e.what();
  }
}

TEST(JinjaBuiltins, FiltersTestsAndMethodsAreFoundByName) {
  EXPECT_EQ(render("{{ 'héllo' | upper }} {{ 'A' | lower }} {{ ' t ' | trim }}"), "HéLLO a t");
  EXPECT_EQ(render("{{ data | tojson }}", {{"data", ordered_json::parse(R"({"a": [1, "é", null]})")}}),
            R"({"a": [1, "é", null]})");
  EXPECT_EQ(render("{{ x is defined }} {{ y is defined }} {{ y is not defined }}", {{"x", 1}}), "True False True");
  // Aliases share one function: e/escape, d/default, eq/equalto/==.
  EXPECT_EQ(render("{{ '<a>' | e }}{{ '<a>' | escape }} {{ nope | d('x') }}{{ nope | default('x') }}"),
            "&lt;a&gt;&lt;a&gt; xx");
  EXPECT_EQ(render("{{ 3 is eq 3 }} {{ 3 is equalto 4 }} {{ [1, 3] | select('==', 3) | list }}"), "True False [3]");
  // Filters and tests named at render time (map, select) use the same tables.
  EXPECT_EQ(render("{{ ['a', 'b'] | map('upper') | join(',') }} {{ [1, 2, 3] | select('odd') | list }}"), "A,B [1, 3]");
  // Methods, by the receiver's type.
  EXPECT_EQ(render("{{ 'a,b'.split(',') }} {{ {'k': 1}.items() | list }} {{ [1, 2, 1].count(1) }}"),
            "['a', 'b'] [('k', 1)] 2");
}

TEST(JinjaBuiltins, NamesKnownOnlyWhileRenderingAreRenderErrors) {
  // A method depends on the value's type, and map's and select's names are values: both wait for the render.
  Template method("{{ 'x'.nosuchmethod() }}");
  try {
    method.render(ordered_json::object());
    FAIL() << "expected a render error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::kRender);
    EXPECT_NE(std::string(e.what()).find("'string' object has no method 'nosuchmethod'"), std::string::npos);
  }
  Template mapped("{{ [1] | map('nosuchfilter') | list }}");
  try {
    mapped.render(ordered_json::object());
    FAIL() << "expected a render error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::kRender);
    EXPECT_NE(std::string(e.what()).find("no filter named 'nosuchfilter'"), std::string::npos);
  }
  EXPECT_EQ(render("{{ [] | map('nosuchfilter') | list }}"), "[]");  // no item, no lookup (as jinja2)
}

TEST(JinjaBuiltins, TablesAnswerByName) {
  EXPECT_TRUE(jinja::find_filter("upper") != nullptr);
  EXPECT_TRUE(jinja::find_filter("tojson") != nullptr);
  EXPECT_TRUE(jinja::find_filter("e") == jinja::find_filter("escape"));
  EXPECT_TRUE(jinja::find_filter("nosuchfilter") == nullptr);
  EXPECT_TRUE(jinja::find_filter("Upper") == nullptr);  // names are case-sensitive, as in jinja2
  EXPECT_TRUE(jinja::find_test("defined") != nullptr);
  EXPECT_TRUE(jinja::find_test("==") != nullptr);
  EXPECT_TRUE(jinja::find_test("nosuchtest") == nullptr);
}

}  // namespace
}  // namespace trainer::chat
