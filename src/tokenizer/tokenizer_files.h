// What the two tokenizer implementations share: the side files next to a tokenizer (tokenizer_config.json,
// config.json) and the factory functions load_tokenizer() dispatches to.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "trainer/tokenizer.h"

namespace trainer::tokenizer_detail {

// tokenizer_config.json and config.json from the tokenizer's directory; null when absent.
struct SideFiles {
  std::string tokenizer_config_path;
  nlohmann::json tokenizer_config;  // tokenizer_config.json
  nlohmann::json model_config;      // config.json
};
SideFiles read_side_files(const std::string& tokenizer_file);
// A JSON object file next to a model or tokenizer; null when the file does not exist, a DataError when it is not
// a JSON object.
nlohmann::json read_json_if_present(const std::string& path);

// A special token named in tokenizer_config.json ("eos_token": "</s>" or {"content": "</s>", ...}).
std::optional<std::string> config_token(const SideFiles& side, const char* key);
// tokenizer_config.json's add_bos_token / add_eos_token when present.
std::optional<bool> config_flag(const SideFiles& side, const char* key);

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& file, const SideFiles& side);
std::unique_ptr<Tokenizer> load_bpe_json(const std::string& file, const SideFiles& side);

}  // namespace trainer::tokenizer_detail
