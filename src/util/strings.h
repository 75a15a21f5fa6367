// Small string helpers: edit distance and "did you mean" suggestions for messages, module paths.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace trainer {

// Levenshtein distance (insert, delete, substitute; each costs 1).
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word`, if it is close enough to be a plausible typo; empty otherwise.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// "a, b or c"
std::string join_alternatives(const std::vector<std::string>& items);

// "\"name\"": a name quoted in a message.
std::string in_quotes(const std::string& s);
// "[2, 3, 4]": a tensor shape in a message.
std::string shape_text(const std::vector<int64_t>& shape);

// The last component of a dotted module path: "encoder.layer.0.attention.query" -> "query".
std::string last_name(const std::string& path);

}  // namespace trainer
