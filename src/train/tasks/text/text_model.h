// The model half of the tasks that train a language model (text, preference): loading it from model.path or a
// checkpoint (4-bit layers, fp16 checks), LoRA (with a randomly initialised demo base saved beside the run),
// activation checkpointing, the checks a resumed checkpoint must pass, and saving it as a Hugging Face directory or a
// PEFT adapter with the tokenizer files (--merge writes the merged model too).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "memory/planner.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/run.h"

namespace trainer {

class LanguageModel;
class LoraAdapters;
class Module;
class Tokenizer;

class TextModel {
 public:
  // `shape`: what one example is to the memory planner (memory.dequantized_base=auto plans with it).
  TextModel(const Config& config, bool primary, ExampleShape shape = {});
  ~TextModel();

  // --merge needs LoRA and a final save (UsageError).
  void check_settings(const TrainOptions& options) const;
  // A checkpoint of another architecture (its config.json, a LoRA checkpoint's base model config) or of other LoRA
  // settings cannot continue this run (DataError).
  void check_checkpoint(const std::filesystem::path& checkpoint, const nlohmann::json& state) const;
  // The model (from model.path, or from `resume` when a full fine-tune resumes), LoRA (its adapters from `resume`),
  // activation checkpointing; checked against `tokenizer`'s vocabulary.
  void build(const std::optional<std::filesystem::path>& resume, const c10::Device& device,
             const Tokenizer& tokenizer);

  LanguageModel& model() { return *model_; }
  LoraAdapters* lora() { return lora_.get(); }
  Module& trainable();
  DataFamily family() const { return family_; }
  int32_t pad_id() const { return pad_id_; }

  // The trained model (or adapter) with the tokenizer files into `dir`.
  void save(const std::filesystem::path& dir);
  // Fully sharded weights: build() leaves pretrained weights on the meta device, read on demand by weight_reader()
  // (empty when they were loaded: random initialisation, LoRA, 4-bit).
  void read_weights_on_demand() { on_demand_ = true; }
  const std::function<at::Tensor(const std::string&)>& weight_reader() const { return reader_; }
  // Fully sharded weights (Task::save_streamed, Task::save_without_weights; never with LoRA).
  void save_streamed(const std::filesystem::path& dir, const std::function<at::Tensor(const std::string&)>& parameter,
                     bool write);
  void save_without_weights(const std::filesystem::path& dir);
  void add_train_state(nlohmann::json& state) const;  // with LoRA: the base model's config
  void after_final_save(const std::filesystem::path& output_dir, const TrainOptions& options);  // --merge

 private:
  void apply_lora_for_training(const std::optional<std::filesystem::path>& resume, const c10::Device& device);
  // The tokenizer files (and the chat template) beside the saved weights, so a saved directory is complete for
  // from_pretrained and for `trainer generate --prompt` / `--chat`.
  void copy_tokenizer_files_to(const std::filesystem::path& to) const;

  const Config& config_;
  bool primary_;
  ExampleShape shape_;
  std::unique_ptr<LanguageModel> model_;
  bool on_demand_ = false;
  std::function<at::Tensor(const std::string&)> reader_;
  std::unique_ptr<LoraAdapters> lora_;
  std::string lora_base_;  // the adapter's base_model_name_or_path
  DataFamily family_ = DataFamily::kCausal;
  int32_t pad_id_ = 0;
};

}  // namespace trainer
