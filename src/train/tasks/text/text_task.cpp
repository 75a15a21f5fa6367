// The text task: seq2seq (T5) and causal (Llama, Qwen2, Mistral) language models on JSONL records through the
// tokenizer and the streaming loader (packing, token-budget micro-batches), trained by TrainStep (train/step.h: the
// loss per target token of the effective batch, the fused chunked loss), evaluated by the validation loss and sample
// generations, saved as a Hugging Face directory or with LoRA as a PEFT adapter (--merge writes the merged model too).
#include "train/tasks/text/text_task.h"

#include <cmath>
#include <filesystem>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/packing.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/planner.h"
#include "memory/policy.h"
#include "models/lora.h"
#include "models/weights.h"
#include "train/activation_checkpointing.h"
#include "train/engine/loader_task.h"
#include "train/resume_check.h"
#include "train/tasks/text/generation_eval.h"
#include "train/step.h"
#include "trainer/data.h"
#include "trainer/hub.h"
#include "trainer/model_dir.h"
#include "trainer/peft.h"
#include "trainer/safetensors.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

// Examples of the longest lengths the config allows: the worst case micro_batch_size=auto must fit.
std::vector<Example> worst_case_examples(const Config& config, DataFamily family, int64_t count, int32_t token) {
  Example e;
  if (family == DataFamily::kSeq2Seq) {
    e.input_ids.assign(static_cast<std::size_t>(config.data.max_input_length), token);
    e.labels.assign(static_cast<std::size_t>(config.data.max_target_length), token);
  } else {
    e.input_ids.assign(static_cast<std::size_t>(config.data.max_length), token);
    e.labels = e.input_ids;
  }
  return std::vector<Example>(static_cast<std::size_t>(count), e);
}

// The summed loss and target tokens of one collated micro-batch without autograd: through the full logits, or with
// `loss_chunk_size` > 0 through the LM head over that many trained positions at a time, so that with a large
// vocabulary evaluation never holds more logits than a training step's chunked loss does.
std::pair<double, int64_t> evaluation_loss(LanguageModel& model, const Batch& batch, int64_t loss_chunk_size) {
  if (loss_chunk_size <= 0) {
    const auto out = forward_loss(model, batch);
    return {out.loss_sum.item<double>(), out.target_tokens};
  }
  const auto [hidden, targets] = model.hidden_and_targets(batch);
  const at::Tensor flat_targets = targets.reshape({-1});
  const at::Tensor rows = (flat_targets != -100).nonzero().reshape({-1});
  const at::Tensor flat_hidden = hidden.reshape({-1, hidden.size(-1)});
  double sum = 0;
  for (int64_t begin = 0; begin < rows.numel(); begin += loss_chunk_size) {
    const at::Tensor index = rows.narrow(0, begin, std::min(loss_chunk_size, rows.numel() - begin));
    const at::Tensor logits = model.lm_head(flat_hidden.index_select(0, index));
    sum += at::cross_entropy_loss(logits.to(at::kFloat), flat_targets.index_select(0, index), {}, at::Reduction::Sum,
                                  -100)
               .item<double>();
  }
  return {sum, rows.numel()};
}

class TextTask final : public LoaderTask<DataLoader, EffectiveBatch> {
 public:
  using LoaderTask::LoaderTask;
  // The loader's workers encode records with tokenizer_, and LoaderTask (which owns the loader) is destroyed after
  // this class's members: stop the workers first, or one still encoding reads a freed tokenizer (a run that ends on
  // an error while records are in flight).
  ~TextTask() override { loader_.reset(); }

  std::string name() const override { return "text"; }
  Counted counted() const override { return {"tokens_seen", "target tokens", "tokens", true}; }
  std::string model_type() const override { return model_->model_type(); }

  void check_settings(const TrainOptions& options) const override {
    if (options.merge && !config().lora.enabled)
      throw UsageError("--merge merges LoRA adapters, but lora.enabled=false",
                       "add --set lora.enabled=true, or drop --merge");
    if (options.merge && !config().checkpoint.save_final)
      throw UsageError("--merge merges the final adapter, but checkpoint.save_final=false",
                       "drop --merge, or set checkpoint.save_final=true");
  }

  // A checkpoint of another architecture cannot continue this run: its config.json (a LoRA checkpoint's base model
  // config) must equal model.path's, and a LoRA checkpoint needs the same adapter shape and scaling.
  void check_checkpoint(const fs::path& checkpoint, const nlohmann::json& state) const override {
    const auto& saved_lora = state.at("config").at("lora");
    if (saved_lora.at("enabled").get<bool>() != config().lora.enabled)
      throw DataError("checkpoint " + checkpoint.string() + " holds " +
                          (config().lora.enabled ? "a full model, not a LoRA adapter" : "a LoRA adapter, not a full model"),
                      "resume with the lora.enabled setting the checkpoint was trained with");
    if (config().lora.enabled) {
      const auto current_lora = nlohmann::json::parse(config_to_json(config())).at("lora");
      std::string changed;
      for (const char* key : {"r", "alpha", "target_modules", "rslora"})
        if (saved_lora.at(key) != current_lora.at(key))
          changed += std::string("\n  lora.") + key + ": checkpoint " + saved_lora.at(key).dump() + ", config " +
                     current_lora.at(key).dump();
      if (!changed.empty())
        throw DataError("checkpoint " + checkpoint.string() + " was trained with other LoRA settings:" + changed,
                        "resume with the lora settings of the checkpoint");
    }
    auto saved = config().lora.enabled ? state.at("base_model_config")
                                       : read_json_file((checkpoint / "config.json").string());
    auto current = read_json_file((fs::path(config().model.path) / "config.json").string());
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

  nlohmann::json open_data() override {
    // Without tokenizer files in model.path: pre-tokenized records only (trainer/tokenizer.h).
    tokenizer_ = load_run_tokenizer(config(), /*samples=*/true);
    return data_fingerprint(config(), *tokenizer_);
  }
  std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                        std::vector<std::string>& warnings) const override {
    return trainer::data_changes(saved, current, warnings);
  }

  void build_model(const std::optional<fs::path>& resume, const c10::Device& device) override;
  Module& model() override { return *model_; }
  Module* adapters() override { return lora_.get(); }
  Module& trainable() override { return lora_ ? static_cast<Module&>(*lora_) : *model_; }

  void open_loader() override {
    // Data parallelism: each rank tokenizes only its share of the records and gets the rest from the others.
    loader_ = make_train_loader(config(), *tokenizer_, family_, distributed::record_share(world()));
  }

  void build_step(const StepParts& parts) override {
    StepOptions options;
    options.device = parts.device;
    options.pad_id = pad_id_;
    options.precision = config().precision.mode;
    options.max_grad_norm = config().training.max_grad_norm;
    options.max_retries = config().memory.max_retries;
    options.chunked_loss = config().training.chunked_loss;
    options.seed = static_cast<uint64_t>(config().training.seed);
    options.packing = config().data.packing;
    options.pack_capacity = pack_capacity(config().data, family_);
    options.sync = parts.sync;
    options.scaler = parts.scaler;
    device_ = parts.device;
    step_ = std::make_unique<TrainStep>(*model_, parts.optimizer, parts.policy, options);
  }
  StepResult train_step(TaskBatch& batch, int64_t step, double lr) override {
    return step_->run(batch_of(batch), step, lr);
  }
  int64_t probe_limit() const override { return config().training.batch_size; }
  void probe(int64_t micro) override {
    step_->forward_backward(worst_case_examples(config(), family_, micro, 5), 1.0);
  }
  std::string probe_case(int64_t micro) const override { return std::to_string(micro) + " at maximum lengths"; }
  std::pair<std::string, std::string> probe_failure() const override {
    return {"not even one example of the maximum lengths fits for micro_batch_size=auto",
            "lower data.max_length / max_input_length / max_target_length, turn on "
            "training.activation_checkpointing and training.chunked_loss, or raise memory.limit"};
  }
  std::vector<std::string> floor_suggestions() const override {
    return {family_ == DataFamily::kSeq2Seq
                ? "shorter sequences: data.max_input_length / data.max_target_length (activations grow with length)"
                : "shorter sequences: data.max_length (activations grow with length)"};
  }
  void set_device(const c10::Device& device) override {
    device_ = device;
    step_->set_device(device);
  }

  // "auto" starts from training's micro-batch (in token mode: what its budget holds at the maximum lengths).
  int64_t evaluation_micro_batch(const MemoryPolicy& policy) const override {
    const auto& configured = config().evaluation.micro_batch_size;
    if (!configured.is_auto) return configured.value;
    if (!policy.by_tokens()) return policy.micro_batch();
    const int64_t longest = max_example_tokens(config().data, family_ == DataFamily::kSeq2Seq);
    return std::max<int64_t>(1, policy.micro_batch() / std::max<int64_t>(1, longest));
  }
  Evaluated evaluate(int64_t step, EvaluationMicroBatch& micro) override;
  void after_evaluation(int64_t step, Reporter& reporter) override;

  void save(const fs::path& dir) override {
    if (lora_) {
      PeftAdapter adapter = to_peft_adapter(*lora_, *model_, lora_base_);
      // A base named by Hub id is written as PEFT writes it: the id, and the commit trained on as the revision.
      if (const auto origin = hub::snapshot_origin(lora_base_)) {
        adapter.config.base_model_name_or_path = origin->repo_id;
        adapter.config.revision = origin->commit;
      }
      write_peft_adapter(dir.string(), adapter);
    } else {
      save_model(*model_, dir.string(), config().checkpoint.max_shard_size.bytes);
    }
    copy_tokenizer_files_to(dir);
  }
  void add_train_state(nlohmann::json& state) const override {
    if (lora_) state["base_model_config"] = model_->hf_config();  // an adapter has no config.json
  }
  void after_final_save(const fs::path& output_dir, const TrainOptions& options) override {
    if (!options.merge) return;
    MergeOptions merge;
    merge.adapter_dir = (output_dir / "final").string();
    merge.output_dir = (output_dir / "final-merged").string();
    merge.max_shard_bytes = config().checkpoint.max_shard_size.bytes;
    merge.quantize = quantize_options(config().model);
    merge_adapter(merge);
  }

 private:
  void apply_lora_for_training(const std::optional<fs::path>& resume);
  // The tokenizer files (and the chat template) beside the saved weights, so a saved directory is complete for
  // from_pretrained and for `trainer generate --prompt` / `--chat`.
  void copy_tokenizer_files_to(const fs::path& to) const {
    fs::path from(config().tokenizer.path.empty() ? config().model.path : config().tokenizer.path);
    if (!fs::is_directory(from)) from = from.parent_path();
    copy_tokenizer_files(from.string(), to.string());
    // The template the run rendered chat records with is the one the saved model speaks (trainer generate --chat,
    // transformers' apply_chat_template: chat_template.jinja takes priority over tokenizer_config.json's).
    if (!config().data.chat_template.empty())
      fs::copy_file(config().data.chat_template, to / "chat_template.jinja", fs::copy_options::overwrite_existing);
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LanguageModel> model_;
  std::unique_ptr<LoraAdapters> lora_;
  std::string lora_base_;  // the adapter's base_model_name_or_path
  DataFamily family_ = DataFamily::kCausal;
  int32_t pad_id_ = 0;
  std::unique_ptr<TrainStep> step_;
  c10::Device device_{c10::kCPU};
};

// The model (from model.path, or from the checkpoint when resuming a full fine-tune), LoRA, activation checkpointing.
void TextTask::build_model(const std::optional<fs::path>& resume, const c10::Device& device) {
  device_ = device;
  // A LoRA base held in bf16 is loaded in bf16: a 7B model never exists in fp32 on the device.
  const bool bf16_weights =
      config().precision.mode == PrecisionMode::kBf16 || (config().lora.enabled && config().lora.base_in_bf16);
  const auto options = at::TensorOptions().dtype(bf16_weights ? at::kBFloat16 : at::kFloat).device(device);
  // fp16-mixed is refused for the T5 family, known from model.path's config.json: before any weight is read.
  if (config().precision.mode == PrecisionMode::kFp16Mixed) {
    const fs::path config_json = fs::path(config().model.path) / "config.json";
    if (fs::exists(config_json))
      check_fp16_supported(read_json_file(config_json.string()).value("model_type", std::string()),
                           config_json.string());
  }
  // With LoRA the base always comes from model.path; the checkpoint holds only the adapter.
  model_ = resume && !config().lora.enabled
               ? load_model(resume->string(), ModelInit::kPretrained, options)
               : load_model(config().model.path, config().model.init, options,
                            static_cast<uint64_t>(config().training.seed), quantize_options(config().model));
  if (config().precision.mode == PrecisionMode::kFp16Mixed)
    check_fp16_supported(model_->model_type(), config().model.path);
  if (!config().lora.enabled && has_quantized_layers(*model_))
    throw UsageError(config().model.path + " holds 4-bit linear layers (bitsandbytes' layout), which cannot be trained",
                     "train LoRA adapters on it: lora.enabled=true (QLoRA)");
  if (has_quantized_layers(*model_)) {
    // Frozen 4-bit weights dequantized once and kept, or on every use: the memory plan's choice. They are kept in
    // the dtype of the layers' inputs: bf16 with precision.mode=bf16, fp32 otherwise (autocast casts after them).
    const at::ScalarType compute = config().precision.mode == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat;
    std::string dequantized;
    const bool keep = choose_dequantized_base(config(), device,
                                              static_cast<double>(dequantized_weight_bytes(*model_, compute)),
                                              dequantized);
    keep_dequantized_weights(*model_, keep);
    spdlog::info("4-bit layers: {}", four_bit_kernels(*model_, device.type(), compute));
    spdlog::info("4-bit base weights: {}", dequantized);
  }
  model_->train(true);
  model_->for_each_parameter([](const std::string&, at::Tensor& p) {
    if (at::isFloatingType(p.scalar_type())) p.requires_grad_(true);
  });
  if (config().lora.enabled) apply_lora_for_training(resume);
  if (config().training.activation_checkpointing) apply_activation_checkpointing(*model_);
  family_ = model_->family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  if (tokenizer_->vocab_size() > model_->vocab_size())
    throw DataError("the tokenizer " + tokenizer_->source() + " has " + std::to_string(tokenizer_->vocab_size()) +
                        " tokens but the model's vocabulary has " + std::to_string(model_->vocab_size()),
                    "tokenizer.path must belong to model.path");
  pad_id_ = tokenizer_->pad_id().value_or(tokenizer_->eos_id().value_or(0));
}

// LoRA on the frozen base, restored from `resume` when resuming. The adapter's base is model.path; a randomly
// initialised base (the tiny demos) is saved to output_dir/base at the start of a run (a resumed run recreates the
// same one from training.seed), so the adapter has a base to be loaded onto.
void TextTask::apply_lora_for_training(const std::optional<fs::path>& resume) {
  lora_base_ = fs::absolute(config().model.path).lexically_normal().string();
  if (config().model.init == ModelInit::kRandom) {
    const fs::path saved = fs::absolute(output_dir() / "base").lexically_normal();
    if (primary() && (!resume || (!fs::exists(saved / kWeightsFileName) && !fs::exists(saved / kWeightsIndexName)))) {
      save_model(*model_, saved.string(), config().checkpoint.max_shard_size.bytes);
      copy_tokenizer_files_to(saved);
    }
    lora_base_ = saved.string();
  }
  lora_ = apply_lora(*model_, config().lora, static_cast<uint64_t>(config().training.seed));
  if (resume) load_lora_weights(*lora_, read_peft_adapter(resume->string()), resume->string());
  const auto& applied = lora_->config();
  std::string targets;
  for (const auto& t : applied.target_modules) targets += (targets.empty() ? "" : ",") + t;
  spdlog::info("LoRA r={} alpha={} (scale {:.4g}{}) dropout={} on {} layers ({}); base frozen{}; {} trainable parameters",
               applied.r, applied.alpha, lora_scaling(applied.alpha, applied.r, applied.rslora),
               applied.rslora ? ", rsLoRA" : "", applied.dropout, lora_->layers().size(), targets,
               applied.base_in_bf16 ? " in bf16" : "", lora_->trainable_parameters());
}

Evaluated TextTask::evaluate(int64_t step, EvaluationMicroBatch& micro) {
  auto validation = make_validation_loader(config(), *tokenizer_, family_, config().training.batch_size,
                                           distributed::record_share(world()));
  if (!validation) return {};
  const auto result = validation_loss(*model_, *validation, micro, config(), device_, pad_id_,
                                      step_->chunked_loss() ? step_->loss_chunk_size() : 0, world());
  if (!config().evaluation.generate)
    return {result.loss, [step, result](Reporter& reporter) { reporter.on_eval(step, result.loss, result.tokens); }};
  // Evaluation by generation over the validation examples, read again from the start.
  auto examples = make_validation_loader(config(), *tokenizer_, family_, config().training.batch_size,
                                         distributed::record_share(world()));
  const auto options = evaluation_generate_options(config(), model_->family(), config().model.path);
  const fs::path predictions = primary() ? predictions_path(output_dir(), step) : fs::path();
  const auto scores = evaluate_by_generation(*model_, *tokenizer_, *examples, config(), options, micro, world(),
                                             predictions);
  if (scores.skipped > 0 && primary())
    spdlog::warn("evaluation.generate: {} validation examples have no prompt (plain text records) and were not "
                 "generated for; prompt/completion records give a prompt and a reference", scores.skipped);
  return {result.loss,
          [step, result, scores, predictions](Reporter& reporter) {
            reporter.on_eval(step, result.loss, result.tokens);
            reporter.on_eval_generation(step, scores.metrics, scores.examples, predictions.string());
          },
          scores.metrics};
}

// Generations from evaluation.sample_prompts, logged as text: what the model has learned, at a glance.
void TextTask::after_evaluation(int64_t step, Reporter& reporter) {
  for (std::size_t i = 0; i < config().evaluation.sample_prompts.size(); ++i) {
    const auto& prompt = config().evaluation.sample_prompts[i];
    const auto ids = prompt_ids(*model_, *tokenizer_, prompt, config().tokenizer.add_eos);
    if (ids.empty()) continue;
    GenerateOptions options;
    options.max_new_tokens = config().evaluation.max_new_tokens;
    const auto generated = generate(*model_, at::tensor(ids, at::kLong).unsqueeze(0).to(device_), options);
    const std::vector<int32_t> out(generated.begin(), generated.end());
    reporter.on_sample(step, i, prompt, tokenizer_->decode(out));
  }
}

}  // namespace

ValidationLoss validation_loss(LanguageModel& model, DataLoader& loader, EvaluationMicroBatch& micro,
                               const Config& config, const c10::Device& device, int32_t pad_id,
                               int64_t loss_chunk_size, distributed::Communicator* world) {
  at::NoGradGuard no_grad;
  model.train(false);
  double loss_sum = 0;
  int64_t tokens = 0, batches = 0, local_examples = 0;
  // A rank out of memory at micro-batch 1 still reads the batches the others read: each rank tokenizes a share of
  // the records for all (RecordShare), so its exchanges must go on.
  while (auto batch = loader.next()) {
    std::span<const Example> examples(batch->examples);
    if (world) {  // this rank's share: disjoint, and together the whole batch
      const auto [first, count] = distributed::share_of(examples, world->rank(), world->world_size(), false);
      examples = examples.subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(count));
    }
    double part_sum = 0;
    int64_t part_tokens = 0;
    const bool fit = micro.run([&](int64_t size) {
      part_sum = 0;
      part_tokens = 0;
      for (const auto& [begin, count] : split_counts(static_cast<int64_t>(examples.size()), size)) {
        const auto collated = collate(
            examples.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count)), pad_id, device);
        const auto [sum, n] =
            evaluation_loss(model, {collated.input_ids, collated.attention_mask, collated.labels, {}}, loss_chunk_size);
        part_sum += sum;
        part_tokens += n;
      }
    });
    if (fit) {
      loss_sum += part_sum;
      tokens += part_tokens;
      local_examples += static_cast<int64_t>(examples.size());
    }
    if (config.evaluation.max_batches > 0 && ++batches >= config.evaluation.max_batches) break;
  }
  model.train(true);
  if (world) {  // the whole validation set's sum and count (exact in doubles up to 2^53 tokens)
    spdlog::debug("evaluation: rank {} of {} evaluated its share: {} examples, {} target tokens", world->rank(),
                  world->world_size(), local_examples, tokens);
    const auto sums = world->all_reduce_sum({loss_sum, static_cast<double>(tokens)}, "summing the validation loss");
    loss_sum = sums[0];
    tokens = static_cast<int64_t>(std::llround(sums[1]));
  }
  return {tokens ? loss_sum / static_cast<double>(tokens) : 0.0, tokens};
}

std::unique_ptr<Task> make_text_task(const TaskContext& context) { return std::make_unique<TextTask>(context); }

}  // namespace trainer
