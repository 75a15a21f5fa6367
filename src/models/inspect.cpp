// Model inspection on the meta device: the architecture is built with shapes only, so a 7B model costs no memory.
#include "models/inspect.h"

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <ostream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "models/image/image_model.h"
#include "models/linear4bit.h"
#include "models/lora.h"
#include "models/model.h"
#include "trainer/config.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace {

std::string group_of(const std::string& name) {
  if (name.find("embed") != std::string::npos || name == "shared.weight") return "embeddings";
  if (name.starts_with("lm_head")) return "lm_head";
  if (name.find("norm") != std::string::npos) return "norms";
  if (name.find("Attention") != std::string::npos || name.find("self_attn") != std::string::npos)
    return "attention";
  // Mixtures of experts: the experts (most of the weights) and their routers apart from the dense MLPs.
  if (name.find(".experts.") != std::string::npos) return "experts";
  if (name.find(".router.") != std::string::npos || name.ends_with(".mlp.gate.weight") ||
      name.ends_with(".block_sparse_moe.gate.weight"))
    return "routers";
  if (name.find("DenseReluDense") != std::string::npos || name.find("mlp") != std::string::npos ||
      name.find("block_sparse_moe") != std::string::npos)
    return "feed-forward";
  return "other";
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

namespace {

// An image classifier (models/image/image_model.h): parameters by part, the training modes' fixed memory, and the
// activations one image costs at the model's size.
void inspect_image_model(const std::string& dir, std::ostream& out) {
  auto model = load_image_classifier(dir, ModelInit::kRandom, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  std::map<std::string, int64_t> groups;
  int64_t total = 0;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    const std::string group = name.starts_with(model->head_prefix())       ? "head"
                              : name.find("embeddings") != std::string::npos ? "embeddings"
                              : name.find("attention") != std::string::npos  ? "attention"
                              : name.find("norm") != std::string::npos       ? "norms"
                                                                             : "feed-forward";
    groups[group] += p.numel();
    total += p.numel();
  });
  const auto estimate = estimate_image_memory(dir);
  const int64_t size = estimate.image_size, tokens = estimate.tokens;
  const double per_image = estimate.activations_per_image;
  out << "model        " << dir << "\n";
  out << "type         " << model->model_type() << " (image classifier, " << model->num_labels() << " classes, "
      << size << " x " << size << " pixels, " << tokens << " tokens per image)\n";
  out << "parameters   " << with_commas(total) << "\n";
  for (const auto& [group, count] : groups)
    out << "  " << std::left << std::setw(13) << group << std::right << std::setw(16) << with_commas(count) << "  ("
        << std::fixed << std::setprecision(1) << 100.0 * static_cast<double>(count) / static_cast<double>(total)
        << "%)\n";
  out << "\nTraining memory before activations (weights + gradients + AdamW state):\n";
  out << "  full fine-tune (fp32)   " << human_bytes(estimate.full_fixed) << "\n";
  out << "  linear probe            " << human_bytes(estimate.probe_fixed) << " (frozen backbone: no gradients or state)\n";
  out << "Activations per image at " << size << " x " << size << " (fp32, full fine-tune, estimate): about "
      << human_bytes(per_image) << "; a linear probe keeps none for the backbone.\n";
}

}  // namespace

ImageMemoryEstimate estimate_image_memory(const std::string& dir) {
  const auto config = read_json_file(dir + "/config.json");
  auto model = load_image_classifier(dir, ModelInit::kRandom, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  ImageMemoryEstimate e;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    e.parameters += p.numel();
    if (name.starts_with(model->head_prefix())) e.head_parameters += p.numel();
  });
  e.image_size = model->image_size();
  const int64_t patch = config.value("patch_size", int64_t{16});
  const int64_t hidden = config.value("hidden_size", int64_t{768}), heads = config.value("num_attention_heads", int64_t{12});
  const int64_t layers = config.value("num_hidden_layers", int64_t{12});
  e.tokens = (e.image_size / patch) * (e.image_size / patch) + 1;
  // What backward keeps per block and image in fp32: Korthikanti et al. 2022's 34 s h + 5 a s^2 bytes at 16 bit,
  // doubled. An estimate; micro_batch_size=auto measures the real thing.
  e.activations_per_image =
      static_cast<double>(layers) * (68.0 * static_cast<double>(e.tokens * hidden) +
                                     10.0 * static_cast<double>(heads * e.tokens * e.tokens));
  const double p = static_cast<double>(e.parameters), h = static_cast<double>(e.head_parameters);
  e.full_fixed = 16 * p;         // fp32 weights, gradients, two AdamW moments
  e.probe_fixed = 4 * p + 12 * h;  // frozen weights; the head's gradients and moments
  return e;
}

void inspect_model(const std::string& dir, const InspectOptions& options, std::ostream& out) {
  if (const std::string path = dir + "/config.json"; std::filesystem::exists(path))
    if (const auto image_config = read_json_file(path); is_image_model_config(image_config))
      return inspect_image_model(dir, out);
  const auto info = inspect_model_dir(dir, /*need_weights=*/false);
  const auto config = read_json_file(dir + "/config.json");
  auto model = build_model(config, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));

  std::map<std::string, int64_t> groups;
  int64_t total = 0;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    groups[group_of(name)] += p.numel();
    total += p.numel();
  });
  // What model.quantize=nf4 (block 64, double quantization) holds in 4 bits: the layers quantization converts.
  const Quantize4bitOptions nf4;
  std::set<std::string> quantizable;
  for (const auto& path : quantizable_layers(*model)) quantizable.insert(path + ".weight");
  double quantized_elements = 0, quantized_bytes = 0;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (!quantizable.contains(name)) return;
    quantized_elements += static_cast<double>(p.numel());
    quantized_bytes += static_cast<double>(quantized_weight_bytes(p.numel(), nf4));
  });
  // The adapters training would add, applied to the shape-only model by the same code.
  LoraConfig lora_config;
  lora_config.enabled = true;
  lora_config.r = options.lora_r;
  lora_config.target_modules = options.lora_targets;
  lora_config.target_parameters = options.lora_parameters;
  lora_config.dropout = 0.0;
  const auto adapters = apply_lora(*model, lora_config, 0);
  const int64_t lora = adapters->trainable_parameters();
  std::string targets;
  for (const auto& t : adapters->config().target_modules) targets += (targets.empty() ? "" : ",") + t;

  std::string dtype = "(no weights: random initialisation)";
  if (!info.weight_files.empty()) {
    const auto file = SafetensorsFile::open(info.weight_files.front());
    if (!file.tensors().empty()) dtype = std::string(c10::toString(file.tensors().front().dtype));
  }

  out << "model        " << dir << "\n";
  out << "type         " << info.model_type << " (" << info.family << ")"
      << (model->lm_head_tied() ? ", LM head tied to the input embedding" : ", separate LM head") << "\n";
  out << "parameters   " << with_commas(total) << "\n";
  for (const auto& [group, count] : groups)
    out << "  " << std::left << std::setw(13) << group << std::right << std::setw(16) << with_commas(count) << "  ("
        << std::fixed << std::setprecision(1) << 100.0 * static_cast<double>(count) / static_cast<double>(total)
        << "%)\n";
  out << "checkpoint   " << dtype << ", " << human_bytes(static_cast<double>(info.weight_bytes)) << " in "
      << info.weight_files.size() << " file(s)\n\n";

  const double p = static_cast<double>(total), l = static_cast<double>(lora);
  struct Row {
    const char* mode;
    double weights, grads, optimizer;
    const char* note;
  };
  const Row rows[] = {
      {"fp32", 4 * p, 4 * p, 8 * p, "fp32 weights, grads, AdamW moments"},
      {"bf16-mixed", 4 * p, 4 * p, 8 * p, "fp32 master weights and grads; bf16 compute copies are transient"},
      {"bf16", 2 * p, 2 * p, 8 * p, "bf16 weights and grads; AdamW moments kept in fp32"},
      {"lora", 4 * p + 4 * l, 4 * l, 8 * l, "frozen fp32 base + fp32 adapters (grads and moments for adapters only)"},
      {"lora-bf16", 2 * p + 4 * l, 4 * l, 8 * l, "the same with lora.base_in_bf16=true (or precision.mode=bf16)"},
      {"qlora", 2 * (p - quantized_elements) + quantized_bytes + 4 * l, 4 * l, 8 * l,
       "model.quantize=nf4: linear layers in 4 bits with their scales, the rest bf16, + fp32 adapters"},
  };
  out << "Training memory before activations (weights + gradients + AdamW state):\n";
  out << "  mode        weights      grads        optimizer    total\n";
  for (const auto& r : rows)
    out << "  " << std::left << std::setw(11) << r.mode << " " << std::setw(12) << human_bytes(r.weights) << " "
        << std::setw(12) << human_bytes(r.grads) << " " << std::setw(12) << human_bytes(r.optimizer) << " "
        << std::setw(12) << human_bytes(r.weights + r.grads + r.optimizer) << " " << r.note << "\n";
  out << "  (lora: r=" << options.lora_r << " on " << targets << ", " << adapters->layers().size() << " layers"
      << (adapters->experts().empty() ? std::string()
                                      : " and " + std::to_string(adapters->experts().size()) +
                                            " experts' stacked parameters")
      << ": " << with_commas(lora) << " trainable parameters; AdamW keeps two fp32 moments for each)\n";
  out << "  (qlora: " << with_commas(static_cast<int64_t>(quantized_elements)) << " weights of "
      << quantizable.size() << " linear layers in NF4, block 64, double quantization)\n";
  out << "Activations come on top; they grow with the micro-batch and the sequence lengths.\n";
}

}  // namespace trainer
