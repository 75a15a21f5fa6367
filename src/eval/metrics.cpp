// Exact match, ROUGE (rouge_score), BLEU and chrF (sacrebleu) computed the way those Python packages compute
// them, down to their tokenizers and the order of floating-point operations, so parity tests can ask for 1e-9.
#include "eval/metrics.h"

#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <unordered_map>

namespace trainer::eval {
namespace {

// Decodes UTF-8 leniently: an invalid byte becomes U+FFFD, so metrics never throw on a model's output.
std::vector<char32_t> decode_utf8(std::string_view text) {
  std::vector<char32_t> out;
  out.reserve(text.size());
  std::size_t i = 0;
  while (i < text.size()) {
    utf8proc_int32_t cp = 0;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + i),
                                    static_cast<utf8proc_ssize_t>(text.size() - i), &cp);
    if (n <= 0) {
      out.push_back(0xFFFD);
      ++i;
    } else {
      out.push_back(static_cast<char32_t>(cp));
      i += static_cast<std::size_t>(n);
    }
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  utf8proc_uint8_t buffer[4];
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buffer);
  out.append(reinterpret_cast<const char*>(buffer), static_cast<std::size_t>(n));
}

// Python's str.isspace(), which str.split() and str.rstrip() use (sacrebleu, SQuAD normalisation).
bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Python's str.split() with no argument.
std::vector<std::u32string> python_split(const std::vector<char32_t>& text) {
  std::vector<std::u32string> words;
  std::u32string current;
  for (char32_t c : text) {
    if (is_python_space(c)) {
      if (!current.empty()) words.push_back(std::move(current));
      current.clear();
    } else {
      current.push_back(c);
    }
  }
  if (!current.empty()) words.push_back(std::move(current));
  return words;
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  for (char32_t c : text) append_utf8(out, c);
  return out;
}

// Python's str.lower(): the simple mapping, except U+0130 whose full lowercase is "i" + combining dot.
void append_python_lower(std::u32string& out, char32_t c) {
  if (c == 0x130) {
    out.push_back(U'i');
    out.push_back(0x307);
    return;
  }
  out.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
}

// Unicode's Cased and Case_Ignorable, as far as Python's Final_Sigma rule in str.lower() needs them.
bool is_cased(char32_t c) {
  const auto cp = static_cast<utf8proc_int32_t>(c);
  return utf8proc_islower(cp) || utf8proc_isupper(cp) || utf8proc_category(cp) == UTF8PROC_CATEGORY_LT;
}

bool is_case_ignorable(char32_t c) {
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_SK:
      return true;
    default:
      return c == U'\'' || c == U'.' || c == U':' || c == 0xB7 || c == 0x2018 || c == 0x2019 || c == 0x2024 ||
             c == 0xFE13 || c == 0xFE52 || c == 0xFE55 || c == 0xFF07 || c == 0xFF0E || c == 0xFF1A;
  }
}

// Python lowercases a capital sigma to the final form when a cased letter precedes it and none follows
// (case-ignorable characters skipped on both sides).
bool is_final_sigma(const std::vector<char32_t>& text, std::size_t at) {
  std::size_t i = at;
  bool cased_before = false;
  while (i > 0) {
    --i;
    if (is_case_ignorable(text[i])) continue;
    cased_before = is_cased(text[i]);
    break;
  }
  if (!cased_before) return false;
  for (std::size_t j = at + 1; j < text.size(); ++j) {
    if (is_case_ignorable(text[j])) continue;
    return !is_cased(text[j]);
  }
  return true;
}

// Python's \w: letters, numbers and underscore.
bool is_word_char(char32_t c) {
  if (c == U'_') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

void check_sizes(const std::vector<std::string>& predictions, const std::vector<std::string>& references,
                 std::string_view metric) {
  if (predictions.size() != references.size()) {
    throw std::invalid_argument(std::string(metric) + ": " + std::to_string(predictions.size()) +
                                " predictions but " + std::to_string(references.size()) +
                                " references; hint: each prediction needs exactly one reference");
  }
}

double fmeasure(double precision, double recall) {
  if (precision + recall > 0) return 2 * precision * recall / (precision + recall);
  return 0.0;
}

using Tokens = std::vector<std::string>;

std::map<std::vector<std::string>, long long> ngram_counts(const Tokens& tokens, std::size_t n) {
  std::map<std::vector<std::string>, long long> counts;
  if (tokens.size() < n) return counts;
  for (std::size_t i = 0; i + n <= tokens.size(); ++i) {
    ++counts[std::vector<std::string>(tokens.begin() + static_cast<std::ptrdiff_t>(i),
                                      tokens.begin() + static_cast<std::ptrdiff_t>(i + n))];
  }
  return counts;
}

RougeScore score_ngrams(const Tokens& target, const Tokens& prediction, std::size_t n) {
  const auto target_ngrams = ngram_counts(target, n);
  const auto prediction_ngrams = ngram_counts(prediction, n);
  long long intersection = 0;
  long long target_count = 0;
  long long prediction_count = 0;
  for (const auto& [ngram, count] : target_ngrams) {
    const auto it = prediction_ngrams.find(ngram);
    if (it != prediction_ngrams.end()) intersection += std::min(count, it->second);
    target_count += count;
  }
  for (const auto& entry : prediction_ngrams) prediction_count += entry.second;
  RougeScore score;
  score.precision = static_cast<double>(intersection) / static_cast<double>(std::max(prediction_count, 1LL));
  score.recall = static_cast<double>(intersection) / static_cast<double>(std::max(target_count, 1LL));
  score.fmeasure = fmeasure(score.precision, score.recall);
  return score;
}

using LcsTable = std::vector<std::vector<int>>;

LcsTable lcs_table(const Tokens& ref, const Tokens& can) {
  LcsTable table(ref.size() + 1, std::vector<int>(can.size() + 1, 0));
  for (std::size_t i = 1; i <= ref.size(); ++i) {
    for (std::size_t j = 1; j <= can.size(); ++j) {
      if (ref[i - 1] == can[j - 1]) {
        table[i][j] = table[i - 1][j - 1] + 1;
      } else {
        table[i][j] = std::max(table[i - 1][j], table[i][j - 1]);
      }
    }
  }
  return table;
}

RougeScore score_lcs(const Tokens& target, const Tokens& prediction) {
  if (target.empty() || prediction.empty()) return {};
  const int lcs = lcs_table(target, prediction).back().back();
  RougeScore score;
  score.precision = static_cast<double>(lcs) / static_cast<double>(prediction.size());
  score.recall = static_cast<double>(lcs) / static_cast<double>(target.size());
  score.fmeasure = fmeasure(score.precision, score.recall);
  return score;
}

// rouge_score's _backtrack_norec: which LCS is read out decides the union, so the tie-break is the same.
std::vector<std::size_t> lcs_indices(const Tokens& ref, const Tokens& can) {
  const LcsTable t = lcs_table(ref, can);
  std::size_t i = ref.size();
  std::size_t j = can.size();
  std::vector<std::size_t> indices;
  while (i > 0 && j > 0) {
    if (ref[i - 1] == can[j - 1]) {
      indices.push_back(i - 1);
      --i;
      --j;
    } else if (t[i][j - 1] > t[i - 1][j]) {
      --j;
    } else {
      --i;
    }
  }
  std::reverse(indices.begin(), indices.end());
  return indices;
}

// rouge_score's _summary_level_lcs (ROUGE paper section 3.2): union LCS of each reference sentence against
// every candidate sentence, each token counted at most as often as it occurs on both sides.
RougeScore summary_level_lcs(const std::vector<Tokens>& ref_sents, const std::vector<Tokens>& can_sents) {
  if (ref_sents.empty() || can_sents.empty()) return {};
  std::size_t m = 0;
  std::size_t n = 0;
  std::unordered_map<std::string, long long> ref_counts;
  std::unordered_map<std::string, long long> can_counts;
  for (const Tokens& s : ref_sents) {
    m += s.size();
    for (const auto& token : s) ++ref_counts[token];
  }
  for (const Tokens& s : can_sents) {
    n += s.size();
    for (const auto& token : s) ++can_counts[token];
  }
  if (m == 0 || n == 0) return {};
  long long hits = 0;
  for (const Tokens& ref : ref_sents) {
    std::set<std::size_t> union_indices;
    for (const Tokens& can : can_sents) {
      for (std::size_t index : lcs_indices(ref, can)) union_indices.insert(index);
    }
    for (std::size_t index : union_indices) {
      const std::string& token = ref[index];
      long long& c = can_counts[token];
      long long& r = ref_counts[token];
      if (c > 0 && r > 0) {
        ++hits;
        --c;
        --r;
      }
    }
  }
  RougeScore score;
  score.recall = static_cast<double>(hits) / static_cast<double>(m);
  score.precision = static_cast<double>(hits) / static_cast<double>(n);
  score.fmeasure = fmeasure(score.precision, score.recall);
  return score;
}

// rouge_score splits Lsum sentences on "\n" (split_summaries=False) and drops empty ones.
std::vector<Tokens> rouge_sentences(std::string_view text, bool use_stemmer) {
  std::vector<Tokens> sentences;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    if (end > start) sentences.push_back(rouge_tokenize(text.substr(start, end - start), use_stemmer));
    start = end + 1;
  }
  return sentences;
}

void add_to(RougeScore& sum, const RougeScore& value) {
  sum.precision += value.precision;
  sum.recall += value.recall;
  sum.fmeasure += value.fmeasure;
}

void divide(RougeScore& sum, double count) {
  sum.precision /= count;
  sum.recall /= count;
  sum.fmeasure /= count;
}

std::string replace_all(std::string text, std::string_view from, std::string_view to) {
  std::string out;
  std::size_t start = 0;
  while (true) {
    const std::size_t at = text.find(from, start);
    if (at == std::string::npos) break;
    out.append(text, start, at - start);
    out.append(to);
    start = at + from.size();
  }
  out.append(text, start, std::string::npos);
  return out;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// The first regex of sacrebleu's TokenizerRegexp: [\{-\~\[-\` -\&\(-\+\:-\@\/].
bool is_13a_symbol(char c) {
  return (c >= '{' && c <= '~') || (c >= '[' && c <= '`') || (c >= ' ' && c <= '&') || (c >= '(' && c <= '+') ||
         (c >= ':' && c <= '@') || c == '/';
}

// Python's str.split() then ' '.join(): the tokens of sacrebleu's tokenizers and of BLEU's n-grams.
std::vector<std::string> split_python_words(std::string_view text) {
  std::vector<std::string> words;
  for (const auto& word : python_split(decode_utf8(text))) words.push_back(encode_utf8(word));
  return words;
}

std::string rstrip_python(std::string_view text) {
  std::vector<char32_t> cps = decode_utf8(text);
  while (!cps.empty() && is_python_space(cps.back())) cps.pop_back();
  return encode_utf8(std::u32string_view(cps.data(), cps.size()));
}

constexpr std::size_t kBleuOrder = 4;
constexpr std::size_t kChrfOrder = 6;
constexpr double kChrfBeta = 2.0;

// sacrebleu's my_log: log with log(0) floored, so a zero precision gives a score of 0 instead of an error.
double floored_log(double x) {
  if (x == 0.0) return -9999999999.0;
  return std::log(x);
}

}  // namespace

std::string squad_normalize(std::string_view text) {
  static constexpr std::string_view kPunctuation = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";
  const std::vector<char32_t> cps = decode_utf8(text);
  std::u32string lowered;
  for (std::size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    if (c < 128 && kPunctuation.find(static_cast<char>(c)) != std::string_view::npos) continue;
    if (c == 0x3A3 && is_final_sigma(cps, i)) {
      lowered.push_back(0x3C2);
    } else {
      append_python_lower(lowered, c);
    }
  }
  // SQuAD lowercases before removing punctuation; no ASCII punctuation lowercases from or to anything else,
  // so removing it while lowercasing gives the same text.
  std::u32string without_articles;
  const std::size_t n = lowered.size();
  std::size_t i = 0;
  while (i < n) {
    const bool boundary_before = i == 0 || !is_word_char(lowered[i - 1]);
    std::size_t match = 0;
    if (boundary_before) {
      for (std::u32string_view article : {std::u32string_view(U"a"), std::u32string_view(U"an"),
                                          std::u32string_view(U"the")}) {
        if (lowered.compare(i, article.size(), article) != 0) continue;
        const std::size_t end = i + article.size();
        if (end == n || !is_word_char(lowered[end])) {
          match = article.size();
          break;
        }
      }
    }
    if (match > 0) {
      without_articles.push_back(U' ');
      i += match;
    } else {
      without_articles.push_back(lowered[i]);
      ++i;
    }
  }
  std::string out;
  const auto words = python_split(std::vector<char32_t>(without_articles.begin(), without_articles.end()));
  for (std::size_t k = 0; k < words.size(); ++k) {
    if (k > 0) out.push_back(' ');
    out += encode_utf8(words[k]);
  }
  return out;
}

double exact_match(const std::vector<std::string>& predictions, const std::vector<std::string>& references,
                   bool normalize) {
  check_sizes(predictions, references, "exact_match");
  if (predictions.empty()) return 0.0;
  std::size_t matches = 0;
  for (std::size_t i = 0; i < predictions.size(); ++i) {
    const bool equal = normalize ? squad_normalize(predictions[i]) == squad_normalize(references[i])
                                 : predictions[i] == references[i];
    if (equal) ++matches;
  }
  return static_cast<double>(matches) / static_cast<double>(predictions.size());
}

std::vector<std::string> rouge_tokenize(std::string_view text, bool use_stemmer) {
  std::vector<std::string> tokens;
  std::string current;
  auto flush = [&] {
    if (current.empty()) return;
    tokens.push_back(use_stemmer && current.size() > 3 ? porter_stem(current) : current);
    current.clear();
  };
  for (char32_t c : decode_utf8(text)) {
    // Python's lower() then [^a-z0-9]: only ASCII letters, digits, and the two non-ASCII code points whose
    // lowercase is ASCII (U+0130 -> "i" + combining dot, KELVIN SIGN -> "k") survive.
    char kept = 0;
    if (c >= U'A' && c <= U'Z') {
      kept = static_cast<char>(c - U'A' + U'a');
    } else if ((c >= U'a' && c <= U'z') || (c >= U'0' && c <= U'9')) {
      kept = static_cast<char>(c);
    } else if (c == 0x130) {
      kept = 'i';
    } else if (c == 0x212A) {
      kept = 'k';
    }
    if (kept != 0) {
      current.push_back(kept);
      if (c == 0x130) flush();  // the combining dot that follows it in Python ends the token
    } else {
      flush();
    }
  }
  flush();
  return tokens;
}

RougeScores rouge_pair(std::string_view prediction, std::string_view reference, bool use_stemmer) {
  const Tokens target = rouge_tokenize(reference, use_stemmer);
  const Tokens predicted = rouge_tokenize(prediction, use_stemmer);
  RougeScores scores;
  scores.rouge1 = score_ngrams(target, predicted, 1);
  scores.rouge2 = score_ngrams(target, predicted, 2);
  scores.rouge_l = score_lcs(target, predicted);
  scores.rouge_lsum = summary_level_lcs(rouge_sentences(reference, use_stemmer),
                                        rouge_sentences(prediction, use_stemmer));
  return scores;
}

RougeScores rouge(const std::vector<std::string>& predictions, const std::vector<std::string>& references,
                  bool use_stemmer) {
  check_sizes(predictions, references, "rouge");
  RougeScores sum;
  if (predictions.empty()) return sum;
  for (std::size_t i = 0; i < predictions.size(); ++i) {
    const RougeScores pair = rouge_pair(predictions[i], references[i], use_stemmer);
    add_to(sum.rouge1, pair.rouge1);
    add_to(sum.rouge2, pair.rouge2);
    add_to(sum.rouge_l, pair.rouge_l);
    add_to(sum.rouge_lsum, pair.rouge_lsum);
  }
  const auto count = static_cast<double>(predictions.size());
  divide(sum.rouge1, count);
  divide(sum.rouge2, count);
  divide(sum.rouge_l, count);
  divide(sum.rouge_lsum, count);
  return sum;
}

std::string tokenize_13a(std::string_view input) {
  std::string line = replace_all(std::string(input), "<skipped>", "");
  line = replace_all(line, "-\n", "");
  line = replace_all(line, "\n", " ");
  if (line.find('&') != std::string::npos) {
    line = replace_all(line, "&quot;", "\"");
    line = replace_all(line, "&amp;", "&");
    line = replace_all(line, "&lt;", "<");
    line = replace_all(line, "&gt;", ">");
  }
  line = " " + line + " ";
  // The four regexes of TokenizerRegexp, each a left-to-right pass of non-overlapping matches. Working on
  // bytes gives the same text as Python's code points: every class is ASCII or a negated ASCII class, and a
  // multi-byte character only ever needs a space before or after it.
  std::string pass;
  for (char c : line) {
    if (is_13a_symbol(c)) {
      pass += ' ';
      pass += c;
      pass += ' ';
    } else {
      pass += c;
    }
  }
  line.swap(pass);
  pass.clear();
  for (std::size_t i = 0; i < line.size();) {  // ([^0-9])([\.,]) -> "\1 \2 "
    if (i + 1 < line.size() && !is_digit(line[i]) && (line[i + 1] == '.' || line[i + 1] == ',')) {
      pass += line[i];
      pass += ' ';
      pass += line[i + 1];
      pass += ' ';
      i += 2;
    } else {
      pass += line[i++];
    }
  }
  line.swap(pass);
  pass.clear();
  for (std::size_t i = 0; i < line.size();) {  // ([\.,])([^0-9]) -> " \1 \2"
    if (i + 1 < line.size() && (line[i] == '.' || line[i] == ',') && !is_digit(line[i + 1])) {
      pass += ' ';
      pass += line[i];
      pass += ' ';
      pass += line[i + 1];
      i += 2;
    } else {
      pass += line[i++];
    }
  }
  line.swap(pass);
  pass.clear();
  for (std::size_t i = 0; i < line.size();) {  // ([0-9])(-) -> "\1 \2 "
    if (i + 1 < line.size() && is_digit(line[i]) && line[i + 1] == '-') {
      pass += line[i];
      pass += " - ";
      i += 2;
    } else {
      pass += line[i++];
    }
  }
  std::string out;
  for (const auto& word : split_python_words(pass)) {
    if (!out.empty()) out += ' ';
    out += word;
  }
  return out;
}

BleuScore corpus_bleu(const std::vector<std::string>& predictions, const std::vector<std::string>& references) {
  check_sizes(predictions, references, "bleu");
  std::vector<long long> correct(kBleuOrder, 0);
  std::vector<long long> total(kBleuOrder, 0);
  BleuScore result;
  for (std::size_t i = 0; i < predictions.size(); ++i) {
    const Tokens hyp = split_python_words(tokenize_13a(rstrip_python(predictions[i])));
    const Tokens ref = split_python_words(tokenize_13a(rstrip_python(references[i])));
    result.sys_len += static_cast<long long>(hyp.size());
    result.ref_len += static_cast<long long>(ref.size());
    for (std::size_t n = 1; n <= kBleuOrder; ++n) {
      const auto hyp_ngrams = ngram_counts(hyp, n);
      const auto ref_ngrams = ngram_counts(ref, n);
      for (const auto& [ngram, count] : hyp_ngrams) {
        total[n - 1] += count;
        const auto it = ref_ngrams.find(ngram);
        if (it != ref_ngrams.end()) correct[n - 1] += std::min(count, it->second);
      }
    }
  }
  if (result.sys_len < result.ref_len) {
    result.brevity_penalty =
        result.sys_len > 0
            ? std::exp(1.0 - static_cast<double>(result.ref_len) / static_cast<double>(result.sys_len))
            : 0.0;
  }
  result.precisions.assign(kBleuOrder, 0.0);
  if (std::all_of(correct.begin(), correct.end(), [](long long c) { return c == 0; })) return result;
  double smooth_mteval = 1.0;
  for (std::size_t n = 1; n <= kBleuOrder; ++n) {
    if (total[n - 1] == 0) break;
    if (correct[n - 1] == 0) {
      smooth_mteval *= 2;  // sacrebleu's 'exp' smoothing (NIST mteval-v13a)
      result.precisions[n - 1] = 100. / (smooth_mteval * static_cast<double>(total[n - 1]));
    } else {
      result.precisions[n - 1] = 100. * static_cast<double>(correct[n - 1]) / static_cast<double>(total[n - 1]);
    }
  }
  double log_sum = 0.0;
  for (double p : result.precisions) log_sum += floored_log(p);
  result.score = result.brevity_penalty * std::exp(log_sum / static_cast<double>(kBleuOrder));
  return result;
}

double corpus_chrf(const std::vector<std::string>& predictions, const std::vector<std::string>& references) {
  check_sizes(predictions, references, "chrf");
  // Per order: hypothesis n-grams (counted only where the reference has n-grams of that order), reference
  // n-grams, matches; summed over the corpus as sacrebleu sums segment statistics.
  std::vector<long long> n_hyp(kChrfOrder, 0);
  std::vector<long long> n_ref(kChrfOrder, 0);
  std::vector<long long> n_match(kChrfOrder, 0);
  auto squeeze = [](const std::string& text) {
    std::u32string joined;
    for (const auto& word : python_split(decode_utf8(text))) joined += word;
    return joined;
  };
  auto char_ngrams = [](const std::u32string& text, std::size_t n) {
    std::map<std::u32string, long long> counts;
    for (std::size_t i = 0; i + n <= text.size(); ++i) ++counts[text.substr(i, n)];
    return counts;
  };
  for (std::size_t i = 0; i < predictions.size(); ++i) {
    const std::u32string hyp = squeeze(predictions[i]);
    const std::u32string ref = squeeze(references[i]);
    for (std::size_t n = 1; n <= kChrfOrder; ++n) {
      const auto hyp_ngrams = char_ngrams(hyp, n);
      const auto ref_ngrams = char_ngrams(ref, n);
      long long hyp_count = 0;
      long long match_count = 0;
      for (const auto& [ngram, count] : hyp_ngrams) {
        hyp_count += count;
        const auto it = ref_ngrams.find(ngram);
        if (it != ref_ngrams.end()) match_count += std::min(count, it->second);
      }
      long long ref_count = 0;
      for (const auto& entry : ref_ngrams) ref_count += entry.second;
      n_hyp[n - 1] += ref_ngrams.empty() ? 0 : hyp_count;
      n_ref[n - 1] += ref_count;
      n_match[n - 1] += match_count;
    }
  }
  const double factor = kChrfBeta * kChrfBeta;
  double avg_prec = 0.0;
  double avg_rec = 0.0;
  int effective_order = 0;
  for (std::size_t i = 0; i < kChrfOrder; ++i) {
    if (n_hyp[i] > 0 && n_ref[i] > 0) {
      avg_prec += static_cast<double>(n_match[i]) / static_cast<double>(n_hyp[i]);
      avg_rec += static_cast<double>(n_match[i]) / static_cast<double>(n_ref[i]);
      ++effective_order;
    }
  }
  if (effective_order == 0) return 0.0;
  avg_prec /= effective_order;
  avg_rec /= effective_order;
  if (avg_prec + avg_rec == 0.0) return 0.0;
  double score = (1 + factor) * avg_prec * avg_rec;
  score /= (factor * avg_prec) + avg_rec;
  return 100 * score;
}

std::map<std::string, double> compute_metrics(const std::vector<std::string>& names,
                                              const std::vector<std::string>& predictions,
                                              const std::vector<std::string>& references, bool use_stemmer) {
  check_sizes(predictions, references, "metrics");
  std::map<std::string, double> values;
  bool rouge_done = false;
  RougeScores rouge_scores;
  for (const std::string& name : names) {
    if (name == "exact_match") {
      values[name] = exact_match(predictions, references, false);
    } else if (name == "exact_match_normalized") {
      values[name] = exact_match(predictions, references, true);
    } else if (name == "rouge1" || name == "rouge2" || name == "rougeL" || name == "rougeLsum") {
      if (!rouge_done) {
        rouge_scores = rouge(predictions, references, use_stemmer);
        rouge_done = true;
      }
      values[name] = name == "rouge1"   ? rouge_scores.rouge1.fmeasure
                     : name == "rouge2" ? rouge_scores.rouge2.fmeasure
                     : name == "rougeL" ? rouge_scores.rouge_l.fmeasure
                                        : rouge_scores.rouge_lsum.fmeasure;
    } else if (name == "bleu") {
      values[name] = corpus_bleu(predictions, references).score;
    } else if (name == "chrf") {
      values[name] = corpus_chrf(predictions, references);
    } else {
      throw std::invalid_argument("unknown metric '" + name +
                                  "'; hint: use one of exact_match, exact_match_normalized, rouge1, rouge2, "
                                  "rougeL, rougeLsum, bleu, chrf");
    }
  }
  return values;
}

}  // namespace trainer::eval
