// Chat records: rendering by the template, ids of the whole rendering, labels on the assistant's turns
// (data.train_on, {% generation %}, prefix-by-prefix and probed spans, the method the dump names), bad records, lengths, the loader's file:line, and the
// data fingerprint's chat part.
#include <gtest/gtest.h>

#include "data/chat_record.h"
#include "tokenizer/token_bytes.h"
#include "tokenizer/unicode.h"
#include "train/resume_check.h"
#include "unit/data/data_test_support.h"

namespace trainer::data {
namespace {

using test::qwen2_tokenizer;
using test::TempDir;
using test::write_file;

const std::string kChatml =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// ChatML with the assistant's content (not its end marker) in {% generation %}.
const std::string kChatmlGeneration =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}{% if message['role'] == 'assistant' "
    "%}{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}"
    "{{'<|im_end|>\\n'}}{% endfor %}";

// Writes tools with tojson ahead of the conversation, and refuses unknown roles.
const std::string kWithTools =
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% for message in messages %}{% if message.role not in ['user', 'assistant', "
    "'system', 'tool'] %}{{ raise_exception('Unknown role: ' + message.role) }}{% endif %}{{ '<|im_start|>' + "
    "message.role + '\\n' }}{% if message.content %}{{ message.content }}{% endif %}{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}{{ '<tool_call>' + call.function.name + '</tool_call>' }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}";

struct ChatFixture {
  TempDir dir;
  MappingSpec spec;

  explicit ChatFixture(const std::string& template_text, TrainOn train_on = TrainOn::kAssistant) {
    write_file(dir.file("chat.jinja"), template_text);
    spec.family = DataFamily::kCausal;
    spec.chat = load_chat_setup(config(train_on));
  }
  Config config(TrainOn train_on) const {
    Config config;
    config.model.path = test::source_path("configs/models/tiny-qwen2");
    config.data.chat_template = dir.file("chat.jinja");
    config.data.train_on = train_on;
    return config;
  }
};

const char* kTwoTurns =
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Soup?"},)"
    R"( {"role": "assistant", "content": "Boil water."}, {"role": "user", "content": "Then?"},)"
    R"( {"role": "assistant", "content": "Add salt."}]})";

// The expected example built piece by piece: (text, trained) in order; the pieces' ids must be the whole text's.
Example expected(const std::vector<std::pair<std::string, bool>>& pieces) {
  const Tokenizer& tok = qwen2_tokenizer();
  Example e;
  std::string whole;
  for (const auto& [text, trained] : pieces) {
    whole += text;
    for (const std::int32_t id : tok.encode(text)) {
      e.input_ids.push_back(id);
      e.labels.push_back(trained ? id : -100);
    }
  }
  EXPECT_EQ(e.input_ids, tok.encode(whole)) << "the pieces must tokenize as the whole does";
  return e;
}

TEST(ChatRecord, AssistantTurnsAndTheirEndMarkersAreTrained) {
  ChatFixture f(kChatml);
  const Outcome o = map_record(kTwoTurns, f.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  const Example e = expected({{"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSoup?<|im_end|>\n"
                               "<|im_start|>assistant\n", false},
                              {"Boil water.<|im_end|>\n", true},
                              {"<|im_start|>user\nThen?<|im_end|>\n<|im_start|>assistant\n", false},
                              {"Add salt.<|im_end|>\n", true}});
  EXPECT_EQ(o.example.input_ids, e.input_ids);
  EXPECT_EQ(o.example.labels, e.labels);
  EXPECT_TRUE(o.chat_text.empty());  // only kept for trainer data --dump
}

TEST(ChatRecord, LastAssistantAndAll) {
  ChatFixture last(kChatml, TrainOn::kLastAssistant);
  Outcome o = map_record(kTwoTurns, last.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  const Example e = expected({{"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSoup?<|im_end|>\n"
                               "<|im_start|>assistant\nBoil water.<|im_end|>\n<|im_start|>user\nThen?<|im_end|>\n"
                               "<|im_start|>assistant\n", false},
                              {"Add salt.<|im_end|>\n", true}});
  EXPECT_EQ(o.example.labels, e.labels);

  ChatFixture all(kChatml, TrainOn::kAll);
  all.spec.keep_chat_text = true;
  o = map_record(kTwoTurns, all.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  EXPECT_EQ(o.example.labels, o.example.input_ids);
  EXPECT_EQ(o.chat_text.substr(0, 26), "<|im_start|>system\nBe brie");
  EXPECT_EQ(o.chat_mask, "all");
}

// ChatML whose last assistant turn writes its reasoning in <think></think> and whose earlier turns drop it (Qwen3's
// shape): prefix by prefix cannot split it, probing finds the spans; the dump names the method.
TEST(ChatRecord, WhereThePrefixesFailTheSpansComeFromProbingTheTemplate) {
  const std::string dropping_reasoning =
      "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' and loop.last %}"
      "{{ '<think>' + (m.reasoning_content or '') + '</think>' }}{% endif %}{{ m.content + '<|im_end|>\\n' }}"
      "{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  ChatFixture f(dropping_reasoning);
  f.spec.keep_chat_text = true;
  const Outcome o = map_record(
      R"({"messages": [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Boil water.",)"
      R"( "reasoning_content": "hot"}, {"role": "user", "content": "Then?"},)"
      R"( {"role": "assistant", "content": "Add salt.", "reasoning_content": "taste"}]})",
      f.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  EXPECT_EQ(o.chat_mask, "probe");
  const Example e = expected({{"<|im_start|>user\nSoup?<|im_end|>\n<|im_start|>assistant\n", false},
                              {"Boil water.<|im_end|>\n", true},
                              {"<|im_start|>user\nThen?<|im_end|>\n<|im_start|>assistant\n", false},
                              {"<think>taste</think>Add salt.<|im_end|>\n", true}});
  EXPECT_EQ(o.example.input_ids, e.input_ids);
  EXPECT_EQ(o.example.labels, e.labels);

  ChatFixture chatml(kChatml);
  chatml.spec.keep_chat_text = true;
  EXPECT_EQ(map_record(kTwoTurns, chatml.spec, qwen2_tokenizer()).chat_mask, "prefix");
  ChatFixture marked(kChatmlGeneration);
  marked.spec.keep_chat_text = true;
  EXPECT_EQ(map_record(kTwoTurns, marked.spec, qwen2_tokenizer()).chat_mask, "generation");
}

TEST(ChatRecord, GenerationBlocksDecideTheMask) {
  ChatFixture f(kChatmlGeneration);
  const Outcome o = map_record(kTwoTurns, f.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  const Example e = expected({{"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSoup?<|im_end|>\n"
                               "<|im_start|>assistant\n", false},
                              {"Boil water.", true},
                              {"<|im_end|>\n<|im_start|>user\nThen?<|im_end|>\n<|im_start|>assistant\n", false},
                              {"Add salt.", true},
                              {"<|im_end|>\n", false}});
  EXPECT_EQ(o.example.input_ids, e.input_ids);
  EXPECT_EQ(o.example.labels, e.labels);
}

TEST(ChatRecord, ToolsKeepTheirKeyOrderAndToolCallsRender) {
  ChatFixture f(kWithTools);
  const Outcome o = map_record(
      R"({"tools": [{"name": "time", "b": 1, "a": 2}], "messages": [{"role": "user", "content": "Time?"},)"
      R"( {"role": "assistant", "tool_calls": [{"function": {"name": "time", "arguments": {}}}]},)"
      R"( {"role": "tool", "content": "noon"}, {"role": "assistant", "content": "Noon."}]})",
      f.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample) << o.problem;
  const Example e = expected(
      {{"<|im_start|>system\n{\"name\": \"time\", \"b\": 1, \"a\": 2}<|im_end|>\n<|im_start|>user\nTime?<|im_end|>\n"
        "<|im_start|>assistant\n", false},
       {"<tool_call>time</tool_call><|im_end|>\n", true},
       {"<|im_start|>tool\nnoon<|im_end|>\n<|im_start|>assistant\n", false},
       {"Noon.<|im_end|>\n", true}});
  EXPECT_EQ(o.example.input_ids, e.input_ids);
  EXPECT_EQ(o.example.labels, e.labels);
}

TEST(ChatRecord, BadRecordsSayWhatIsWrong) {
  ChatFixture f(kWithTools);
  const auto problem = [&](const std::string& line) {
    const Outcome o = map_record(line, f.spec, qwen2_tokenizer());
    EXPECT_EQ(o.kind, OutcomeKind::kBadRecord) << line;
    EXPECT_FALSE(o.fatal) << line;
    return o.problem;
  };
  EXPECT_EQ(problem(R"({"messages": "hi"})"), "field \"messages\" must be a list of message objects, not string");
  EXPECT_EQ(problem(R"({"messages": []})"), "field \"messages\" is an empty list");
  EXPECT_EQ(problem(R"({"messages": [{"content": "hi"}]})"), "messages[0] has no \"role\"");
  EXPECT_EQ(problem(R"({"messages": [{"role": "user"}]})"), "messages[0] (role \"user\") has no \"content\"");
  EXPECT_EQ(problem(R"({"messages": [{"role": "user", "content": 5}]})"),
            "messages[0].content must be a string or a list of content parts, not number");
  EXPECT_EQ(problem(R"({"messages": [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]})"),
            "messages[0].tool_calls must be a list, not object");
  EXPECT_EQ(problem(R"({"tools": {"a": 1}, "messages": [{"role": "user", "content": "x"}]})"),
            "field \"tools\" must be a list of function schemas, not object");
  EXPECT_EQ(problem(R"({"messages": [{"role": "robot", "content": "x"}]})"),
            "chat template raised an exception: Unknown role: robot");
  EXPECT_EQ(problem(R"({"messages": [{"role": "user", "content": "x"}]})"),
            "no assistant message to train on");
}

TEST(ChatRecord, MissingOrBrokenTemplatesStopAtTheFirstChatRecord) {
  TempDir dir;  // a base model's tokenizer files: no chat template
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
    std::filesystem::copy_file(test::source_path(std::string("configs/models/tiny-qwen2/") + name), dir.file(name));
  Config config;
  config.model.path = dir.path().string();
  MappingSpec spec;
  spec.family = DataFamily::kCausal;
  spec.chat = load_chat_setup(config);
  Outcome o = map_record(kTwoTurns, spec, qwen2_tokenizer());
  EXPECT_EQ(o.kind, OutcomeKind::kBadRecord);
  EXPECT_TRUE(o.fatal);
  EXPECT_NE(o.problem.find("no chat template in"), std::string::npos) << o.problem;
  EXPECT_NE(o.hint.find("data.chat_template"), std::string::npos) << o.hint;
  // Records without messages do not need one.
  EXPECT_EQ(map_record(R"({"text": "Soup."})", spec, qwen2_tokenizer()).kind, OutcomeKind::kExample);

  ChatFixture broken("{% for m in messages %}{{ m.content }");
  o = map_record(kTwoTurns, broken.spec, qwen2_tokenizer());
  EXPECT_TRUE(o.fatal);
  EXPECT_NE(o.problem.find("syntax error at line 1"), std::string::npos) << o.problem;
  EXPECT_NE(o.problem.find("chat.jinja"), std::string::npos) << o.problem;
}

TEST(ChatRecord, TemplatesFromTheModelDirectoryNamedOrPlain) {
  TempDir dir;
  for (const char* name : {"tokenizer.json", "config.json"})
    std::filesystem::copy_file(test::source_path(std::string("configs/models/tiny-qwen2/") + name), dir.file(name));
  nlohmann::ordered_json tokenizer_config = {{"eos_token", "<|im_end|>"}};
  tokenizer_config["chat_template"] = nlohmann::ordered_json::array(
      {{{"name", "default"}, {"template", "{{ eos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}},
       {{"name", "tool_use"}, {"template", "T{% for m in messages %}{{ m.content }}{% endfor %}"}}});
  write_file(dir.file("tokenizer_config.json"), tokenizer_config.dump());
  Config config;
  config.model.path = dir.path().string();
  config.data.train_on = TrainOn::kAll;
  MappingSpec spec;
  spec.family = DataFamily::kCausal;
  spec.keep_chat_text = true;
  spec.chat = load_chat_setup(config);
  const char* messages = R"("messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])";
  EXPECT_EQ(map_record(std::string("{") + messages + "}", spec, qwen2_tokenizer()).chat_text, "<|im_end|>ab");
  EXPECT_EQ(map_record(std::string(R"({"tools": [], )") + messages + "}", spec, qwen2_tokenizer()).chat_text, "Tab");
}

TEST(ChatRecord, OverLengthIsTruncatedWithLabelsInPlaceOrSkipped) {
  ChatFixture f(kChatml);
  const Outcome whole = map_record(kTwoTurns, f.spec, qwen2_tokenizer());
  ASSERT_EQ(whole.kind, OutcomeKind::kExample);
  const std::size_t n = whole.example.input_ids.size();
  f.spec.max_length = static_cast<std::int64_t>(n - 3);
  Outcome o = map_record(kTwoTurns, f.spec, qwen2_tokenizer());
  ASSERT_EQ(o.kind, OutcomeKind::kExample);
  EXPECT_TRUE(o.truncated);
  const auto& ids = whole.example.input_ids;
  const auto& labels = whole.example.labels;
  EXPECT_EQ(o.example.input_ids, std::vector<int32_t>(ids.begin(), ids.end() - 3));
  EXPECT_EQ(o.example.labels, std::vector<int32_t>(labels.begin(), labels.end() - 3));
  f.spec.on_overlength = OverlengthPolicy::kSkip;
  EXPECT_EQ(map_record(kTwoTurns, f.spec, qwen2_tokenizer()).kind, OutcomeKind::kOverlengthSkipped);
}

TEST(ChatRecord, TokenRangesCoverTheTextAndSplitCharactersShareOne) {
  const Tokenizer& tok = qwen2_tokenizer();
  const std::string text = "<|im_start|>user\nCafé 日本語 ok<|im_end|>\n";
  const auto ids = tok.encode(text);
  const auto ranges = token_byte_ranges(tok, text, ids);
  ASSERT_TRUE(ranges);
  ASSERT_EQ(ranges->size(), ids.size());
  EXPECT_EQ(ranges->front().first, 0u);
  EXPECT_EQ(ranges->back().second, text.size());
  for (std::size_t k = 1; k < ranges->size(); ++k) {
    const bool same = (*ranges)[k] == (*ranges)[k - 1];
    EXPECT_TRUE(same || (*ranges)[k].first == (*ranges)[k - 1].second) << k;
  }
  EXPECT_FALSE(token_byte_ranges(tok, "something else entirely", ids));

  // char_to_token semantics: a span marks from the token of its first byte through the token of its last.
  const std::vector<std::pair<std::size_t, std::size_t>> r = {{0, 2}, {2, 5}, {5, 6}, {6, 9}};
  EXPECT_EQ(tokens_in_spans(r, {{3, 6}}), (std::vector<bool>{false, true, true, false}));
  EXPECT_EQ(tokens_in_spans(r, {{0, 1}, {7, 20}}), (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ(tokens_in_spans(r, {{4, 4}}), (std::vector<bool>{false, false, false, false}));
}

TEST(ChatRecord, LoaderReportsFileAndLineAndCountsSkips) {
  ChatFixture f(kChatml);
  const std::string path = f.dir.file("chat.jsonl");
  write_file(path, std::string(kTwoTurns) + "\n" + R"({"messages": [{"role": "user"}]})" + "\n" + kTwoTurns + "\n");
  Config config = f.config(TrainOn::kAssistant);
  config.data.train_files = {path};
  config.data.shuffle = false;
  config.training.batch_size = 4;
  try {
    auto loader = make_train_loader(config, qwen2_tokenizer(), DataFamily::kCausal);
    while (loader->next()) {
    }
    FAIL() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()), path + ":2: messages[0] (role \"user\") has no \"content\"");
    EXPECT_EQ(e.exit_code(), kExitData);
  }
  config.data.on_bad_record = BadRecordPolicy::kSkip;
  auto loader = make_train_loader(config, qwen2_tokenizer(), DataFamily::kCausal);
  const auto batch = loader->next();
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->examples.size(), 2u);
  EXPECT_EQ(loader->stats().bad_records_skipped, 1);
}

TEST(ChatRecord, FingerprintCoversTrainOnAndTheTemplate) {
  ChatFixture f(kChatml);
  Config config = f.config(TrainOn::kAssistant);
  const std::string path = f.dir.file("chat.jsonl");
  write_file(path, std::string(kTwoTurns) + "\n");
  config.data.train_files = {path};
  const auto before = data_fingerprint(config, qwen2_tokenizer());
  std::vector<std::string> warnings;
  EXPECT_TRUE(data_changes(before, data_fingerprint(config, qwen2_tokenizer()), warnings).empty());
  config.data.train_on = TrainOn::kAll;
  auto changes = data_changes(before, data_fingerprint(config, qwen2_tokenizer()), warnings);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("data.train_on is all now, assistant in the checkpoint"), std::string::npos) << changes[0];
  config.data.train_on = TrainOn::kAssistant;
  write_file(f.dir.file("chat.jinja"), kChatmlGeneration);
  changes = data_changes(before, data_fingerprint(config, qwen2_tokenizer()), warnings);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_NE(changes[0].find("the chat template changed"), std::string::npos) << changes[0];
}

// The same tokenizer seen only through the Tokenizer interface: no byte table, so token_byte_ranges decodes each
// token (the method the byte table must agree with).
class DecodeOnlyTokenizer final : public Tokenizer {
 public:
  explicit DecodeOnlyTokenizer(const Tokenizer& inner) : inner_(inner) {}
  std::vector<std::int32_t> encode(std::string_view text) const override { return inner_.encode(text); }
  std::string decode(std::span<const std::int32_t> ids, bool skip_special) const override {
    return inner_.decode(ids, skip_special);
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }
  std::optional<std::int32_t> eos_id() const override { return inner_.eos_id(); }
  std::optional<std::int32_t> pad_id() const override { return inner_.pad_id(); }
  std::optional<std::int32_t> bos_id() const override { return inner_.bos_id(); }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override { return inner_.token_to_id(token); }
  SpecialTokenTemplate special_token_template() const override { return inner_.special_token_template(); }
  const std::string& source() const override { return inner_.source(); }

 private:
  const Tokenizer& inner_;
};

TEST(ChatRecord, TokenRangesFromTheByteTableEqualDecodingEachToken) {
  const Tokenizer& tok = qwen2_tokenizer();
  const DecodeOnlyTokenizer decoding(tok);
  ASSERT_NE(tokenizer_detail::decoded_token_bytes(tok), nullptr) << "the byte-level BPE must take the fast path";
  ASSERT_EQ(tokenizer_detail::decoded_token_bytes(decoding), nullptr);
  const std::vector<std::string> texts = {
      "<|im_start|>user\nCafé 日本語 ok<|im_end|>\n<|im_start|>assistant\nSure.<|im_end|>\n",
      "emoji 🍲🔥 and 👩‍🍳 mixed with ü, ß, ø and 中文字符 after spaces   \t\n\n",
      "Здравствуйте! Γειά σου. مرحبا. שלום. नमस्ते. 😀😃😄😁",
      "<|endoftext|><|im_start|><|im_end|>   <|im_end|>x",
      "a\u00a0b\u2028c\u200bd \xef\xbf\xbd replacement char",
      "",
  };
  std::size_t split_characters = 0;
  const auto* table = tokenizer_detail::decoded_token_bytes(tok);
  for (const std::string& text : texts) {
    const auto ids = tok.encode(text);
    for (const std::int32_t id : ids)
      if (!tokenizer_detail::is_valid_utf8((*table)[static_cast<std::size_t>(id)])) ++split_characters;
    const auto fast = token_byte_ranges(tok, text, ids);
    const auto slow = token_byte_ranges(decoding, text, ids);
    ASSERT_TRUE(fast.has_value()) << "the byte table places every text its tokens spell: " << text;
    if (slow) {
      EXPECT_EQ(*fast, *slow) << text;
    }
    // Decoding cannot place a U+FFFD of the text that the tokens split (the partial token decodes to U+FFFD too):
    // the byte table can, and covers the character with both tokens.
    EXPECT_EQ(slow.has_value(), text.find("\xef\xbf\xbd") == std::string::npos) << text;
    // Where the tokens do not spell the text, both say so.
    const std::string other = text + "!";
    EXPECT_EQ(token_byte_ranges(tok, other, ids).has_value(), token_byte_ranges(decoding, other, ids).has_value());
  }
  EXPECT_GT(split_characters, 0u) << "some token must hold part of a character, so the decoding path is exercised";
}

TEST(ChatRecord, OnlyObjectsWithMessagesAndNoInputIdsAreChatRecords) {
  ChatFixture f(kChatml);
  f.spec.text_field = "text";
  // "messages" inside a text record's text: a text record.
  const Outcome text = map_record(R"({"text": "the \"messages\": field"})", f.spec, qwen2_tokenizer());
  ASSERT_EQ(text.kind, OutcomeKind::kExample) << text.problem;
  EXPECT_EQ(text.example.input_ids, encode_for_training(qwen2_tokenizer(), "the \"messages\": field", true));
  // input_ids take precedence over messages (a pre-tokenized record).
  const Outcome ids =
      map_record(R"({"messages": [{"role": "user", "content": "a"}], "input_ids": [5, 6, 7]})", f.spec,
                 qwen2_tokenizer());
  ASSERT_EQ(ids.kind, OutcomeKind::kExample) << ids.problem;
  EXPECT_EQ(ids.example.input_ids, (std::vector<std::int32_t>{5, 6, 7}));
  // A broken line that names messages is reported as invalid JSON, as any other.
  const Outcome broken = map_record(R"({"messages": [)", f.spec, qwen2_tokenizer());
  ASSERT_EQ(broken.kind, OutcomeKind::kBadRecord);
  EXPECT_NE(broken.problem.find("invalid JSON"), std::string::npos) << broken.problem;
  // A list naming messages is not an object.
  const Outcome list = map_record(R"(["messages"])", f.spec, qwen2_tokenizer());
  ASSERT_EQ(list.kind, OutcomeKind::kBadRecord);
  EXPECT_NE(list.problem.find("not an object"), std::string::npos) << list.problem;
}

}  // namespace
}  // namespace trainer::data
