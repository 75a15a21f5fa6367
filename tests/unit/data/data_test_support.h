// Shared helpers of the data tests: the tiny tokenizers, JSONL writers and configs.
#pragma once

#include <zlib.h>

#include <memory>
#include <string>
#include <vector>

#include "support/paths.h"
#include "support/temp_dir.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer::test {

inline const Tokenizer& t5_tokenizer() {
  static const auto tokenizer = load_tokenizer(source_path("configs/models/tiny-t5"));
  return *tokenizer;
}
inline const Tokenizer& qwen2_tokenizer() {
  static const auto tokenizer = load_tokenizer(source_path("configs/models/tiny-qwen2"));
  return *tokenizer;
}

// n seq2seq records of varied lengths: {"input": "...", "target": "..."}; record i is recognisable by its text.
inline std::string seq2seq_lines(int n, int first = 0) {
  std::string text;
  for (int i = first; i < first + n; ++i) {
    std::string input = "Write the steps for dish " + std::to_string(i) + ".";
    for (int k = 0; k < i % 7; ++k) input += " Add salt and pepper.";
    text += R"({"input": ")" + input + R"(", "target": "Step )" + std::to_string(i) + R"(. Stir gently."})" "\n";
  }
  return text;
}

inline void write_gzip(const std::string& path, const std::string& text) {
  gzFile gz = gzopen(path.c_str(), "wb");
  gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
  gzclose(gz);
}

inline Config seq2seq_config(const std::vector<std::string>& files, int64_t batch_size = 4) {
  Config config;
  config.data.train_files = files;
  config.data.num_workers = 2;
  config.training.batch_size = batch_size;
  config.training.seed = 7;
  return config;
}

// Every batch of a loader until it ends (or `limit` batches), as the source indexes and epochs.
struct BatchTrace {
  std::vector<std::vector<uint64_t>> sources;
  std::vector<std::vector<std::vector<int32_t>>> ids;
  std::vector<int64_t> epochs;
  bool operator==(const BatchTrace&) const = default;
};
inline BatchTrace trace(DataLoader& loader, std::size_t limit = SIZE_MAX) {
  BatchTrace t;
  while (t.sources.size() < limit) {
    auto batch = loader.next();
    if (!batch) break;
    std::vector<uint64_t> sources;
    std::vector<std::vector<int32_t>> ids;
    for (const auto& e : batch->examples) {
      sources.push_back(e.source_index);
      ids.push_back(e.input_ids);
    }
    t.sources.push_back(sources);
    t.ids.push_back(ids);
    t.epochs.push_back(batch->epoch);
  }
  return t;
}

}  // namespace trainer::test
