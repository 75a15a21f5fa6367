// A compiled PCRE2 pattern (UTF + UCP, JIT when available) for the pre-tokenizers' split patterns: \p{L},
// \p{N}, lookahead and (?i:...) behave as in the Oniguruma regexes Hugging Face tokenizers uses.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainer::tokenizer_detail {

class Regex {
 public:
  // `literal`: the pattern is a plain string (tokenizers' {"String": ...} patterns). Throws std::invalid_argument
  // with PCRE2's message when the pattern does not compile.
  Regex(const std::string& pattern, bool literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The [begin, end) byte ranges of every non-overlapping match, left to right; empty matches are left out.
  // `text` must be valid UTF-8 (checked once by the caller). Thread-safe.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view text) const;
  // The same, appended to `matches` (which the caller may reuse from text to text).
  void find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& matches) const;

 private:
  struct Code;
  std::unique_ptr<Code> code_;
};

}  // namespace trainer::tokenizer_detail
