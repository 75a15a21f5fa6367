// Chat records through the real binary: configs/tiny-qwen2-chat.json trains the tiny Qwen2 on the demo
// conversations (loss falls, the saved model carries its chat template); `trainer data` marks the trained tokens and
// --dump writes what is trained; bad chat records exit 3 with file:line or are counted with skip.
#include <algorithm>
#include <filesystem>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/metrics.h"
#include "support/process.h"
#include "support/temp_dir.h"

namespace trainer::test {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line.front() == '{') lines.push_back(nlohmann::json::parse(line));
  return lines;
}

TEST(IntegrationChatData, TheTinyChatConfigTrainsAndLossFalls) {
  TempDir dir;
  const ProcessResult r = run_trainer({"--config", "configs/tiny-qwen2-chat.json", "--set",
                                       "checkpoint.output_dir=" + dir.path().string(), "--set",
                                       "training.max_steps=16", "--set", "training.batch_size=4", "--set",
                                       "evaluation.every_steps=0"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto loss = metric_values(dir.path() / "metrics.jsonl", "loss");
  ASSERT_GE(loss.size(), 3u);
  EXPECT_LT(loss.back(), loss.front() * 0.85) << "first " << loss.front() << ", last " << loss.back();
  EXPECT_TRUE(fs::exists(dir.path() / "final" / "chat_template.jinja"));
}

TEST(IntegrationChatData, DataMarksTrainedTokensAndDumpWritesExamples) {
  const ProcessResult r = run_trainer({"data", "--config", "configs/tiny-qwen2-chat.json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "examples            300")) << r.out;
  EXPECT_TRUE(contains(r.out, "first chat record (data/demo/chat.jsonl:1)")) << r.out;
  // The assistant's answer and its end marker are trained, the user's question is not.
  EXPECT_TRUE(contains(r.out, "<|im_start|>assistant\n[[Crispy garlic noodles needs")) << r.out;
  EXPECT_TRUE(contains(r.out, "medium heat.<|im_end|>\n]]")) << r.out;
  EXPECT_TRUE(contains(r.out, "<|im_start|>user\nWhat goes into crispy garlic noodles?<|im_end|>")) << r.out;

  const ProcessResult dumped =
      run_trainer({"data", "--config", "configs/tiny-qwen2-chat.json", "--dump", "3", "data/demo/chat.jsonl"});
  ASSERT_EQ(dumped.exit_code, 0) << dumped.err;
  const auto lines = json_lines(dumped.out);
  ASSERT_EQ(lines.size(), 3u) << dumped.out;
  for (const auto& line : lines) {
    ASSERT_EQ(line["input_ids"].size(), line["labels"].size());
    EXPECT_TRUE(line["text"].get<std::string>().starts_with("<|im_start|>system\n"));
    EXPECT_EQ(line["mask"], "prefix");  // Qwen2.5's template splits prefix by prefix
    int trained = 0;
    for (std::size_t i = 0; i < line["labels"].size(); ++i) {
      if (line["labels"][i] == -100) continue;
      EXPECT_EQ(line["labels"][i], line["input_ids"][i]);
      ++trained;
    }
    EXPECT_GT(trained, 0);
    EXPECT_LT(trained, static_cast<int>(line["labels"].size()));
  }
  // Other record kinds dump too (no text field): the causal demo's prompt/completion records.
  const ProcessResult causal =
      run_trainer({"data", "--config", "configs/tiny-qwen2.json", "--dump", "2"});
  ASSERT_EQ(causal.exit_code, 0) << causal.err;
  const auto causal_lines = json_lines(causal.out);
  ASSERT_EQ(causal_lines.size(), 2u);
  EXPECT_FALSE(causal_lines[0].contains("text"));
  EXPECT_EQ(causal_lines[0]["labels"][0], -100);  // the prompt is masked
}

TEST(IntegrationChatData, BadChatRecordsExitThreeWithFileAndLineOrAreSkipped) {
  TempDir dir;
  const std::string good =
      R"({"messages": [{"role": "user", "content": "Soup?"}, {"role": "assistant", "content": "Boil water."}]})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"messages": {"role": "user"}})", "field \"messages\" must be a list of message objects, not object"},
      {R"({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]})", "messages[0] has no \"role\""},
      {R"({"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]})",
       "messages[0] (role \"user\") has no \"content\""},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": 3}]})",
       "messages[1].tool_calls must be a list, not number"},
  };
  for (const auto& [line, message] : cases) {
    SCOPED_TRACE(line);
    const std::string path = dir.file("bad.jsonl");
    write_file(path, good + "\n" + line + "\n" + good + "\n");
    const std::string files = "data.train_files=[\"" + path + "\"]";
    const ProcessResult r = run_trainer({"data", "--config", "configs/tiny-qwen2-chat.json", "--set", files});
    EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
    EXPECT_TRUE(contains(r.err, path + ":2: " + message)) << r.err;
    const ProcessResult skipped = run_trainer(
        {"data", "--config", "configs/tiny-qwen2-chat.json", "--set", files, "--set", "data.on_bad_record=skip"});
    EXPECT_EQ(skipped.exit_code, 0) << skipped.err;
    EXPECT_TRUE(contains(skipped.out, "bad records skipped 1")) << skipped.out;
  }

  // A template that does not parse, and one that raises: exit 3 naming the record and the template's words.
  const std::string path = dir.file("chat.jsonl");
  write_file(path, good + "\n");
  write_file(dir.file("broken.jinja"), "{% for m in messages %}{{ m.content }");
  write_file(dir.file("raises.jinja"), "{{ raise_exception('Only user turns, please') }}");
  const std::string files = "data.train_files=[\"" + path + "\"]";
  ProcessResult r = run_trainer({"data", "--config", "configs/tiny-qwen2-chat.json", "--set", files, "--set",
                                 "data.chat_template=" + dir.file("broken.jinja"), "--set", "data.on_bad_record=skip"});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, path + ":1: " + dir.file("broken.jinja"))) << r.err;
  EXPECT_TRUE(contains(r.err, "syntax error at line 1")) << r.err;
  r = run_trainer({"data", "--config", "configs/tiny-qwen2-chat.json", "--set", files, "--set",
                   "data.chat_template=" + dir.file("raises.jinja")});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, path + ":1: chat template raised an exception: Only user turns, please")) << r.err;
}

// The new ids `trainer generate` printed ("ids: 5 17 42").
std::vector<std::string> generated_ids(const std::string& out) {
  std::vector<std::string> ids;
  const auto at = out.find("ids:");
  if (at == std::string::npos) return ids;
  std::istringstream line(out.substr(at + 4, out.find('\n', at) - at - 4));
  for (std::string id; line >> id;) ids.push_back(id);
  return ids;
}

TEST(IntegrationChatData, GenerateRendersTheChatAndStopsAtTheEndOfTurnIds) {
  TempDir dir;
  const fs::path model = dir.path() / "model";
  fs::create_directories(model);
  for (const char* name : {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
    fs::copy_file(std::string(TRAINER_SOURCE_DIR) + "/configs/models/tiny-qwen2/" + name, model / name);
  const std::vector<std::string> args = {"generate", "--model", model.string(), "--random-init", "--seed", "3",
                                         "--system", "Be brief.", "--chat", "What goes into soup?",
                                         "--max-new-tokens", "6"};
  const ProcessResult free = run_trainer(args);
  ASSERT_EQ(free.exit_code, 0) << free.err;
  // system + user, rendered by the directory's template with the generation prompt.
  EXPECT_TRUE(contains(free.out, "chat prompt: 2 message(s), ")) << free.out;
  EXPECT_TRUE(contains(free.out, "chat_template.jinja")) << free.out;
  const auto ids = generated_ids(free.out);
  ASSERT_EQ(ids.size(), 6u) << free.out;
  // generation_config.json's eos_token_id list stops generation at the first of them that comes.
  write_file((model / "generation_config.json").string(), "{\"eos_token_id\": [9999, " + ids[2] + "]}");
  const ProcessResult stopped = run_trainer(args);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.err;
  const auto first = std::find(ids.begin(), ids.end(), ids[2]) - ids.begin();
  EXPECT_EQ(generated_ids(stopped.out).size(), static_cast<std::size_t>(first + 1)) << stopped.out;

  // A messages file with tools picks the same template and renders the tools.
  write_file(dir.file("messages.json"), R"({"tools": [{"type": "function", "function": {"name": "set_timer"}}],)"
                                        R"( "messages": [{"role": "user", "content": "Start a timer."}]})");
  const ProcessResult with_tools = run_trainer(
      {"generate", "--model", model.string(), "--random-init", "--messages", dir.file("messages.json"),
       "--max-new-tokens", "2"});
  ASSERT_EQ(with_tools.exit_code, 0) << with_tools.err;
  EXPECT_TRUE(contains(with_tools.out, "chat prompt: 1 message(s), ")) << with_tools.out;
  const ProcessResult both = run_trainer({"generate", "--model", model.string(), "--random-init", "--prompt", "x",
                                          "--chat", "y"});
  EXPECT_EQ(both.exit_code, 2) << both.out << both.err;
}

}  // namespace
}  // namespace trainer::test
