// What the tasks on a language model share (the text task and the preference task): the model (TextModel: loading,
// LoRA, 4-bit bases, the checkpoint's checks, saving as a Hugging Face directory or a PEFT adapter, --merge), the
// tokenizer, the JSONL loader and its data check. A task derived from it writes only its data, step and evaluation.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "models/model.h"
#include "train/engine/loader_task.h"
#include "train/resume_check.h"
#include "train/tasks/text/text_model.h"
#include "trainer/data.h"
#include "trainer/tokenizer.h"

namespace trainer {

class LanguageModelTask : public LoaderTask<DataLoader, EffectiveBatch> {
 public:
  // `shape`: what one example is to the memory planner (TextModel's 4-bit choice reads it; a DPO pair's).
  explicit LanguageModelTask(const TaskContext& context, const ExampleShape& shape = {})
      : LoaderTask(context), text_model_(config(), primary(), shape) {}
  // The loader's workers encode records with tokenizer_, and LoaderTask (which owns the loader) is destroyed after
  // this class's members: stop the workers first, or one still encoding reads a freed tokenizer (a run that ends on
  // an error while records are in flight). A derived task whose workers read its own members stops them in its own
  // destructor too.
  ~LanguageModelTask() override { loader_.reset(); }

  std::string model_type() const override { return model_->model_type(); }
  void check_settings(const TrainOptions& options) const override { text_model_.check_settings(options); }
  void check_checkpoint(const std::filesystem::path& checkpoint, const nlohmann::json& state) const override {
    text_model_.check_checkpoint(checkpoint, state);
  }
  std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                        std::vector<std::string>& warnings) const override {
    return trainer::data_changes(saved, current, warnings);
  }

  Module& model() override { return *model_; }
  Module* adapters() override { return text_model_.lora(); }
  Module& trainable() override { return text_model_.trainable(); }

  void save(const std::filesystem::path& dir) override { text_model_.save(dir); }
  void save_streamed(const std::filesystem::path& dir, const std::function<at::Tensor(const std::string&)>& parameter,
                     bool write) override {
    text_model_.save_streamed(dir, parameter, write);
  }
  void save_without_weights(const std::filesystem::path& dir) override { text_model_.save_without_weights(dir); }
  void read_weights_on_demand() override { text_model_.read_weights_on_demand(); }
  std::function<at::Tensor(const std::string&)> weight_reader() override { return text_model_.weight_reader(); }
  void add_train_state(nlohmann::json& state) const override { text_model_.add_train_state(state); }
  void after_final_save(const std::filesystem::path& output_dir, const TrainOptions& options) override {
    text_model_.after_final_save(output_dir, options);
  }

 protected:
  // Builds the model (from the checkpoint `resume` when resuming) on `device`; model_ then points at it.
  void build_text_model(const std::optional<std::filesystem::path>& resume, const c10::Device& device) {
    text_model_.build(resume, device, *tokenizer_);
    model_ = &text_model_.model();
  }

  std::unique_ptr<Tokenizer> tokenizer_;  // open_data loads it
  TextModel text_model_;
  LanguageModel* model_ = nullptr;  // text_model_'s, after load_model
};

}  // namespace trainer
