// Finding and loading a tokenizer (file or model directory), the side files it reads, and the training
// convention for special tokens.
#include "trainer/tokenizer.h"

#include <filesystem>
#include <fstream>

#include "tokenizer/tokenizer_files.h"
#include "trainer/errors.h"

namespace trainer {
namespace fs = std::filesystem;

namespace tokenizer_detail {

nlohmann::json read_json_if_present(const std::string& path) {
  if (!fs::exists(path)) return nullptr;
  std::ifstream in(path);
  nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (json.is_discarded() || !json.is_object())
    throw DataError(path + " is not a JSON object", "restore the file from the model's repository");
  return json;
}

SideFiles read_side_files(const std::string& tokenizer_file) {
  const fs::path dir = fs::path(tokenizer_file).parent_path();
  SideFiles side;
  side.tokenizer_config_path = (dir / "tokenizer_config.json").string();
  side.tokenizer_config = read_json_if_present((dir / "tokenizer_config.json").string());
  side.model_config = read_json_if_present((dir / "config.json").string());
  return side;
}

std::optional<std::string> config_token(const SideFiles& side, const char* key) {
  if (!side.tokenizer_config.is_object() || !side.tokenizer_config.contains(key)) return std::nullopt;
  const auto& value = side.tokenizer_config[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  if (value.is_null()) return std::nullopt;
  throw DataError(side.tokenizer_config_path + ": \"" + key + "\" is neither a string nor {\"content\": ...}",
                  "write the token as a string, e.g. \"eos_token\": \"</s>\"");
}

std::optional<bool> config_flag(const SideFiles& side, const char* key) {
  if (!side.tokenizer_config.is_object() || !side.tokenizer_config.contains(key)) return std::nullopt;
  const auto& value = side.tokenizer_config[key];
  if (value.is_null()) return std::nullopt;
  if (!value.is_boolean())
    throw DataError(side.tokenizer_config_path + ": \"" + key + "\" must be true or false");
  return value.get<bool>();
}

}  // namespace tokenizer_detail

namespace {

const char* const kSentencePieceNames[] = {"spiece.model", "tokenizer.model"};

std::string find_in_dir(const fs::path& dir, TokenizerKind kind) {
  if (kind != TokenizerKind::kBpe)
    for (const char* name : kSentencePieceNames)
      if (fs::is_regular_file(dir / name)) return (dir / name).string();
  if (kind != TokenizerKind::kSentencePiece && fs::is_regular_file(dir / "tokenizer.json"))
    return (dir / "tokenizer.json").string();
  const std::string wanted = kind == TokenizerKind::kBpe             ? "tokenizer.json"
                             : kind == TokenizerKind::kSentencePiece ? "spiece.model or tokenizer.model"
                                                                     : "tokenizer.json, spiece.model or tokenizer.model";
  throw DataError("no tokenizer in " + dir.string() + ": it holds no " + wanted,
                  "point tokenizer.path at the model directory or the tokenizer file itself, or set tokenizer.kind");
}

}  // namespace

bool has_tokenizer(const std::string& path_or_dir, TokenizerKind kind) {
  const fs::path path(path_or_dir);
  if (!fs::is_directory(path)) return fs::is_regular_file(path);
  if (kind != TokenizerKind::kBpe)
    for (const char* name : kSentencePieceNames)
      if (fs::is_regular_file(path / name)) return true;
  return kind != TokenizerKind::kSentencePiece && fs::is_regular_file(path / "tokenizer.json");
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path_or_dir, TokenizerKind kind) {
  const fs::path path(path_or_dir);
  if (!fs::exists(path))
    throw DataError("tokenizer " + path_or_dir + " does not exist",
                    "set tokenizer.path (or model.path) to a directory with tokenizer.json, spiece.model or "
                    "tokenizer.model");
  const std::string file = fs::is_directory(path) ? find_in_dir(path, kind) : path.string();
  if (kind == TokenizerKind::kAuto)
    kind = path.extension() == ".json" || fs::path(file).extension() == ".json" ? TokenizerKind::kBpe
                                                                                : TokenizerKind::kSentencePiece;
  const auto side = tokenizer_detail::read_side_files(file);
  if (kind == TokenizerKind::kBpe) return tokenizer_detail::load_bpe_json(file, side);
  return tokenizer_detail::load_sentencepiece(file, side);
}

std::vector<std::int32_t> encode_for_training(const Tokenizer& tokenizer, std::string_view text, bool add_eos) {
  const SpecialTokenTemplate special = tokenizer.special_token_template();
  const auto eos = tokenizer.eos_id();
  std::vector<std::int32_t> ids = special.prefix;
  const std::vector<std::int32_t> body = tokenizer.encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  std::vector<std::int32_t> suffix = special.suffix;
  if (!add_eos && eos && !suffix.empty() && suffix.back() == *eos) suffix.pop_back();
  ids.insert(ids.end(), suffix.begin(), suffix.end());
  if (add_eos && eos && (ids.empty() || ids.back() != *eos)) ids.push_back(*eos);
  return ids;
}

}  // namespace trainer
