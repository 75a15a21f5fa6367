// LoRA applied from outside (see lora.h). The formulas follow PEFT's tuners/lora/layer.py (Linear.forward,
// get_delta_weight, reset_lora_parameters) so that an adapter computes the same here and in PEFT.
#include "models/lora.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include "models/linear4bit.h"
#include "models/weights.h"
#include "trainer/errors.h"
#include "trainer/hub.h"
#include "trainer/hf_weights.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

constexpr const char* kHintTargets =
    "lora.target_modules names linear layers by their last name(s), e.g. q_proj, v_proj (Llama family) or q, v "
    "(T5); `trainer inspect MODEL_DIR` shows the model's layers by group";

// No gradients for the base, so no optimizer state either; optionally held in bf16 (4-bit layers keep their
// codes and fp32 scales: only their bias converts).
void freeze(LanguageModel& model, bool to_bf16) {
  at::NoGradGuard no_grad;
  std::set<const c10::TensorImpl*> quant_state;
  model.for_each_module([&](const std::string&, Module& m) {
    auto* linear = dynamic_cast<Linear*>(&m);
    if (linear == nullptr || linear->quantized() == nullptr) return;
    linear->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      if (name != "bias") quant_state.insert(p.unsafeGetTensorImpl());
    });
  });
  model.for_each_parameter([&](const std::string&, at::Tensor& p) {
    if (to_bf16 && p.scalar_type() != at::kBFloat16 && !quant_state.count(p.unsafeGetTensorImpl()))
      p = p.detach().to(at::kBFloat16);
    p.requires_grad_(false);
  });
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// W + delta in fp32, returned in W's dtype (a 4-bit W is dequantized first and the sum returned in the dtype it was
// quantized from: PEFT's route for QLoRA, dequantize, merge, keep full precision).
at::Tensor weight_plus(const Linear& base, const at::Tensor& delta) {
  const QuantState4bit* quant = base.quantized();
  const at::Tensor w = quant ? dequantize_weight(base.weight, *quant, at::kFloat) : base.weight;
  return (w.to(at::kFloat) + delta.to(at::kFloat)).to(quant ? quant->dtype : w.scalar_type());
}

// Puts an adapted layer's merged weight in place and removes its hook: the layer computes the adapted function.
void install_merged(Linear& base, const at::Tensor& merged) {
  if (base.quantized() != nullptr) base.set_weight(merged);
  else base.weight.copy_(merged);
  base.set_output_hook({});
}

// A = kaiming_uniform_(a=sqrt(5)) on (rows, in): gain sqrt(2 / (1 + 5)), bound sqrt(3) * gain / sqrt(in) =
// 1/sqrt(in). Drawn on the CPU from our own generator, so the start does not depend on the device or other draws.
void init_lora_A(at::Tensor& lora_A, at::Generator& generator) {
  if (lora_A.is_meta()) return;
  const double bound = 1.0 / std::sqrt(static_cast<double>(lora_A.size(1)));
  at::Tensor a = at::empty(lora_A.sizes(), at::TensorOptions().dtype(at::kFloat));
  a.uniform_(-bound, bound, generator);
  lora_A.copy_(a);
}

constexpr const char* kGateUp = "gate_up_proj";
constexpr const char* kDown = "down_proj";

std::string expert_example(const std::vector<StackedExpertLayers>& groups) {
  return groups.empty() ? std::string("mlp.experts.gate_up_proj") : groups.front().path + "." + kGateUp;
}

constexpr const char* kHintExperts =
    "name the experts as PEFT does, by transformers 5's stacked parameters: lora.target_parameters = "
    "[\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"] (gate_up_proj holds each expert's gate and up "
    "projections, down_proj its down projection); the router stays frozen";

}  // namespace

LoraLinear::LoraLinear(Linear& base, int64_t r, double scaling, double dropout, std::optional<c10::Device> device)
    : base_(&base), r_(r), scaling_(scaling) {
  auto options = base.weight.options().dtype(at::kFloat);
  if (device && base.weight.is_meta()) options = options.device(*device);
  lora_A = at::zeros({r, base.in_features()}, options);
  lora_B = at::zeros({base.out_features(), r}, options);
  lora_A.requires_grad_(true);
  lora_B.requires_grad_(true);
  register_parameter("lora_A.weight", &lora_A);
  register_parameter("lora_B.weight", &lora_B);
  lora_dropout = register_module("lora_dropout", std::make_shared<Dropout>(dropout));
}

at::Tensor LoraLinear::adapt(const at::Tensor& x, const at::Tensor& y, bool training) const {
  if (!active) return y;
  at::Tensor input = x.scalar_type() == lora_A.scalar_type() ? x : x.to(lora_A.scalar_type());
  input = lora_dropout->forward(input, training);
  const at::Tensor delta = at::linear(at::linear(input, lora_A), lora_B) * scaling_;  // (..., out)
  return (y + delta).to(y.scalar_type());
}

at::Tensor LoraLinear::merged_weight() const {
  at::NoGradGuard no_grad;
  return weight_plus(*base_, at::matmul(lora_B.to(at::kFloat), lora_A.to(at::kFloat)) * scaling_);  // (out, in)
}

LoraExperts::LoraExperts(std::vector<std::vector<Linear*>> parts, int64_t r, double scaling,
                         std::optional<c10::Device> device)
    : parts_(std::move(parts)), r_(r), scaling_(scaling) {
  const Linear& first = *parts_.at(0).at(0);
  int64_t out = 0;
  for (const Linear* part : parts_[0]) out += part->out_features();
  auto options = first.weight.options().dtype(at::kFloat);
  if (device && first.weight.is_meta()) options = options.device(*device);
  lora_A = at::zeros({r * experts(), first.in_features()}, options);
  lora_B = at::zeros({out, r * experts()}, options);
  lora_A.requires_grad_(true);
  lora_B.requires_grad_(true);
  register_parameter("lora_A.weight", &lora_A);
  register_parameter("lora_B.weight", &lora_B);
}

at::Tensor LoraExperts::A(int64_t e) const { return lora_A.narrow(0, e * r_, r_); }
at::Tensor LoraExperts::B(int64_t e) const { return lora_B.view({lora_B.size(0), r_, experts()}).select(2, e); }

at::Tensor LoraExperts::adapt(int64_t e, int64_t row, int64_t rows, const at::Tensor& x, const at::Tensor& y) const {
  if (!active) return y;
  const at::Tensor input = x.scalar_type() == lora_A.scalar_type() ? x : x.to(lora_A.scalar_type());
  const bool pass = !pass_A_.empty();
  const at::Tensor a = pass ? pass_A_[static_cast<std::size_t>(e)] : A(e);
  const at::Tensor b = pass ? pass_B_[static_cast<std::size_t>(e)] : B(e);
  const at::Tensor delta = at::linear(at::linear(input, a), b.narrow(0, row, rows)) * scaling_;  // (..., rows)
  return (y + delta).to(y.scalar_type());
}

void LoraExperts::begin_pass() {
  pass_A_ = lora_A.view({experts(), r_, lora_A.size(1)}).unbind(0);
  pass_B_ = lora_B.view({lora_B.size(0), r_, experts()}).unbind(2);
}

void LoraAdapters::add(const std::string& module_path, std::shared_ptr<LoraLinear> layer) {
  Linear& base = layer->base();
  if (base.has_output_hook())
    throw UsageError(module_path + " is adapted twice", "apply LoRA to a model once");
  // Its dropout's masks are keyed by the adapted layer's path, like the model's own dropout sites.
  assign_dropout_sites(*layer, module_path + ".");
  // The hook owns the adapter, so the model keeps computing with it whatever happens to this object.
  base.set_output_hook([layer](const at::Tensor& x, const at::Tensor& y, bool training) {
    return layer->adapt(x, y, training);
  });
  layers_.emplace_back(module_path, register_module(module_path, std::move(layer)));
}

void LoraAdapters::add_experts(const std::string& path, std::shared_ptr<LoraExperts> experts) {
  for (int64_t e = 0; e < experts->experts(); ++e) {
    int64_t row = 0;
    for (Linear* part : experts->parts()[static_cast<std::size_t>(e)]) {
      if (part->has_output_hook()) throw UsageError(path + " is adapted twice", "apply LoRA to a model once");
      const int64_t rows = part->out_features();
      // The hooks own the adapter, as LoraLinear's hook does.
      part->set_output_hook([experts, e, row, rows](const at::Tensor& x, const at::Tensor& y, bool) {
        return experts->adapt(e, row, rows, x, y);
      });
      row += rows;
    }
  }
  experts_.emplace_back(path, register_module(path, std::move(experts)));
}

void LoraAdapters::add_experts(const LoraExpertTarget& target, std::shared_ptr<LoraExperts> experts) {
  if (target.pass_hook) {  // the block's other adapted parameter may have a hook already: both begin
    std::function<void()> before = *target.pass_hook;
    *target.pass_hook = [before, experts] {
      if (before) before();
      experts->begin_pass();
    };
  }
  add_experts(target.path, std::move(experts));
}

void LoraAdapters::set_active(bool active) {
  for (auto& [path, layer] : layers_) layer->active = active;
  for (auto& [path, experts] : experts_) experts->active = active;
}

int64_t LoraAdapters::trainable_parameters() const {
  int64_t n = 0;
  for (const auto& [path, layer] : layers_) n += layer->lora_A.numel() + layer->lora_B.numel();
  for (const auto& [path, experts] : experts_) n += experts->lora_A.numel() + experts->lora_B.numel();
  return n;
}

std::vector<std::string> default_lora_targets(LanguageModel& model) {
  if (model.family() == ModelFamily::kSeq2Seq) return {"q", "v"};
  // Phi-3's attention has one fused qkv_proj (PEFT has no default for it: the whole projection is the closest).
  bool fused = false;
  model.for_each_module(
      [&](const std::string& name, Module&) { fused = fused || name.ends_with(".qkv_proj"); });
  if (fused) return {"qkv_proj"};
  return {"q_proj", "v_proj"};
}

double lora_scaling(double alpha, int64_t r, bool rslora) {
  return rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

std::vector<std::string> lora_target_layers(LanguageModel& model, const std::vector<std::string>& targets) {
  std::set<const Module*> expert_layers;  // not modules in transformers 5: PEFT's target_modules never reach them
  for (const auto& group : model.stacked_expert_layers())
    for (const auto* layers : {&group.gate, &group.up, &group.down})
      for (const Linear* layer : *layers) expert_layers.insert(layer);
  std::vector<std::string> selected, not_linear;
  std::vector<bool> matched(targets.size(), false), matched_experts(targets.size(), false);
  model.for_each_module([&](const std::string& name, Module& m) {  // in the model's order, as PEFT lists them
    const bool expert = expert_layers.contains(&m);
    bool selects = false;
    for (std::size_t i = 0; i < targets.size(); ++i) {
      if (name != targets[i] && !name.ends_with("." + targets[i])) continue;
      if (expert) matched_experts[i] = true;
      else selects = matched[i] = true;
    }
    if (!selects) return;
    if (dynamic_cast<Linear*>(&m) == nullptr) not_linear.push_back(name);
    else selected.push_back(name);
  });
  std::vector<std::string> unmatched, experts_only;
  for (std::size_t i = 0; i < targets.size(); ++i)
    if (!matched[i]) (matched_experts[i] ? experts_only : unmatched).push_back(targets[i]);
  if (!experts_only.empty())
    throw UsageError("lora.target_modules: " + join(experts_only) + " select(s) only experts of this " +
                         model.model_type() + " mixture of experts, which transformers 5 holds as stacked parameters "
                         "that PEFT's target_modules cannot name (an adapter on them would not load in PEFT)",
                     kHintExperts);
  if (!unmatched.empty())
    throw UsageError("lora.target_modules: " + join(unmatched) + " match no module of this " + model.model_type() +
                         " model (the LM head and the embeddings are parameters, not layers trainer can adapt)",
                     kHintTargets);
  if (!not_linear.empty())
    throw UsageError("lora.target_modules selects modules that are not linear layers: " + join(not_linear),
                     kHintTargets);
  return selected;
}

std::vector<LoraExpertTarget> lora_expert_targets(LanguageModel& model, const std::vector<std::string>& targets) {
  if (targets.empty()) return {};
  const auto groups = model.stacked_expert_layers();
  if (groups.empty())
    throw UsageError("lora.target_parameters: this " + model.model_type() + " model has no experts trainer can adapt "
                         "(LoRA on experts covers the mixtures of experts qwen3_moe, mixtral, qwen2_moe and olmoe; "
                         "Gemma 4's experts are not supported yet)",
                     "drop lora.target_parameters and adapt linear layers with lora.target_modules");
  std::vector<std::string> other;
  for (const auto& target : targets) {
    const std::string last = target.substr(target.rfind('.') == std::string::npos ? 0 : target.rfind('.') + 1);
    if (last != kGateUp && last != kDown) other.push_back(target);
  }
  if (!other.empty())
    throw UsageError("lora.target_parameters: " + join(other) + " name(s) no stacked expert parameter; trainer adapts "
                         "the experts' gate_up_proj and down_proj (e.g. " + expert_example(groups) + ")",
                     kHintExperts);
  std::vector<bool> matched(targets.size(), false);
  std::vector<LoraExpertTarget> out;
  for (const auto& group : groups) {
    std::vector<const char*> selected;
    for (const char* parameter : {kGateUp, kDown}) {  // the order transformers registers them, which PEFT follows
      const std::string key = group.path + "." + parameter;
      bool selects = false;
      for (std::size_t i = 0; i < targets.size(); ++i)
        if (key == targets[i] || key.ends_with("." + targets[i])) selects = matched[i] = true;
      if (selects) selected.push_back(parameter);
    }
    for (std::size_t k = 0; k < selected.size(); ++k) {
      LoraExpertTarget target;
      target.path = group.path;
      target.pass_hook = group.pass_hook;
      for (std::size_t nest = k + 1; nest < selected.size(); ++nest) target.path += ".base_layer";
      for (std::size_t e = 0; e < group.gate.size(); ++e)
        target.parts.push_back(std::string(selected[k]) == kGateUp
                                   ? std::vector<Linear*>{group.gate[e], group.up[e]}
                                   : std::vector<Linear*>{group.down[e]});
      out.push_back(std::move(target));
    }
  }
  std::vector<std::string> unmatched;
  for (std::size_t i = 0; i < targets.size(); ++i)
    if (!matched[i]) unmatched.push_back(targets[i]);
  if (!unmatched.empty())
    throw UsageError("lora.target_parameters: " + join(unmatched) + " match(es) no parameter of this " +
                         model.model_type() + " model (its experts' parameters are named like " +
                         expert_example(groups) + ")",
                     kHintExperts);
  return out;
}

std::unique_ptr<LoraAdapters> apply_lora(LanguageModel& model, const LoraConfig& config, uint64_t seed,
                                         std::optional<c10::Device> device) {
  LoraConfig applied = config;
  applied.enabled = true;
  if (applied.target_modules.empty()) applied.target_modules = default_lora_targets(model);
  const auto paths = lora_target_layers(model, applied.target_modules);
  const auto expert_targets = lora_expert_targets(model, applied.target_parameters);
  if (!expert_targets.empty() && config.dropout != 0.0)
    throw UsageError("lora.dropout is " + std::to_string(config.dropout) +
                         ", but LoRA on the experts (lora.target_parameters) has no dropout: PEFT refuses it there, "
                         "so the adapter would not load",
                     "set lora.dropout=0");
  freeze(model, config.base_in_bf16);
  auto linears = linear_layers(model);
  auto adapters = std::make_unique<LoraAdapters>(applied);
  const double scaling = lora_scaling(config.alpha, config.r, config.rslora);
  at::Generator generator = at::detail::createCPUGenerator(seed);
  at::NoGradGuard no_grad;
  for (const auto& path : paths) {
    auto layer = std::make_shared<LoraLinear>(*linears.at(path), config.r, scaling, config.dropout, device);
    init_lora_A(layer->lora_A, generator);
    adapters->add(path, std::move(layer));
  }
  for (const auto& target : expert_targets) {  // after the linear layers, as PEFT injects target_parameters
    auto experts = std::make_shared<LoraExperts>(target.parts, config.r, scaling, device);
    init_lora_A(experts->lora_A, generator);
    adapters->add_experts(target, std::move(experts));
  }
  return adapters;
}

std::unique_ptr<LoraAdapters> apply_peft_adapter(LanguageModel& model, const PeftAdapter& adapter,
                                                 const std::string& source) {
  const auto& c = adapter.config;
  const std::string expected_task = model.family() == ModelFamily::kSeq2Seq ? "SEQ_2_SEQ_LM" : "CAUSAL_LM";
  if (!c.task_type.empty() && c.task_type != expected_task)
    throw DataError(source + ": the adapter's task_type is " + c.task_type + ", but the " + model.model_type() +
                        " base model is a " + expected_task + " model",
                    "load it onto the base model it was trained on (base_model_name_or_path: " +
                        c.base_model_name_or_path + ")");
  auto linears = linear_layers(model);
  std::map<std::string, LoraExpertTarget> expert_targets;  // by the path PEFT saves them under
  try {
    for (auto& target : lora_expert_targets(model, c.target_parameters)) expert_targets[target.path] = target;
  } catch (const UsageError& e) {
    throw DataError(source + ": the adapter's target_parameters do not fit the base model: " + e.what(),
                    "load it onto the base model it was trained on (base_model_name_or_path: " +
                        c.base_model_name_or_path + ")");
  }
  auto shapes = [](const LoraWeights& w) {
    return "lora_A " + std::to_string(w.lora_A.size(0)) + " x " + std::to_string(w.lora_A.size(1)) + " and lora_B " +
           std::to_string(w.lora_B.size(0)) + " x " + std::to_string(w.lora_B.size(1));
  };
  std::vector<std::string> problems;
  for (const auto& [path, target] : expert_targets)
    if (!adapter.modules.contains(path))
      problems.push_back(path + ": target_parameters select it, but the file has no weights for it");
  for (const auto& [path, weights] : adapter.modules) {
    if (const auto it = expert_targets.find(path); it != expert_targets.end()) {
      const auto& parts = it->second.parts;
      const auto experts = static_cast<int64_t>(parts.size());
      int64_t out = 0;
      for (const Linear* part : parts[0]) out += part->out_features();
      const int64_t in = parts[0][0]->in_features();
      if (weights.lora_A.size(1) != in || weights.lora_B.size(0) != out || weights.lora_A.size(0) % experts != 0)
        problems.push_back(path + ": " + shapes(weights) + " do not fit " + std::to_string(experts) +
                           " experts' stacked " + std::to_string(out) + " x " + std::to_string(in) +
                           " weights (lora_A r*" + std::to_string(experts) + " x " + std::to_string(in) +
                           ", lora_B " + std::to_string(out) + " x r*" + std::to_string(experts) + ")");
      continue;
    }
    const auto it = linears.find(path);
    if (it == linears.end()) {
      problems.push_back(path + ": no such linear layer in the base model" +
                         (path.find(".experts") != std::string::npos ? " (nor experts its target_parameters select)"
                                                                      : ""));
      continue;
    }
    const Linear& base = *it->second;
    const int64_t out = base.out_features(), in = base.in_features();
    if (weights.lora_A.size(1) != in || weights.lora_B.size(0) != out)
      problems.push_back(path + ": " + shapes(weights) + " do not fit a " + std::to_string(out) + " x " +
                         std::to_string(in) + " weight");
  }
  if (!problems.empty()) {
    std::string list;
    for (const auto& p : problems) list += "\n  " + p;
    throw DataError(source + ": the adapter does not fit the base model:" + list,
                    "load it onto the base model it was trained on (base_model_name_or_path: " +
                        c.base_model_name_or_path + ")");
  }
  if (!expert_targets.empty() && c.lora_dropout != 0.0)
    throw DataError(source + ": lora_dropout is " + std::to_string(c.lora_dropout) +
                        " with target_parameters; PEFT refuses dropout on parameters",
                    "save the adapter with lora_dropout 0");
  freeze(model, false);
  LoraConfig config;
  config.enabled = true;
  config.r = c.r;
  config.alpha = c.lora_alpha;
  config.dropout = c.lora_dropout;
  config.target_modules = c.target_modules;
  config.target_parameters = c.target_parameters;
  config.rslora = c.use_rslora;
  auto adapters = std::make_unique<LoraAdapters>(config);
  at::NoGradGuard no_grad;
  for (const auto& [path, weights] : adapter.modules) {
    if (expert_targets.contains(path)) continue;
    const int64_t r = weights.lora_A.size(0);
    auto layer = std::make_shared<LoraLinear>(*linears.at(path), r, lora_scaling(c.lora_alpha, r, c.use_rslora),
                                              c.lora_dropout);
    layer->lora_A.copy_(weights.lora_A);
    layer->lora_B.copy_(weights.lora_B);
    adapters->add(path, std::move(layer));
  }
  for (const auto& [path, target] : expert_targets) {
    const auto& weights = adapter.modules.at(path);
    const int64_t r = weights.lora_A.size(0) / static_cast<int64_t>(target.parts.size());
    auto experts = std::make_shared<LoraExperts>(target.parts, r, lora_scaling(c.lora_alpha, r, c.use_rslora));
    experts->lora_A.copy_(weights.lora_A);
    experts->lora_B.copy_(weights.lora_B);
    adapters->add_experts(target, std::move(experts));
  }
  return adapters;
}

void load_lora_weights(LoraAdapters& adapters, const PeftAdapter& adapter, const std::string& source) {
  ShapeMap expected, got;
  for (const auto& [path, layer] : adapters.layers()) {
    expected[path + ".lora_A.weight"] = layer->lora_A.sizes().vec();
    expected[path + ".lora_B.weight"] = layer->lora_B.sizes().vec();
  }
  for (const auto& [path, experts] : adapters.experts()) {
    expected[path + ".lora_A.weight"] = experts->lora_A.sizes().vec();
    expected[path + ".lora_B.weight"] = experts->lora_B.sizes().vec();
  }
  for (const auto& [path, weights] : adapter.modules) {
    got[path + ".lora_A.weight"] = weights.lora_A.sizes().vec();
    got[path + ".lora_B.weight"] = weights.lora_B.sizes().vec();
  }
  try {
    check_state_dict(expected, got, source);
  } catch (const DataError& e) {
    throw DataError(e.what(),
                    "the adapter was saved with other lora settings (r, target_modules, target_parameters) or another "
                    "model");
  }
  at::NoGradGuard no_grad;
  for (const auto& [path, layer] : adapters.layers()) {
    const auto& weights = adapter.modules.at(path);
    layer->lora_A.copy_(weights.lora_A);
    layer->lora_B.copy_(weights.lora_B);
  }
  for (const auto& [path, experts] : adapters.experts()) {
    const auto& weights = adapter.modules.at(path);
    experts->lora_A.copy_(weights.lora_A);
    experts->lora_B.copy_(weights.lora_B);
  }
}

PeftAdapter to_peft_adapter(const LoraAdapters& adapters, const LanguageModel& model,
                            const std::string& base_model_name_or_path) {
  PeftAdapter out;
  const auto& c = adapters.config();
  out.config.task_type = model.family() == ModelFamily::kSeq2Seq ? "SEQ_2_SEQ_LM" : "CAUSAL_LM";
  out.config.base_model_name_or_path = base_model_name_or_path;
  out.config.r = c.r;
  out.config.lora_alpha = c.alpha;
  out.config.lora_dropout = c.dropout;
  out.config.target_modules = c.target_modules;
  const bool plain_names = std::all_of(c.target_modules.begin(), c.target_modules.end(), [](const std::string& t) {
    return !t.empty() && std::all_of(t.begin(), t.end(), [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; });
  });
  if (const std::string scope = model.text_model_path(); !scope.empty() && !c.target_modules.empty() && plain_names) {
    // A multimodal model: PEFT's regular-expression form, so that PEFT adapts the text model's layers only (its
    // vision tower has q_proj, v_proj ... too). Dots are literal; names are plain identifiers.
    std::string names, escaped;
    for (const auto& target : c.target_modules) names += (names.empty() ? "" : "|") + target;
    for (const char ch : scope) escaped += ch == '.' ? std::string("\\.") : std::string(1, ch);
    out.config.target_modules = {escaped + "\\..*\\.(" + names + ")"};
    out.config.target_modules_regex = true;
  }
  out.config.target_parameters = c.target_parameters;
  out.config.use_rslora = c.rslora;
  for (const auto& [path, layer] : adapters.layers())
    out.modules[path] = {layer->lora_A.detach(), layer->lora_B.detach()};
  for (const auto& [path, experts] : adapters.experts())
    out.modules[path] = {experts->lora_A.detach(), experts->lora_B.detach()};
  return out;
}

void merge_lora(LoraAdapters& adapters) {
  at::NoGradGuard no_grad;
  for (const auto& [path, layer] : adapters.layers()) {
    Linear& base = layer->base();
    if (base.has_output_hook()) install_merged(base, layer->merged_weight());  // else merged already
  }
  for (const auto& [path, experts] : adapters.experts()) {
    for (int64_t e = 0; e < experts->experts(); ++e) {
      const at::Tensor delta = at::matmul(experts->B(e), experts->A(e)) * experts->scaling();  // (out, in)
      int64_t row = 0;
      for (Linear* part : experts->parts()[static_cast<std::size_t>(e)]) {
        if (part->has_output_hook())
          install_merged(*part, weight_plus(*part, delta.narrow(0, row, part->out_features())));
        row += part->out_features();
      }
    }
  }
}

MergeResult merge_adapter(const MergeOptions& options) {
  namespace fs = std::filesystem;
  const PeftAdapter adapter = read_peft_adapter(options.adapter_dir);
  MergeResult result;
  result.base_dir = options.base_dir.empty() ? adapter.config.base_model_name_or_path : options.base_dir;
  // An adapter's Hub base at the revision it was trained on (PEFT's "revision"), unless --base names one.
  if (options.base_dir.empty() && !adapter.config.revision.empty() && !fs::exists(result.base_dir) &&
      hub::parse_hub_id(result.base_dir) && result.base_dir.find('@') == std::string::npos)
    result.base_dir += "@" + adapter.config.revision;
  if (result.base_dir.empty())
    throw UsageError(options.adapter_dir + "/" + kAdapterConfigName + " names no base_model_name_or_path",
                     "give the base model directory: --base DIR");
  if (!fs::is_directory(result.base_dir)) {
    // PEFT names a Hub base by its id: resolved in the Hugging Face cache (downloaded when missing).
    hub::ResolveOptions resolve;
    resolve.what = "the adapter's base_model_name_or_path";
    try {
      result.base_dir = hub::resolve(result.base_dir, resolve).local_path;
    } catch (const Error& e) {
      throw DataError("the base model " + result.base_dir + " is not a directory here, and the Hub could not provide "
                      "it: " + e.what(),
                      "give the local Hugging Face directory of the base model, or its Hub id, with --base" +
                          (e.hint().empty() ? std::string() : "; " + e.hint()));
    }
  }
  if (!fs::is_directory(result.base_dir))
    throw DataError("the base model " + result.base_dir + " is not a directory here",
                    "give the local Hugging Face directory of the base model, or its Hub id, with --base");
  const auto info = inspect_model_dir(result.base_dir, /*need_weights=*/true);
  result.dtype = options.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  if (options.dtype == "auto") {
    const auto file = SafetensorsFile::open(info.weight_files.front());
    for (const auto& tensor : file.tensors())
      if (at::isFloatingType(tensor.dtype)) {
        result.dtype = tensor.dtype;
        break;
      }
  }
  // What is written keeps a mixture of experts' experts in full precision, as transformers + bitsandbytes do: read
  // as stored, unless the adapter adapts them (then as trained: quantized, dequantized, merged).
  std::optional<Quantize4bitOptions> quantize = options.quantize;
  if (quantize && adapter.config.target_parameters.empty()) quantize->experts = false;
  auto model = load_model(result.base_dir, ModelInit::kPretrained, at::TensorOptions().dtype(result.dtype), 0,
                          quantize);
  model->train(false);
  auto adapters = apply_peft_adapter(*model, adapter, options.adapter_dir);
  merge_lora(*adapters);
  dequantize_model(*model, result.dtype);  // 4-bit layers without an adapter: full precision too
  save_model(*model, options.output_dir, options.max_shard_bytes);
  copy_tokenizer_files(result.base_dir, options.output_dir);
  copy_tokenizer_files(options.adapter_dir, options.output_dir);  // trainer saves the run's tokenizer there
  result.layers = adapters->layers().size() + adapters->experts().size();
  return result;
}

}  // namespace trainer
