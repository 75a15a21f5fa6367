// Token choice for generation over a batch of prompts: greedy, sampling and beam search, following transformers'
// GenerationMixin (_sample, _beam_search and NoRepeatNGramLogitsProcessor) closely enough to give the same ids.
// The model only runs the cache (prefill, decode_step, select_rows); the bookkeeping of beams is small and runs on
// the CPU in plain loops.
#include "models/generation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/hf_config.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

constexpr float kLarge = 1.0e9f;  // transformers' "very large negative value" of beam search

// The prompts as one batch on the model's device. `history` holds each row as the logits processors see it:
// a causal row with its padding, a seq2seq row as the decoder's start token.
struct PaddedPrompts {
  at::Tensor ids, mask;
  std::vector<std::vector<int64_t>> history;
};

PaddedPrompts pad_prompts(const LanguageModel& model, const std::vector<std::vector<int64_t>>& prompts,
                          int64_t pad, const at::Device& device) {
  const bool causal = model.family() == ModelFamily::kCausal;
  std::size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  if (longest == 0) throw DataError("generation: every prompt is empty", "give each prompt at least one token");
  const auto rows = static_cast<int64_t>(prompts.size());
  const auto width = static_cast<int64_t>(longest);
  at::Tensor ids = at::full({rows, width}, pad, at::kLong);
  at::Tensor mask = at::zeros({rows, width}, at::kLong);
  PaddedPrompts out;
  const int64_t start = hf::get_int(model.hf_config(), "decoder_start_token_id",
                                    hf::get_int(model.hf_config(), "pad_token_id", 0));
  for (int64_t r = 0; r < rows; ++r) {
    const auto& p = prompts[static_cast<std::size_t>(r)];
    if (p.empty())
      throw DataError("generation: prompt " + std::to_string(r) + " is empty", "give each prompt at least one token");
    const auto n = static_cast<int64_t>(p.size());
    const int64_t first = causal ? width - n : 0;  // causal prompts end together: padding on the left
    ids[r].narrow(0, first, n).copy_(at::tensor(p, at::kLong));
    mask[r].narrow(0, first, n).fill_(1);
    if (causal) {
      std::vector<int64_t> row(static_cast<std::size_t>(width), pad);
      std::copy(p.begin(), p.end(), row.begin() + first);
      out.history.push_back(std::move(row));
    } else {
      out.history.push_back({start});
    }
  }
  out.ids = ids.to(device);
  out.mask = mask.to(device);
  return out;
}

// Tokens that would repeat an n-gram of `history` (transformers' _calc_banned_ngram_tokens): the last tokens of
// every earlier n-gram whose first n - 1 tokens equal the last n - 1 tokens of the history.
std::vector<int64_t> banned_tokens(const std::vector<int64_t>& history, int64_t n) {
  std::vector<int64_t> banned;
  const auto length = static_cast<int64_t>(history.size());
  if (n <= 0 || length + 1 < n) return banned;
  const int64_t tail = length - (n - 1);  // start of the last n - 1 tokens
  for (int64_t i = 0; i + n <= length; ++i) {
    if (std::equal(history.begin() + i, history.begin() + i + n - 1, history.begin() + tail))
      banned.push_back(history[static_cast<std::size_t>(i + n - 1)]);
  }
  return banned;
}

// Sets the scores of banned n-gram continuations to -inf, row by row (scores (N, V), histories N).
void ban_repeated_ngrams(at::Tensor& scores, const std::vector<const std::vector<int64_t>*>& histories, int64_t n) {
  if (n <= 0) return;
  std::vector<int64_t> rows, tokens;
  for (std::size_t r = 0; r < histories.size(); ++r)
    for (const int64_t t : banned_tokens(*histories[r], n)) {
      rows.push_back(static_cast<int64_t>(r));
      tokens.push_back(t);
    }
  if (rows.empty()) return;
  const auto device = scores.device();
  scores.index_put_({at::tensor(rows, at::kLong).to(device), at::tensor(tokens, at::kLong).to(device)},
                    -std::numeric_limits<float>::infinity());
}

// One token per row from scores (N, V) fp32, as transformers' sampling warpers order it: temperature, top-k, top-p.
std::vector<int64_t> sample_rows(const at::Tensor& scores, const GenerateOptions& options, at::Generator& generator) {
  at::Tensor logits = (scores / options.temperature).to(at::kCPU);
  if (options.top_k > 0 && options.top_k < logits.size(-1)) {
    const at::Tensor kth = std::get<0>(logits.topk(options.top_k, -1)).narrow(-1, options.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  at::Tensor probs = at::softmax(logits, -1);
  if (options.top_p < 1.0) {
    // The smallest set of tokens whose probability reaches top_p (at least one), renormalised by multinomial.
    const auto [sorted, order] = probs.sort(-1, /*descending=*/true);
    const at::Tensor before = sorted.cumsum(-1) - sorted;  // probability mass ahead of each token
    const at::Tensor kept = sorted.masked_fill(before >= options.top_p, 0.0);
    probs = at::zeros_like(probs).scatter(-1, order, kept);
  }
  const at::Tensor drawn = at::multinomial(probs, 1, false, generator).reshape({-1});
  return {drawn.data_ptr<int64_t>(), drawn.data_ptr<int64_t>() + drawn.numel()};
}

bool is_eos(const std::vector<int64_t>& eos, int64_t token) {
  return std::find(eos.begin(), eos.end(), token) != eos.end();
}

at::Tensor long_tensor(const std::vector<int64_t>& values, const at::Device& device) {
  return at::tensor(values, at::kLong).to(device);
}

// Fully sharded weights (options.pace): this batch is done while another rank's goes on. Each of its decoding steps
// is one of the collectives the others' steps pair with, so it steps on with its `rows` rows (their outputs unused)
// until no rank needs another step.
void step_on_until_all_done(LanguageModel& model, GenerationState& state, int64_t rows, const GenerateOptions& options,
                            const at::Device& device) {
  const at::Tensor tokens = at::full({rows, 1}, options.pad_token_id.value_or(0), at::TensorOptions().dtype(at::kLong).device(device));
  do {
    (void)model.decode_step(state, tokens);
  } while (options.pace(false));
}

// Whether this batch takes another decoding step: `mine`, or with options.pace whether any rank's batch does.
bool any_goes_on(bool mine, const GenerateOptions& options) { return options.pace ? options.pace(mine) : mine; }

// Greedy or sampling: every row advances by one token a step; finished rows leave the batch.
std::vector<std::vector<int64_t>> greedy_or_sample(LanguageModel& model, PaddedPrompts& prompts,
                                                   const GenerateOptions& options, const std::vector<int64_t>& eos) {
  const auto device = prompts.ids.device();
  const auto rows = static_cast<std::size_t>(prompts.ids.size(0));
  std::vector<std::vector<int64_t>> out(rows);
  at::Generator generator = options.seed ? at::detail::createCPUGenerator(*options.seed)
                                         : at::detail::getDefaultCPUGenerator();
  auto [state, logits] = model.prefill(prompts.ids, prompts.mask, options.max_new_tokens);
  std::vector<int64_t> alive(rows);  // original row of each row of the state
  std::iota(alive.begin(), alive.end(), 0);
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    at::Tensor scores = logits.to(at::kFloat);
    std::vector<const std::vector<int64_t>*> histories;
    for (const int64_t r : alive) histories.push_back(&prompts.history[static_cast<std::size_t>(r)]);
    ban_repeated_ngrams(scores, histories, options.no_repeat_ngram_size);
    std::vector<int64_t> tokens;
    if (options.temperature > 0) {
      tokens = sample_rows(scores, options, generator);
    } else {
      const at::Tensor best = scores.argmax(-1).to(at::kCPU);
      tokens.assign(best.data_ptr<int64_t>(), best.data_ptr<int64_t>() + best.numel());
    }
    std::vector<int64_t> keep, kept_rows, kept_tokens;
    for (std::size_t j = 0; j < alive.size(); ++j) {
      const auto r = static_cast<std::size_t>(alive[j]);
      out[r].push_back(tokens[j]);
      prompts.history[r].push_back(tokens[j]);
      if (is_eos(eos, tokens[j])) continue;
      keep.push_back(static_cast<int64_t>(j));
      kept_rows.push_back(alive[j]);
      kept_tokens.push_back(tokens[j]);
    }
    const bool more = !keep.empty() && step + 1 < options.max_new_tokens;
    if (!any_goes_on(more, options)) break;
    if (!more) {
      step_on_until_all_done(model, *state, static_cast<int64_t>(alive.size()), options, device);
      break;
    }
    if (keep.size() < alive.size()) model.select_rows(*state, at::tensor(keep, at::kLong));
    alive = std::move(kept_rows);
    logits = model.decode_step(*state, long_tensor(kept_tokens, device).unsqueeze(1));
  }
  return out;
}

struct Hypothesis {
  std::vector<int64_t> tokens;  // generated so far
  float score = -kLarge;
  bool finished = false;
};

// Beam search as transformers' _beam_search: per prompt, the top (1 + EOS count, at least 2) x num_beams
// continuations of all beams; the best num_beams of those that did not just stop keep running, the first
// num_beams of them that stopped (EOS or the length limit) compete, length-penalised, for the num_beams kept
// hypotheses. A prompt stops when early_stopping's rule says no running beam can do better; the best kept
// hypothesis is its answer.
std::vector<std::vector<int64_t>> beam_search(LanguageModel& model, PaddedPrompts& prompts,
                                              const GenerateOptions& options, const std::vector<int64_t>& eos) {
  const auto device = prompts.ids.device();
  const int64_t batch = prompts.ids.size(0), beams = options.num_beams;
  const int64_t keep_k = std::max<int64_t>(2, 1 + static_cast<int64_t>(eos.size())) * beams;
  const double penalty = options.length_penalty;
  // Lengths as transformers counts them: the decoder's input so far (the padded prompt, or the start token).
  const int64_t prompt_length = static_cast<int64_t>(prompts.history[0].size());
  const int64_t max_length = prompt_length + options.max_new_tokens;
  int64_t length = prompt_length;

  auto [state, logits] = model.prefill(prompts.ids, prompts.mask, options.max_new_tokens);
  // Every prompt's state and first logits, once per beam.
  const at::Tensor expand = at::arange(batch, at::kLong).repeat_interleave(beams);
  model.select_rows(*state, expand);
  logits = logits.index_select(0, expand.to(logits.device()));

  std::vector<std::vector<Hypothesis>> running(static_cast<std::size_t>(batch)), kept(static_cast<std::size_t>(batch));
  for (auto& r : running) {
    r.resize(static_cast<std::size_t>(beams));
    r[0].score = 0.0f;  // only the first beam's continuations count at the first step
  }
  for (auto& k : kept) k.resize(static_cast<std::size_t>(beams));
  std::vector<char> improvable(static_cast<std::size_t>(batch), 1);  // the early-stop heuristic is unsatisfied
  std::vector<int64_t> active(static_cast<std::size_t>(batch));      // prompts whose beams the state holds
  std::iota(active.begin(), active.end(), 0);

  auto history_of = [&](int64_t item, const Hypothesis& h) {
    std::vector<int64_t> full = prompts.history[static_cast<std::size_t>(item)];
    full.insert(full.end(), h.tokens.begin(), h.tokens.end());
    return full;
  };

  while (true) {
    const auto n_active = static_cast<int64_t>(active.size());
    at::Tensor log_probs = at::log_softmax(logits.to(at::kFloat), -1);  // (A * beams, V)
    const int64_t vocab = log_probs.size(-1);
    if (options.no_repeat_ngram_size > 0) {
      std::vector<std::vector<int64_t>> full;
      for (const int64_t item : active)
        for (const auto& h : running[static_cast<std::size_t>(item)]) full.push_back(history_of(item, h));
      std::vector<const std::vector<int64_t>*> pointers;
      for (const auto& f : full) pointers.push_back(&f);
      ban_repeated_ngrams(log_probs, pointers, options.no_repeat_ngram_size);
    }
    std::vector<float> running_scores;
    for (const int64_t item : active)
      for (const auto& h : running[static_cast<std::size_t>(item)]) running_scores.push_back(h.score);
    log_probs = log_probs + at::tensor(running_scores, at::kFloat).to(device).unsqueeze(1);
    const auto [top_values, top_indices] = log_probs.reshape({n_active, beams * vocab}).topk(keep_k, -1);
    const at::Tensor values_cpu = top_values.to(at::kCPU).contiguous(), indices_cpu = top_indices.to(at::kCPU).contiguous();
    const auto values = values_cpu.accessor<float, 2>();
    const auto indices = indices_cpu.accessor<int64_t, 2>();
    const bool at_limit = length + 1 >= max_length;
    const auto generated = static_cast<double>(length + 1 - prompt_length);
    const auto length_divisor = static_cast<float>(std::pow(generated, penalty));

    std::vector<int64_t> reorder;  // for each new running beam: its source row of the state
    for (int64_t a = 0; a < n_active; ++a) {
      const auto item = static_cast<std::size_t>(active[static_cast<std::size_t>(a)]);
      struct Candidate {
        Hypothesis h;
        int64_t source;
        float score;
        bool stops;
      };
      std::vector<Candidate> candidates;
      for (int64_t k = 0; k < keep_k; ++k) {
        const float score = values[a][k];
        const int64_t index = indices[a][k];
        const int64_t beam = index / vocab, token = index % vocab;
        Candidate c{running[item][static_cast<std::size_t>(beam)], beam, score, at_limit || is_eos(eos, token)};
        c.h.tokens.push_back(token);
        candidates.push_back(std::move(c));
      }
      // The next running beams: the best num_beams that did not stop.
      std::vector<std::size_t> order(candidates.size());
      std::iota(order.begin(), order.end(), 0);
      auto running_score = [&](std::size_t i) { return candidates[i].score + (candidates[i].stops ? -kLarge : 0.0f); };
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t x, std::size_t y) { return running_score(x) > running_score(y); });
      std::vector<Hypothesis> next;
      for (int64_t j = 0; j < beams; ++j) {
        const auto& c = candidates[order[static_cast<std::size_t>(j)]];
        Hypothesis h = c.h;
        h.score = running_score(order[static_cast<std::size_t>(j)]);
        next.push_back(std::move(h));
        reorder.push_back(a * beams + c.source);
      }
      // The kept hypotheses: the earlier ones and the first num_beams candidates that stopped, length-penalised.
      const bool full = std::all_of(kept[item].begin(), kept[item].end(), [](const Hypothesis& h) { return h.finished; });
      std::vector<Hypothesis> merged = kept[item];
      for (int64_t k = 0; k < keep_k; ++k) {
        const auto& c = candidates[static_cast<std::size_t>(k)];
        Hypothesis h = c.h;
        h.finished = c.stops && k < beams;
        h.score = c.score / length_divisor;
        if (full && options.early_stopping == EarlyStopping::kWhenFull) h.score += -kLarge;
        if (!improvable[item]) h.score += -kLarge;
        if (!h.finished) h.score += -kLarge;
        merged.push_back(std::move(h));
      }
      std::stable_sort(merged.begin(), merged.end(),
                       [](const Hypothesis& x, const Hypothesis& y) { return x.score > y.score; });
      merged.resize(static_cast<std::size_t>(beams));
      kept[item] = std::move(merged);
      running[item] = std::move(next);
    }
    length += 1;

    // Which prompts can still improve (transformers' _check_early_stop_heuristic), and which are frozen.
    std::vector<int64_t> still_active, rows;
    for (int64_t a = 0; a < n_active && !at_limit; ++a) {
      const auto item = static_cast<std::size_t>(active[static_cast<std::size_t>(a)]);
      const int64_t hypothetical = options.early_stopping == EarlyStopping::kNever && penalty > 0.0
                                       ? max_length - prompt_length
                                       : length - prompt_length;
      const float best = running[item][0].score /
                         static_cast<float>(std::pow(static_cast<double>(hypothetical), penalty));
      float worst = std::numeric_limits<float>::infinity();
      for (const auto& h : kept[item]) worst = std::min(worst, h.score);
      bool beatable = false;
      for (const auto& h : kept[item]) {
        if (best > (h.finished ? worst : -kLarge)) beatable = true;
      }
      improvable[item] = improvable[item] && beatable;
      const bool all_finished =
          std::all_of(kept[item].begin(), kept[item].end(), [](const Hypothesis& h) { return h.finished; });
      const bool frozen = !improvable[item] || (options.early_stopping == EarlyStopping::kWhenFull && all_finished);
      if (frozen) continue;
      still_active.push_back(static_cast<int64_t>(item));
      for (int64_t j = 0; j < beams; ++j) rows.push_back(reorder[static_cast<std::size_t>(a * beams + j)]);
    }
    const bool more = !at_limit && !still_active.empty();
    if (!any_goes_on(more, options)) break;
    if (!more) {
      step_on_until_all_done(model, *state, n_active * beams, options, device);
      break;
    }
    // Most steps reorder beams; a step where every beam continues itself copies nothing.
    std::vector<int64_t> same(rows.size());
    std::iota(same.begin(), same.end(), 0);
    if (rows != same) model.select_rows(*state, at::tensor(rows, at::kLong));
    active = std::move(still_active);
    std::vector<int64_t> tokens;
    for (const int64_t item : active)
      for (const auto& h : running[static_cast<std::size_t>(item)]) tokens.push_back(h.tokens.back());
    logits = model.decode_step(*state, long_tensor(tokens, device).unsqueeze(1));
  }

  std::vector<std::vector<int64_t>> out;
  for (auto& k : kept) out.push_back(std::move(k[0].tokens));
  return out;
}

std::vector<int64_t> eos_ids(const LanguageModel& model, const GenerateOptions& options) {
  if (!options.eos_token_ids.empty()) return options.eos_token_ids;
  if (const auto eos = model.eos_token_id()) return {*eos};
  return {};
}

// Restores the model's training mode when generation ends, however it ends.
class EvalModeScope {
 public:
  explicit EvalModeScope(LanguageModel& model) : model_(model), was_training_(model.is_training()) { model.train(false); }
  ~EvalModeScope() { model_.train(was_training_); }
  EvalModeScope(const EvalModeScope&) = delete;
  EvalModeScope& operator=(const EvalModeScope&) = delete;

 private:
  LanguageModel& model_;
  bool was_training_;
};

}  // namespace

std::vector<std::vector<int64_t>> generate_batch(LanguageModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                                 const GenerateOptions& options) {
  if (prompts.empty()) return {};
  if (options.max_new_tokens <= 0) return std::vector<std::vector<int64_t>>(prompts.size());
  if (options.num_beams < 1)
    throw DataError("generation: num_beams is " + std::to_string(options.num_beams), "use 1 (no beam search) or more");
  if (options.num_beams > 1 && options.temperature > 0)
    throw DataError("generation: beam search with sampling is not supported",
                    "use num_beams 1 with do_sample, or do_sample false with beams");
  at::NoGradGuard no_grad;
  EvalModeScope eval_mode(model);
  const auto& config = model.hf_config();
  const auto eos = eos_ids(model, options);
  int64_t pad = options.pad_token_id.value_or(
      hf::get_optional_int(config, "pad_token_id").value_or(eos.empty() ? 0 : eos.front()));
  if (pad < 0 || pad >= model.vocab_size()) pad = 0;
  PaddedPrompts padded = pad_prompts(model, prompts, pad, model.lm_head_weight().device());
  return options.num_beams > 1 ? beam_search(model, padded, options, eos) : greedy_or_sample(model, padded, options, eos);
}

std::vector<int64_t> generate(LanguageModel& model, const at::Tensor& prompt_ids, const GenerateOptions& options) {
  const at::Tensor row = prompt_ids.reshape({-1}).to(at::kCPU).to(at::kLong).contiguous();
  std::vector<int64_t> prompt(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  return generate_batch(model, {prompt}, options).front();
}

void apply_generation_config(const nlohmann::json& g, ModelFamily family, GenerateOptions& options) {
  if (!g.is_object()) throw DataError("generation_config.json: expected a JSON object");
  auto integer = [&](const char* key) -> std::optional<int64_t> {
    const auto* v = hf::find(g, key);
    if (!v || v->is_null()) return std::nullopt;
    if (!v->is_number_integer())
      throw DataError(std::string("generation_config.json: \"") + key + "\" must be an integer");
    return v->get<int64_t>();
  };
  auto number = [&](const char* key) -> std::optional<double> {
    const auto* v = hf::find(g, key);
    if (!v || v->is_null()) return std::nullopt;
    if (!v->is_number()) throw DataError(std::string("generation_config.json: \"") + key + "\" must be a number");
    return v->get<double>();
  };
  if (const auto n = integer("max_new_tokens")) options.max_new_tokens = *n;
  else if (const auto m = integer("max_length"); m && family == ModelFamily::kSeq2Seq) options.max_new_tokens = *m - 1;
  if (const auto n = integer("num_beams")) options.num_beams = *n;
  if (const auto p = number("length_penalty")) options.length_penalty = *p;
  if (const auto n = integer("no_repeat_ngram_size")) options.no_repeat_ngram_size = *n;
  if (const auto* e = hf::find(g, "early_stopping"); e && !e->is_null()) {
    if (e->is_boolean()) options.early_stopping = e->get<bool>() ? EarlyStopping::kWhenFull : EarlyStopping::kHeuristic;
    else if (e->is_string() && e->get<std::string>() == "never") options.early_stopping = EarlyStopping::kNever;
    else throw DataError("generation_config.json: \"early_stopping\" must be true, false or \"never\"");
  }
  const auto* sample = hf::find(g, "do_sample");
  const bool do_sample = sample && sample->is_boolean() && sample->get<bool>();
  if (do_sample) {
    options.temperature = number("temperature").value_or(1.0);
    options.top_k = integer("top_k").value_or(50);
    options.top_p = number("top_p").value_or(1.0);
  } else if (sample && sample->is_boolean()) {
    options.temperature = 0.0;
  }
  if (const auto* e = hf::find(g, "eos_token_id"); e && !e->is_null()) {
    options.eos_token_ids.clear();
    if (e->is_number_integer()) options.eos_token_ids.push_back(e->get<int64_t>());
    else if (e->is_array())
      for (const auto& id : *e)
        if (id.is_number_integer()) options.eos_token_ids.push_back(id.get<int64_t>());
  }
  if (const auto p = integer("pad_token_id")) options.pad_token_id = *p;
}

}  // namespace trainer
