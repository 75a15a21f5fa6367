// Evaluation by generation for the text task (see generation_eval.h).
#include "train/tasks/text/generation_eval.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <stdexcept>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "distributed/process_group.h"
#include "eval/metrics.h"
#include "models/generation.h"
#include "models/hf_config.h"
#include "train/engine/task.h"
#include "trainer/model_dir.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

// One validation example as generation sees it.
struct Item {
  int64_t index = 0;  // in the validation order
  std::vector<int64_t> prompt;
  std::vector<int32_t> reference;
};

std::vector<int32_t> without_eos(std::vector<int32_t> ids, std::optional<int32_t> eos) {
  while (eos && !ids.empty() && ids.back() == *eos) ids.pop_back();
  return ids;
}

// The prompt and reference of an example; nothing for a causal example whose labels cover it all (plain text).
std::optional<Item> item_of(const Example& e, bool seq2seq, std::optional<int32_t> eos) {
  Item item;
  if (seq2seq) {
    item.prompt.assign(e.input_ids.begin(), e.input_ids.end());
    for (const auto label : e.labels)
      if (label != -100) item.reference.push_back(label);
  } else {
    std::size_t first = 0;  // the first trained position: where the completion starts
    while (first < e.labels.size() && e.labels[first] == -100) ++first;
    if (first == 0 || first >= e.input_ids.size()) return std::nullopt;
    item.prompt.assign(e.input_ids.begin(), e.input_ids.begin() + static_cast<std::ptrdiff_t>(first));
    item.reference.assign(e.input_ids.begin() + static_cast<std::ptrdiff_t>(first), e.input_ids.end());
  }
  item.reference = without_eos(std::move(item.reference), eos);
  if (item.prompt.empty()) return std::nullopt;
  return item;
}

std::string text_of(const Tokenizer& tokenizer, std::span<const int32_t> ids) {
  if (!is_ids_only(tokenizer)) return tokenizer.decode(ids);
  std::string text;
  for (const auto id : ids) text += (text.empty() ? "" : " ") + std::to_string(id);
  return text;
}

}  // namespace

fs::path predictions_path(const fs::path& output_dir, int64_t step) {
  return output_dir / "evaluations" / ("step-" + std::to_string(step)) / "predictions.jsonl";
}

GenerateOptions evaluation_generate_options(const Config& config, ModelFamily family, const fs::path& model_dir) {
  const auto& e = config.evaluation;
  GenerateOptions options;
  options.max_new_tokens = family == ModelFamily::kSeq2Seq ? config.data.max_target_length : 64;
  nlohmann::json generation_config = nlohmann::json::object();
  const fs::path file = model_dir / "generation_config.json";
  if (!model_dir.empty() && fs::exists(file)) {
    generation_config = read_json_file(file.string());
    apply_generation_config(generation_config, family, options);
  }
  if (e.generate_max_new_tokens) options.max_new_tokens = *e.generate_max_new_tokens;
  if (e.generate_num_beams) options.num_beams = *e.generate_num_beams;
  if (e.generate_length_penalty) options.length_penalty = *e.generate_length_penalty;
  if (e.generate_early_stopping)
    options.early_stopping = *e.generate_early_stopping == GenerateEarlyStopping::kTrue    ? EarlyStopping::kWhenFull
                             : *e.generate_early_stopping == GenerateEarlyStopping::kNever ? EarlyStopping::kNever
                                                                                           : EarlyStopping::kHeuristic;
  if (e.generate_no_repeat_ngram_size) options.no_repeat_ngram_size = *e.generate_no_repeat_ngram_size;
  // Sampling settings: the config's, else generation_config.json's, else transformers' defaults.
  const bool do_sample = e.generate_do_sample.value_or(hf::get_bool(generation_config, "do_sample", false));
  const double temperature = e.generate_temperature.value_or(hf::get_double(generation_config, "temperature", 1.0));
  options.temperature = do_sample ? temperature : 0.0;
  options.top_p = e.generate_top_p.value_or(hf::get_double(generation_config, "top_p", 1.0));
  options.top_k = e.generate_top_k.value_or(hf::get_int(generation_config, "top_k", 50));
  if (do_sample) options.num_beams = 1;  // validate() refuses beams with sampling set in the config itself
  options.seed = static_cast<uint64_t>(config.training.seed);
  return options;
}

GenerationScores evaluate_by_generation(LanguageModel& model, const Tokenizer& tokenizer, DataLoader& validation,
                                        const Config& config, const GenerateOptions& options,
                                        EvaluationMicroBatch& micro, distributed::Communicator* world,
                                        const fs::path& predictions_file, StepSync* sync) {
  const auto& e = config.evaluation;
  const bool seq2seq = model.family() == ModelFamily::kSeq2Seq;
  GenerationScores scores;
  // The examples, in validation order: every rank reads the same ones.
  std::vector<Item> items;
  int64_t seen = 0;
  while (auto batch = validation.next()) {
    for (const auto& example : batch->examples) {
      if (e.generate_examples > 0 && seen >= e.generate_examples) break;
      ++seen;
      if (auto item = item_of(example, seq2seq, tokenizer.eos_id())) {
        item->index = seen - 1;
        items.push_back(std::move(*item));
      } else {
        ++scores.skipped;
      }
    }
    if (e.generate_examples > 0 && seen >= e.generate_examples) break;
  }
  // This rank's contiguous share, longest prompts first (less padding per batch; an out-of-memory error comes early).
  const auto total = static_cast<int64_t>(items.size());
  const int rank = world ? world->rank() : 0, ranks = world ? world->world_size() : 1;
  const int64_t begin = total * rank / ranks, end = total * (rank + 1) / ranks;
  std::vector<std::size_t> order(static_cast<std::size_t>(end - begin));
  std::iota(order.begin(), order.end(), static_cast<std::size_t>(begin));
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return items[a].prompt.size() > items[b].prompt.size();
  });
  std::vector<std::vector<int64_t>> answers(items.size());
  std::size_t done = 0;
  // Fully sharded weights: each round of batches and each decoding step agreed by every rank (a status that also
  // carries another rank's out-of-memory error into this rank's try).
  const bool paced = sync && sync->shards_weights();
  GenerateOptions step_options = options;
  if (paced) step_options.pace = [sync](bool mine) { return sync->agree_passes(mine ? 1 : 0) > 0; };
  const std::vector<int64_t> placeholder = {step_options.pad_token_id.value_or(0)};
  while (true) {
    const bool mine = done < order.size();
    if (!(paced ? step_options.pace(mine) : mine)) break;
    std::size_t count = 0;
    std::vector<std::vector<int64_t>> out;
    const bool fit = micro.run([&](int64_t size) {
      if (!mine) {  // another rank still generates: this one paces it with a one-token prompt
        (void)generate_batch(model, {placeholder}, step_options);
        return;
      }
      count = std::min(order.size() - done, static_cast<std::size_t>(size));
      std::vector<std::vector<int64_t>> prompts;
      for (std::size_t i = done; i < done + count; ++i) prompts.push_back(items[order[i]].prompt);
      out = generate_batch(model, prompts, step_options);
    });
    if (!fit) break;  // this rank ran out of memory at 1: the engine's agreement stops every rank
    for (std::size_t i = 0; i < count; ++i) answers[order[done + i]] = std::move(out[i]);
    done += count;
  }
  // Every rank's answers as text, gathered in validation order.
  nlohmann::json mine = nlohmann::json::array();
  const auto eos = tokenizer.eos_id();
  for (const auto i : order) {
    std::vector<int32_t> answer(answers[i].begin(), answers[i].end());
    answer = without_eos(std::move(answer), eos);
    const std::vector<int32_t> prompt(items[i].prompt.begin(), items[i].prompt.end());
    mine.push_back({{"index", items[i].index},
                    {"prompt", text_of(tokenizer, prompt)},
                    {"reference", text_of(tokenizer, items[i].reference)},
                    {"prediction", text_of(tokenizer, answer)}});
  }
  std::vector<nlohmann::json> records;
  if (world) {
    for (const auto& part : world->all_gather_bytes(mine.dump(), "gathering the generated answers"))
      for (auto& record : nlohmann::json::parse(part)) records.push_back(std::move(record));
  } else {
    for (auto& record : mine) records.push_back(std::move(record));
  }
  std::sort(records.begin(), records.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    return a.at("index").get<int64_t>() < b.at("index").get<int64_t>();
  });
  std::vector<std::string> predictions, references;
  for (const auto& r : records) {
    predictions.push_back(r.at("prediction").get<std::string>());
    references.push_back(r.at("reference").get<std::string>());
  }
  scores.examples = static_cast<int64_t>(records.size());
  if (!records.empty()) scores.metrics = eval::compute_metrics(e.generate_metrics, predictions, references,
                                                               e.generate_use_stemmer);
  if (!predictions_file.empty()) {
    fs::create_directories(predictions_file.parent_path());
    const fs::path temp = predictions_file.string() + ".tmp";
    {
      std::ofstream file(temp);
      for (const auto& r : records)
        file << nlohmann::json{{"index", r.at("index")}, {"prompt", r.at("prompt")}, {"reference", r.at("reference")},
                               {"prediction", r.at("prediction")}}
                    .dump()
             << "\n";
    }
    fs::rename(temp, predictions_file);
  }
  return scores;
}

}  // namespace trainer
