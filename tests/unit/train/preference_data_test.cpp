// Preference records as DPO reads them (src/train/tasks/preference/preference_data.h): a standard pair gets the EOS
// text on each completion and the loss on the completion only, conversational and implicit-prompt pairs go through
// the chat template, and bad records are outcomes that say what is wrong (the loader adds file:line). The ids
// themselves are compared with TRL's in tests/parity/test_dpo.py.
#include <gtest/gtest.h>

#include "data/record.h"
#include "support/paths.h"
#include "support/temp_dir.h"
#include "train/tasks/preference/preference_data.h"
#include "trainer/config.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace {

struct Fixture {
  Config config;
  std::unique_ptr<Tokenizer> tokenizer;
  PreferenceSpec spec;
  Fixture() {
    config.model.path = test::source_path("configs/models/tiny-qwen2");
    config.data.max_length = 128;
    tokenizer = load_tokenizer(config.model.path);
    spec = preference_spec(config, *tokenizer);
  }
  data::Outcome map(const std::string& line) const { return map_preference(line, spec, *tokenizer); }
};

int64_t trained(const std::vector<int32_t>& labels) {
  int64_t n = 0;
  for (int32_t l : labels) n += l != -100 ? 1 : 0;
  return n;
}

TEST(PreferenceData, AStandardPairEndsEachCompletionWithEosAndTrainsOnTheCompletionOnly) {
  Fixture f;
  const auto out = f.map(R"({"prompt": "Recipe for soup:", "chosen": " Simmer it.", "rejected": " Burn it."})");
  ASSERT_EQ(out.kind, data::OutcomeKind::kExample) << out.problem;
  const Example& pair = out.example;
  const auto prompt = f.tokenizer->encode("Recipe for soup:");
  const int32_t eos = *f.tokenizer->eos_id();
  EXPECT_EQ(pair.input_ids, f.tokenizer->encode("Recipe for soup: Simmer it." + f.spec.eos_text));
  EXPECT_EQ(pair.input_ids.back(), eos);
  EXPECT_EQ(pair.rejected_ids.back(), eos);
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    EXPECT_EQ(pair.labels[i], -100);
    EXPECT_EQ(pair.rejected_labels[i], -100);
  }
  EXPECT_EQ(trained(pair.labels), static_cast<int64_t>(pair.input_ids.size() - prompt.size()));
  EXPECT_EQ(trained(pair.rejected_labels), static_cast<int64_t>(pair.rejected_ids.size() - prompt.size()));
  // A completion that already ends with the EOS text gets no second one.
  const auto again = f.map(R"({"prompt": "Recipe for soup:", "chosen": " Simmer it.<|endoftext|>", "rejected": " Burn it."})");
  EXPECT_EQ(again.example.input_ids, pair.input_ids);
}

TEST(PreferenceData, AnImplicitPromptIsWhatTheConversationsShare) {
  Fixture f;
  const auto implicit = f.map(
      R"({"chosen": [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Simmer it."}],)"
      R"( "rejected": [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Burn it."}]})");
  const auto explicit_prompt = f.map(
      R"({"prompt": [{"role": "user", "content": "Soup?"}], "chosen": [{"role": "assistant", "content": "Simmer it."}],)"
      R"( "rejected": [{"role": "assistant", "content": "Burn it."}]})");
  ASSERT_EQ(implicit.kind, data::OutcomeKind::kExample) << implicit.problem;
  EXPECT_EQ(implicit.example.input_ids, explicit_prompt.example.input_ids);
  EXPECT_EQ(implicit.example.labels, explicit_prompt.example.labels);
  EXPECT_EQ(implicit.example.rejected_labels, explicit_prompt.example.rejected_labels);
  EXPECT_GT(trained(implicit.example.labels), 0);
}

// Mistral v3's shape: the system message goes into the last user turn only when that turn ends the conversation, so
// the pair's rendering does not begin with the prompt's, and the tokens after the shared ones would hold the user's
// question: the completion's assistant span is trained instead (found by probing; the template needs no swap).
TEST(PreferenceData, WhereThePairDoesNotBeginWithThePromptTheCompletionsSpanIsTrained) {
  test::TempDir dir;
  test::write_file(dir.file("chat.jinja"),
                   "{% set system = messages[0].content if messages[0].role == 'system' else '' %}"
                   "{% for m in messages if m.role != 'system' %}{% if m.role == 'user' %}{{ '[INST] ' }}"
                   "{% if loop.last and system %}{{ system + '\\n\\n' }}{% endif %}{{ m.content + '[/INST]' }}"
                   "{% else %}{{ ' ' + m.content + '</s>' }}{% endif %}{% endfor %}");
  Fixture f;
  f.config.data.chat_template = dir.file("chat.jinja");
  f.spec = preference_spec(f.config, *f.tokenizer);
  const auto out = f.map(
      R"({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Soup?"}],)"
      R"( "chosen": [{"role": "assistant", "content": "Simmer it."}],)"
      R"( "rejected": [{"role": "assistant", "content": "Burn it."}]})");
  ASSERT_EQ(out.kind, data::OutcomeKind::kExample) << out.problem;
  const auto trained_text = [&](const std::vector<int32_t>& ids, const std::vector<int32_t>& labels) {
    std::vector<int32_t> kept;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (labels[i] != -100) kept.push_back(ids[i]);
    return f.tokenizer->decode(kept, /*skip_special=*/false);
  };
  EXPECT_EQ(out.example.input_ids, f.tokenizer->encode("[INST] Soup?[/INST] Simmer it.</s>"));
  EXPECT_EQ(trained_text(out.example.input_ids, out.example.labels), " Simmer it.</s>");
  EXPECT_EQ(trained_text(out.example.rejected_ids, out.example.rejected_labels), " Burn it.</s>");
}

TEST(PreferenceData, BadRecordsSayWhatIsWrong) {
  Fixture f;
  auto problem = [&](const std::string& line) {
    const auto out = f.map(line);
    EXPECT_EQ(out.kind, data::OutcomeKind::kBadRecord) << line;
    return out.problem;
  };
  EXPECT_NE(problem(R"({"prompt": "a", "chosen": "b"})").find("no \"rejected\" field"), std::string::npos);
  EXPECT_NE(problem(R"({"prompt": "a", "chosen": "b", "rejected": 3})").find("must be a string"), std::string::npos);
  EXPECT_NE(problem(R"({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"})")
                .find("list of messages"),
            std::string::npos);
  EXPECT_NE(problem(R"({"chosen": "yes", "rejected": "no"})").find("share no prompt"), std::string::npos);
  EXPECT_NE(problem(R"([1, 2])").find("not an object"), std::string::npos);
  EXPECT_NE(problem("{\"prompt\": ").find("invalid JSON"), std::string::npos);
}

TEST(PreferenceData, APromptThatFillsMaxLengthIsSkippedAndLongerPairsAreCut) {
  Fixture f;
  f.spec.max_length = 8;
  const auto skipped = f.map(R"({"prompt": "one two three four five six seven eight nine ten", "chosen": " a",)"
                             R"( "rejected": " b"})");
  EXPECT_EQ(skipped.kind, data::OutcomeKind::kOverlengthSkipped);
  EXPECT_NE(skipped.problem.find("the prompt alone"), std::string::npos) << skipped.problem;
  const auto cut = f.map(R"({"prompt": "one", "chosen": " two three four five six seven eight nine ten eleven",)"
                         R"( "rejected": " b"})");
  ASSERT_EQ(cut.kind, data::OutcomeKind::kExample) << cut.problem;
  EXPECT_TRUE(cut.truncated);
  EXPECT_EQ(cut.example.input_ids.size(), 8u);
  EXPECT_LT(cut.example.rejected_ids.size(), 8u);
  f.spec.on_overlength = OverlengthPolicy::kSkip;
  EXPECT_EQ(f.map(R"({"prompt": "one", "chosen": " two three four five six seven eight nine ten eleven",)"
                  R"( "rejected": " b"})")
                .kind,
            data::OutcomeKind::kOverlengthSkipped);
}

}  // namespace
}  // namespace trainer
