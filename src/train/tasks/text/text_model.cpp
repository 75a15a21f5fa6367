// The model half of the language-model tasks (see text_model.h).
#include "train/tasks/text/text_model.h"

#include <filesystem>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "memory/planner.h"
#include "models/lora.h"
#include "models/weights.h"
#include "train/activation_checkpointing.h"
#include "train/resume_check.h"
#include "trainer/hub.h"
#include "trainer/model_dir.h"
#include "trainer/peft.h"
#include "trainer/safetensors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

TextModel::TextModel(const Config& config, bool primary, ExampleShape shape)
    : config_(config), primary_(primary), shape_(std::move(shape)) {}
TextModel::~TextModel() = default;

Module& TextModel::trainable() { return lora_ ? static_cast<Module&>(*lora_) : *model_; }

void TextModel::check_settings(const TrainOptions& options) const {
  if (options.merge && !config_.lora.enabled)
    throw UsageError("--merge merges LoRA adapters, but lora.enabled=false",
                     "add --set lora.enabled=true, or drop --merge");
  if (options.merge && !config_.checkpoint.save_final)
    throw UsageError("--merge merges the final adapter, but checkpoint.save_final=false",
                     "drop --merge, or set checkpoint.save_final=true");
}

// A checkpoint of another architecture cannot continue this run: its config.json (a LoRA checkpoint's base model
// config) must equal model.path's, and a LoRA checkpoint needs the same adapter shape and scaling.
void TextModel::check_checkpoint(const fs::path& checkpoint, const nlohmann::json& state) const {
  const auto& saved_lora = state.at("config").at("lora");
  if (saved_lora.at("enabled").get<bool>() != config_.lora.enabled)
    throw DataError("checkpoint " + checkpoint.string() + " holds " +
                        (config_.lora.enabled ? "a full model, not a LoRA adapter" : "a LoRA adapter, not a full model"),
                    "resume with the lora.enabled setting the checkpoint was trained with");
  if (config_.lora.enabled) {
    const auto current_lora = nlohmann::json::parse(config_to_json(config_)).at("lora");
    std::string changed;
    // A checkpoint from before lora.target_parameters existed adapted no experts: [].
    for (const char* key : {"r", "alpha", "target_modules", "target_parameters", "rslora"}) {
      const auto saved_value = saved_lora.value(key, nlohmann::json::array());
      if (saved_value != current_lora.at(key))
        changed += std::string("\n  lora.") + key + ": checkpoint " + saved_value.dump() + ", config " +
                   current_lora.at(key).dump();
    }
    if (!changed.empty())
      throw DataError("checkpoint " + checkpoint.string() + " was trained with other LoRA settings:" + changed,
                      "resume with the lora settings of the checkpoint");
  }
  auto saved = config_.lora.enabled ? state.at("base_model_config")
                                     : read_json_file((checkpoint / "config.json").string());
  auto current = read_json_file((fs::path(config_.model.path) / "config.json").string());
  std::string differences;
  for (const auto& [key, value] : current.items()) {
    if (key == "transformers_version") continue;
    if (!saved.contains(key) || saved[key] != value)
      differences += "\n  " + key + ": checkpoint " + (saved.contains(key) ? saved[key].dump() : "(missing)") +
                     ", model.path " + value.dump();
  }
  if (!differences.empty())
    throw DataError("checkpoint " + checkpoint.string() + " belongs to another model than model.path:" + differences,
                    "resume with the model.path the checkpoint was trained from");
}

// The model (from model.path, or from the checkpoint when resuming a full fine-tune), LoRA, activation checkpointing.
void TextModel::build(const std::optional<fs::path>& resume, const c10::Device& device, const Tokenizer& tokenizer) {
  // A LoRA base held in bf16 is loaded in bf16: a 7B model never exists in fp32 on the device.
  const bool bf16_weights =
      config_.precision.mode == PrecisionMode::kBf16 || (config_.lora.enabled && config_.lora.base_in_bf16);
  const auto options = at::TensorOptions().dtype(bf16_weights ? at::kBFloat16 : at::kFloat).device(device);
  // fp16-mixed is refused for the T5 family, known from model.path's config.json: before any weight is read.
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) {
    const fs::path config_json = fs::path(config_.model.path) / "config.json";
    if (fs::exists(config_json))
      check_fp16_supported(read_json_file(config_json.string()).value("model_type", std::string()),
                           config_json.string());
  }
  // With LoRA the base always comes from model.path; the checkpoint holds only the adapter. Fully sharded weights
  // read the base (or the full fine-tune's weights) unit by unit as they cut it; the adapters are made at once.
  WeightReader* reader = on_demand_ ? &reader_ : nullptr;
  model_ = resume && !config_.lora.enabled
               ? load_model(resume->string(), ModelInit::kPretrained, options, 0, std::nullopt, reader)
               : load_model(config_.model.path, config_.model.init, options,
                            static_cast<uint64_t>(config_.training.seed), quantize_options(config_.model), reader);
  if (config_.precision.mode == PrecisionMode::kFp16Mixed)
    check_fp16_supported(model_->model_type(), config_.model.path);
  if (!config_.lora.enabled && has_quantized_layers(*model_))
    throw UsageError(config_.model.path + " holds 4-bit linear layers (bitsandbytes' layout), which cannot be trained",
                     "train LoRA adapters on it: lora.enabled=true (QLoRA)");
  if (has_quantized_layers(*model_)) {
    // Frozen 4-bit weights dequantized once and kept, or on every use: the memory plan's choice. They are kept in
    // the dtype of the layers' inputs: bf16 with precision.mode=bf16, fp32 otherwise (autocast casts after them).
    const at::ScalarType compute = config_.precision.mode == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat;
    std::string dequantized;
    const bool keep = choose_dequantized_base(config_, device,
                                              static_cast<double>(dequantized_weight_bytes(*model_, compute)),
                                              dequantized, shape_);
    keep_dequantized_weights(*model_, keep);
    spdlog::info("4-bit layers: {}", four_bit_kernels(*model_, device.type(), compute));
    spdlog::info("4-bit base weights: {}", dequantized);
  }
  model_->train(true);
  model_->for_each_parameter([](const std::string&, at::Tensor& p) {
    if (at::isFloatingType(p.scalar_type())) p.requires_grad_(true);
  });
  if (config_.lora.enabled) apply_lora_for_training(resume, device);
  if (config_.training.activation_checkpointing) apply_activation_checkpointing(*model_);
  family_ = model_->family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  if (tokenizer.vocab_size() > model_->vocab_size())
    throw DataError("the tokenizer " + tokenizer.source() + " has " + std::to_string(tokenizer.vocab_size()) +
                        " tokens but the model's vocabulary has " + std::to_string(model_->vocab_size()),
                    "tokenizer.path must belong to model.path");
  pad_id_ = tokenizer.pad_id().value_or(tokenizer.eos_id().value_or(0));
}

// LoRA on the frozen base, restored from `resume` when resuming. The adapter's base is model.path; a randomly
// initialised base (the tiny demos) is saved to output_dir/base at the start of a run (a resumed run recreates the
// same one from training.seed), so the adapter has a base to be loaded onto.
void TextModel::apply_lora_for_training(const std::optional<fs::path>& resume, const c10::Device& device) {
  lora_base_ = fs::absolute(config_.model.path).lexically_normal().string();
  if (config_.model.init == ModelInit::kRandom) {
    const fs::path saved = fs::absolute(fs::path(config_.checkpoint.output_dir) / "base").lexically_normal();
    if (primary_ && (!resume || (!fs::exists(saved / kWeightsFileName) && !fs::exists(saved / kWeightsIndexName)))) {
      save_model(*model_, saved.string(), config_.checkpoint.max_shard_size.bytes);
      copy_tokenizer_files_to(saved);
    }
    lora_base_ = saved.string();
  }
  lora_ = apply_lora(*model_, config_.lora, static_cast<uint64_t>(config_.training.seed), device);
  if (resume) load_lora_weights(*lora_, read_peft_adapter(resume->string()), resume->string());
  const auto& applied = lora_->config();
  std::string targets, experts;
  for (const auto& t : applied.target_modules) targets += (targets.empty() ? "" : ",") + t;
  for (const auto& t : applied.target_parameters) experts += (experts.empty() ? "" : ",") + t;
  if (!experts.empty())
    experts = fmt::format(" and {} experts' stacked parameters ({})", lora_->experts().size(), experts);
  spdlog::info("LoRA r={} alpha={} (scale {:.4g}{}) dropout={} on {} layers ({}){}; base frozen{}; {} trainable "
               "parameters",
               applied.r, applied.alpha, lora_scaling(applied.alpha, applied.r, applied.rslora),
               applied.rslora ? ", rsLoRA" : "", applied.dropout, lora_->layers().size(), targets, experts,
               applied.base_in_bf16 ? " in bf16" : "", lora_->trainable_parameters());
}

void TextModel::save(const fs::path& dir) {
  if (lora_) {
    PeftAdapter adapter = to_peft_adapter(*lora_, *model_, lora_base_);
    // A base named by Hub id is written as PEFT writes it: the id, and the commit trained on as the revision.
    if (const auto origin = hub::snapshot_origin(lora_base_)) {
      adapter.config.base_model_name_or_path = origin->repo_id;
      adapter.config.revision = origin->commit;
    }
    write_peft_adapter(dir.string(), adapter);
  } else {
    save_model(*model_, dir.string(), config_.checkpoint.max_shard_size.bytes);
  }
  copy_tokenizer_files_to(dir);
}
void TextModel::save_streamed(const fs::path& dir, const std::function<at::Tensor(const std::string&)>& parameter,
                              bool write) {
  save_model_streamed(*model_, dir.string(), config_.checkpoint.max_shard_size.bytes, parameter, write);
  if (write) copy_tokenizer_files_to(dir);
}

void TextModel::save_without_weights(const fs::path& dir) {
  fs::create_directories(dir);
  save_model_config(*model_, dir.string());
  copy_tokenizer_files_to(dir);
}

void TextModel::add_train_state(nlohmann::json& state) const {
  if (lora_) state["base_model_config"] = model_->hf_config();  // an adapter has no config.json
}
void TextModel::after_final_save(const fs::path& output_dir, const TrainOptions& options) {
  if (!options.merge) return;
  MergeOptions merge;
  merge.adapter_dir = (output_dir / "final").string();
  merge.output_dir = (output_dir / "final-merged").string();
  merge.max_shard_bytes = config_.checkpoint.max_shard_size.bytes;
  merge.quantize = quantize_options(config_.model);
  merge_adapter(merge);
}

void TextModel::copy_tokenizer_files_to(const fs::path& to) const {
  fs::path from(config_.tokenizer.path.empty() ? config_.model.path : config_.tokenizer.path);
  if (!fs::is_directory(from)) from = from.parent_path();
  copy_tokenizer_files(from.string(), to.string());
  // The template the run rendered chat records with is the one the saved model speaks (trainer generate --chat,
  // transformers' apply_chat_template: chat_template.jinja takes priority over tokenizer_config.json's).
  if (!config_.data.chat_template.empty())
    fs::copy_file(config_.data.chat_template, to / "chat_template.jinja", fs::copy_options::overwrite_existing);
}

}  // namespace trainer
