// A Hugging Face model directory as trainer sees it before loading: config.json, weight files, tokenizer files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace trainer {

struct ModelDirInfo {
  std::string dir;
  std::string model_type;                 // config.json "model_type": t5, llama, qwen2, mistral
  std::string family;                     // "seq2seq" or "causal"
  std::vector<std::string> weight_files;  // model.safetensors or the shards named in the index
  std::uint64_t weight_bytes = 0;
  std::string tokenizer_file;             // tokenizer.json, spiece.model or tokenizer.model; empty if none
};

// The model types trainer implements, and their family.
const std::vector<std::pair<std::string, std::string>>& supported_model_types();

// A JSON file (config.json, an index, a train state); DataError naming the file when missing or invalid.
nlohmann::json read_json_file(const std::string& path);

// Reads dir/config.json and lists the weight and tokenizer files. With `need_weights` a directory without
// weights is an error. Throws DataError naming the file and a hint.
ModelDirInfo inspect_model_dir(const std::string& dir, bool need_weights);

// Copies the tokenizer files (and generation_config.json) that `from_dir` holds into `to_dir`, so a saved model or
// adapter directory is complete for from_pretrained and for `trainer generate --prompt`.
void copy_tokenizer_files(const std::string& from_dir, const std::string& to_dir);

}  // namespace trainer
