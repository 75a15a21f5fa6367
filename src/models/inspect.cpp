// Model inspection on the meta device: the architecture is built with shapes only, so a 7B model costs no memory.
#include "models/inspect.h"

#include <fstream>
#include <iomanip>
#include <map>
#include <ostream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

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
  if (name.find("DenseReluDense") != std::string::npos || name.find("mlp") != std::string::npos)
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

void inspect_model(const std::string& dir, const InspectOptions& options, std::ostream& out) {
  const auto info = inspect_model_dir(dir, /*need_weights=*/false);
  const auto config = read_json_file(dir + "/config.json");
  auto model = build_model(config, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));

  std::map<std::string, int64_t> groups;
  int64_t total = 0;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    groups[group_of(name)] += p.numel();
    total += p.numel();
  });
  // The adapters training would add, applied to the shape-only model by the same code.
  LoraConfig lora_config;
  lora_config.enabled = true;
  lora_config.r = options.lora_r;
  lora_config.target_modules = options.lora_targets;
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
  };
  out << "Training memory before activations (weights + gradients + AdamW state):\n";
  out << "  mode        weights      grads        optimizer    total\n";
  for (const auto& r : rows)
    out << "  " << std::left << std::setw(11) << r.mode << " " << std::setw(12) << human_bytes(r.weights) << " "
        << std::setw(12) << human_bytes(r.grads) << " " << std::setw(12) << human_bytes(r.optimizer) << " "
        << std::setw(12) << human_bytes(r.weights + r.grads + r.optimizer) << " " << r.note << "\n";
  out << "  (lora: r=" << options.lora_r << " on " << targets << ", " << adapters->layers().size()
      << " layers: " << with_commas(lora) << " trainable parameters; AdamW keeps two fp32 moments for each)\n";
  out << "Activations come on top; they grow with the micro-batch and the sequence lengths.\n";
}

}  // namespace trainer
