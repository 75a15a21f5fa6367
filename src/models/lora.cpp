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

}  // namespace

LoraLinear::LoraLinear(Linear& base, int64_t r, double scaling, double dropout)
    : base_(&base), r_(r), scaling_(scaling) {
  const auto options = base.weight.options().dtype(at::kFloat);
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
  // A 4-bit base is dequantized first (PEFT's route for QLoRA: dequantize, merge, keep full precision).
  const QuantState4bit* quant = base_->quantized();
  const at::Tensor w = quant ? dequantize_weight(base_->weight, *quant, at::kFloat) : base_->weight;
  const at::Tensor delta = at::matmul(lora_B.to(at::kFloat), lora_A.to(at::kFloat)) * scaling_;  // (out, in)
  return (w.to(at::kFloat) + delta).to(quant ? quant->dtype : w.scalar_type());
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

void LoraAdapters::set_active(bool active) {
  for (auto& [path, layer] : layers_) layer->active = active;
}

int64_t LoraAdapters::trainable_parameters() const {
  int64_t n = 0;
  for (const auto& [path, layer] : layers_) n += layer->lora_A.numel() + layer->lora_B.numel();
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
  std::vector<std::string> selected, not_linear;
  std::vector<bool> matched(targets.size(), false);
  model.for_each_module([&](const std::string& name, Module& m) {  // in the model's order, as PEFT lists them
    bool selects = false;
    for (std::size_t i = 0; i < targets.size(); ++i)
      if (name == targets[i] || name.ends_with("." + targets[i])) selects = matched[i] = true;
    if (!selects) return;
    if (dynamic_cast<Linear*>(&m) == nullptr) not_linear.push_back(name);
    else selected.push_back(name);
  });
  std::vector<std::string> unmatched;
  for (std::size_t i = 0; i < targets.size(); ++i)
    if (!matched[i]) unmatched.push_back(targets[i]);
  if (!unmatched.empty())
    throw UsageError("lora.target_modules: " + join(unmatched) + " match no module of this " + model.model_type() +
                         " model (the LM head and the embeddings are parameters, not layers trainer can adapt)",
                     kHintTargets);
  if (!not_linear.empty())
    throw UsageError("lora.target_modules selects modules that are not linear layers: " + join(not_linear),
                     kHintTargets);
  // A mixture of experts' experts are one module each here, as the files store them, but transformers 5 holds
  // them as 3D parameters that PEFT's target_modules cannot name: an adapter on them would not load in PEFT.
  std::vector<std::string> experts;
  for (const auto& name : selected)
    if (name.find(".experts.") != std::string::npos) experts.push_back(name);
  if (!experts.empty())
    throw UsageError("lora.target_modules selects the experts of a mixture of experts (" + experts.front() +
                         (experts.size() > 1 ? " and " + std::to_string(experts.size() - 1) + " more" : "") +
                         "): LoRA on experts is not supported yet",
                     "adapt the attention (q_proj, k_proj, v_proj, o_proj) and the dense layers' MLPs by their full "
                     "names; the experts and the router stay frozen");
  return selected;
}

std::unique_ptr<LoraAdapters> apply_lora(LanguageModel& model, const LoraConfig& config, uint64_t seed) {
  LoraConfig applied = config;
  applied.enabled = true;
  if (applied.target_modules.empty()) applied.target_modules = default_lora_targets(model);
  const auto paths = lora_target_layers(model, applied.target_modules);
  freeze(model, config.base_in_bf16);
  auto linears = linear_layers(model);
  auto adapters = std::make_unique<LoraAdapters>(applied);
  const double scaling = lora_scaling(config.alpha, config.r, config.rslora);
  at::Generator generator = at::detail::createCPUGenerator(seed);
  at::NoGradGuard no_grad;
  for (const auto& path : paths) {
    auto layer = std::make_shared<LoraLinear>(*linears.at(path), config.r, scaling, config.dropout);
    if (!layer->lora_A.is_meta()) {
      // kaiming_uniform_(a=sqrt(5)) on (r, in): gain sqrt(2 / (1 + 5)), bound sqrt(3) * gain / sqrt(in) = 1/sqrt(in).
      // Drawn on the CPU from our own generator, so the start does not depend on the device or other draws.
      const double bound = 1.0 / std::sqrt(static_cast<double>(layer->lora_A.size(1)));
      at::Tensor a = at::empty(layer->lora_A.sizes(), at::TensorOptions().dtype(at::kFloat));
      a.uniform_(-bound, bound, generator);
      layer->lora_A.copy_(a);
    }
    adapters->add(path, std::move(layer));
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
  std::vector<std::string> problems;
  for (const auto& [path, weights] : adapter.modules) {
    const auto it = linears.find(path);
    if (it == linears.end()) {
      problems.push_back(path + ": no such linear layer in the base model");
      continue;
    }
    const Linear& base = *it->second;
    const int64_t out = base.out_features(), in = base.in_features();
    if (weights.lora_A.size(1) != in || weights.lora_B.size(0) != out)
      problems.push_back(path + ": lora_A " + std::to_string(weights.lora_A.size(0)) + " x " +
                         std::to_string(weights.lora_A.size(1)) + " and lora_B " +
                         std::to_string(weights.lora_B.size(0)) + " x " + std::to_string(weights.lora_B.size(1)) +
                         " do not fit a " + std::to_string(out) + " x " + std::to_string(in) +
                         " weight");
  }
  if (!problems.empty()) {
    std::string list;
    for (const auto& p : problems) list += "\n  " + p;
    throw DataError(source + ": the adapter does not fit the base model:" + list,
                    "load it onto the base model it was trained on (base_model_name_or_path: " +
                        c.base_model_name_or_path + ")");
  }
  freeze(model, false);
  LoraConfig config;
  config.enabled = true;
  config.r = c.r;
  config.alpha = c.lora_alpha;
  config.dropout = c.lora_dropout;
  config.target_modules = c.target_modules;
  config.rslora = c.use_rslora;
  auto adapters = std::make_unique<LoraAdapters>(config);
  at::NoGradGuard no_grad;
  for (const auto& [path, weights] : adapter.modules) {
    const int64_t r = weights.lora_A.size(0);
    auto layer = std::make_shared<LoraLinear>(*linears.at(path), r, lora_scaling(c.lora_alpha, r, c.use_rslora),
                                              c.lora_dropout);
    layer->lora_A.copy_(weights.lora_A);
    layer->lora_B.copy_(weights.lora_B);
    adapters->add(path, std::move(layer));
  }
  return adapters;
}

void load_lora_weights(LoraAdapters& adapters, const PeftAdapter& adapter, const std::string& source) {
  ShapeMap expected, got;
  for (const auto& [path, layer] : adapters.layers()) {
    expected[path + ".lora_A.weight"] = layer->lora_A.sizes().vec();
    expected[path + ".lora_B.weight"] = layer->lora_B.sizes().vec();
  }
  for (const auto& [path, weights] : adapter.modules) {
    got[path + ".lora_A.weight"] = weights.lora_A.sizes().vec();
    got[path + ".lora_B.weight"] = weights.lora_B.sizes().vec();
  }
  try {
    check_state_dict(expected, got, source);
  } catch (const DataError& e) {
    throw DataError(e.what(), "the adapter was saved with other lora settings (r, target_modules) or another model");
  }
  at::NoGradGuard no_grad;
  for (const auto& [path, layer] : adapters.layers()) {
    const auto& weights = adapter.modules.at(path);
    layer->lora_A.copy_(weights.lora_A);
    layer->lora_B.copy_(weights.lora_B);
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
  out.config.use_rslora = c.rslora;
  for (const auto& [path, layer] : adapters.layers())
    out.modules[path] = {layer->lora_A.detach(), layer->lora_B.detach()};
  return out;
}

void merge_lora(LoraAdapters& adapters) {
  at::NoGradGuard no_grad;
  for (const auto& [path, layer] : adapters.layers()) {
    Linear& base = layer->base();
    if (!base.has_output_hook()) continue;  // merged already
    if (base.quantized() != nullptr) base.set_weight(layer->merged_weight());
    else base.weight.copy_(layer->merged_weight());
    base.set_output_hook({});
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
  // What is written keeps a mixture of experts' experts in full precision, as transformers + bitsandbytes do.
  std::optional<Quantize4bitOptions> quantize = options.quantize;
  if (quantize) quantize->experts = false;
  auto model = load_model(result.base_dir, ModelInit::kPretrained, at::TensorOptions().dtype(result.dtype), 0,
                          quantize);
  model->train(false);
  auto adapters = apply_peft_adapter(*model, adapter, options.adapter_dir);
  merge_lora(*adapters);
  dequantize_model(*model, result.dtype);  // 4-bit layers without an adapter: full precision too
  save_model(*model, options.output_dir, options.max_shard_bytes);
  copy_tokenizer_files(result.base_dir, options.output_dir);
  copy_tokenizer_files(options.adapter_dir, options.output_dir);  // trainer saves the run's tokenizer there
  result.layers = adapters->layers().size();
  return result;
}

}  // namespace trainer
