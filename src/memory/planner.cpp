// The memory planner (see planner.h).
//
// Activation model. For each architecture, what our forward pass keeps for backward is a sum of tensors whose
// sizes are products of the dimensions: per token and layer, so many elements of size d_model, d_ff, heads x d_kv,
// and per (query, key) pair so many elements of the attention maps and masks. The coefficients below are those
// counts for our implementation, measured with the CPU budget allocator (allocated bytes after forward, minus the
// weights) over several shapes of each architecture and solved by least squares; the fits reproduce every
// measurement within 0.6% (scripts/bench/calibrate_planner.py measures and fits them). They are element counts in
// the activation dtype; the log-probabilities of the loss are always fp32. Dropout keeps a bool mask (one byte per
// element, models/dropout.h) beside what it multiplies, hence the separate dropout terms.
// Re-measure them when a model's forward changes (tests/unit/memory/planner_test.cpp fails when they drift).
#include "memory/planner.h"

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <set>
#include <ostream>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "memory/cpu_budget.h"
#include "memory/optimizer_footprint.h"
#include "models/image/clip.h"
#include "models/decoder/spec.h"
#include "models/hf_config.h"
#include "models/image/image_model.h"
#include "models/inspect.h"
#include "models/linear4bit.h"
#include "models/lora.h"
#include "models/model.h"
#include "trainer/device.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

// Elements kept per example: the whole forward, and with activation checkpointing (block inputs only, plus one
// block recomputed at a time during backward).
struct Activations {
  double saved = 0;          // without checkpointing
  double checkpointed = 0;   // block inputs + everything outside the blocks
  double largest_block = 0;  // one block's activations, alive while it is recomputed
  double log_probs = 0;      // fp32 elements of the log-softmax kept by the loss (targets x vocabulary)
  double targets = 0;        // target positions per example
};

// T5 / FLAN-T5 (t5.cpp). Coefficients per token and layer without dropout; with dropout (dropout_rate > 0) each
// site adds its bool mask (`masks`, one byte per element: mask_share of an activation element) and, where the
// probabilities are computed explicitly for keyed attention dropout, what that path keeps beyond
// scaled_dot_product_attention (`explicit_attention`: the softmax output and the dropped probabilities). In fp32
// on the CPU the sum reproduces the measured dropout fit (scripts/bench/calibrate_planner.py) within 0.03.
struct T5Coefficients {
  double d, ff, heads_kv, attention, decoder_d, decoder_heads_kv, cross_attention, cross_kv, encoder_out, decoder_out,
      per_token;
};
constexpr T5Coefficients kT5NoDropout{6.32, 3.99, 2.73, 1.30, 8.33, 5.65, 0.16, 2.07, 2.54, 3.92, 195};
constexpr T5Coefficients kT5DropoutMasks{2, 1, 0, 1, 3, 0, 1, 0, 2, 2, 0};
constexpr T5Coefficients kT5ExplicitAttention{0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0};

T5Coefficients with_dropout(const T5Coefficients& off, double mask_share) {
  const T5Coefficients& m = kT5DropoutMasks;
  const T5Coefficients& e = kT5ExplicitAttention;
  auto add = [mask_share](double base, double masks, double extra) { return base + mask_share * masks + extra; };
  return {add(off.d, m.d, e.d),
          add(off.ff, m.ff, e.ff),
          add(off.heads_kv, m.heads_kv, e.heads_kv),
          add(off.attention, m.attention, e.attention),
          add(off.decoder_d, m.decoder_d, e.decoder_d),
          add(off.decoder_heads_kv, m.decoder_heads_kv, e.decoder_heads_kv),
          add(off.cross_attention, m.cross_attention, e.cross_attention),
          add(off.cross_kv, m.cross_kv, e.cross_kv),
          add(off.encoder_out, m.encoder_out, e.encoder_out),
          add(off.decoder_out, m.decoder_out, e.decoder_out),
          add(off.per_token, m.per_token, e.per_token)};
}

Activations t5_activations(const nlohmann::json& c, double t, double l, double dropout_share) {
  const double d = static_cast<double>(hf::get_int(c, "d_model"));
  const double ff = static_cast<double>(hf::get_int(c, "d_ff"));
  const double heads = static_cast<double>(hf::get_int(c, "num_heads"));
  const double inner = heads * static_cast<double>(hf::get_int(c, "d_kv"));
  const double encoder_layers = static_cast<double>(hf::get_int(c, "num_layers"));
  const double decoder_layers = static_cast<double>(hf::get_int(c, "num_decoder_layers", hf::get_int(c, "num_layers")));
  const double vocab = static_cast<double>(hf::get_int(c, "vocab_size"));
  const bool dropout = hf::get_double(c, "dropout_rate", 0.1) > 0;
  const T5Coefficients k = dropout ? with_dropout(kT5NoDropout, dropout_share) : kT5NoDropout;

  const double encoder_block = t * (k.d * d + k.ff * ff + k.heads_kv * inner + k.attention * heads * t);
  const double decoder_block = l * (k.decoder_d * d + k.ff * ff + k.decoder_heads_kv * inner + k.attention * heads * l +
                                    k.cross_attention * heads * t) +
                               t * k.cross_kv * inner;
  const double outside = t * k.encoder_out * d + l * k.decoder_out * d + (t + l) * k.per_token;
  Activations a;
  a.saved = encoder_layers * encoder_block + decoder_layers * decoder_block + outside;
  a.checkpointed = encoder_layers * t * d + decoder_layers * l * d + outside;
  a.largest_block = std::max(encoder_block, decoder_block);
  a.log_probs = l * vocab;
  a.targets = l;
  return a;
}

// The decoder families (models/decoder): per token and layer 6 d_model + 4 intermediate + 2 (q and attention
// output) heads x head_dim + 2 (k, v) kv_heads x head_dim, plus the float attention mask of t x t per layer; a
// d_model more for each norm beyond Llama's two and a q and k more with q/k norms; more with attention dropout or
// soft-capped scores (below). The shapes are the family's (head_dim and the rest with its config class's defaults),
// per layer where they differ (Gemma 4: full layers' head_dim and kv heads, double-wide MLPs; a layer that reuses
// another's keys and values keeps none of its own); Gemma 4's per-layer inputs keep per layer their gate, product
// and projection (3 x width + d_model + the normed d_model) and, outside the blocks, the table rows, the projection
// and its norm (4 x layers x width). A sparse layer's MLP: below.
Activations decoder_activations(const nlohmann::json& c, double t) {
  const auto spec = decoder_spec_for(hf::get_string(c, "model_type", ""), c);
  if (!spec) throw DataError("config.json: model_type \"" + hf::get_string(c, "model_type", "") + "\" is not a decoder family");
  const double d = static_cast<double>(spec->hidden);
  const double heads = static_cast<double>(spec->heads);
  const double layers = static_cast<double>(spec->layers.size());
  const double vocab = static_cast<double>(spec->vocab_size);
  const double per_layer = static_cast<double>(spec->per_layer_input);
  const int norms = !spec->pre_attention_norm.empty() + !spec->post_attention_norm.empty() +
                    !spec->pre_mlp_norm.empty() + !spec->post_mlp_norm.empty();

  double saved = 0, largest = 0, max_head_dim = 0;
  for (std::size_t i = 0; i < spec->layers.size(); ++i) {
    const double ff = static_cast<double>(spec->intermediate_of(i));
    const double head_dim = static_cast<double>(spec->head_dim_of(i));
    const double kv_heads = spec->layers[i].kv_from ? 0.0 : static_cast<double>(spec->kv_heads_of(i));
    max_head_dim = std::max(max_head_dim, head_dim);
    // A mixture of experts' MLP keeps per token, for each of its top_k experts, the routed copy of the input, the
    // gate, up and gated products and the weighted output (what routing sends where changes which expert holds them,
    // not how many there are), and the router's logits and fp32 probabilities.
    const MoeSpec& moe = spec->moe;
    // Gemma 4's experts run beside the dense MLP, with three norms more.
    const double mlp = spec->layers[i].sparse
                           ? static_cast<double>(moe.top_k) * (3 * static_cast<double>(moe.intermediate) + 2 * d) +
                                 3 * static_cast<double>(moe.experts) + (moe.gemma4 ? 4 * ff + 4 * d : 0.0)
                           : 4 * ff;
    double block = t * (6 * d + mlp + 2 * heads * head_dim + 2 * kv_heads * head_dim + t);
    if (norms > 2) block += t * d * (norms - 2);
    if (spec->qk_norm != QkNorm::kNone) block += t * (heads + kv_heads) * head_dim;
    if (spec->v_norm) block += t * kv_heads * head_dim;
    // attention_dropout > 0: keyed dropout computes the probabilities explicitly, keeping per head and (query, key)
    // the probabilities and the dropped probabilities (the byte mask is within the fit), and with grouped-query
    // attention the keys and values repeated per head (measured: within 5% of the difference, 0.1% to 5% overall).
    // Soft-capped scores (Gemma 2) take the same explicit path, keeping the scores, their tanh and the probabilities.
    if (spec->attention_dropout > 0 || spec->attention_softcap)
      block += t * ((spec->attention_softcap ? 3 : 2) * heads * t +
                    (spec->kv_heads_of(i) != spec->heads ? heads * head_dim : 0));
    if (per_layer > 0) block += t * (3 * per_layer + 2 * d);
    saved += block;
    largest = std::max(largest, block);
  }
  const double outside = t * (3 * d + 21 + 2 * max_head_dim) + t * 4 * layers * per_layer;
  Activations a;
  a.saved = saved + outside;
  a.checkpointed = layers * t * d + outside;
  a.largest_block = largest;
  a.log_probs = t * vocab;
  a.targets = t;
  return a;
}

std::string precision_name(PrecisionMode mode) {
  for (const auto& [value, name] : enum_names(mode))
    if (value == mode) return std::string(name);
  return "?";
}

}  // namespace

double MemoryPlan::loss_chunked(int64_t micro, int64_t chunk) const {
  const int64_t size = std::min(chunk > 0 ? chunk : loss_chunk_size, micro * targets_per_example);
  return static_cast<double>(size) * loss_chunk_bytes_per_token + static_cast<double>(micro) * loss_rows_per_example +
         loss_fixed;
}

double MemoryPlan::peak(int64_t micro, bool checkpointing, bool chunked_loss, int64_t chunk) const {
  const double m = static_cast<double>(micro);
  const double activations = checkpointing ? activations_per_example_checkpointed : activations_per_example;
  const double loss = chunked_loss ? loss_chunked(micro, chunk) : m * loss_per_example;
  return weights + gradients + optimizer_state + workspace + m * activations + loss;
}

namespace {

// What the optimizer-state row of the plan counts.
std::string optimizer_state_note(const Config& config) {
  const auto& o = config.optimizer;
  std::string note = o.name == OptimizerName::kAdafactor
                         ? std::string("fp32 row + column statistics per matrix") + (o.adafactor_beta1 ? ", fp32 first moment" : "")
                         : std::string(o.state_dtype == StateDtype::kBf16   ? "two bf16"
                                       : o.state_dtype == StateDtype::kInt8 ? "two blockwise 8-bit (AdamW8bit)"
                                                                            : "two fp32") +
                               " moments per trainable parameter";
  if (o.bf16_update == Bf16Update::kKahan && config.precision.mode == PrecisionMode::kBf16 && !config.lora.enabled)
    note += " + bf16 Kahan compensation";
  return note;
}

}  // namespace

int64_t MemoryPlan::largest_micro_batch(bool checkpointing, bool chunked_loss, int64_t chunk) const {
  if (capacity <= 0) return batch_size;
  const double allowed = capacity * (1.0 - safety_margin);
  int64_t best = 0;
  for (int64_t m = 1; m <= batch_size; ++m)
    if (peak(m, checkpointing, chunked_loss, chunk) <= allowed) best = m;
  return best;
}

int64_t MemoryPlan::fitting_loss_chunk_size(int64_t micro) const {
  const double allowed = capacity > 0 ? capacity * (1.0 - safety_margin) : peak(micro, true, true);
  for (int64_t chunk = loss_chunk_size;; chunk = std::max(kMinLossChunkSize, chunk / 2)) {
    if (peak(micro, true, true, chunk) <= allowed) return chunk;
    if (chunk <= kMinLossChunkSize) return 0;
  }
}

MemoryPlan plan_memory(const Config& config, const nlohmann::json& hf_config, const c10::Device& device,
                       double capacity, const std::string& capacity_source, const ExampleShape& shape) {
  auto model = build_model(hf_config, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  const bool seq2seq = model->family() == ModelFamily::kSeq2Seq;
  std::set<std::string> adapted;  // the linear layers LoRA adapts, selected as apply_lora selects them
  if (config.lora.enabled) {
    const auto targets = config.lora.target_modules.empty() ? default_lora_targets(*model) : config.lora.target_modules;
    for (auto& path : lora_target_layers(*model, targets)) adapted.insert(path + ".weight");
  }

  const PrecisionMode mode = config.precision.mode;
  const double compute_bytes = mode == PrecisionMode::kFp32 ? 4 : 2;  // activations
  // Dropout masks: one byte per element on every device (keyed masks are bool tensors).
  const double dropout_share = 1.0 / compute_bytes;

  MemoryPlan plan;
  int64_t adapter = 0;
  double optimizer_state = 0;  // optimizer_state_bytes of every trainable parameter (LoRA: A and B, fp32)
  // LoRA keeps, per token of each adapted module: the adapter's input after dropout (in_features) and its byte
  // mask, when lora.dropout > 0, and A's output (r). Summed over the modules of the encoder/decoder stacks.
  double adapter_elements_input = 0, adapter_elements_target = 0;
  int64_t largest_trainable = 0;  // elements of the largest trainable tensor (the optimizer's scratch follows it)
  // model.quantize: the linear layers' weights in 4 bits with their scales (models/linear4bit.h).
  const auto quantize = quantize_options(config.model);
  std::set<std::string> quantized;
  if (quantize)
    for (const auto& path : quantizable_layers(*model)) quantized.insert(path + ".weight");
  double quantized_elements = 0, quantized_bytes = 0;
  int64_t largest_quantized = 0;
  auto trainable = [&](int64_t numel, double state) {
    optimizer_state += state;
    plan.trainable_numels.push_back(numel);
    plan.trainable_state_bytes.push_back(state);
  };
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    plan.parameters += p.numel();
    if (quantized.contains(name)) {
      quantized_elements += static_cast<double>(p.numel());
      quantized_bytes += static_cast<double>(quantized_weight_bytes(p.numel(), *quantize));
      largest_quantized = std::max(largest_quantized, p.numel());
    }
    if (!config.lora.enabled) largest_trainable = std::max(largest_trainable, p.numel());
    if (!config.lora.enabled)
      trainable(p.numel(), static_cast<double>(optimizer_state_bytes(config.optimizer, p.sizes(),
                                                                     config.precision.mode == PrecisionMode::kBf16)));
    if (!adapted.contains(name)) return;
    largest_trainable = std::max({largest_trainable, config.lora.r * p.size(0), config.lora.r * p.size(1)});
    adapter += config.lora.r * (p.size(0) + p.size(1));
    trainable(config.lora.r * p.size(1),
              static_cast<double>(optimizer_state_bytes(config.optimizer, {config.lora.r, p.size(1)}, false)));
    trainable(p.size(0) * config.lora.r,
              static_cast<double>(optimizer_state_bytes(config.optimizer, {p.size(0), config.lora.r}, false)));
    const double per_token =
        static_cast<double>(config.lora.r) +
        (config.lora.dropout > 0 ? (1.0 + dropout_share) * static_cast<double>(p.size(1)) : 0.0);
    (name.starts_with("decoder.") ? adapter_elements_target : adapter_elements_input) += per_token;
  });

  if (config.lora.enabled) {
    // The experts' adapters (lora.target_parameters): per stacked parameter A (r E, in) and B (out, r E); per token
    // each of its top-k experts keeps A's output (r) for every layer of the expert that holds a part of it.
    const int64_t top_k = hf_config.value("num_experts_per_tok", int64_t{2});
    for (const auto& target : lora_expert_targets(*model, config.lora.target_parameters)) {
      const int64_t experts = static_cast<int64_t>(target.parts.size()), rank = config.lora.r * experts;
      const int64_t in = target.parts[0][0]->in_features();
      int64_t out = 0;
      for (const Linear* part : target.parts[0]) out += part->out_features();
      largest_trainable = std::max({largest_trainable, rank * in, rank * out});
      adapter += rank * (in + out);
      trainable(rank * in, static_cast<double>(optimizer_state_bytes(config.optimizer, {rank, in}, false)));
      trainable(out * rank, static_cast<double>(optimizer_state_bytes(config.optimizer, {out, rank}, false)));
      const auto parts = static_cast<int64_t>(target.parts[0].size());
      adapter_elements_input += static_cast<double>(config.lora.r * top_k * parts);
    }
  }

  const double p = static_cast<double>(plan.parameters);
  if (config.lora.enabled) {
    plan.trainable_parameters = adapter;
    const double base_bytes = config.lora.base_in_bf16 || mode == PrecisionMode::kBf16 ? 2 : 4;
    plan.weights = (p - quantized_elements) * base_bytes + quantized_bytes + 4.0 * static_cast<double>(adapter);
    plan.gradients = 4.0 * static_cast<double>(adapter);
  } else {
    plan.trainable_parameters = plan.parameters;
    plan.weights = p * (mode == PrecisionMode::kBf16 ? 2 : 4);
    plan.gradients = p * (mode == PrecisionMode::kBf16 ? 2 : 4);
  }
  plan.optimizer_state = optimizer_state;
  // bf16-mixed, fp16-mixed: autocast keeps a 16-bit copy of every weight it casts until backward has used it.
  const bool mixed = mode == PrecisionMode::kBf16Mixed || mode == PrecisionMode::kFp16Mixed;
  if (mixed && !(config.lora.enabled && config.lora.base_in_bf16)) plan.workspace += 2 * (p - quantized_elements);
  // A 4-bit layer computes with its weight dequantized for the moment of its matmul (forward, and again in
  // backward): one layer at a time, an fp32 copy, the compute-dtype one and the int32 index of its bytes.
  plan.workspace += static_cast<double>(largest_quantized) * (4.0 + (mixed || mode == PrecisionMode::kBf16 ? 2.0 : 4.0) + 2.0);
  if (!device.is_cpu()) plan.workspace += 512.0 * 1024 * 1024;  // CUDA context, cuBLAS/cuDNN workspaces
  // The optimizer's update scratch (train/optimizer.cpp): two fp32 buffers (four with bf16 moments) of the largest
  // trainable tensor's size, at most 4M elements each. Tens of MiB; most of a tiny model's step with a large
  // vocabulary. None where AdamW runs ATen's fused kernel (fp32 parameters and moments).
  const bool bf16_trainable = !config.lora.enabled && mode == PrecisionMode::kBf16;
  if (!adamw_uses_fused_kernel(config.optimizer, bf16_trainable)) {
    // int8 moments: the step dequantizes one parameter's moments to fp32 and copies its codes (12 bytes an element).
    const double scratch_buffers = config.optimizer.state_dtype == StateDtype::kBf16   ? 4
                                   : config.optimizer.state_dtype == StateDtype::kInt8 ? 3
                                                                                       : 2;
    plan.workspace += scratch_buffers * 4.0 * static_cast<double>(std::min<int64_t>(largest_trainable, 1 << 22));
  }

  const Activations base_activations =
      seq2seq ? t5_activations(hf_config, static_cast<double>(config.data.max_input_length),
                               static_cast<double>(config.data.max_target_length), dropout_share)
              : decoder_activations(hf_config, static_cast<double>(config.data.max_length));
  Activations a = base_activations;
  plan.longest_example_tokens = max_example_tokens(config.data, seq2seq);
  if (config.lora.enabled) {
    const double input_tokens = static_cast<double>(seq2seq ? config.data.max_input_length : config.data.max_length);
    const double extra = adapter_elements_input * input_tokens +
                         adapter_elements_target * static_cast<double>(config.data.max_target_length);
    const double layers =
        seq2seq ? static_cast<double>(hf::get_int(hf_config, "num_layers") +
                                      hf::get_int(hf_config, "num_decoder_layers", hf::get_int(hf_config, "num_layers")))
                : static_cast<double>(decoder_spec_for(hf::get_string(hf_config, "model_type", ""), hf_config)->layers.size());
    a.saved += extra;
    a.largest_block += extra / layers;
  }
  // Backward starts with the gradients of the log-probabilities and of the logits next to the kept ones (fp32,
  // plus the compute-dtype logits in bf16); with checkpointing, one block is recomputed at a time instead.
  const double logits_bytes = 4 + (mode == PrecisionMode::kFp32 ? 0 : compute_bytes);
  const double vocab = static_cast<double>(model->vocab_size());
  plan.loss_per_example = a.log_probs * 4 + 2 * a.targets * vocab * logits_bytes;
  // The fused loss (train/fused_loss.cpp) holds one chunk of fp32 logits, made into their gradient in place, and
  // beside it the compute-dtype product before the conversion or the compute-dtype gradient the matmuls take after
  // it (none in fp32); the hidden states' gradient for every position; with a trainable head in bf16-mixed, the
  // chunk's head-weight gradient in bf16 before it is added to the fp32 one.
  const at::Tensor head = model->lm_head_weight();
  const double hidden_size = static_cast<double>(head.size(1));
  // A soft-capped head (Gemma 2) keeps the chunk's tanh beside it for the cap's gradient: 4 more bytes a logit.
  plan.loss_chunk_bytes_per_token = vocab * (logits_bytes + (model->final_logit_softcap() ? 4 : 0));
  plan.loss_rows_per_example = a.targets * hidden_size * compute_bytes;
  const bool head_trained = !config.lora.enabled;
  plan.loss_fixed = head_trained && mixed ? vocab * hidden_size * compute_bytes : 0;
  plan.loss_chunk_size = config.training.loss_chunk_size;
  plan.targets_per_example = static_cast<int64_t>(a.targets);
  plan.activations_per_example = a.saved * compute_bytes;
  plan.activations_per_example_checkpointed = (a.checkpointed + a.largest_block) * compute_bytes;
  plan.unit = shape.unit;
  plan.unit_note = shape.unit_note;
  if (shape.sequences != 1 || shape.reference_forward) {
    // An example of several sequences (a DPO pair: two of data.max_length) through forward and backward, and with
    // a reference's forward without autograd beside them its hidden states for every position while its
    // log-probabilities are summed (a block's activations at a time otherwise).
    const auto sequences = static_cast<double>(shape.sequences);
    plan.activations_per_example *= sequences;
    plan.activations_per_example_checkpointed *= sequences;
    plan.loss_per_example *= sequences;
    plan.loss_rows_per_example *= sequences + (shape.reference_forward ? 1 : 0);
    plan.targets_per_example *= shape.sequences;
  }
  if (shape.reference_weights) {  // a second model, counted as this one's size
    const bool bf16 = mode == PrecisionMode::kBf16 || (config.lora.enabled && config.lora.base_in_bf16);
    plan.reference_weights = p * (bf16 ? 2 : 4);
    plan.weights += plan.reference_weights;
  }
  plan.capacity = capacity;
  plan.capacity_source = capacity_source;
  plan.safety_margin = config.memory.auto_safety_margin;
  plan.batch_size = config.training.batch_size;
  if (quantize) {
    // In the dtype of the layers' inputs: bf16 with precision.mode=bf16, fp32 otherwise (models/linear4bit.h).
    plan.dequantized_base = quantized_elements * (mode == PrecisionMode::kBf16 ? 2.0 : 4.0);
    plan.keeps_dequantized_base =
        keep_dequantized_base(plan, config, plan.dequantized_base, plan.dequantized_base_reason);
    if (plan.keeps_dequantized_base) plan.weights += plan.dequantized_base;
  }
  return plan;
}

namespace {

double ram_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}

}  // namespace

bool keep_dequantized_base(const MemoryPlan& plan, const Config& config, double copies, std::string& reason) {
  const std::string size = human_bytes(copies);
  if (config.memory.dequantized_base == DequantizedBase::kPerUse) {
    reason = "dequantized on every use (memory.dequantized_base=per_use; kept they would take " + size + ")";
    return false;
  }
  if (config.memory.dequantized_base == DequantizedBase::kKeep) {
    reason = "dequantized once and kept, " + size + " (memory.dequantized_base=keep)";
    return true;
  }
  MemoryPlan with = plan;
  if (with.capacity <= 0) {
    with.capacity = ram_bytes();
    with.capacity_source = "this machine's RAM";
  }
  const bool checkpointing = config.training.activation_checkpointing;
  const bool chunked = config.training.chunked_loss;
  const double allowed = with.capacity * (1.0 - with.safety_margin);
  const std::string budget = human_bytes(allowed) + " usable of " + with.capacity_source;
  int64_t micro = 0;
  bool fits = false;
  if (config.training.micro_batch_size.is_auto || config.training.micro_batch_tokens > 0) {
    micro = std::max<int64_t>(1, with.largest_micro_batch(checkpointing, chunked));
    with.weights += copies;
    fits = with.largest_micro_batch(checkpointing, chunked) >= micro;
  } else {
    micro = std::min(config.training.micro_batch_size.value, with.batch_size);
    fits = with.peak(micro, checkpointing, chunked) + copies <= allowed;
  }
  reason = fits ? "dequantized once and kept, " + size + " (memory.dequantized_base=auto: micro-batch " +
                      std::to_string(micro) + " still fits " + budget + " by the plan)"
                : "dequantized on every use (memory.dequantized_base=auto: kept, " + size + " would not fit " + budget +
                      " by the plan at micro-batch " + std::to_string(micro) + ")";
  return fits;
}

bool choose_dequantized_base(const Config& config, const c10::Device& device, double copies, std::string& reason,
                             const ExampleShape& shape) {
  if (config.memory.dequantized_base != DequantizedBase::kAuto) return keep_dequantized_base({}, config, copies, reason);
  double capacity = 0;
  std::string source;
  if (config.memory.limit.bytes > 0) {
    capacity = static_cast<double>(config.memory.limit.bytes);
    source = "memory.limit";
  } else if (!device.is_cpu()) {
    capacity = static_cast<double>(at::accelerator::getMemoryInfo(device.index()).second);
    source = device.str();
  }
  MemoryPlan plan;
  try {
    const auto hf_config = read_json_file((std::filesystem::path(config.model.path) / "config.json").string());
    Config per_use = config;
    per_use.memory.dequantized_base = DequantizedBase::kPerUse;  // the plan without the copies
    plan = plan_memory(per_use, hf_config, device, capacity, source, shape);
  } catch (const std::exception& e) {
    reason = std::string("dequantized on every use (memory.dequantized_base=auto: no memory plan: ") + e.what() + ")";
    return false;
  }
  return keep_dequantized_base(plan, config, copies, reason);
}

void print_plan(const MemoryPlan& plan, const Config& config, std::ostream& out) {
  auto row = [&out](const std::string& what, double bytes, const std::string& note) {
    out << "  " << std::left << std::setw(36) << what << std::right << std::setw(12) << human_bytes(bytes) << "  "
        << note << "\n";
  };
  out << "Memory plan (" << (config.lora.enabled ? "LoRA r=" + std::to_string(config.lora.r) : "full fine-tune")
      << ", precision " << precision_name(config.precision.mode) << ")\n";
  out << "  parameters " << plan.parameters << ", trainable " << plan.trainable_parameters << "\n\n";
  row("weights", plan.weights,
      !config.lora.enabled                        ? ""
      : config.model.quantize != QuantizeMode::kNone ? std::string("frozen base, linear layers in 4 bits (") +
                                                         enum_name(config.model.quantize) + "), + fp32 adapters"
                                                   : "frozen base + fp32 adapters");
  if (plan.reference_weights > 0)
    row("  of which the DPO reference", plan.reference_weights,
        config.dpo.reference_model.empty() ? "a frozen copy of the starting weights" : "dpo.reference_model, frozen");
  if (plan.dequantized_base > 0)
    row(plan.keeps_dequantized_base ? "  of which dequantized 4-bit weights" : "dequantized 4-bit weights (not kept)",
        plan.dequantized_base, plan.dequantized_base_reason);
  row("gradients", plan.gradients, "trainable parameters, kept across micro-batches");
  row(std::string("optimizer state (") + (config.optimizer.name == OptimizerName::kAdafactor ? "Adafactor" : "AdamW") +
          ")",
      plan.optimizer_state, optimizer_state_note(config));
  row("workspace", plan.workspace, "optimizer scratch, autocast weight copies, device libraries");
  row("activations per " + plan.unit, plan.activations_per_example, plan.unit_note);
  row("  with activation checkpointing", plan.activations_per_example_checkpointed, "block inputs + one block");
  // The chunked loss is the default: its row first; the full logits only with training.chunked_loss=false.
  row("chunked loss (per micro-batch)", plan.loss_chunked(1),
      "fused, " + std::to_string(std::min(config.training.loss_chunk_size, plan.targets_per_example)) +
          " tokens at a time (one example)" + (config.training.chunked_loss ? "" : "; off in this config"));
  row("  plain loss, per example", plan.loss_per_example,
      std::string("full-vocabulary fp32 logits and their gradients (training.chunked_loss=false") +
          (config.training.chunked_loss ? ")" : ", this config)"));
  out << "\n";
  out << "  capacity: " << (plan.capacity > 0 ? human_bytes(plan.capacity) : std::string("unknown")) << " ("
      << plan.capacity_source << "), safety margin " << static_cast<int>(plan.safety_margin * 100) << "%\n\n";

  const bool checkpointing = config.training.activation_checkpointing;
  const bool chunked = config.training.chunked_loss;
  out << "  micro-batch   peak (as configured)   peak (checkpointing + chunked loss)\n";
  std::vector<int64_t> rows;
  for (int64_t m = 1; m < plan.batch_size; m *= 2) rows.push_back(m);
  rows.push_back(plan.batch_size);
  for (const int64_t m : rows)
    out << "  " << std::setw(11) << m << "   " << std::setw(20) << human_bytes(plan.peak(m, checkpointing, chunked))
        << "   " << std::setw(12) << human_bytes(plan.peak(m, true, true)) << "\n";
  out << "\n";
  // The settings the recommendations turn on: only those this config has off.
  std::string turn_on;
  if (!checkpointing) turn_on = "training.activation_checkpointing=true";
  if (!chunked) turn_on += std::string(turn_on.empty() ? "" : " and ") + "training.chunked_loss=true";
  if (plan.capacity <= 0) {
    out << "recommendation: no capacity is known (CPU without memory.limit); the whole batch of " << plan.batch_size
        << " needs " << human_bytes(plan.peak(plan.batch_size, checkpointing, chunked)) << "\n";
    return;
  }
  const int64_t as_configured = plan.largest_micro_batch(checkpointing, chunked);
  const int64_t with_everything = plan.largest_micro_batch(true, true);
  if (as_configured > 0) {
    out << "recommendation: micro_batch_size " << as_configured << " ("
        << (plan.batch_size + as_configured - 1) / as_configured << " accumulation steps for batch_size "
        << plan.batch_size << ") with the configured activation_checkpointing="
        << (checkpointing ? "true" : "false") << ", chunked_loss=" << (chunked ? "true" : "false") << "\n";
    if (chunked)
      out << "  loss chunks of " << std::min(config.training.loss_chunk_size, plan.targets_per_example)
          << " tokens: " << human_bytes(plan.loss_chunked(as_configured)) << " at that micro-batch\n";
    if (with_everything > as_configured) out << "  with " << turn_on << ": " << with_everything << "\n";
    if (config.training.micro_batch_tokens > 0)  // the table's examples are all at the maximum lengths
      out << "  token-budget mode: that is training.micro_batch_tokens " << as_configured * plan.longest_example_tokens
          << " (" << plan.longest_example_tokens << " tokens an example at the maximum lengths; configured "
          << config.training.micro_batch_tokens << ")\n";
  } else if (with_everything > 0) {
    out << "recommendation: turn on " << turn_on << "; then micro_batch_size " << with_everything << " fits\n";
  } else if (const int64_t chunk = plan.fitting_loss_chunk_size(1); chunk > 0) {
    const int64_t micro = plan.largest_micro_batch(true, true, chunk);
    out << "recommendation: training.loss_chunk_size=" << chunk << " (configured " << config.training.loss_chunk_size
        << ")" << (turn_on.empty() ? "" : " with " + turn_on)
        << "; then micro_batch_size " << micro << " fits (" << (plan.batch_size + micro - 1) / micro
        << " accumulation steps for batch_size " << plan.batch_size
        << "). The smaller_loss_chunks escalation gets there by itself at the first out-of-memory error\n";
  } else {
    const double fixed = plan.weights + plan.gradients + plan.optimizer_state + plan.workspace;
    const double allowed = plan.capacity * (1.0 - plan.safety_margin);
    out << "recommendation: not even one example fits. Weights, gradients and optimizer state alone need "
        << human_bytes(fixed) << " of the " << human_bytes(allowed) << " usable";
    if (fixed >= allowed) {
      out << ": that is more than the device holds whatever the batch; train LoRA adapters (lora.enabled=true"
          << (config.precision.mode == PrecisionMode::kBf16 ? "" : ", precision.mode=bf16")
          << (config.optimizer.name == OptimizerName::kAdafactor ? ""
                                                                  : "), shrink the optimizer state "
                                                                    "(optimizer.name=adafactor")
          << ") or use a larger device\n";
    } else {
      out << "; one example at the maximum lengths needs " << human_bytes(plan.peak(1, true, true) - fixed)
          << " more with checkpointing and chunked loss: shorten data.max_length / max_input_length / "
             "max_target_length, lower training.loss_chunk_size, or use a larger device\n";
    }
  }
  out << "micro_batch_size=auto measures the same on the device at the start of training.\n";
}

void print_optimizer_choices(const Config& config, const nlohmann::json& hf_config, const c10::Device& device,
                             double capacity, const std::string& source, std::ostream& out,
                             const ExampleShape& shape) {
  struct Choice {
    const char* label;
    PrecisionMode mode;
    OptimizerName name;
    StateDtype state;
    Bf16Update update;
  };
  // Least loss of precision first: fp32 master weights (fp32, bf16-mixed), then bf16 weights with Kahan
  // compensation, then with stochastic rounding; within each, the optimizer state from exact to small.
  const Choice choices[] = {
      {"fp32, AdamW", PrecisionMode::kFp32, OptimizerName::kAdamW, StateDtype::kFp32, Bf16Update::kStochastic},
      {"fp32, Adafactor", PrecisionMode::kFp32, OptimizerName::kAdafactor, StateDtype::kFp32, Bf16Update::kStochastic},
      {"bf16-mixed, AdamW", PrecisionMode::kBf16Mixed, OptimizerName::kAdamW, StateDtype::kFp32, Bf16Update::kStochastic},
      {"bf16-mixed, AdamW bf16 moments", PrecisionMode::kBf16Mixed, OptimizerName::kAdamW, StateDtype::kBf16,
       Bf16Update::kStochastic},
      {"bf16-mixed, Adafactor", PrecisionMode::kBf16Mixed, OptimizerName::kAdafactor, StateDtype::kFp32,
       Bf16Update::kStochastic},
      {"bf16 + kahan, AdamW", PrecisionMode::kBf16, OptimizerName::kAdamW, StateDtype::kFp32, Bf16Update::kKahan},
      {"bf16 + kahan, AdamW bf16 moments", PrecisionMode::kBf16, OptimizerName::kAdamW, StateDtype::kBf16,
       Bf16Update::kKahan},
      {"bf16 + kahan, Adafactor", PrecisionMode::kBf16, OptimizerName::kAdafactor, StateDtype::kFp32, Bf16Update::kKahan},
      {"bf16 + stochastic, AdamW", PrecisionMode::kBf16, OptimizerName::kAdamW, StateDtype::kFp32,
       Bf16Update::kStochastic},
      {"bf16 + stochastic, AdamW bf16 moments", PrecisionMode::kBf16, OptimizerName::kAdamW, StateDtype::kBf16,
       Bf16Update::kStochastic},
      {"bf16 + stochastic, Adafactor", PrecisionMode::kBf16, OptimizerName::kAdafactor, StateDtype::kFp32,
       Bf16Update::kStochastic},
  };
  out << "\nprecision and optimizer choices (weights + gradients + optimizer state + workspace; the largest "
         "micro-batch with activation checkpointing and chunked loss):\n";
  const Choice* recommended = nullptr;
  for (const auto& c : choices) {
    Config alternative = config;
    alternative.precision.mode = c.mode;
    alternative.optimizer.name = c.name;
    alternative.optimizer.state_dtype = c.state;
    alternative.optimizer.bf16_update = c.update;
    const auto plan = plan_memory(alternative, hf_config, device, capacity, source, shape);
    const double fixed = plan.weights + plan.gradients + plan.optimizer_state + plan.workspace;
    const int64_t micro = plan.largest_micro_batch(true, true);
    const bool current = c.mode == config.precision.mode && c.name == config.optimizer.name &&
                         (c.name == OptimizerName::kAdafactor || c.state == config.optimizer.state_dtype) &&
                         (c.mode != PrecisionMode::kBf16 || c.update == config.optimizer.bf16_update);
    out << "  " << std::left << std::setw(40) << c.label << std::right << std::setw(12) << human_bytes(fixed) << "  "
        << (capacity <= 0 ? std::string("capacity unknown") : micro > 0 ? "micro-batch " + std::to_string(micro)
                                                                          : std::string("does not fit"))
        << (current ? "  (this config)" : "") << "\n";
    if (!recommended && (capacity <= 0 || micro > 0)) recommended = &c;
  }
  if (recommended && capacity > 0)
    out << "  the least loss of precision that fits: " << recommended->label << " (precision.mode="
        << enum_name(recommended->mode) << ", optimizer.name=" << enum_name(recommended->name)
        << (recommended->name == OptimizerName::kAdamW ? std::string(", optimizer.state_dtype=") +
                                                             enum_name(recommended->state)
                                                       : std::string())
        << (recommended->mode == PrecisionMode::kBf16 ? std::string(", optimizer.bf16_update=") +
                                                            enum_name(recommended->update)
                                                      : std::string())
        << ")\n";
}

PlanCapacity plan_capacity(const Config& config) {
  DeviceConfig device_config = config.device;
  device_config.wait_for_device = false;
  device_config.allow_cpu_fallback = true;
  const ResolvedDevice resolved = resolve_device(device_config);
  PlanCapacity c;
  c.device = resolved.device;
  c.device_description = resolved.description;
  if (config.memory.limit.bytes > 0) {
    c.capacity = static_cast<double>(config.memory.limit.bytes);
    c.source = "memory.limit on " + resolved.description;
  } else if (!resolved.device.is_cpu()) {
    c.capacity = static_cast<double>(at::accelerator::getMemoryInfo(resolved.device.index()).second);
    c.source = resolved.description;
  } else {
    c.source = "CPU without memory.limit; this machine has " + human_bytes(ram_bytes()) + " of RAM";
  }
  return c;
}

int run_image_plan(const Config& config, std::ostream& out, int64_t world_size, bool contrastive) {
  const PlanCapacity planned = plan_capacity(config);
  const double capacity = planned.capacity;
  const std::string& source = planned.source;
  // An image classifier: fixed memory of the mode, activations per image at its size, what fits.
  const auto e = estimate_image_memory(config.model.path);
  const bool probe = config.training.linear_probe;
  double fixed = probe ? e.probe_fixed : e.full_fixed;
  const double per_image = probe ? 0.0 : e.activations_per_image;
  out << "model " << config.model.path << " on " << planned.device_description
      << (contrastive ? " (CLIP, contrastive: the estimate covers the image tower only; the text tower, the "
                        "projections and gradient caching's embeddings come on top, measured by the run, "
                      : " (image classifier, ")
      << e.image_size << " x " << e.image_size << " pixels, " << e.tokens << " tokens per image)\n";
  if (world_size > 1 && !contrastive) {
    // Each rank decodes and trains its share of every effective batch (docs/images.md#data-parallelism-for-image-
    // classifiers); sharded, it keeps about 1/N of the AdamW moments (8 bytes per trainable parameter).
    const int64_t share = (config.training.batch_size + world_size - 1) / world_size;
    const bool sharded = config.distributed.shard_optimizer && !config.distributed.shard_weights;
    out << "data parallelism: " << world_size << " ranks (backend " << (planned.device.is_cuda() ? "nccl" : "gloo")
        << "); each rank decodes and trains about " << share << " of the " << config.training.batch_size
        << " images of every effective batch"
        << (config.distributed.shard_weights ? std::string()
                                             : std::string(" and holds the whole model and its gradients") +
                                                   (sharded ? " and about 1/" + std::to_string(world_size) +
                                                                  " of the AdamW state (distributed.shard_optimizer)"
                                                            : std::string(" and the whole optimizer state")))
        << ": every figure below is per rank\n";
    if (sharded)
      fixed -= 8.0 * static_cast<double>(probe ? e.head_parameters : e.parameters) *
               (1.0 - 1.0 / static_cast<double>(world_size));
    if (config.distributed.shard_weights) {
      // Fully sharded: 1/N of the weights, gradients and AdamW state, plus what is gathered at once: the root (patch
      // and position embeddings, final norm, head) for a step with its gradient, and the largest encoder layer with
      // its gradient in its backward (twice its weights with distributed.prefetch), at param_dtype's bytes.
      auto model = load_image_classifier(config.model.path, ModelInit::kRandom,
                                         at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
      const std::vector<std::size_t> units = parameter_units(*model);
      std::vector<int64_t> numel(model->blocks().size() + 1, 0);
      std::size_t i = 0;
      model->for_each_parameter([&](const std::string&, at::Tensor& p) { numel[units[i++]] += p.numel(); });
      const int64_t root = numel[0];
      const int64_t largest = numel.size() > 1 ? *std::max_element(numel.begin() + 1, numel.end()) : 0;
      const bool mixed = config.precision.mode == PrecisionMode::kBf16Mixed ||
                         config.precision.mode == PrecisionMode::kFp16Mixed;
      const double gathered_bytes = config.distributed.param_dtype == ShardDtype::kFp32   ? 4.0
                                    : config.distributed.param_dtype == ShardDtype::kAuto ? (mixed ? 2.0 : 4.0)
                                                                                          : 2.0;
      const int64_t held = config.distributed.reshard_after_forward
                               ? (config.distributed.prefetch && numel.size() > 2 ? 2 : 1) * largest
                               : static_cast<int64_t>(e.parameters) - root;
      fixed = fixed / static_cast<double>(world_size) + gathered_bytes * static_cast<double>(root + held) +
              (probe ? 0.0 : 4.0 * static_cast<double>(root + largest));
      out << "fully sharded weights (distributed.shard_weights) over " << world_size << " ranks: each keeps 1/"
          << world_size << " of the weights, gradients and AdamW state, and holds gathered the root (" << root
          << " parameters, for a whole step) and " << held << " parameters of encoder layers at a time\n";
    }
  }
  out << "  mode                      " << (probe ? "linear probe (backbone frozen)" : "full fine-tune") << "\n";
  out << "  weights + grads + AdamW   " << human_bytes(fixed) << "\n";
  out << "  activations per image     " << human_bytes(per_image) << " (fp32 estimate)\n";
  out << "  memory                    " << (capacity > 0 ? human_bytes(capacity) : std::string("no limit")) << " ("
      << source << ")\n";
  if (capacity > 0 && per_image > 0)
    out << "  largest micro-batch       about "
        << std::max<int64_t>(0, static_cast<int64_t>((capacity - fixed) / per_image)) << " images (the run "
        << "measures it with training.micro_batch_size=auto)\n";
  return kExitOk;
}

MemoryPlan plan_image_run(const Config& config, bool clip) {
  const auto meta = at::TensorOptions().device(at::kMeta).dtype(at::kFloat);
  int64_t parameters = 0, trained = 0;
  auto count = [&](const at::Tensor& p, bool trains) {
    parameters += p.numel();
    if (trains && !config.lora.enabled) trained += p.numel();
  };
  if (clip) {
    auto model = load_clip(config.model.path, ModelInit::kRandom, meta, 0);
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      bool trains = true;
      if (config.contrastive.freeze_image_tower)
        for (const char* prefix : ClipModel::kVisionPrefixes) trains = trains && !name.starts_with(prefix);
      count(p, trains);
    });
  } else {
    auto model = load_image_classifier(config.model.path, ModelInit::kRandom, meta);
    const std::string head = model->head_prefix();
    model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
      count(p, !config.training.linear_probe || name.starts_with(head));
    });
  }
  MemoryPlan plan;
  plan.parameters = parameters;
  plan.trainable_parameters = trained;
  plan.weights = static_cast<double>(parameters) * (config.precision.mode == PrecisionMode::kBf16 ? 2 : 4);
  plan.gradients = 4.0 * static_cast<double>(trained);
  plan.optimizer_state = config.optimizer.name == OptimizerName::kAdamW
                             ? static_cast<double>(trained) * (config.optimizer.state_dtype == StateDtype::kBf16   ? 4
                                                               : config.optimizer.state_dtype == StateDtype::kInt8 ? 2
                                                                                                                   : 8)
                             : 0.0;
  return plan;
}

std::string plan_fully_sharded(MemoryPlan& plan, const Config& config, const nlohmann::json& hf_config, int64_t world) {
  auto model = build_model(hf_config, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  const std::vector<std::size_t> units = parameter_units(*model);
  std::vector<int64_t> numel;
  std::size_t i = 0;
  model->for_each_parameter([&](const std::string&, at::Tensor& p) {
    const std::size_t u = units[i++];
    if (numel.size() <= u) numel.resize(u + 1, 0);
    numel[u] += p.numel();
  });
  const int64_t total = std::max<int64_t>(1, plan.parameters);
  const int64_t root = numel.empty() ? 0 : numel[0];
  int64_t largest_block = 0, blocks = 0;
  for (std::size_t u = 1; u < numel.size(); ++u) {
    largest_block = std::max(largest_block, numel[u]);
    blocks += numel[u];
  }
  const double n = static_cast<double>(world);
  const double weight_bytes = plan.weights / static_cast<double>(total);  // per parameter, on average
  const double grad_bytes = plan.gradients / static_cast<double>(std::max<int64_t>(1, plan.trainable_parameters));
  // Mixed precision (distributed.param_dtype, reduce_dtype) applies to fp32 weights: gathered in param_dtype,
  // gradients accumulated and reduced in reduce_dtype (engine.cpp resolves auto the same way).
  const bool mixed = config.precision.mode == PrecisionMode::kBf16Mixed || config.precision.mode == PrecisionMode::kFp16Mixed;
  const double param_bytes = config.distributed.param_dtype == ShardDtype::kFp32   ? 4.0
                             : config.distributed.param_dtype == ShardDtype::kAuto ? (mixed ? 2.0 : 4.0)
                                                                                   : 2.0;
  const double reduce_bytes = config.distributed.reduce_dtype == ShardDtype::kFp32   ? 4.0
                              : config.distributed.reduce_dtype == ShardDtype::kAuto ? param_bytes
                                                                                     : 2.0;
  const double gathered_weight_bytes = weight_bytes >= 4.0 ? param_bytes : weight_bytes;
  const double gathered_grad_bytes = grad_bytes >= 4.0 ? reduce_bytes : grad_bytes;
  // With prefetch, the next unit is gathered while one computes: two of the largest at once.
  const bool prefetch = config.distributed.prefetch && numel.size() > 2;
  const double gathered_blocks = static_cast<double>(
      config.distributed.reshard_after_forward ? (prefetch ? 2 * largest_block : largest_block) : blocks);
  const double whole_weights = plan.weights, whole_gradients = plan.gradients, whole_state = plan.optimizer_state;
  plan.weights = whole_weights / n + (static_cast<double>(root) + gathered_blocks) * gathered_weight_bytes;
  // LoRA's adapters are whole on every rank (their gradients and state too); a full fine-tune's are 1/N, but for
  // Adafactor's row and column statistics, which every rank holding a piece of a matrix keeps whole.
  const double trained_share = config.lora.enabled ? 1.0 : n;
  plan.gradients = whole_gradients / trained_share +
                   (config.lora.enabled ? 0.0 : static_cast<double>(root + largest_block) * gathered_grad_bytes);
  plan.optimizer_state = whole_state / trained_share;
  if (!config.lora.enabled && config.optimizer.name == OptimizerName::kAdafactor) {
    plan.optimizer_state = 0;
    model->for_each_parameter([&](const std::string&, at::Tensor& p) {
      const auto sizes = p.sizes();
      if (sizes.size() >= 2)
        plan.optimizer_state += 4.0 * static_cast<double>(p.numel() / sizes.back() + p.numel() / sizes[sizes.size() - 2]);
      else
        plan.optimizer_state += 4.0 * static_cast<double>(p.numel()) / n;
      if (config.optimizer.adafactor_beta1) plan.optimizer_state += 4.0 * static_cast<double>(p.numel()) / n;
    });
  }
  // Autocast's 16-bit copies (plan_memory counted one of every weight): none of weights gathered in 16 bits already;
  // of fp32 gathers, those the graph keeps (every unit's without activation checkpointing, else the root's and one
  // unit's).
  if (mixed && !(config.lora.enabled && config.lora.base_in_bf16)) {
    plan.workspace -= 2.0 * static_cast<double>(total);
    if (gathered_weight_bytes >= 4.0)
      plan.workspace += 2.0 * (config.training.activation_checkpointing ? static_cast<double>(root + largest_block)
                                                                        : static_cast<double>(total));
  }
  std::ostringstream line;
  line << "fully sharded weights (distributed.shard_weights) over " << world << " ranks: each keeps 1/" << world
       << " of the weights (" << human_bytes(whole_weights) << "), gradients (" << human_bytes(whole_gradients)
       << ") and optimizer state (" << human_bytes(whole_state) << "), and holds gathered the root (what no unit holds: "
       << root << " parameters, for a whole step, with their gradient) and "
       << (config.distributed.reshard_after_forward
               ? std::string(prefetch ? "two of the largest unit (the one computing and the next, prefetched: "
                                      : "the largest unit (") +
                     std::to_string(largest_block) + " parameters, with its gradient in its backward)"
               : "every unit from its forward to its backward (distributed.reshard_after_forward=false)")
       << ", gathered in " << (gathered_weight_bytes == 2.0 ? "16" : "32") << "-bit and reduced in "
       << (gathered_grad_bytes == 2.0 ? "16" : "32")
       << "-bit (distributed.param_dtype, reduce_dtype); evaluation (generation and samples too) gathers the root "
          "and one unit at a time";
  return line.str();
}

int run_plan(const Config& config, std::ostream& out, int64_t world_size, const ExampleShape& shape) {
  const PlanCapacity planned = plan_capacity(config);
  const double capacity = planned.capacity;
  const std::string& source = planned.source;
  inspect_model_dir(config.model.path, /*need_weights=*/false);  // a clear error for a wrong model.path
  const auto hf_config = read_json_file(config.model.path + "/config.json");
  if (config.precision.mode == PrecisionMode::kFp16Mixed)  // refused as training refuses it
    check_fp16_supported(hf_config.value("model_type", std::string()), config.model.path + "/config.json");
  auto plan = plan_memory(config, hf_config, planned.device, capacity, source, shape);
  out << "model " << config.model.path << " on " << planned.device_description << "\n";
  if (world_size > 1) {
    // Each rank trains a share of the effective batch (docs/distributed.md): the rows and the accumulation
    // below are the share's.
    const int64_t share = (config.training.batch_size + world_size - 1) / world_size;
    out << "data parallelism: " << world_size << " ranks (backend " << (planned.device.is_cuda() ? "nccl" : "gloo")
        << "); each rank trains "
        << (config.training.micro_batch_tokens > 0 ? "a token-balanced share (about " : "about ") << share << " of the "
        << config.training.batch_size << " examples" << (config.training.micro_batch_tokens > 0 ? ")" : "")
        << " of every effective batch"
        << (config.distributed.shard_weights ? ""
                                             : std::string(" and holds the whole model and its gradients") +
                                                   (config.distributed.shard_optimizer ? "" : " and the whole optimizer state"))
        << ": every figure below is per rank\n";
    plan.batch_size = share;
    if (config.distributed.shard_weights) {
      out << plan_fully_sharded(plan, config, hf_config, world_size) << "\n";
    } else if (config.distributed.shard_optimizer) {
      // ZeRO-1: whole parameters shared out as the optimizer does (shard_owners); the plan takes the fullest rank.
      const auto owners = shard_owners(plan.trainable_numels, static_cast<int>(world_size));
      std::vector<double> per_rank(static_cast<std::size_t>(world_size), 0.0);
      for (std::size_t i = 0; i < owners.size(); ++i)
        per_rank[static_cast<std::size_t>(owners[i])] += plan.trainable_state_bytes[i];
      out << "sharded optimizer state (distributed.shard_optimizer): " << human_bytes(plan.optimizer_state)
          << " in all, 1/" << world_size << " = " << human_bytes(plan.optimizer_state / static_cast<double>(world_size))
          << "; per rank:";
      for (std::size_t r = 0; r < per_rank.size(); ++r) out << (r ? "," : "") << " " << r << ": " << human_bytes(per_rank[r]);
      out << "\n";
      plan.optimizer_state = *std::max_element(per_rank.begin(), per_rank.end());
    }
  }
  print_plan(plan, config, out);
  if (world_size > 1 && config.distributed.shard_weights)
    out << "(the precision and optimizer choices are planned for unsharded runs: try them here with --set)\n";
  else
    print_optimizer_choices(config, hf_config, planned.device, capacity, source, out, shape);
  return kExitOk;
}

}  // namespace trainer
