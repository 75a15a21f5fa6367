// Record mapping: JSON fields -> token ids -> Example, with the bad-record and over-length rules (see record.h).
#include "data/record.h"

#include "data/table_file.h"

#include <cstdint>
#include <cstring>

#include <nlohmann/json.hpp>

#include "data/chat_record.h"

namespace trainer::data {
namespace {

using nlohmann::json;

Outcome bad(std::string what) { return bad_record(std::move(what)); }

bool is_whitespace_only(std::string_view text) {
  for (char c : text)
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return false;
  return true;
}

// The string in `field`, or the reason it cannot be used.
const std::string* string_field(const json& record, const std::string& field, std::string& problem) {
  const auto it = record.find(field);
  if (it == record.end()) {
    problem = "missing field \"" + field + "\"";
    return nullptr;
  }
  if (!it->is_string()) {
    problem = "field \"" + field + "\" must be a string, not " + std::string(it->type_name());
    return nullptr;
  }
  return &it->get_ref<const std::string&>();
}

// An array of token ids, each in [0, vocab_size) (or -100 where `allow_ignore`).
bool id_array(const json& value, const char* field, std::int64_t vocab_size, bool allow_ignore,
              std::vector<std::int32_t>& ids, std::string& problem) {
  if (!value.is_array()) {
    problem = std::string("field \"") + field + "\" must be an array of integers, not " + value.type_name();
    return false;
  }
  ids.reserve(value.size());
  for (std::size_t i = 0; i < value.size(); ++i) {
    const json& element = value[i];
    if (!element.is_number_integer()) {
      problem = std::string("field \"") + field + "\"[" + std::to_string(i) + "] must be an integer, not " +
                element.type_name();
      return false;
    }
    const std::int64_t id = element.get<std::int64_t>();
    if ((id < 0 || id >= vocab_size) && !(allow_ignore && id == -100)) {
      problem = std::string("field \"") + field + "\"[" + std::to_string(i) + "] = " + std::to_string(id) +
                " is outside the tokenizer's vocabulary [0, " + std::to_string(vocab_size) + ")" +
                (allow_ignore ? " (and not -100)" : "");
      return false;
    }
    ids.push_back(static_cast<std::int32_t>(id));
  }
  return true;
}

// Cuts `ids` to `max`; when the sequence ended in EOS it still does, as transformers' truncation keeps the
// special tokens of the template.
void truncate_keeping_eos(std::vector<std::int32_t>& ids, std::size_t max, bool ends_in_eos) {
  if (ids.size() <= max) return;
  const std::int32_t last = ids.back();
  ids.resize(max);
  if (ends_in_eos && max > 0) ids.back() = last;
}

// The length policy for seq2seq: encoder input and decoder targets each have their own maximum.
Outcome finish_seq2seq(Example example, const MappingSpec& spec, bool keep_eos, std::optional<std::int32_t> eos) {
  const auto max_input = static_cast<std::size_t>(spec.max_input_length);
  const auto max_target = static_cast<std::size_t>(spec.max_target_length);
  const bool too_long = example.input_ids.size() > max_input || example.labels.size() > max_target;
  if (too_long && spec.on_overlength == OverlengthPolicy::kSkip)
    return overlength_skipped(std::to_string(example.input_ids.size()) + " input and " +
                              std::to_string(example.labels.size()) + " target tokens, more than data.max_input_length = " +
                              std::to_string(max_input) + " or data.max_target_length = " + std::to_string(max_target));
  Outcome outcome;
  if (too_long) {
    const bool input_eos = keep_eos && eos && !example.input_ids.empty() && example.input_ids.back() == *eos;
    const bool target_eos = keep_eos && eos && !example.labels.empty() && example.labels.back() == *eos;
    truncate_keeping_eos(example.input_ids, max_input, input_eos);
    truncate_keeping_eos(example.labels, max_target, target_eos);
    outcome.truncated = true;
  }
  outcome.example = std::move(example);
  return outcome;
}

Outcome map_pretokenized(const json& record, const MappingSpec& spec, const Tokenizer& tokenizer) {
  const std::int64_t vocab = tokenizer.vocab_size();
  Example example;
  std::string problem;
  if (!id_array(record["input_ids"], "input_ids", vocab, false, example.input_ids, problem)) return bad(problem);
  if (example.input_ids.empty()) return bad("field \"input_ids\" is empty");
  const auto labels = record.find("labels");
  const bool has_labels = labels != record.end() && !labels->is_null();
  if (has_labels && !id_array(*labels, "labels", vocab, true, example.labels, problem)) return bad(problem);
  if (spec.family == DataFamily::kSeq2Seq) {
    if (!has_labels) return bad("missing field \"labels\" (a pre-tokenized seq2seq record needs decoder targets)");
    if (example.labels.empty()) return bad("field \"labels\" is empty");
    return finish_seq2seq(std::move(example), spec, false, std::nullopt);
  }
  if (!has_labels) {
    example.labels = example.input_ids;
  } else if (example.labels.size() != example.input_ids.size()) {
    return bad("fields \"input_ids\" and \"labels\" differ in length (" + std::to_string(example.input_ids.size()) +
               " and " + std::to_string(example.labels.size()) + ")");
  }
  return finish_causal(std::move(example), spec);
}

Outcome map_seq2seq(const json& record, const MappingSpec& spec, const Tokenizer& tokenizer) {
  std::string problem;
  const std::string* input = string_field(record, spec.input_field, problem);
  if (!input) return bad(problem);
  const std::string* target = string_field(record, spec.target_field, problem);
  if (!target) return bad(problem);
  if (is_whitespace_only(*target)) return bad("empty target (field \"" + spec.target_field + "\")");
  Example example;
  // transformers' T5 tokenizer appends </s> to every sequence it encodes, the encoder input included.
  example.input_ids = encode_for_training(tokenizer, *input, true);
  example.labels = encode_for_training(tokenizer, *target, spec.add_eos);
  return finish_seq2seq(std::move(example), spec, true, tokenizer.eos_id());
}

Outcome map_causal(const json& record, const MappingSpec& spec, const Tokenizer& tokenizer) {
  std::string problem;
  Example example;
  const bool prompt_form = record.contains(spec.prompt_field) || record.contains(spec.completion_field) ||
                           !record.contains(spec.text_field);
  if (!prompt_form) {
    const std::string* text = string_field(record, spec.text_field, problem);
    if (!text) return bad(problem);
    if (is_whitespace_only(*text)) return bad("empty text (field \"" + spec.text_field + "\")");
    example.input_ids = encode_for_training(tokenizer, *text, spec.add_eos);
    example.labels = example.input_ids;
    return finish_causal(std::move(example), spec);
  }
  const std::string* prompt = string_field(record, spec.prompt_field, problem);
  if (!prompt) {
    if (!record.contains(spec.prompt_field) && !record.contains(spec.completion_field))
      return bad("missing field \"" + spec.text_field + "\" (or \"" + spec.prompt_field + "\" and \"" +
                 spec.completion_field + "\")");
    return bad(problem);
  }
  const std::string* completion = string_field(record, spec.completion_field, problem);
  if (!completion) return bad(problem);
  if (is_whitespace_only(*completion)) return bad("empty completion (field \"" + spec.completion_field + "\")");
  // Prompt and completion are tokenized apart and concatenated: the prompt's ids are then exactly what
  // generation sees when it is given the prompt alone, and the loss mask falls on a token boundary. (Tokenizing
  // the joined text could merge across the boundary: a token half prompt, half completion.)
  example.input_ids = encode_for_training(tokenizer, *prompt, false);
  const std::size_t prompt_tokens = example.input_ids.size();
  const std::vector<std::int32_t> body = tokenizer.encode(*completion);
  example.input_ids.insert(example.input_ids.end(), body.begin(), body.end());
  if (spec.add_eos)
    if (const auto eos = tokenizer.eos_id()) example.input_ids.push_back(*eos);
  example.labels = example.input_ids;
  std::fill(example.labels.begin(), example.labels.begin() + static_cast<std::ptrdiff_t>(prompt_tokens), -100);
  if (target_tokens(example, DataFamily::kCausal) == 0)
    return bad("empty completion (field \"" + spec.completion_field + "\" has no tokens)");
  return finish_causal(std::move(example), spec);
}

}  // namespace

// One sequence of at most max_length tokens, cut at the end (an EOS is not put back: a completion cut
// mid-sentence must not teach the model to stop there).
Outcome finish_causal(Example example, const MappingSpec& spec) {
  const auto max_length = static_cast<std::size_t>(spec.max_length);
  Outcome outcome;
  if (example.input_ids.size() > max_length) {
    if (spec.on_overlength == OverlengthPolicy::kSkip)
      return overlength_skipped(std::to_string(example.input_ids.size()) + " tokens, more than data.max_length = " +
                                std::to_string(max_length));
    example.input_ids.resize(max_length);
    example.labels.resize(max_length);
    outcome.truncated = true;
    if (target_tokens(example, DataFamily::kCausal) == 0)
      return overlength_skipped("the prompt fills data.max_length = " + std::to_string(max_length) +
                                " tokens: no completion token is left to train on");
  }
  outcome.example = std::move(example);
  return outcome;
}

MappingSpec mapping_spec(const Config& config, DataFamily family) {
  const DataConfig& d = config.data;
  MappingSpec spec;
  spec.family = family;
  spec.input_field = d.input_field;
  spec.target_field = d.target_field;
  spec.text_field = d.text_field;
  spec.prompt_field = d.prompt_field;
  spec.completion_field = d.completion_field;
  spec.max_input_length = d.max_input_length;
  spec.max_target_length = d.max_target_length;
  spec.max_length = d.max_length;
  spec.on_overlength = d.on_overlength;
  spec.add_eos = config.tokenizer.add_eos;
  if (family == DataFamily::kCausal) spec.chat = load_chat_setup(config);
  return spec;
}

std::size_t find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    // Eight ASCII bytes at a time.
    std::uint64_t eight = 0;
    if (i + sizeof eight <= n && (std::memcpy(&eight, s + i, sizeof eight), (eight & 0x8080808080808080ULL) == 0)) {
      i += sizeof eight;
      continue;
    }
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t length = 0;
    std::uint32_t min = 0, code = 0;
    if ((c & 0xE0) == 0xC0) length = 2, min = 0x80, code = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) length = 3, min = 0x800, code = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) length = 4, min = 0x10000, code = c & 0x07;
    else return i;
    if (i + length > n) return i;
    for (std::size_t k = 1; k < length; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      code = (code << 6) | (s[i + k] & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return i;
    i += length;
  }
  return std::string_view::npos;
}

Outcome bad_record(std::string what, std::string hint, bool fatal) {
  Outcome outcome;
  outcome.kind = OutcomeKind::kBadRecord;
  outcome.problem = std::move(what);
  outcome.hint = std::move(hint);
  outcome.fatal = fatal;
  return outcome;
}

Outcome overlength_skipped(std::string what) {
  Outcome outcome;
  outcome.kind = OutcomeKind::kOverlengthSkipped;
  outcome.problem = std::move(what);
  return outcome;
}

Outcome map_record(std::string_view line, const MappingSpec& spec, const Tokenizer& tokenizer) {
  if (const std::size_t at = find_invalid_utf8(line); at != std::string_view::npos)
    return bad("invalid UTF-8 at byte " + std::to_string(at + 1) + " of the line");
  // A chat record is parsed once, with its keys in their order (templates write tools and tool-call arguments as
  // given, tojson); anything else, and any line that does not parse, takes the path below.
  if (line.find(std::string_view("\"messages\"")) != std::string_view::npos) {
    nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (ordered.is_object() && !ordered.contains("input_ids") && ordered.contains(kMessagesField))
      return map_chat(ordered, spec, tokenizer);
  }
  json record;
  try {
    record = json::parse(line);
  } catch (const json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ..." -> from "column"
    std::string what = e.what();
    if (const auto column = what.find("column"); column != std::string::npos) what = what.substr(column);
    return bad("invalid JSON (" + what + ")");
  }
  if (!record.is_object()) return bad(std::string("the record is a JSON ") + record.type_name() + ", not an object");
  if (record.contains("input_ids")) return map_pretokenized(record, spec, tokenizer);
  if (record.contains(kMessagesField)) {
    // Again with the keys in their order: templates write tools and tool-call arguments as given (tojson).
    return map_chat(nlohmann::ordered_json::parse(line), spec, tokenizer);
  }
  return spec.family == DataFamily::kSeq2Seq ? map_seq2seq(record, spec, tokenizer)
                                             : map_causal(record, spec, tokenizer);
}

Outcome map_table_row(const TableRows& rows, std::uint64_t row, std::string& scratch, const MappingSpec& spec,
                      const Tokenizer& tokenizer) {
  json record;
  if (rows.has_column(kMessagesField) || !rows.object(row, record)) {
    rows.render(row, scratch);
    return map_record(scratch, spec, tokenizer);
  }
  if (record.contains("input_ids")) return map_pretokenized(record, spec, tokenizer);
  return spec.family == DataFamily::kSeq2Seq ? map_seq2seq(record, spec, tokenizer)
                                             : map_causal(record, spec, tokenizer);
}

}  // namespace trainer::data
