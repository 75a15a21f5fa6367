// SentencePiece models (T5, FLAN-T5, Llama-2: spiece.model / tokenizer.model) through libsentencepiece, so ids
// are exactly those of Python's sentencepiece. Special ids come from the model (T5: pad 0, eos 1, unk 2).
#include <filesystem>

#include <sentencepiece_processor.h>

#include "tokenizer/tokenizer_files.h"
#include "trainer/errors.h"

namespace trainer::tokenizer_detail {
namespace {

std::optional<std::int32_t> valid_id(int id) {
  if (id < 0) return std::nullopt;
  return static_cast<std::int32_t>(id);
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& file, const SideFiles& side) : source_(file) {
    const auto status = processor_.Load(file);
    if (!status.ok())
      throw DataError("cannot read SentencePiece model " + file + ": " + status.ToString(),
                      "a SentencePiece tokenizer is a spiece.model or tokenizer.model file (protobuf); for a "
                      "tokenizer.json set tokenizer.kind=bpe");
    eos_ = valid_id(processor_.eos_id());
    pad_ = valid_id(processor_.pad_id());
    bos_ = valid_id(processor_.bos_id());
    if (auto token = config_token(side, "pad_token"); token && !pad_) pad_ = token_to_id(*token);

    // transformers: T5Tokenizer appends </s>; LlamaTokenizer prepends <s> (add_bos_token=True,
    // add_eos_token=False); tokenizer_config.json may say otherwise.
    const bool is_t5 = std::filesystem::path(file).filename() == "spiece.model" ||
                       (side.model_config.is_object() && side.model_config.value("model_type", "") == "t5");
    const bool add_bos = config_flag(side, "add_bos_token").value_or(!is_t5);
    const bool add_eos = config_flag(side, "add_eos_token").value_or(is_t5);
    if (add_bos && bos_) template_.prefix.push_back(*bos_);
    if (add_eos && eos_) template_.suffix.push_back(*eos_);
  }

  std::vector<std::int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw DataError("SentencePiece (" + source_ + ") cannot encode a text: " + status.ToString());
    return {ids.begin(), ids.end()};
  }

  std::string decode(std::span<const std::int32_t> ids, bool skip_special) const override {
    std::vector<int> known;
    known.reserve(ids.size());
    bool has_control = false;
    for (const std::int32_t id : ids) {
      if (id < 0 || id >= processor_.GetPieceSize()) continue;
      known.push_back(id);
      has_control = has_control || processor_.IsControl(id);
    }
    if (skip_special || !has_control) {
      std::string text;
      const auto status = processor_.Decode(known, &text);
      if (!status.ok()) throw DataError("SentencePiece (" + source_ + ") cannot decode: " + status.ToString());
      return text;
    }
    // sentencepiece drops control symbols (</s>, <pad>); spell them out where they stand, as transformers does.
    const auto proto = processor_.DecodeIdsAsImmutableProto(known);
    std::string text;
    for (std::size_t i = 0; i < proto.pieces_size(); ++i) {
      const auto piece = proto.pieces(static_cast<int>(i));
      text += processor_.IsControl(static_cast<int>(piece.id())) ? piece.piece() : piece.surface();
    }
    return text;
  }

  std::int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::optional<std::int32_t> eos_id() const override { return eos_; }
  std::optional<std::int32_t> pad_id() const override { return pad_; }
  std::optional<std::int32_t> bos_id() const override { return bos_; }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    const int id = processor_.PieceToId(token);
    if (id == processor_.unk_id() && token != processor_.IdToPiece(id)) return std::nullopt;
    return id;
  }
  SpecialTokenTemplate special_token_template() const override { return template_; }
  const std::string& source() const override { return source_; }

 private:
  sentencepiece::SentencePieceProcessor processor_;
  std::string source_;
  std::optional<std::int32_t> eos_, pad_, bos_;
  SpecialTokenTemplate template_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& file, const SideFiles& side) {
  return std::make_unique<SentencePieceTokenizer>(file, side);
}

}  // namespace trainer::tokenizer_detail
