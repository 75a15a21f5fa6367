// The model registry and the loss of a micro-batch: what is the same for every architecture (generation:
// generation.cpp).
#include "models/model.h"

#include <array>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/decoder/spec.h"
#include "models/dropout.h"
#include "models/hf_config.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {

std::unique_ptr<LanguageModel> make_t5(const nlohmann::json& config, const c10::TensorOptions& options);
std::unique_ptr<LanguageModel> make_decoder(const nlohmann::json& config, DecoderSpec spec,
                                           const c10::TensorOptions& options);

std::unique_ptr<LanguageModel> build_model(const nlohmann::json& config, const c10::TensorOptions& options) {
  const std::string type = hf::get_string(config, "model_type", "");
  std::unique_ptr<LanguageModel> model;
  if (type == "t5") model = make_t5(config, options);
  if (auto spec = decoder_spec_for(type, config)) model = make_decoder(config, std::move(*spec), options);
  if (model) {
    assign_dropout_sites(*model);  // each dropout's masks keyed by its module path
    return model;
  }
  std::string names;
  for (const auto& [known, family] : supported_model_types()) names += (names.empty() ? "" : ", ") + known;
  throw DataError("config.json: model_type \"" + type + "\" is not supported", "supported model types: " + names);
}

void check_fp16_supported(const std::string& model_type, const std::string& config_json) {
  // The T5 family as transformers names it: each is T5's blocks (relative attention, gated or relu FF).
  // (ByT5 and FLAN-T5 checkpoints say "t5".)
  static constexpr std::array<const char*, 5> kT5Family = {"t5", "mt5", "umt5", "longt5", "switch_transformers"};
  for (const char* type : kT5Family)
    if (model_type == type)
      throw UsageError("precision.mode=fp16-mixed is refused for " + config_json + " (model_type \"" + model_type +
                           "\"): T5 / FLAN-T5 activations overflow fp16 in the forward pass (inf, then NaN loss), "
                           "which no loss scale can prevent",
                       "use precision.mode=bf16-mixed or bf16 where the GPU has bf16 (Ampere and newer, and the CPU), "
                       "else precision.mode=fp32");
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
  out.routing_loss = model.routing_loss();
  if (keep_logits) out.logits = logits;
  return out;
}

std::vector<std::size_t> parameter_units(ShardableModule& model) {
  std::map<const Module*, std::size_t> index;
  const auto blocks = model.blocks();
  for (std::size_t i = 0; i < blocks.size(); ++i) index[blocks[i]] = i + 1;
  std::vector<std::pair<std::string, std::size_t>> prefixes;
  model.for_each_module([&](const std::string& name, Module& module) {
    if (const auto it = index.find(&module); it != index.end()) prefixes.emplace_back(name + ".", it->second);
  });
  const auto outside = model.parameters_used_outside_blocks();
  const std::set<std::string> outside_blocks(outside.begin(), outside.end());
  std::vector<std::size_t> units;
  model.for_each_parameter([&](const std::string& name, at::Tensor&) {
    std::size_t unit = 0;
    if (!outside_blocks.count(name))
      for (const auto& [prefix, i] : prefixes)
        if (name.starts_with(prefix)) {
          unit = i;
          break;
        }
    units.push_back(unit);
  });
  return units;
}

int64_t count_parameters(Module& model) {
  int64_t total = 0;
  model.for_each_parameter([&](const std::string&, at::Tensor& p) { total += p.numel(); });
  return total;
}

std::vector<int64_t> prompt_ids(const LanguageModel& model, const Tokenizer& tokenizer, std::string_view prompt,
                                bool add_eos) {
  const auto ids = encode_for_training(tokenizer, prompt, model.family() == ModelFamily::kSeq2Seq && add_eos);
  return {ids.begin(), ids.end()};
}

}  // namespace trainer
