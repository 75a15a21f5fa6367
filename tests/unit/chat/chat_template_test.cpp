// Unit tests of the chat template interpreter and chat rendering (src/chat); byte-for-byte parity with
// transformers is tests/parity/test_chat_templates.py's job.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "chat/chat_template.h"
#include "chat/training_templates.h"

namespace trainer::chat {
namespace {

using nlohmann::ordered_json;

const char* kChatml =
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m.content + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

ordered_json conversation() {
  return ordered_json::parse(R"([{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "wörld"},
                                 {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}])");
}

std::string text_of(const ChatRendering& r, const Span& s) { return r.text.substr(s.first, s.second - s.first); }

TEST(ChatTemplate, GenerationSpansAreByteRangesOfTheAssistantText) {
  auto r = render_chat(kChatml, conversation(), {});
  ASSERT_EQ(r.generation_spans.size(), 2u);
  EXPECT_EQ(text_of(r, r.generation_spans[0]), "wörld<|im_end|>");
  EXPECT_EQ(text_of(r, r.generation_spans[1]), "ok<|im_end|>");
}

TEST(ChatTemplate, PrefixSpansAgreeWithGenerationSpans) {
  Template t(kChatml);
  ChatOptions options;
  auto spans = assistant_spans_by_prefix(t, conversation(), options);
  auto r = render_chat(t, conversation(), options);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(text_of(r, spans[0]), "wörld<|im_end|>\n");  // the prefix method also takes the newline after the turn
  EXPECT_EQ(spans[1].first, r.generation_spans[1].first);
}

// What assistant_spans_by_prefix computes, rendered the long way: for each assistant message, the conversation before
// it with the generation prompt, and the conversation through it without, each rendered on its own.
std::vector<Span> spans_rendering_every_prefix(const Template& t, const ordered_json& messages,
                                               const ChatOptions& options) {
  const std::string full = render_chat(t, messages, options).text;
  std::vector<Span> spans;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    if (messages[i]["role"] != "assistant") continue;
    ChatOptions with_prompt = options, without = options;
    with_prompt.add_generation_prompt = true;
    without.add_generation_prompt = false;
    const std::string prompt =
        render_chat(t, ordered_json(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i)), with_prompt)
            .text;
    const std::string turn =
        render_chat(t, ordered_json(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i + 1)), without)
            .text;
    EXPECT_EQ(turn.compare(0, prompt.size(), prompt), 0);
    std::size_t end = prompt.size();
    while (end < turn.size() && end < full.size() && turn[end] == full[end]) ++end;
    while (end > prompt.size() && end < full.size() && (static_cast<unsigned char>(full[end]) & 0xC0) == 0x80) --end;
    spans.emplace_back(prompt.size(), end);
  }
  return spans;
}

TEST(ChatTemplate, PrefixSpansEqualRenderingEveryPrefixOnItsOwn) {
  // ChatML; Phi-3's shape (eos_token after the last turn unless a generation prompt follows); Llama 2's (content
  // stripped, the answer after " " and closed by eos_token).
  const std::vector<std::string> templates = {
      kChatml,
      "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}",
      "{% for m in messages %}{% if m.role == 'user' %}{{ bos_token + '[INST] ' + m.content | trim + ' [/INST]' }}"
      "{% else %}{{ ' ' + m.content | trim + ' ' + eos_token }}{% endif %}{% endfor %}",
  };
  const std::vector<ordered_json> conversations = {
      conversation(),
      ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}])"),
      ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"}])"),
      ordered_json::parse(R"([{"role": "user", "content": "日本"}, {"role": "assistant", "content": "語"},
                              {"role": "user", "content": "ü"}, {"role": "assistant", "content": ""},
                              {"role": "user", "content": "x"}, {"role": "assistant", "content": "🍲"}])"),
  };
  int compared = 0;
  for (const std::string& source : templates) {
    const Template t(source);
    for (const ordered_json& messages : conversations) {
      for (const bool add_generation_prompt : {false, true}) {
        ChatOptions options;
        options.add_generation_prompt = add_generation_prompt;
        options.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
        const auto expected = spans_rendering_every_prefix(t, messages, options);
        EXPECT_EQ(assistant_spans_by_prefix(t, messages, options), expected)
            << source << "\n" << messages.dump() << " add_generation_prompt=" << add_generation_prompt;
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 24);
}

TEST(ChatTemplate, PrefixSpansFailWithAHintWhenTheTemplateRewritesEarlierTurns) {
  Template t("{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.content }};{% endfor %}");
  try {
    assistant_spans_by_prefix(t, conversation(), {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("assistant message 1"), std::string::npos) << e.what();
    EXPECT_NE(e.hint().find("data.train_on=all"), std::string::npos);
    EXPECT_NE(e.hint().find(training_template_families()), std::string::npos) << e.hint();
    EXPECT_EQ(e.exit_code(), kExitData);
  }
}

// A Qwen3-like template: the last assistant turn writes its reasoning in <think></think>, earlier turns drop it, so
// rendering prefix by prefix cannot split it. `marked` puts {% generation %} where TRL's training versions put it
// (after the header, through the end-of-turn marker and its newline).
std::string reasoning_template(bool marked) {
  const std::string open = marked ? "{% generation %}" : "", close = marked ? "{% endgeneration %}" : "";
  return "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}" + open +
         "{% if loop.last %}{{ '<think>' + (m.reasoning_content or '') + '</think>' }}{% endif %}"
         "{{ m.content + '<|im_end|>\\n' }}" + close +
         "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
}

TEST(ChatTemplate, ProbeSpansEqualTheMarksOfATemplateThatRewritesEarlierTurns) {
  ordered_json messages = conversation();
  messages[3]["reasoning_content"] = "why";
  const Template original(reasoning_template(false)), marked(reasoning_template(true));
  const ChatRendering r = render_chat(original, messages, {});
  EXPECT_THROW(assistant_spans_by_prefix(original, messages, {}), Error);
  const auto spans = assistant_spans_by_probe(original, messages, {}, r.text);
  const ChatRendering expected = render_chat(marked, messages, {});
  ASSERT_EQ(expected.text, r.text);
  EXPECT_EQ(spans, expected.generation_spans);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(text_of(r, spans[0]), "w\xc3\xb6rld<|im_end|>\n");
  EXPECT_EQ(text_of(r, spans[1]), "<think>why</think>ok<|im_end|>\n");  // the reasoning of the last turn is trained
  // assistant_spans tries prefix by prefix first, and says which method found the spans.
  const AssistantSpans found = assistant_spans(original, messages, {}, r.text);
  EXPECT_EQ(found.spans, spans);
  EXPECT_STREQ(span_method_name(found.method), "probe");
  const Template chatml(kChatml);
  const AssistantSpans by_prefix = assistant_spans(chatml, conversation(), {}, render_chat(chatml, conversation(), {}).text);
  EXPECT_STREQ(span_method_name(by_prefix.method), "prefix");
  EXPECT_EQ(by_prefix.spans, assistant_spans_by_prefix(chatml, conversation(), {}));
}

TEST(ChatTemplate, ProbeSpansEqualPrefixSpansWhereBothApply) {
  // ChatML; Phi-3's shape (eos_token after the last turn unless a generation prompt follows); Llama 2's (content
  // stripped, the answer after " " and closed by eos_token).
  ChatOptions options;
  options.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  for (const std::string& source :
       {std::string(kChatml),
        std::string("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"),
        std::string("{% for m in messages %}{% if m.role == 'user' %}{{ bos_token + '[INST] ' + m.content | trim + "
                    "' [/INST]' }}{% else %}{{ ' ' + m.content | trim + ' ' + eos_token }}{% endif %}{% endfor %}")}) {
    const Template t(source);
    const std::string full = render_chat(t, conversation(), options).text;
    EXPECT_EQ(assistant_spans_by_probe(t, conversation(), options, full), assistant_spans_by_prefix(t, conversation(), options))
        << source;
  }
}

TEST(ChatTemplate, ProbeSpansRefuseTemplatesTheProbeCannotTrust) {
  // Each rewrites earlier turns ([LAST]), so prefix by prefix fails too, and then:
  const std::vector<std::pair<std::string, std::string>> cases = {
      // renders the content twice
      {"{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.content }}/{{ m.content }};{% endfor %}",
       "differ elsewhere"},
      // changes the content in a way the probe sees
      {"{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.content | replace('1', 'one') }};{% endfor %}",
       "differ elsewhere"},
      // renders a later part by the content, in a way two probes of one length do not show
      {"{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.content }};{% endfor %}"
       "{% if messages | length > 1 %}{{ messages[1].content | length }}{% endif %}",
       "after the message's place"},
      // renders an earlier part by the content
      {"{% if messages | length > 1 %}{{ messages[1].content | length }}{% endif %}"
       "{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.content }};{% endfor %}",
       "before the message's place"},
  };
  for (const auto& [source, why] : cases) {
    const Template t(source);
    const std::string full = render_chat(t, conversation(), {}).text;
    try {
      assistant_spans(t, conversation(), {}, full);
      ADD_FAILURE() << "expected an error: " << source;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("cannot find the span of assistant message 1"), std::string::npos) << what;
      EXPECT_NE(what.find("nor by probing (assistant message 1): "), std::string::npos) << what;
      EXPECT_NE(what.find(why), std::string::npos) << source << "\n" << what;
      EXPECT_NE(e.hint().find("data.train_on=all"), std::string::npos) << e.hint();
      EXPECT_EQ(e.exit_code(), kExitData);
    }
  }
}

// Each training version parses, marks both assistant turns of a two-turn conversation (bos_token for DeepSeek's,
// eos_token for Mistral's; the text and its end-of-turn marker for the families TRL has no version of), and is found
// by its original's digest only. Parity with TRL is tests/parity/test_chat_training_templates.py's.
TEST(ChatTemplate, TrainingTemplatesMarkEveryAssistantTurn) {
  EXPECT_EQ(training_template_for("a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8")->family,
            "Qwen3");
  EXPECT_EQ(training_template_for(std::string(64, '0')), nullptr);
  EXPECT_EQ(training_template_families(),
            "Qwen3, Qwen3-Instruct-2507, DeepSeek-R1-Distill, Gemma 3, Gemma 4, gpt-oss, Mistral v3");
  ChatOptions options;
  options.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  for (const std::string& digest : {"a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
                                    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
                                    "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f",
                                    "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4",
                                    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
                                    // Gemma 4 at b446025, 6b7e72c, 905e84b and 8995379; Mistral v3
                                    "781d10940fbc44be40064b5d43a056fc486c84ceaa55538226368b57314132bf",
                                    "33204f1acb5bd0002713e16a593847f24ceeafe711ed88bda2a352dc996a3373",
                                    "2f1b4d75d067bae3fe44e676721c7f077d243bc007156cb9c2f8b5836613d082",
                                    "0a2c8073c878ab1da004bee933a998606537bbb62016310352c7285c3f01c5b5",
                                    "e16746b40344d6c5b5265988e0328a0bf7277be86f1c335156eae07e29c82826"}) {
    const TrainingTemplate* found = training_template_for(digest);
    ASSERT_NE(found, nullptr) << digest;
    const ChatRendering r = render_chat(found->text, conversation(), options);
    ASSERT_EQ(r.generation_spans.size(), 2u) << found->family << "\n" << r.text;
    EXPECT_NE(text_of(r, r.generation_spans[0]).find("w\xc3\xb6rld"), std::string::npos) << found->family;
    EXPECT_NE(text_of(r, r.generation_spans[1]).find("ok"), std::string::npos) << found->family;
    EXPECT_EQ(text_of(r, r.generation_spans[0]).find("again"), std::string::npos) << found->family;
    if (found->family == "Gemma 4") EXPECT_EQ(text_of(r, r.generation_spans[1]), "ok<turn|>\n");
    if (found->family == "Mistral v3") EXPECT_EQ(text_of(r, r.generation_spans[1]), " ok</s>");
  }
}

TEST(ChatTemplate, SyntaxErrorNamesLineAndColumn) {
  try {
    Template t("a\n{% if x %}\n  {{ 1 + }}\n{% endif %}");
    FAIL() << "expected a syntax error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::kSyntax);
    EXPECT_EQ(e.line(), 3);
    EXPECT_EQ(e.column(), 10);
    EXPECT_NE(std::string(e.what()).find("line 3, column 10"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, RaiseExceptionCarriesTheTemplatesMessage) {
  try {
    render_chat("{{ raise_exception('roles must alternate') }}", ordered_json::array(), {});
    FAIL() << "expected an error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::kRaised);
    EXPECT_EQ(e.template_message(), "roles must alternate");
  }
}

TEST(ChatTemplate, LimitsStopRunawayTemplates) {
  ChatOptions options;
  options.limits.max_steps = 10000;
  try {
    render_chat("{% for i in range(100000) %}{% endfor %}", ordered_json::array(), options);
    FAIL() << "expected the step limit";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.kind(), TemplateError::Kind::kLimit);
  }
  options = {};
  options.limits.max_output_bytes = 1000;
  EXPECT_THROW(render_chat("{% for i in range(1000) %}xx{% endfor %}", ordered_json::array(), options), TemplateError);
}

TEST(ChatTemplate, VariablesFollowTransformersPrecedence) {
  ChatOptions options;
  options.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  options.extra = {{"eos_token", "<override>"}, {"date_string", "1 Jan 2026"}};
  options.tools = ordered_json::array({{{"name", "f"}}});
  options.add_generation_prompt = true;
  auto r = render_chat("{{ bos_token }}{{ eos_token }}{{ date_string }}{{ tools | length }}{{ add_generation_prompt }}"
                       "{{ documents is none }}",
                       ordered_json::array(), options);
  EXPECT_EQ(r.text, "<s><override>1 Jan 20261TrueTrue");
}

TEST(ChatTemplate, OneTemplateRendersOnManyThreads) {
  Template t(kChatml);
  const std::string expected = render_chat(t, conversation(), {}).text;
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k) ok[static_cast<std::size_t>(i)] += render_chat(t, conversation(), {}).text == expected;
    });
  }
  for (auto& th : threads) th.join();
  for (int n : ok) EXPECT_EQ(n, 50);
}

class ModelDirectory : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("trainer_chat_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  std::filesystem::path dir_;
};

TEST_F(ModelDirectory, ReadsTheTemplateAndSpecialTokensFromTokenizerConfig) {
  write("tokenizer_config.json", R"({"chat_template": "{{ bos_token }}x", "bos_token": {"content": "<s>",
      "lstrip": false}, "eos_token": "</s>", "pad_token": null, "model_max_length": 10})");
  auto found = load_chat_template(dir_, false);
  EXPECT_EQ(found.source, "{{ bos_token }}x");
  EXPECT_EQ(found.special_tokens, ordered_json({{"bos_token", "<s>"}, {"eos_token", "</s>"}}));
}

TEST_F(ModelDirectory, PicksToolUseWhenToolsAreGivenAndDefaultOtherwise) {
  write("tokenizer_config.json", R"({"chat_template": [{"name": "default", "template": "D"},
      {"name": "tool_use", "template": "T"}]})");
  EXPECT_EQ(load_chat_template(dir_, false).source, "D");
  EXPECT_EQ(load_chat_template(dir_, true).source, "T");
}

TEST_F(ModelDirectory, AJinjaFileTakesPriority) {
  write("tokenizer_config.json", R"({"chat_template": "from config"})");
  write("chat_template.jinja", "from file");
  auto found = load_chat_template(dir_, false);
  EXPECT_EQ(found.source, "from file");
  EXPECT_NE(found.origin.find("chat_template.jinja"), std::string::npos);
}

TEST_F(ModelDirectory, NoTemplateIsADataErrorWithAHint) {
  write("tokenizer_config.json", R"({"eos_token": "</s>"})");
  try {
    load_chat_template(dir_, false);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), kExitData);
    EXPECT_NE(std::string(e.what()).find(dir_.string()), std::string::npos);
    EXPECT_NE(e.hint().find("data.chat_template"), std::string::npos);
  }
}

}  // namespace
}  // namespace trainer::chat
