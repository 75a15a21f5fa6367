// A tokenizer without a vocabulary, for pre-tokenized records and a model directory without tokenizer files (see
// ids_only_tokenizer in trainer/tokenizer.h): the ids the data pipeline needs come from the model's config files.
#include <filesystem>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "tokenizer/tokenizer_files.h"
#include "trainer/errors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

// `key` from the first of `files` that has a non-null value: an id, or a list of ids (its first). The file's name
// goes into `from`.
std::optional<std::int32_t> token_id(const std::vector<std::pair<fs::path, nlohmann::json>>& files, const char* key,
                                     std::string& from) {
  for (const auto& [path, json] : files) {
    if (!json.is_object() || !json.contains(key) || json[key].is_null()) continue;
    const auto& value = json[key].is_array() && !json[key].empty() ? json[key][0] : json[key];
    if (!value.is_number_integer() || value.get<std::int64_t>() < 0)
      throw DataError(path.string() + ": \"" + key + "\" is " + json[key].dump() + ", not a token id",
                      "write the id as a non-negative integer (or a list of them)");
    from = path.filename().string();
    return value.get<std::int32_t>();
  }
  return std::nullopt;
}

class IdsOnlyTokenizer final : public Tokenizer {
 public:
  IdsOnlyTokenizer(std::string dir, std::string source, std::int64_t vocab, std::optional<std::int32_t> eos,
                   std::optional<std::int32_t> pad)
      : dir_(std::move(dir)), source_(std::move(source)), vocab_(vocab), eos_(eos), pad_(pad) {}

  std::vector<std::int32_t> encode(std::string_view) const override { throw needs_tokenizer("encoding text"); }
  std::string decode(std::span<const std::int32_t>, bool) const override { throw needs_tokenizer("decoding ids"); }
  std::int64_t vocab_size() const override { return vocab_; }
  std::optional<std::int32_t> eos_id() const override { return eos_; }
  std::optional<std::int32_t> pad_id() const override { return pad_; }
  std::optional<std::int32_t> bos_id() const override { return std::nullopt; }
  std::optional<std::int32_t> token_to_id(std::string_view) const override { return std::nullopt; }
  SpecialTokenTemplate special_token_template() const override { return {}; }
  const std::string& source() const override { return source_; }

 private:
  UsageError needs_tokenizer(const char* what) const {
    return UsageError(std::string(what) + " needs a tokenizer, and " + dir_ +
                          " has no tokenizer files (tokenizer.json, spiece.model or tokenizer.model): records with "
                          "text fields (input/target, text, prompt/completion) are tokenized with it",
                      "set tokenizer.path to the model's tokenizer (or copy its tokenizer files into " + dir_ +
                          "), or give every record pre-tokenized \"input_ids\" (and \"labels\")");
  }

  std::string dir_, source_;
  std::int64_t vocab_;
  std::optional<std::int32_t> eos_, pad_;
};

}  // namespace

std::unique_ptr<Tokenizer> ids_only_tokenizer(const std::string& model_dir) {
  const fs::path dir(model_dir);
  const fs::path config_path = dir / "config.json", generation_path = dir / "generation_config.json";
  const nlohmann::json config = tokenizer_detail::read_json_if_present(config_path.string());
  if (!config.is_object())
    throw DataError(model_dir + " has neither tokenizer files nor a config.json",
                    "point model.path at a Hugging Face model directory");
  const std::vector<std::pair<fs::path, nlohmann::json>> files = {{config_path, config},
                                                                  {generation_path, tokenizer_detail::read_json_if_present(generation_path.string())}};
  std::string vocab_from, eos_from, pad_from;
  const auto vocab = token_id(files, "vocab_size", vocab_from);
  if (!vocab)
    throw DataError(config_path.string() + " has no \"vocab_size\"", "restore the file from the model's repository");
  const auto eos = token_id(files, "eos_token_id", eos_from);
  const auto pad = token_id(files, "pad_token_id", pad_from);
  if (!eos && !pad)
    throw DataError(model_dir + " has no tokenizer files, and neither config.json nor generation_config.json gives "
                        "\"pad_token_id\" or \"eos_token_id\": pre-tokenized batches are padded with one of them",
                    "add \"pad_token_id\": <id> to " + config_path.string() +
                        " (the id the model pads with), or set tokenizer.path to the model's tokenizer");
  return std::make_unique<IdsOnlyTokenizer>(
      model_dir, config_path.string(), *vocab, eos, pad);
}

std::unique_ptr<Tokenizer> load_run_tokenizer(const Config& config, bool samples) {
  if (!config.tokenizer.path.empty() || has_tokenizer(config.model.path, config.tokenizer.kind))
    return load_tokenizer(config.tokenizer.path.empty() ? config.model.path : config.tokenizer.path,
                          config.tokenizer.kind);
  auto tokenizer = ids_only_tokenizer(config.model.path);
  if (samples && !config.evaluation.sample_prompts.empty())
    throw UsageError("evaluation.sample_prompts needs a tokenizer (to encode the prompts and decode what the model "
                         "writes), and " + config.model.path +
                         " has no tokenizer files (tokenizer.json, spiece.model or tokenizer.model)",
                     "set evaluation.sample_prompts=[] to train on pre-tokenized records without one, or set "
                     "tokenizer.path to the model's tokenizer");
  spdlog::info("{} has no tokenizer files: pre-tokenized records (input_ids, labels) only; padding id {} and EOS id {} "
               "from its config.json / generation_config.json",
               config.model.path, tokenizer->pad_id().value_or(tokenizer->eos_id().value_or(0)),
               tokenizer->eos_id() ? std::to_string(*tokenizer->eos_id()) : std::string("(none)"));
  return tokenizer;
}

bool is_ids_only(const Tokenizer& tokenizer) { return dynamic_cast<const IdsOnlyTokenizer*>(&tokenizer) != nullptr; }

}  // namespace trainer
