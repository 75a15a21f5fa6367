// Metrics of evaluation by generation (exact match, ROUGE, BLEU, chrF), written to give the values of the
// reference Python packages (rouge_score, sacrebleu) on the same predictions and references. No LibTorch.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace trainer::eval {

// One ROUGE variant for one pair, as rouge_score's scoring.Score.
struct RougeScore {
  double precision = 0.0;
  double recall = 0.0;
  double fmeasure = 0.0;
};

// Corpus ROUGE: the mean over pairs of each per-pair value (what Seq2SeqTrainer examples report as
// np.mean of rouge_score's F-measures), in rouge_score's 0..1 scale.
struct RougeScores {
  RougeScore rouge1;
  RougeScore rouge2;
  RougeScore rouge_l;
  RougeScore rouge_lsum;
};

// sacrebleu's BLEUScore for corpus_bleu with defaults, in sacrebleu's 0..100 scale.
struct BleuScore {
  double score = 0.0;
  std::vector<double> precisions;  // 4 n-gram precisions, smoothed as sacrebleu's 'exp' method does
  double brevity_penalty = 1.0;
  long long sys_len = 0;
  long long ref_len = 0;
};

// Fraction (0..1) of predictions equal to their reference; with normalize, both go through SQuAD's
// normalize_answer first (lowercase, ASCII punctuation removed, articles a/an/the removed, whitespace collapsed).
double exact_match(const std::vector<std::string>& predictions, const std::vector<std::string>& references,
                   bool normalize);
std::string squad_normalize(std::string_view text);

// rouge_score's default tokenizer: lowercase, non-[a-z0-9] to spaces, split; Porter stem when longer than 3.
std::vector<std::string> rouge_tokenize(std::string_view text, bool use_stemmer);
// One pair, as rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer).score(ref, pred)
// with split_summaries=False: rougeLsum splits sentences on newlines.
RougeScores rouge_pair(std::string_view prediction, std::string_view reference, bool use_stemmer);
RougeScores rouge(const std::vector<std::string>& predictions, const std::vector<std::string>& references,
                  bool use_stemmer);

// nltk's PorterStemmer() in its default NLTK_EXTENSIONS mode, for lowercase ASCII words.
std::string porter_stem(std::string_view word);

// sacrebleu's 13a tokenizer (mteval-v13a), as BLEU applies it after rstrip().
std::string tokenize_13a(std::string_view line);
// sacrebleu.corpus_bleu(predictions, [references]) with defaults (13a, smoothing 'exp', no lowercase).
BleuScore corpus_bleu(const std::vector<std::string>& predictions, const std::vector<std::string>& references);
// sacrebleu.corpus_chrf(predictions, [references]) with defaults (char order 6, word order 0, beta 2).
double corpus_chrf(const std::vector<std::string>& predictions, const std::vector<std::string>& references);

// The metrics a config names ("exact_match", "exact_match_normalized", "rouge1", "rouge2", "rougeL",
// "rougeLsum", "bleu", "chrf"), each as one number: ROUGE as the mean F-measure (0..1), BLEU and chrF 0..100,
// exact match 0..1. An unknown name throws std::invalid_argument naming it and the known ones.
std::map<std::string, double> compute_metrics(const std::vector<std::string>& names,
                                              const std::vector<std::string>& predictions,
                                              const std::vector<std::string>& references, bool use_stemmer);

}  // namespace trainer::eval
