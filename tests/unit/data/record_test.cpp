// Record mapping: field mapping, EOS conventions, prompt masking, pre-tokenized records, bad-record classes and
// the length policy.
#include <gtest/gtest.h>

#include "data/record.h"
#include "unit/data/data_test_support.h"

namespace trainer::data {
namespace {

using test::qwen2_tokenizer;
using test::t5_tokenizer;

MappingSpec seq2seq_spec() { return MappingSpec{}; }
MappingSpec causal_spec() {
  MappingSpec spec;
  spec.family = DataFamily::kCausal;
  return spec;
}

TEST(DataRecord, Seq2SeqInputAndTargetBothEndInEos) {
  const Tokenizer& tok = t5_tokenizer();
  const Outcome o = map_record(R"({"input": "Chop the onion.", "target": "Done."})", seq2seq_spec(), tok);
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  auto input = tok.encode("Chop the onion.");
  input.push_back(*tok.eos_id());
  auto target = tok.encode("Done.");
  target.push_back(*tok.eos_id());
  EXPECT_EQ(o.example.input_ids, input);
  EXPECT_EQ(o.example.labels, target);
  EXPECT_EQ(target_tokens(o.example, DataFamily::kSeq2Seq), static_cast<int64_t>(target.size()));
}

TEST(DataRecord, PromptTokensAreMaskedAndCompletionEndsInEos) {
  const Tokenizer& tok = qwen2_tokenizer();
  const Outcome o =
      map_record(R"({"prompt": "Recipe: soup\nSteps:", "completion": " 1. Boil water."})", causal_spec(), tok);
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  const auto prompt = encode_for_training(tok, "Recipe: soup\nSteps:", false);
  auto expected = prompt;
  const auto completion = tok.encode(" 1. Boil water.");
  expected.insert(expected.end(), completion.begin(), completion.end());
  expected.push_back(*tok.eos_id());
  EXPECT_EQ(o.example.input_ids, expected);
  ASSERT_EQ(o.example.labels.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i)
    EXPECT_EQ(o.example.labels[i], i < prompt.size() ? -100 : expected[i]) << i;
  EXPECT_EQ(target_tokens(o.example, DataFamily::kCausal), static_cast<int64_t>(completion.size() + 1));
}

TEST(DataRecord, TextRecordsTrainEveryToken) {
  const Tokenizer& tok = qwen2_tokenizer();
  const Outcome o = map_record(R"({"text": "Soup. Boil water."})", causal_spec(), tok);
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  EXPECT_EQ(o.example.input_ids, encode_for_training(tok, "Soup. Boil water.", true));
  EXPECT_EQ(o.example.labels, o.example.input_ids);
}

TEST(DataRecord, CustomFieldNamesAreHonoured) {
  MappingSpec spec = seq2seq_spec();
  spec.input_field = "question";
  spec.target_field = "answer";
  EXPECT_EQ(map_record(R"({"question": "a", "answer": "b"})", spec, t5_tokenizer()).kind, OutcomeKind::kExample);
  const Outcome o = map_record(R"({"input": "a", "target": "b"})", spec, t5_tokenizer());
  EXPECT_EQ(o.problem, "missing field \"question\"");
}

TEST(DataRecord, PreTokenizedRecordsAreAcceptedAndRangeChecked) {
  const Tokenizer& tok = qwen2_tokenizer();
  Outcome o = map_record(R"({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]})", causal_spec(), tok);
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  EXPECT_EQ(o.example.input_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(o.example.labels, (std::vector<int32_t>{-100, 2, 3}));
  o = map_record(R"({"input_ids": [4, 5]})", causal_spec(), tok);
  EXPECT_EQ(o.example.labels, (std::vector<int32_t>{4, 5}));

  const std::string too_big = std::to_string(tok.vocab_size());
  o = map_record(R"({"input_ids": [1, )" + too_big + "]}", causal_spec(), tok);
  EXPECT_EQ(o.kind, OutcomeKind::kBadRecord);
  EXPECT_NE(o.problem.find("outside the tokenizer's vocabulary"), std::string::npos) << o.problem;
  EXPECT_EQ(map_record(R"({"input_ids": [1, -100]})", causal_spec(), tok).kind, OutcomeKind::kBadRecord);
  EXPECT_EQ(map_record(R"({"input_ids": [1, 2.5]})", causal_spec(), tok).kind, OutcomeKind::kBadRecord);
  EXPECT_EQ(map_record(R"({"input_ids": [1, 2], "labels": [1]})", causal_spec(), tok).kind, OutcomeKind::kBadRecord);
  // seq2seq needs decoder targets
  EXPECT_EQ(map_record(R"({"input_ids": [1, 2]})", seq2seq_spec(), t5_tokenizer()).kind, OutcomeKind::kBadRecord);
  o = map_record(R"({"input_ids": [1, 2], "labels": [3]})", seq2seq_spec(), t5_tokenizer());
  EXPECT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
}

TEST(DataRecord, EachBadRecordClassSaysWhatIsWrong) {
  const Tokenizer& tok = t5_tokenizer();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"input": "a", "target": )", "invalid JSON"},
      {R"({"input": "a"})", "missing field \"target\""},
      {R"({"input": "a", "target": 3})", "field \"target\" must be a string, not number"},
      {"{\"input\": \"a\xff\", \"target\": \"b\"}", "invalid UTF-8 at byte 13"},
      {"{\"input\": \"\xed\xa0\x80\", \"target\": \"b\"}", "invalid UTF-8"},  // a surrogate
      {R"({"input": "a", "target": "  "})", "empty target"},
      {R"(["a", "b"])", "not an object"},
  };
  for (const auto& [line, expected] : cases) {
    const Outcome o = map_record(line, seq2seq_spec(), tok);
    EXPECT_EQ(o.kind, OutcomeKind::kBadRecord) << line;
    EXPECT_NE(o.problem.find(expected), std::string::npos) << line << " -> " << o.problem;
  }
  const Outcome o = map_record(R"({"prompt": "a", "completion": ""})", causal_spec(), qwen2_tokenizer());
  EXPECT_NE(o.problem.find("empty completion"), std::string::npos) << o.problem;
  const Outcome none = map_record(R"({"body": "a"})", causal_spec(), qwen2_tokenizer());
  EXPECT_EQ(none.problem, "missing field \"text\" (or \"prompt\" and \"completion\")");
}

TEST(DataRecord, OverlengthIsTruncatedKeepingEosOrSkipped) {
  const Tokenizer& tok = t5_tokenizer();
  MappingSpec spec = seq2seq_spec();
  spec.max_input_length = 4;
  spec.max_target_length = 3;
  const std::string line = R"({"input": "one two three four five six seven", "target": "eight nine ten eleven"})";
  Outcome o = map_record(line, spec, tok);
  ASSERT_EQ(o.kind, OutcomeKind::kExample);
  EXPECT_TRUE(o.truncated);
  ASSERT_EQ(o.example.input_ids.size(), 4u);
  EXPECT_EQ(o.example.input_ids.back(), *tok.eos_id());
  ASSERT_EQ(o.example.labels.size(), 3u);
  EXPECT_EQ(o.example.labels.back(), *tok.eos_id());
  spec.on_overlength = OverlengthPolicy::kSkip;
  o = map_record(line, spec, tok);
  EXPECT_EQ(o.kind, OutcomeKind::kOverlengthSkipped);

  MappingSpec causal = causal_spec();
  causal.max_length = 5;
  o = map_record(R"({"text": "one two three four five six seven eight"})", causal, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample);
  EXPECT_TRUE(o.truncated);
  EXPECT_EQ(o.example.input_ids.size(), 5u);
  // A prompt that fills max_length leaves nothing to train on: skipped, and counted as over-length.
  o = map_record(R"({"prompt": "one two three four five six seven", "completion": " eight"})", causal,
                 qwen2_tokenizer());
  EXPECT_EQ(o.kind, OutcomeKind::kOverlengthSkipped);
}

TEST(DataRecord, Utf8ValidatorAcceptsValidTextAndFindsTheFirstBadByte) {
  EXPECT_EQ(find_invalid_utf8("plain ascii"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x8d\xb2"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("ab\xc0\xaf"), 2u);  // overlong '/'
  EXPECT_EQ(find_invalid_utf8("abc\xe2\x82"), 3u);  // cut short
  EXPECT_EQ(find_invalid_utf8("\xf4\x90\x80\x80"), 0u);  // above U+10FFFF
  // Long ASCII runs (read eight bytes at a time) before, around and after the bad byte.
  EXPECT_EQ(find_invalid_utf8("0123456789abcdef\xc0\xaf"), 16u);
  EXPECT_EQ(find_invalid_utf8("0123456789a\xe2\x82"), 11u);
  EXPECT_EQ(find_invalid_utf8("01234567\xff" "01234567"), 8u);
  EXPECT_EQ(find_invalid_utf8("0123456\xc3\xa9 0123456789abcdef \xed\xa0\x80 tail"), 27u);  // a surrogate
  EXPECT_EQ(find_invalid_utf8("0123456\xc3\xa9 0123456789abcdef \xf0\x9f\x8d\xb2 tail"), std::string_view::npos);
}

}  // namespace
}  // namespace trainer::data
