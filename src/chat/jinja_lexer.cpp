// The Jinja lexer: jinja2's tokenizer as transformers configures it (trim_blocks=True, lstrip_blocks=True), turning
// a template into text, tag and expression tokens, each with its line and column for error messages.
#include <algorithm>
#include <cctype>

#include "chat/jinja_internal.h"

namespace trainer::chat::jinja {

namespace {

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // jinja2 normalises newlines and, without keep_trailing_newline, drops one newline at the very end.
    src_.reserve(source.size());
    for (std::size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r' && i + 1 < source.size() && source[i + 1] == '\n') continue;
      src_ += source[i] == '\r' ? '\n' : source[i];
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    for (std::size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> run() {
    std::size_t pos = 0;
    bool strip_next = false;
    while (pos <= src_.size()) {
      std::size_t tag = find_tag(pos);
      std::string text = src_.substr(pos, tag == std::string::npos ? std::string::npos : tag - pos);
      Pos text_pos = position(pos);
      std::size_t text_start = pos;
      if (strip_next) {
        std::size_t first = 0;
        while (first < text.size() && is_space(text[first])) ++first;
        text.erase(0, first);
        text_start += first;
        text_pos = position(text_start);
        strip_next = false;
      }
      if (tag == std::string::npos) {
        if (!text.empty()) tokens_.push_back({Tok::kText, text, text_pos});
        break;
      }
      char kind = src_[tag + 1];
      char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (sign == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (sign != '+' && (kind == '%' || kind == '#')) {
        // lstrip_blocks: whitespace from the start of the line to a block or comment tag goes.
        std::size_t newline = text.rfind('\n');
        std::size_t line_start = newline == std::string::npos ? 0 : newline + 1;
        bool at_line_start = newline != std::string::npos || pos == 0 || src_[pos - 1] == '\n';
        if (at_line_start &&
            std::all_of(text.begin() + static_cast<std::ptrdiff_t>(line_start), text.end(),
                        [](char c) { return c == ' ' || c == '\t'; })) {
          text.erase(line_start);
        }
      }
      if (!text.empty()) tokens_.push_back({Tok::kText, text, text_pos});
      std::size_t inner = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        std::size_t end = src_.find("#}", inner);
        if (end == std::string::npos) fail(Kind::kSyntax, "unclosed comment: missing '#}'", position(tag));
        bool minus = end > inner && src_[end - 1] == '-';
        pos = end + 2;
        if (minus) strip_next = true;
        else if (pos < src_.size() && src_[pos] == '\n') ++pos;  // trim_blocks applies to comments too
        continue;
      }
      bool block = kind == '%';
      tokens_.push_back({block ? Tok::kBlockBegin : Tok::kVarBegin, "", position(tag)});
      std::size_t first_token = tokens_.size();
      pos = lex_inside(inner, block, strip_next, tag);
      if (block && tokens_.size() > first_token + 1 && tokens_[first_token].type == Tok::kName &&
          tokens_[first_token].text == "raw") {
        pos = lex_raw(pos, tag);
      }
    }
    tokens_.push_back({Tok::kEof, "", position(src_.size())});
    return std::move(tokens_);
  }

 private:
  Pos position(std::size_t offset) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    std::size_t line_index = static_cast<std::size_t>(it - line_starts_.begin()) - 1;
    std::size_t column = code_point_count(src_.substr(line_starts_[line_index], offset - line_starts_[line_index]));
    return {static_cast<int>(line_index + 1), static_cast<int>(column + 1)};
  }

  std::size_t find_tag(std::size_t from) const {
    for (std::size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  // Tokens of one {{ }} or {% %}; returns the offset after the closing delimiter.
  std::size_t lex_inside(std::size_t i, bool block, bool& strip_next, std::size_t tag) {
    int depth = 0;
    const char close = block ? '%' : '}';
    while (true) {
      while (i < src_.size() && is_space(src_[i])) ++i;
      if (i >= src_.size()) fail(Kind::kSyntax, block ? "unclosed tag: missing '%}'" : "unclosed '{{': missing '}}'",
                                 position(tag));
      if (depth == 0) {
        std::size_t j = i;
        char sign = '\0';
        if ((src_[j] == '-' || src_[j] == '+') && j + 1 < src_.size() && src_[j + 1] == close) sign = src_[j++];
        if (j + 1 < src_.size() && src_[j] == close && src_[j + 1] == '}') {
          tokens_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, "", position(i)});
          std::size_t after = j + 2;
          if (sign == '-') strip_next = true;
          else if (block && sign != '+' && after < src_.size() && src_[after] == '\n') ++after;  // trim_blocks
          return after;
        }
      }
      Pos here = position(i);
      char c = src_[i];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        std::size_t j = i;
        while (j < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        tokens_.push_back({Tok::kName, src_.substr(i, j - i), here});
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        std::size_t j = i;
        bool is_float = false;
        while (j < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        if (j + 1 < src_.size() && src_[j] == '.' && std::isdigit(static_cast<unsigned char>(src_[j + 1]))) {
          is_float = true;
          ++j;
          while (j < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        }
        if (j < src_.size() && (src_[j] == 'e' || src_[j] == 'E')) {
          std::size_t k = j + 1;
          if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
          if (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) {
            is_float = true;
            j = k;
            while (j < src_.size() && std::isdigit(static_cast<unsigned char>(src_[j]))) ++j;
          }
        }
        std::string digits;
        for (std::size_t k = i; k < j; ++k) {
          if (src_[k] != '_') digits += src_[k];
        }
        tokens_.push_back({is_float ? Tok::kFloat : Tok::kInt, digits, here});
        i = j;
      } else if (c == '\'' || c == '"') {
        i = lex_string(i, here);
      } else {
        static const char* const kTwo[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op(1, c);
        for (const char* two : kTwo) {
          if (src_.compare(i, 2, two) == 0) op = two;
        }
        if (op.size() == 1 && std::string("+-*/%~<>=()[]{},.:|!").find(c) == std::string::npos) {
          fail(Kind::kSyntax, std::string("unexpected character '") + c + "'", here);
        }
        if (c == '(' || c == '[' || c == '{') ++depth;
        if (c == ')' || c == ']' || c == '}') --depth;
        tokens_.push_back({Tok::kOp, op, here});
        i += op.size();
      }
    }
  }

  std::size_t lex_string(std::size_t i, Pos here) {
    char quote = src_[i++];
    std::string value;
    while (true) {
      if (i >= src_.size()) fail(Kind::kSyntax, "unterminated string", here);
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\' || i + 1 >= src_.size()) {
        value += c;
        ++i;
        continue;
      }
      char e = src_[i + 1];
      i += 2;
      auto hex = [&](int count) {
        if (i + static_cast<std::size_t>(count) > src_.size()) fail(Kind::kSyntax, "truncated escape in string", here);
        std::uint32_t cp = static_cast<std::uint32_t>(
            std::stoul(src_.substr(i, static_cast<std::size_t>(count)), nullptr, 16));
        i += static_cast<std::size_t>(count);
        append_utf8(value, cp);
      };
      switch (e) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case '0': value += '\0'; break;
        case 'a': value += '\a'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\\': value += '\\'; break;
        case '\'': value += '\''; break;
        case '"': value += '"'; break;
        case '\n': break;
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default:
          value += '\\';
          value += e;
      }
    }
    tokens_.push_back({Tok::kString, value, here});
    return i + 1;
  }

  // {% raw %}...{% endraw %}: the text between is output as it stands.
  std::size_t lex_raw(std::size_t pos, std::size_t tag) {
    for (std::size_t i = src_.find("{%", pos); i != std::string::npos; i = src_.find("{%", i + 2)) {
      std::size_t j = i + 2;
      bool minus_before = j < src_.size() && src_[j] == '-';
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
      while (j < src_.size() && is_space(src_[j])) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && is_space(src_[j])) ++j;
      bool minus_after = j < src_.size() && src_[j] == '-';
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
      if (src_.compare(j, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos, i - pos);
      if (minus_before) {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      }
      if (!text.empty()) tokens_.push_back({Tok::kText, text, position(pos)});
      tokens_.push_back({Tok::kBlockBegin, "", position(i)});
      tokens_.push_back({Tok::kName, "endraw", position(i)});
      tokens_.push_back({Tok::kBlockEnd, "", position(j)});
      std::size_t after = j + 2;
      if (minus_after) {
        while (after < src_.size() && is_space(src_[after])) ++after;
      } else if (after < src_.size() && src_[after] == '\n') {
        ++after;
      }
      return after;
    }
    fail(Kind::kSyntax, "missing {% endraw %}", position(tag));
  }

  std::string src_;
  std::vector<std::size_t> line_starts_{0};
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(source).run(); }

}  // namespace trainer::chat::jinja
