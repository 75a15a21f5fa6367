// The model registry, the loss of a micro-batch, and token generation: what is the same for every architecture.
#include "models/model.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/dropout.h"
#include "models/hf_config.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {

std::unique_ptr<LanguageModel> make_t5(const nlohmann::json& config, const c10::TensorOptions& options);
std::unique_ptr<LanguageModel> make_llama(const nlohmann::json& config, const c10::TensorOptions& options);

std::unique_ptr<LanguageModel> build_model(const nlohmann::json& config, const c10::TensorOptions& options) {
  const std::string type = hf::get_string(config, "model_type", "");
  std::unique_ptr<LanguageModel> model;
  if (type == "t5") model = make_t5(config, options);
  if (type == "llama" || type == "qwen2" || type == "mistral") model = make_llama(config, options);
  if (model) {
    assign_dropout_sites(*model);  // each dropout's masks keyed by its module path
    return model;
  }
  std::string names;
  for (const auto& [known, family] : supported_model_types()) names += (names.empty() ? "" : ", ") + known;
  throw DataError("config.json: model_type \"" + type + "\" is not supported", "supported model types: " + names);
}

LossSum forward_loss(LanguageModel& model, const Batch& batch, bool keep_logits) {
  const auto [hidden, targets] = model.hidden_and_targets(batch);
  const at::Tensor logits = model.lm_head(hidden);
  // Cross-entropy in fp32 whatever the compute dtype, summed: the caller divides by the effective batch's tokens.
  const at::Tensor loss_sum = at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, logits.size(-1)}),
                                                     targets.reshape({-1}), /*weight=*/{}, at::Reduction::Sum,
                                                     /*ignore_index=*/-100);
  LossSum out;
  out.loss_sum = loss_sum;
  out.target_tokens = (targets != -100).sum().item<int64_t>();
  if (keep_logits) out.logits = logits;
  return out;
}

int64_t count_parameters(Module& model) {
  int64_t total = 0;
  model.for_each_parameter([&](const std::string&, at::Tensor& p) { total += p.numel(); });
  return total;
}

namespace {

// Nucleus sampling: the smallest set of tokens whose probability reaches top_p, renormalised.
int64_t sample(const at::Tensor& logits, const GenerateOptions& options, at::Generator& generator) {
  at::Tensor probs = at::softmax(logits.to(at::kFloat) / options.temperature, -1);
  if (options.top_p < 1.0) {
    const auto [sorted, order] = probs.sort(-1, /*descending=*/true);
    const at::Tensor before = sorted.cumsum(-1) - sorted;  // probability mass ahead of each token
    const at::Tensor kept = sorted.masked_fill(before >= options.top_p, 0.0);
    probs = at::zeros_like(probs).scatter(-1, order, kept);
  }
  return at::multinomial(probs, 1, false, generator).item<int64_t>();
}

}  // namespace

std::vector<int64_t> prompt_ids(const LanguageModel& model, const Tokenizer& tokenizer, std::string_view prompt,
                                bool add_eos) {
  const auto ids = encode_for_training(tokenizer, prompt, model.family() == ModelFamily::kSeq2Seq && add_eos);
  return {ids.begin(), ids.end()};
}

std::vector<int64_t> generate(LanguageModel& model, const at::Tensor& prompt_ids, const GenerateOptions& options) {
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.train(false);
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  if (options.seed) {
    generator = at::detail::createCPUGenerator(*options.seed);
  }
  std::vector<int64_t> out;
  auto [state, logits] = model.prefill(prompt_ids);
  const auto eos = model.eos_token_id();
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    const at::Tensor last = logits.reshape({-1}).to(at::kCPU);
    const int64_t token = options.temperature > 0 ? sample(last, options, generator) : last.argmax().item<int64_t>();
    out.push_back(token);
    if (eos && token == *eos) break;
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end()) break;
    if (i + 1 == options.max_new_tokens) break;
    logits = model.decode_step(*state, at::full({1, 1}, token, prompt_ids.options()));
  }
  model.train(was_training);
  return out;
}

}  // namespace trainer
