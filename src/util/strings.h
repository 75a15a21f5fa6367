// Small string helpers for messages: edit distance and "did you mean" suggestions.
#pragma once

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

}  // namespace trainer
