// The C++ side of tests/parity/test_tokenizers.py: encodes and decodes the cases the pytest writes, so it can
// compare our ids with the Python libraries'. Skipped unless TRAINER_TOKENIZER_CASES names a JSONL file of
// {"tokenizer": path, "text": ...} lines; writes one {"ids", "with_special", "decoded", "decoded_special"} line
// per case (or {"error": message}) to the same path with ".out.jsonl" appended.
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "trainer/errors.h"
#include "trainer/tokenizer.h"

namespace trainer {

TEST(TokenizerExternal, EncodesTheCasesFile) {
  const char* cases_path = std::getenv("TRAINER_TOKENIZER_CASES");
  if (!cases_path || !*cases_path) GTEST_SKIP() << "set TRAINER_TOKENIZER_CASES=cases.jsonl (the parity test does)";
  std::ifstream in(cases_path);
  ASSERT_TRUE(in) << "cannot open " << cases_path;
  std::ofstream out(std::string(cases_path) + ".out.jsonl");
  std::map<std::string, std::unique_ptr<Tokenizer>> tokenizers;
  std::string line;
  int count = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto request = nlohmann::json::parse(line);
    nlohmann::json result;
    try {
      const std::string path = request.at("tokenizer").get<std::string>();
      auto& tokenizer = tokenizers[path];
      if (!tokenizer) tokenizer = load_tokenizer(path, TokenizerKind::kAuto);
      const std::string text = request.at("text").get<std::string>();
      const auto ids = tokenizer->encode(text);
      const auto special = tokenizer->special_token_template();
      std::vector<std::int32_t> with_special = special.prefix;
      with_special.insert(with_special.end(), ids.begin(), ids.end());
      with_special.insert(with_special.end(), special.suffix.begin(), special.suffix.end());
      result["ids"] = ids;
      result["with_special"] = with_special;
      result["decoded"] = tokenizer->decode(with_special, true);
      result["decoded_special"] = tokenizer->decode(with_special, false);
      result["vocab_size"] = tokenizer->vocab_size();
      for (const auto& [key, id] : {std::pair{"eos_id", tokenizer->eos_id()}, std::pair{"pad_id", tokenizer->pad_id()},
                                    std::pair{"bos_id", tokenizer->bos_id()}})
        result[key] = id ? nlohmann::json(*id) : nlohmann::json(nullptr);
    } catch (const std::exception& error) {
      result = {{"error", error.what()}};
    }
    out << result.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    ++count;
  }
  EXPECT_GT(count, 0) << cases_path << " holds no cases";
}

}  // namespace trainer
