// nltk's PorterStemmer in its default NLTK_EXTENSIONS mode, rule for rule (nltk/stem/porter.py), so that
// rouge_score's use_stemmer=True gives the same tokens here as in Python.
#include <array>
#include <string>
#include <string_view>
#include <utility>

#include "eval/metrics.h"

namespace trainer::eval {
namespace {

bool is_vowel(char c) { return c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u'; }

// nltk's _consonant_flags: 'y' is a consonant at the start and after a vowel, a vowel after a consonant.
bool is_consonant(std::string_view word, std::size_t i) {
  bool flag = true;
  for (std::size_t k = 0; k <= i; ++k) {
    if (is_vowel(word[k])) {
      flag = false;
    } else if (word[k] == 'y') {
      flag = k == 0 ? true : !flag;
    } else {
      flag = true;
    }
  }
  return flag;
}

// The number of "vc" in the consonant/vowel pattern.
int measure(std::string_view stem) {
  int count = 0;
  bool previous_vowel = false;
  for (std::size_t i = 0; i < stem.size(); ++i) {
    const bool consonant = is_consonant(stem, i);
    if (consonant && previous_vowel) ++count;
    previous_vowel = !consonant;
  }
  return count;
}

bool contains_vowel(std::string_view stem) {
  for (std::size_t i = 0; i < stem.size(); ++i) {
    if (!is_consonant(stem, i)) return true;
  }
  return false;
}

bool ends_double_consonant(std::string_view word) {
  const std::size_t n = word.size();
  return n >= 2 && word[n - 1] == word[n - 2] && is_consonant(word, n - 1);
}

bool ends_cvc(std::string_view word) {
  const std::size_t n = word.size();
  if (n >= 3 && is_consonant(word, n - 3) && !is_consonant(word, n - 2) && is_consonant(word, n - 1) &&
      word[n - 1] != 'w' && word[n - 1] != 'x' && word[n - 1] != 'y') {
    return true;
  }
  // The NLTK extension: a two-letter vowel-consonant word counts as cvc.
  return n == 2 && !is_consonant(word, 0) && is_consonant(word, 1);
}

bool ends_with(std::string_view word, std::string_view suffix) {
  return word.size() >= suffix.size() && word.substr(word.size() - suffix.size()) == suffix;
}

enum class Condition { kNone, kPositiveMeasure, kMeasureAbove1 };

struct Rule {
  std::string_view suffix;
  std::string_view replacement;
  Condition condition;
};

bool holds(Condition condition, std::string_view stem) {
  switch (condition) {
    case Condition::kNone: return true;
    case Condition::kPositiveMeasure: return measure(stem) > 0;
    case Condition::kMeasureAbove1: return measure(stem) > 1;
  }
  return false;
}

// nltk's _apply_rule_list: the first rule whose suffix matches decides, even when its condition fails.
template <std::size_t N>
std::string apply_rules(const std::string& word, const std::array<Rule, N>& rules) {
  for (const Rule& rule : rules) {
    if (ends_with(word, rule.suffix)) {
      const std::string stem = word.substr(0, word.size() - rule.suffix.size());
      if (holds(rule.condition, stem)) return stem + std::string(rule.replacement);
      return word;
    }
  }
  return word;
}

std::string step1a(const std::string& word) {
  if (word.size() == 4 && ends_with(word, "ies")) return word.substr(0, 1) + "ie";
  static constexpr std::array<Rule, 4> kRules{{{"sses", "ss", Condition::kNone},
                                               {"ies", "i", Condition::kNone},
                                               {"ss", "ss", Condition::kNone},
                                               {"s", "", Condition::kNone}}};
  return apply_rules(word, kRules);
}

std::string step1b(const std::string& word) {
  if (ends_with(word, "ied")) return word.substr(0, word.size() - 3) + (word.size() == 4 ? "ie" : "i");
  if (ends_with(word, "eed")) {
    const std::string stem = word.substr(0, word.size() - 3);
    return measure(stem) > 0 ? stem + "ee" : word;
  }
  std::string stem;
  bool found = false;
  for (std::string_view suffix : {std::string_view("ed"), std::string_view("ing")}) {
    if (ends_with(word, suffix)) {
      stem = word.substr(0, word.size() - suffix.size());
      if (contains_vowel(stem)) {
        found = true;
        break;
      }
    }
  }
  if (!found) return word;
  if (ends_with(stem, "at")) return stem + "e";
  if (ends_with(stem, "bl")) return stem + "e";
  if (ends_with(stem, "iz")) return stem + "e";
  if (ends_double_consonant(stem)) {
    const char last = stem.back();
    // nltk's "*d" rule drops the doubled pair and appends the last letter back, unless it is l, s or z.
    if (last != 'l' && last != 's' && last != 'z') return stem.substr(0, stem.size() - 1);
    return stem;
  }
  if (measure(stem) == 1 && ends_cvc(stem)) return stem + "e";
  return stem;
}

std::string step1c(const std::string& word) {
  if (!ends_with(word, "y")) return word;
  const std::string stem = word.substr(0, word.size() - 1);
  if (stem.size() > 1 && is_consonant(stem, stem.size() - 1)) return stem + "i";
  return word;
}

std::string step2(const std::string& word) {
  if (ends_with(word, "alli") && measure(std::string_view(word).substr(0, word.size() - 4)) > 0) {
    return step2(word.substr(0, word.size() - 4) + "al");
  }
  static constexpr std::array<Rule, 21> kRules{{
      {"ational", "ate", Condition::kPositiveMeasure}, {"tional", "tion", Condition::kPositiveMeasure},
      {"enci", "ence", Condition::kPositiveMeasure},   {"anci", "ance", Condition::kPositiveMeasure},
      {"izer", "ize", Condition::kPositiveMeasure},    {"bli", "ble", Condition::kPositiveMeasure},
      {"alli", "al", Condition::kPositiveMeasure},     {"entli", "ent", Condition::kPositiveMeasure},
      {"eli", "e", Condition::kPositiveMeasure},       {"ousli", "ous", Condition::kPositiveMeasure},
      {"ization", "ize", Condition::kPositiveMeasure}, {"ation", "ate", Condition::kPositiveMeasure},
      {"ator", "ate", Condition::kPositiveMeasure},    {"alism", "al", Condition::kPositiveMeasure},
      {"iveness", "ive", Condition::kPositiveMeasure}, {"fulness", "ful", Condition::kPositiveMeasure},
      {"ousness", "ous", Condition::kPositiveMeasure}, {"aliti", "al", Condition::kPositiveMeasure},
      {"iviti", "ive", Condition::kPositiveMeasure},   {"biliti", "ble", Condition::kPositiveMeasure},
      {"fulli", "ful", Condition::kPositiveMeasure},
  }};
  for (const Rule& rule : kRules) {
    if (ends_with(word, rule.suffix)) return apply_rules(word, std::array<Rule, 1>{rule});
  }
  // nltk's "logi" rule tests the measure of the word without "ogi" (the stem keeps its 'l').
  if (ends_with(word, "logi")) {
    return measure(std::string_view(word).substr(0, word.size() - 3)) > 0 ? word.substr(0, word.size() - 1)
                                                                          : word;
  }
  return word;
}

std::string step3(const std::string& word) {
  static constexpr std::array<Rule, 7> kRules{{{"icate", "ic", Condition::kPositiveMeasure},
                                               {"ative", "", Condition::kPositiveMeasure},
                                               {"alize", "al", Condition::kPositiveMeasure},
                                               {"iciti", "ic", Condition::kPositiveMeasure},
                                               {"ical", "ic", Condition::kPositiveMeasure},
                                               {"ful", "", Condition::kPositiveMeasure},
                                               {"ness", "", Condition::kPositiveMeasure}}};
  return apply_rules(word, kRules);
}

std::string step4(const std::string& word) {
  static constexpr std::array<std::string_view, 19> kSuffixes{
      "al",   "ance", "ence", "er",  "ic", "able", "ible", "ant", "ement", "ment",
      "ent",  "ion",  "ou",   "ism", "ate", "iti", "ous",  "ive", "ize"};
  for (std::string_view suffix : kSuffixes) {
    if (!ends_with(word, suffix)) continue;
    const std::string stem = word.substr(0, word.size() - suffix.size());
    bool ok = measure(stem) > 1;
    if (suffix == "ion") ok = ok && !stem.empty() && (stem.back() == 's' || stem.back() == 't');
    return ok ? stem : word;
  }
  return word;
}

std::string step5a(const std::string& word) {
  if (!ends_with(word, "e")) return word;
  const std::string stem = word.substr(0, word.size() - 1);
  const int m = measure(stem);
  if (m > 1) return stem;
  if (m == 1 && !ends_cvc(stem)) return stem;
  return word;
}

std::string step5b(const std::string& word) {
  if (ends_with(word, "ll") && measure(std::string_view(word).substr(0, word.size() - 1)) > 1) {
    return word.substr(0, word.size() - 1);
  }
  return word;
}

}  // namespace

std::string porter_stem(std::string_view input) {
  static const std::array<std::pair<std::string_view, std::string_view>, 16> kIrregular{{
      {"sky", "sky"},         {"skies", "sky"},       {"dying", "die"},     {"lying", "lie"},
      {"tying", "tie"},       {"news", "news"},       {"innings", "inning"}, {"inning", "inning"},
      {"outings", "outing"},  {"outing", "outing"},   {"cannings", "canning"}, {"canning", "canning"},
      {"howe", "howe"},       {"proceed", "proceed"}, {"exceed", "exceed"},  {"succeed", "succeed"},
  }};
  std::string word(input);
  for (char& c : word) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  for (const auto& [form, stem] : kIrregular) {
    if (word == form) return std::string(stem);
  }
  if (word.size() <= 2) return word;
  word = step1a(word);
  word = step1b(word);
  word = step1c(word);
  word = step2(word);
  word = step3(word);
  word = step4(word);
  word = step5a(word);
  word = step5b(word);
  return word;
}

}  // namespace trainer::eval
