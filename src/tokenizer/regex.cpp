// PCRE2 behind the Regex class: compiled once, JIT-compiled when the library supports it, matched with
// per-thread match data so one Regex serves every tokenizer worker.
#include "tokenizer/regex.h"

#include <stdexcept>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace trainer::tokenizer_detail {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
};

Regex::Regex(const std::string& pattern, bool literal) : code_(std::make_unique<Code>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  const std::uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0u);
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                              &offset, nullptr);
  if (!code_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw std::invalid_argument("regex error at offset " + std::to_string(offset) + ": " +
                                reinterpret_cast<const char*>(message));
  }
  code_->jit = pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  if (code_ && code_->code) pcre2_code_free(code_->code);
}

std::vector<std::pair<std::size_t, std::size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  find_all(text, matches);
  return matches;
}

void Regex::find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& matches) const {
  struct MatchData {
    pcre2_match_data* data = pcre2_match_data_create(4, nullptr);
    ~MatchData() { pcre2_match_data_free(data); }
  };
  thread_local MatchData match;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t start = 0;
  while (start <= text.size()) {
    const int rc = code_->jit ? pcre2_jit_match(code_->code, subject, text.size(), start, 0, match.data, nullptr)
                              : pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK,
                                            match.data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw std::runtime_error(std::string("regex match failed: ") + reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.data);
    const std::size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else {  // an empty match: step over one character
      start = end + 1;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
    }
  }
}

}  // namespace trainer::tokenizer_detail
