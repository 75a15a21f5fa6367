// Unicode helpers the byte-level BPE tokenizer needs: UTF-8 checks, lossy decoding (as Rust's
// String::from_utf8_lossy), normalisation forms through utf8proc, character classes, and GPT-2's byte alphabet.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace trainer::tokenizer_detail {

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };

bool is_valid_utf8(std::string_view text);
// Invalid sequences become U+FFFD, one per maximal invalid subpart (Unicode's recommended practice, as Rust).
std::string utf8_lossy(std::string_view bytes);
// Decodes the code point at text[pos] (valid UTF-8 assumed) and advances pos.
char32_t next_code_point(std::string_view text, std::size_t& pos);
// The code point that ends just before `end` (valid UTF-8 assumed).
char32_t previous_code_point(std::string_view text, std::size_t end, std::size_t* start = nullptr);
void append_utf8(std::string& out, char32_t code_point);

std::string normalize(std::string_view text, NormalForm form);
// Rust's char::to_lowercase on every character (tokenizers' Lowercase normalizer): the Unicode lowercase
// mapping, one-to-many for U+0130; no context rules (a final capital sigma becomes a plain sigma).
std::string to_lowercase(std::string_view text);

// Rust's char::is_whitespace (the White_Space property).
bool is_whitespace(char32_t c);
// Rust's char::is_alphanumeric (letters and numbers).
bool is_alphanumeric(char32_t c);

// GPT-2's bytes_to_unicode(): every byte as a printable character, UTF-8 encoded.
const std::array<std::string, 256>& byte_to_unicode();

}  // namespace trainer::tokenizer_detail
