// Semantic checks of a parsed configuration: ranges and consistency between keys. Pure: no file system access
// (a config for another machine must validate here), so paths are checked when the run starts.
#include <algorithm>
#include <cmath>
#include <regex>
#include <string>

#include "trainer/config.h"
#include "util/strings.h"

namespace trainer {
namespace {

class Checker {
 public:
  explicit Checker(std::vector<ConfigProblem>& problems) : problems_(problems) {}

  void require(bool ok, const std::string& where, const std::string& what) {
    if (!ok) problems_.push_back({where, what});
  }
  void at_least(std::int64_t value, std::int64_t minimum, const std::string& where) {
    require(value >= minimum, where, "must be at least " + std::to_string(minimum) + ", got " + std::to_string(value));
  }
  void in_range(double value, double low, double high, const std::string& where, bool high_inclusive = true) {
    const bool ok = value >= low && (high_inclusive ? value <= high : value < high);
    require(ok, where,
            "must be in [" + trim(low) + ", " + trim(high) + (high_inclusive ? "]" : ")") + ", got " + trim(value));
  }

 private:
  static std::string trim(double v) {
    std::string s = std::to_string(v);
    s.erase(s.find_last_not_of('0') + 1);
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }
  std::vector<ConfigProblem>& problems_;
};

bool known_step(const std::string& step) {
  return std::find_if(std::begin(kEscalationSteps), std::end(kEscalationSteps),
                      [&](const char* s) { return step == s; }) != std::end(kEscalationSteps);
}

const std::vector<std::string>& generation_metric_names() {
  // eval/metrics.h's compute_metrics knows these names.
  static const std::vector<std::string> names = {"exact_match", "exact_match_normalized", "rouge1", "rouge2",
                                                 "rougeL",      "rougeLsum",              "bleu",   "chrf"};
  return names;
}

bool is_generation_metric(const std::string& name) {
  const auto& names = generation_metric_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

bool is_device_spec(const std::string& spec) {
  static const std::regex pattern("auto|cpu|cuda(:[0-9]+)?");
  return std::regex_match(spec, pattern);
}

}  // namespace

std::vector<ConfigProblem> validate(const Config& c) {
  std::vector<ConfigProblem> problems;
  Checker check(problems);

  check.require(!c.model.path.empty(), "model.path",
                "is required: a Hugging Face model directory (for init=random, one holding config.json)");

  const auto& d = c.data;
  check.require(!d.train_files.empty(), "data.train_files", "is required: one or more data files (JSONL, Parquet, Arrow), globs or datasets folders");
  check.in_range(d.validation_fraction, 0.0, 1.0, "data.validation_fraction", /*high_inclusive=*/false);
  check.require(d.validation_files.empty() || d.validation_fraction == 0.0, "data.validation_fraction",
                "give either validation_files or validation_fraction, not both");
  check.at_least(d.max_input_length, 1, "data.max_input_length");
  check.at_least(d.max_target_length, 1, "data.max_target_length");
  check.at_least(d.max_length, 2, "data.max_length");
  check.at_least(d.num_workers, 1, "data.num_workers");
  for (const auto& [key, field] : {std::pair{"input_field", &d.input_field}, {"target_field", &d.target_field},
                                   {"text_field", &d.text_field}, {"prompt_field", &d.prompt_field},
                                   {"completion_field", &d.completion_field}})
    check.require(!field->empty(), std::string("data.") + key, "must name a record field");

  const auto& t = c.training;
  check.at_least(t.batch_size, 1, "training.batch_size");
  if (!t.micro_batch_size.is_auto) {
    check.at_least(t.micro_batch_size.value, 1, "training.micro_batch_size");
    check.require(t.micro_batch_size.value <= t.batch_size, "training.micro_batch_size",
                  "(" + std::to_string(t.micro_batch_size.value) + ") is larger than training.batch_size (" +
                      std::to_string(t.batch_size) + "); the micro-batch is a part of the effective batch");
  }
  check.at_least(t.gradient_accumulation_steps, 0, "training.gradient_accumulation_steps");
  check.at_least(t.micro_batch_tokens, 0, "training.micro_batch_tokens");
  if (t.micro_batch_tokens > 0) {
    check.require(t.micro_batch_size.is_auto, "training.micro_batch_size",
                  "is fixed, but training.micro_batch_tokens (token-budget mode) sizes the micro-batches; "
                  "leave micro_batch_size at \"auto\", or set micro_batch_tokens to 0");
    check.require(t.gradient_accumulation_steps == 0, "training.gradient_accumulation_steps",
                  "must be 0 with training.micro_batch_tokens: the number of micro-batches follows from the tokens");
  }
  if (t.gradient_accumulation_steps > 0 && t.micro_batch_tokens == 0) {
    if (t.micro_batch_size.is_auto) {
      check.require(false, "training.gradient_accumulation_steps",
                    "needs a fixed training.micro_batch_size; with \"auto\" the steps follow from batch_size");
    } else {
      const auto product = t.micro_batch_size.value * t.gradient_accumulation_steps;
      check.require(product == t.batch_size, "training.batch_size",
                    "(" + std::to_string(t.batch_size) + ") must equal micro_batch_size x gradient_accumulation_steps = " +
                        std::to_string(product) + "; set batch_size to " + std::to_string(product) +
                        " or leave gradient_accumulation_steps at 0");
    }
  }
  check.at_least(t.max_steps, 0, "training.max_steps");
  check.at_least(t.epochs, 0, "training.epochs");
  check.require(t.max_steps > 0 || t.epochs > 0, "training.max_steps",
                "the run has no length: set training.max_steps or training.epochs above 0");
  check.require(t.max_grad_norm >= 0, "training.max_grad_norm", "must be >= 0 (0 turns clipping off)");
  check.at_least(t.loss_chunk_size, 1, "training.loss_chunk_size");

  const auto& e = c.evaluation;
  check.at_least(e.every_steps, 0, "evaluation.every_steps");
  if (!e.micro_batch_size.is_auto) check.at_least(e.micro_batch_size.value, 1, "evaluation.micro_batch_size");
  check.at_least(e.max_batches, 0, "evaluation.max_batches");
  check.at_least(e.max_new_tokens, 1, "evaluation.max_new_tokens");
  check.at_least(e.generate_examples, 0, "evaluation.generate_examples");
  if (e.generate_max_new_tokens) check.at_least(*e.generate_max_new_tokens, 1, "evaluation.generate_max_new_tokens");
  if (e.generate_num_beams) check.at_least(*e.generate_num_beams, 1, "evaluation.generate_num_beams");
  if (e.generate_no_repeat_ngram_size)
    check.at_least(*e.generate_no_repeat_ngram_size, 0, "evaluation.generate_no_repeat_ngram_size");
  if (e.generate_temperature)
    check.require(*e.generate_temperature > 0, "evaluation.generate_temperature", "must be above 0");
  if (e.generate_top_p) check.in_range(*e.generate_top_p, 0.0, 1.0, "evaluation.generate_top_p");
  if (e.generate_top_k) check.at_least(*e.generate_top_k, 0, "evaluation.generate_top_k");
  check.require(!(e.generate_do_sample.value_or(false) && e.generate_num_beams.value_or(1) > 1),
                "evaluation.generate_do_sample", "beam search with sampling is not supported: set "
                "evaluation.generate_num_beams=1 or generate_do_sample=false");
  for (const auto& name : e.generate_metrics)
    check.require(is_generation_metric(name), "evaluation.generate_metrics",
                  "'" + name + "' is not one of " + join_alternatives(generation_metric_names()));
  if (e.generate)
    check.require(!c.data.validation_files.empty() || c.data.validation_fraction > 0, "evaluation.generate",
                  "needs validation data: data.validation_files or data.validation_fraction");
  for (const auto& prompt : e.class_prompts)
    check.require(prompt.find("{}") != std::string::npos, "evaluation.class_prompts",
                  "\"" + prompt + "\" has no {} where the class name goes (e.g. \"a photo of a {}.\")");
  if (t.objective == TrainingObjective::kContrastive) {
    check.require(!t.linear_probe, "training.linear_probe",
                  "is for classifiers; with training.objective=contrastive use contrastive.freeze_image_tower to "
                  "lock the image tower");
    check.require(t.micro_batch_tokens == 0 && !c.data.packing, "training.micro_batch_tokens",
                  "counts tokens; a contrastive run's micro-batch counts image-caption pairs: set "
                  "training.micro_batch_tokens=0 and data.packing=false");
    check.require(t.batch_size >= 2, "training.batch_size",
                  "a contrastive batch needs at least 2 pairs (each pair's negatives are the others)");
  } else {
    check.require(c.contrastive == ContrastiveConfig{}, "contrastive",
                  "applies only with training.objective=contrastive");
  }
  if (t.objective == TrainingObjective::kDpo) {
    const auto& dpo = c.dpo;
    check.require(dpo.beta > 0, "dpo.beta", "must be > 0, got " + std::to_string(dpo.beta));
    check.require(!dpo.loss_type.empty(), "dpo.loss_type", "names at least one loss (sigmoid, hinge, ipo, robust, sft)");
    for (const auto& name : dpo.loss_type)
      check.require(name == "sigmoid" || name == "hinge" || name == "ipo" || name == "robust" || name == "sft",
                    "dpo.loss_type",
                    "'" + name + "' is not one of sigmoid, hinge, ipo, robust, sft (TRL's other loss types are not "
                    "implemented)");
    check.require(dpo.loss_weights.empty() || dpo.loss_weights.size() == dpo.loss_type.size(), "dpo.loss_weights",
                  "has " + std::to_string(dpo.loss_weights.size()) + " weights for " +
                      std::to_string(dpo.loss_type.size()) + " loss types: give one per loss type, or none");
    check.require(dpo.label_smoothing >= 0 && dpo.label_smoothing < 0.5, "dpo.label_smoothing",
                  "must be in [0, 0.5), got " + std::to_string(dpo.label_smoothing));
    check.require(!c.data.packing && t.micro_batch_tokens == 0, "data.packing",
                  "a DPO run's micro-batch counts preference pairs: set data.packing=false and "
                  "training.micro_batch_tokens=0");
    check.require(!c.evaluation.generate, "evaluation.generate",
                  "evaluation by generation is for supervised runs; a DPO evaluation reports the rewards and the "
                  "loss of the validation pairs");
    check.require(!t.linear_probe, "training.linear_probe", "is for image classifiers");
  } else {
    check.require(c.dpo == DpoConfig{}, "dpo", "applies only with training.objective=dpo");
  }

  const auto& o = c.optimizer;
  check.require(o.lr > 0 && o.lr < 1, "optimizer.lr", "must be in (0, 1), got " + std::to_string(o.lr));
  check.in_range(o.beta1, 0.0, 1.0, "optimizer.beta1", false);
  check.in_range(o.beta2, 0.0, 1.0, "optimizer.beta2", false);
  check.require(o.eps > 0, "optimizer.eps", "must be > 0");
  check.require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0");
  check.require(o.adafactor_eps1 > 0, "optimizer.adafactor_eps1", "must be > 0");
  check.require(o.adafactor_eps2 > 0, "optimizer.adafactor_eps2", "must be > 0");
  check.require(o.clip_threshold > 0, "optimizer.clip_threshold", "must be > 0");
  check.require(o.decay_rate < 0, "optimizer.decay_rate", "must be < 0 (the decay is 1 - t^decay_rate)");
  check.require(!o.warmup_init || o.relative_step, "optimizer.warmup_init", "only applies with optimizer.relative_step=true");
  check.require(o.name == OptimizerName::kAdafactor || !(o.relative_step || o.adafactor_beta1), "optimizer.name",
                "optimizer.relative_step / adafactor_beta1 are Adafactor's: set optimizer.name=adafactor");

  check.require(o.state_dtype != StateDtype::kInt8 || o.name == OptimizerName::kAdamW, "optimizer.state_dtype",
                "int8 is AdamW's (bitsandbytes' AdamW8bit); Adafactor keeps factored fp32 statistics");
  check.require(o.state_dtype != StateDtype::kInt8 || c.precision.mode != PrecisionMode::kBf16 || c.lora.enabled,
                "optimizer.state_dtype",
                "int8 moments update fp32 parameters (as bitsandbytes' CPU AdamW8bit): use precision.mode=bf16-mixed "
                "or fp32 with it, or state_dtype=bf16 with precision.mode=bf16");

  const auto& s = c.scheduler;
  check.at_least(s.warmup_steps, 0, "scheduler.warmup_steps");
  check.in_range(s.warmup_ratio, 0.0, 1.0, "scheduler.warmup_ratio");
  check.require(s.warmup_steps == 0 || s.warmup_ratio == 0.0, "scheduler.warmup_ratio",
                "give either warmup_steps or warmup_ratio, not both");
  check.in_range(s.min_lr_ratio, 0.0, 1.0, "scheduler.min_lr_ratio");

  const auto& p = c.precision;
  check.require(p.initial_loss_scale > 0 && std::isfinite(p.initial_loss_scale), "precision.initial_loss_scale",
                "must be a positive number, e.g. 65536 (2^16)");
  check.at_least(p.loss_scale_growth_interval, 1, "precision.loss_scale_growth_interval");

  const auto& l = c.lora;
  if (l.enabled) {
    check.at_least(l.r, 1, "lora.r");
    check.require(l.alpha > 0, "lora.alpha", "must be > 0");
    check.in_range(l.dropout, 0.0, 1.0, "lora.dropout", false);
    // PEFT's LoRA on parameters (ParamWrapper) refuses dropout: B A (dropout(x)) cannot be folded into a weight.
    check.require(l.target_parameters.empty() || l.dropout == 0.0, "lora.dropout",
                  "must be 0 with lora.target_parameters (PEFT refuses dropout on the experts' stacked parameters, so "
                  "the adapter would not load there); set lora.dropout=0");
  }
  check.require(l.target_parameters.empty() || l.enabled, "lora.target_parameters",
                "only applies with lora.enabled=true");
  check.require(!l.base_in_bf16 || l.enabled, "lora.base_in_bf16", "only applies with lora.enabled=true");

  const auto& mq = c.model;
  const bool power_of_two = mq.quantize_block_size > 0 && (mq.quantize_block_size & (mq.quantize_block_size - 1)) == 0;
  check.require(power_of_two && mq.quantize_block_size >= 64 && mq.quantize_block_size <= 4096,
                "model.quantize_block_size",
                "must be 64, 128, 256, 512, 1024, 2048 or 4096 (bitsandbytes' block sizes), got " +
                    std::to_string(mq.quantize_block_size));
  check.require(mq.quantize == QuantizeMode::kNone || l.enabled, "model.quantize",
                "4-bit layers are frozen: quantizing leaves nothing of the base to train; set lora.enabled=true "
                "(QLoRA) or model.quantize=none");

  const auto& m = c.memory;
  check.require(m.shrink_factor > 0 && m.shrink_factor < 1, "memory.shrink_factor",
                "must be in (0, 1), e.g. 0.5 halves the micro-batch after an out-of-memory error");
  check.at_least(m.min_micro_batch_size, 1, "memory.min_micro_batch_size");
  check.at_least(m.max_retries, 0, "memory.max_retries");
  check.at_least(m.regrow_after_steps, 0, "memory.regrow_after_steps");
  check.in_range(m.auto_safety_margin, 0.0, 0.9, "memory.auto_safety_margin");
  check.at_least(m.empty_cache_every, 0, "memory.empty_cache_every");
  std::vector<std::string> steps(std::begin(kEscalationSteps), std::end(kEscalationSteps));
  for (std::size_t i = 0; i < m.escalation.size(); ++i) {
    const auto& step = m.escalation[i];
    bool known = false;
    for (const auto& s2 : steps) known = known || s2 == step;
    std::string hint = closest_match(step, steps);
    check.require(known, "memory.escalation[" + std::to_string(i) + "]",
                  "'" + step + "' is not one of " + join_alternatives(steps) +
                      (hint.empty() ? "" : "; did you mean '" + hint + "'?"));
  }
  // The device moves end the ladder: nothing that changes how the step computes may come after one.
  std::size_t first_move = m.escalation.size();
  for (std::size_t i = 0; i < m.escalation.size(); ++i) {
    const bool is_move = std::find(std::begin(kDeviceEscalationSteps), std::end(kDeviceEscalationSteps),
                                   m.escalation[i]) != std::end(kDeviceEscalationSteps);
    if (is_move) first_move = std::min(first_move, i);
    else if (i > first_move && known_step(m.escalation[i]))
      check.require(false, "memory.escalation[" + std::to_string(i) + "]",
                    "'" + m.escalation[i] + "' comes after the device move '" + m.escalation[first_move] +
                        "'; the device moves are the end of the ladder: list them last");
  }
  if (!t.micro_batch_size.is_auto)
    check.require(m.min_micro_batch_size <= t.micro_batch_size.value, "memory.min_micro_batch_size",
                  "is larger than training.micro_batch_size");

  const auto& dev = c.device;
  check.require(is_device_spec(dev.type), "device.type",
                "'" + dev.type + "' is not auto, cpu, cuda or cuda:N (N a device index)");
  check.require(dev.wait_timeout_s >= 0, "device.wait_timeout_s", "must be >= 0");
  check.require(dev.poll_interval_s > 0, "device.poll_interval_s", "must be > 0");

  const auto& ck = c.checkpoint;
  check.require(!ck.output_dir.empty(), "checkpoint.output_dir", "is required");
  check.at_least(ck.every_steps, 0, "checkpoint.every_steps");
  check.at_least(ck.keep_last, 1, "checkpoint.keep_last");
  check.require(ck.max_shard_size.bytes >= (1u << 20), "checkpoint.max_shard_size", "must be at least 1MiB");
  if (ck.keep_best) {
    // The best is chosen among checkpoints by the validation loss at their own step.
    check.require(!c.data.validation_files.empty() || c.data.validation_fraction > 0, "checkpoint.keep_best",
                  "needs validation data: data.validation_files or data.validation_fraction");
    check.require(ck.every_steps > 0 && e.every_steps > 0 && ck.every_steps % e.every_steps == 0,
                  "checkpoint.keep_best",
                  "needs checkpoint.every_steps (" + std::to_string(ck.every_steps) +
                      ") to be a multiple of evaluation.every_steps (" + std::to_string(e.every_steps) +
                      "), both above 0, so that every checkpoint has a validation loss");
    if (ck.best_metric != "loss") {
      const bool measured = e.generate && std::find(e.generate_metrics.begin(), e.generate_metrics.end(),
                                                    ck.best_metric) != e.generate_metrics.end();
      check.require(measured, "checkpoint.best_metric",
                    "'" + ck.best_metric + "' is not measured: use loss, or set evaluation.generate=true with '" +
                        ck.best_metric + "' in evaluation.generate_metrics");
    }
  }

  check.at_least(c.logging.every_steps, 1, "logging.every_steps");
  check.require(c.distributed.timeout_s > 0, "distributed.timeout_s", "must be > 0");
  check.require(c.distributed.bucket_size.bytes >= (1u << 10), "distributed.bucket_size", "must be at least 1KiB");
  return problems;
}

}  // namespace trainer
