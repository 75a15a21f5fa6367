// The generation-metrics parity tests' helper (tests/parity/test_generation_metrics.py): reads
// {"predictions": [...], "references": [...], "use_stemmer": bool} on stdin and prints every metric as JSON,
// with the per-pair ROUGE scores and the porter stems of "stem_words" if given, so pytest can compare each
// value with rouge_score, sacrebleu and nltk.
#include <exception>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "eval/metrics.h"

namespace {

nlohmann::json to_json(const trainer::eval::RougeScore& score) {
  return {{"precision", score.precision}, {"recall", score.recall}, {"fmeasure", score.fmeasure}};
}

nlohmann::json to_json(const trainer::eval::RougeScores& scores) {
  return {{"rouge1", to_json(scores.rouge1)},
          {"rouge2", to_json(scores.rouge2)},
          {"rougeL", to_json(scores.rouge_l)},
          {"rougeLsum", to_json(scores.rouge_lsum)}};
}

int run() {
  const std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  const nlohmann::json request = nlohmann::json::parse(input);
  const auto predictions = request.at("predictions").get<std::vector<std::string>>();
  const auto references = request.at("references").get<std::vector<std::string>>();
  const bool use_stemmer = request.value("use_stemmer", false);
  namespace ev = trainer::eval;

  nlohmann::json out;
  out["exact_match"] = ev::exact_match(predictions, references, false);
  out["exact_match_normalized"] = ev::exact_match(predictions, references, true);
  out["rouge"] = to_json(ev::rouge(predictions, references, use_stemmer));
  nlohmann::json pairs = nlohmann::json::array();
  for (std::size_t i = 0; i < predictions.size() && i < references.size(); ++i) {
    pairs.push_back(to_json(ev::rouge_pair(predictions[i], references[i], use_stemmer)));
  }
  out["rouge_pairs"] = pairs;
  const ev::BleuScore bleu = ev::corpus_bleu(predictions, references);
  out["bleu"] = {{"score", bleu.score},
                 {"precisions", bleu.precisions},
                 {"bp", bleu.brevity_penalty},
                 {"sys_len", bleu.sys_len},
                 {"ref_len", bleu.ref_len}};
  out["chrf"] = ev::corpus_chrf(predictions, references);
  out["named"] = ev::compute_metrics({"exact_match", "exact_match_normalized", "rouge1", "rouge2", "rougeL",
                                      "rougeLsum", "bleu", "chrf"},
                                     predictions, references, use_stemmer);
  if (request.contains("stem_words")) {
    nlohmann::json stems = nlohmann::json::array();
    for (const auto& word : request.at("stem_words").get<std::vector<std::string>>()) {
      stems.push_back(ev::porter_stem(word));
    }
    out["stems"] = stems;
  }
  std::cout << out.dump() << "\n";
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& error) {
    std::cerr << "trainer_metrics_tool: " << error.what()
              << "\nhint: stdin must be {\"predictions\": [...], \"references\": [...], \"use_stemmer\": bool}\n";
    return 1;
  }
}
