// The image-classification task (ViT, CLIP vision classifiers): image folders or JSONL listings through the threaded
// image loader (seeded augmentation; each rank decodes only its share), full fine-tune, linear probe or LoRA with the
// head in full, trained by ImageTrainStep (train/tasks/image/image_step.h: cross-entropy per image of the effective batch),
// evaluated by the loss and top-1 / top-5 accuracy, saved as a Hugging Face directory (config.json with the classes,
// preprocessor_config.json) or as a PEFT adapter.
#include "train/tasks/image/image_task.h"

#include <cmath>
#include <filesystem>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/image_loader.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/policy.h"
#include "models/image/image_lora.h"
#include "models/image/image_model.h"
#include "train/activation_checkpointing.h"
#include "train/engine/loader_task.h"
#include "train/tasks/image/image_step.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

// A directory transformers loads: the model (config.json with the classes) and its preprocessing.
void save_classifier_dir(ImageClassifier& model, const data::ImageProcessorSpec& spec, const fs::path& dir) {
  save_image_classifier(model, dir.string());
  write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec));
}

class ImageTask final : public LoaderTask<ImageLoader, ImageBatch> {
 public:
  using LoaderTask::LoaderTask;

  Counted counted() const override { return {"images_seen", "images", "images", true}; }
  std::string model_type() const override { return model_->model_type(); }

  void check_settings(const TrainOptions& options) const override {
    if (options.merge)
      throw UsageError("--merge is not implemented for image classifiers",
                       "drop --merge; PEFT merges the adapter in final/: PeftModel.from_pretrained(<classifier>."
                       "from_pretrained(base), \"final\").merge_and_unload()");
    if (config().lora.enabled && config().training.linear_probe)
      throw UsageError("lora.enabled=true and training.linear_probe=true both choose what trains",
                       "pick one: LoRA adapters plus the head, or the head alone");
    if (config().training.micro_batch_tokens > 0 || config().data.packing)
      throw UsageError("training.micro_batch_tokens and data.packing count tokens; an image classifier's "
                       "micro-batch counts images",
                       "set training.micro_batch_tokens=0 and data.packing=false");
  }

  // The classes come from the training data; the model gets a head for them.
  nlohmann::json open_data() override {
    dataset_ = open_training_images(config(), {});
    if (dataset_->classes.size() < 2)
      throw DataError("data.train_files: " + std::to_string(dataset_->classes.size()) +
                          " class(es); a classifier needs at least 2",
                      "an image folder holds one subfolder per class; JSONL records need a \"label\"");
    return image_data_fingerprint(*dataset_);
  }
  // Other classes need another head: refused even with --allow-data-change.
  std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                        std::vector<std::string>& warnings) const override {
    (void)warnings;
    if (saved == current) return {};
    const std::string what = "the training images differ from those the checkpoint was trained on (" +
                             saved.at("records").dump() + " records in " + std::to_string(saved.at("classes").size()) +
                             " classes then, " + current.at("records").dump() + " in " +
                             std::to_string(current.at("classes").size()) + " now";
    if (saved.at("classes") != current.at("classes"))
      throw DataError(what + "; other classes)",
                      "restore the data, or start a new run (another checkpoint.output_dir) from the checkpoint's "
                      "weights: other classes need another head");
    return {what + "; same classes)"};
  }

  void build_model(const std::optional<fs::path>& resume, const c10::Device& device) override;
  Module& model() override { return *model_; }
  ShardableModule* shardable_model() override { return model_.get(); }
  Module* adapters() override { return lora_.get(); }
  // Fully sharded weights: the root (embeddings, final norm, head) gathered for an evaluation, each encoder layer for
  // its forward, as in training.
  bool evaluates_unit_by_unit() const override { return true; }
  Module& trainable() override { return lora_ ? static_cast<Module&>(*lora_) : *model_; }

  void open_loader() override { loader_ = make_image_train_loader(config(), dataset_, spec_, shard()); }

  void build_step(const StepParts& parts) override {
    ImageStepOptions options;
    options.device = parts.device;
    options.precision = config().precision.mode;
    options.max_grad_norm = config().training.max_grad_norm;
    options.max_retries = config().memory.max_retries;
    options.seed = static_cast<uint64_t>(config().training.seed);
    options.linear_probe = config().training.linear_probe;
    options.sync = parts.sync;
    options.scaler = parts.scaler;
    device_ = parts.device;
    sync_ = parts.sync;
    step_ = std::make_unique<ImageTrainStep>(*model_, parts.optimizer, parts.policy, options);
  }
  StepResult train_step(TaskBatch& batch, int64_t step, double lr) override {
    return step_->run(batch_of(batch), step, lr);
  }
  // With data parallelism a micro-batch never holds more than a rank's share of the effective batch.
  int64_t probe_limit() const override {
    const int64_t ranks = world() ? world()->world_size() : 1;
    return (config().training.batch_size + ranks - 1) / ranks;
  }
  // Images have one size: any pixels are the worst case.
  void probe(int64_t micro) override {
    const auto [height, width] = spec_.output_size();
    step_->forward_backward(at::zeros({micro, 3, height, width}), at::zeros({micro}, at::kLong), 0, 0, 1.0);
  }
  std::string probe_case(int64_t micro) const override { return std::to_string(micro) + " images"; }
  std::pair<std::string, std::string> probe_failure() const override {
    return {"not even one image fits for micro_batch_size=auto",
            "turn on training.activation_checkpointing, use a smaller image size, or raise memory.limit"};
  }
  std::vector<std::string> floor_suggestions() const override {
    std::vector<std::string> s = {"a smaller image size (preprocessor_config.json's size: activations grow with "
                                  "the number of patches)"};
    if (!config().training.linear_probe && !config().lora.enabled)
      s.push_back("training.linear_probe=true (only the head trains; the backbone keeps no activations)");
    return s;
  }
  void set_device(const c10::Device& device) override {
    device_ = device;
    step_->set_device(device);
  }

  Evaluated evaluate(int64_t step, EvaluationMicroBatch& micro) override;

  // What checkpoints and the final save hold: the model with its preprocessing, or with LoRA the PEFT adapter.
  void save(const fs::path& dir) override {
    if (lora_) {
      write_image_adapter(dir.string(), *lora_, *model_, lora_base_);
      write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
    } else {
      save_classifier_dir(*model_, spec_, dir);
    }
  }
  // Fully sharded weights (never with LoRA): the same directory, each weight fetched as its file is written; and what
  // a checkpoint whose weights are in the ranks' parts holds beside them.
  void save_streamed(const fs::path& dir, const std::function<at::Tensor(const std::string&)>& parameter,
                     bool write) override {
    save_image_classifier_streamed(*model_, dir.string(), parameter, write);
    if (write) write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  }
  void save_without_weights(const fs::path& dir) override {
    save_image_classifier_config(*model_, dir.string());
    write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  }

 private:
  void choose_trainable();
  void apply_lora_to_model(const std::optional<fs::path>& resume);
  // Data parallelism: this rank's share of each effective batch (none in one process).
  ImageShard shard() const {
    if (!world()) return {};
    return {world()->rank(), world()->world_size(),
            distributed::kept_counts_exchange(world(), "counting the decoded images of the effective batch")};
  }

  std::shared_ptr<const data::ImageDataset> dataset_;
  std::unique_ptr<ImageClassifier> model_;
  std::unique_ptr<ImageLoraAdapters> lora_;
  std::string lora_base_;  // the adapter's base_model_name_or_path
  data::ImageProcessorSpec spec_;
  std::unique_ptr<ImageTrainStep> step_;
  c10::Device device_{c10::kCPU};
  StepSync* sync_ = nullptr;
};

// Resuming a full fine-tune loads the checkpoint's weights; with LoRA the base always comes from model.path (a
// checkpoint holds the adapter and the head). A linear probe freezes everything but the head.
void ImageTask::build_model(const std::optional<fs::path>& resume, const c10::Device& device) {
  if (config().model.quantize != QuantizeMode::kNone)
    throw UsageError("model.quantize: 4-bit layers are built for the text models (T5, Llama, Qwen2, Mistral), not for "
                     "the image models (ViT, CLIP)",
                     "set model.quantize=none (LoRA on ViT and CLIP trains on the full-precision base)");
  device_ = device;
  const auto options = at::TensorOptions()
                           .dtype(config().precision.mode == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat)
                           .device(device);
  const auto seed = static_cast<uint64_t>(config().training.seed);
  model_ = resume && !config().lora.enabled
               ? load_image_classifier(resume->string(), ModelInit::kPretrained, options, seed, dataset_->classes)
               : load_image_classifier(config().model.path, config().model.init, options, seed, dataset_->classes);
  spec_ = image_processor_for(config().model.path, *model_);
  model_->train(true);
  if (config().lora.enabled) apply_lora_to_model(resume);
  else choose_trainable();
}

// Full fine-tune, or with training.linear_probe the head alone.
void ImageTask::choose_trainable() {
  const std::string head = model_->head_prefix();
  int64_t trainable = 0;
  model_->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    const bool train = !config().training.linear_probe || name.starts_with(head);
    p.requires_grad_(train);
    if (train) trainable += p.numel();
  });
  if (config().training.activation_checkpointing && !config().training.linear_probe)
    model_->set_block_runner(activation_checkpointing_runner());
  spdlog::info("{} classes ({}{}); {} images for training, each {} x {} pixels; {}", dataset_->classes.size(),
               dataset_->classes.front(), dataset_->classes.size() > 1 ? ", ..." : "", dataset_->records.size(),
               spec_.output_size().second, spec_.output_size().first,
               config().training.linear_probe ? fmt::format("linear probe: the backbone is frozen, {} parameters of "
                                                            "the head ({}) train", trainable, head)
                                              : std::string("full fine-tune"));
}

// LoRA adapters on the frozen backbone, the head trained in full; saved as a PEFT adapter. A randomly initialised
// base (the demo) or a CLIPVisionModel tower is saved to output_dir/base first as a classifier (a resume finds it
// there, or recreates the same one from training.seed), so the adapter has a base that transformers loads.
void ImageTask::apply_lora_to_model(const std::optional<fs::path>& resume) {
  lora_base_ = fs::absolute(config().model.path).lexically_normal().string();
  // A CLIPVisionModel directory holds the tower alone: CLIPForImageClassification.from_pretrained cannot read its
  // config, so the adapter gets the classifier as its base, saved like a random one.
  const bool tower_only =
      config().model.init != ModelInit::kRandom &&
      read_json_file((fs::path(config().model.path) / "config.json").string()).value("model_type", "") ==
          "clip_vision_model";
  if (config().model.init == ModelInit::kRandom || tower_only) {
    const fs::path saved = fs::absolute(output_dir() / "base").lexically_normal();
    if (primary() && !fs::exists(saved / "model.safetensors")) save_classifier_dir(*model_, spec_, saved);
    lora_base_ = saved.string();
  }
  lora_ = apply_image_lora(*model_, config().lora, static_cast<uint64_t>(config().training.seed));
  if (resume) load_image_adapter(resume->string(), *lora_, *model_);
  if (config().training.activation_checkpointing) model_->set_block_runner(activation_checkpointing_runner());
  std::string targets;
  for (const auto& t : lora_->config().target_modules) targets += (targets.empty() ? "" : ",") + t;
  spdlog::info("{} classes; {} images for training, each {} x {} pixels; LoRA r={} alpha={} on {} layers ({}) and "
               "the head ({}) in full; base frozen", dataset_->classes.size(), dataset_->records.size(),
               spec_.output_size().second, spec_.output_size().first, lora_->config().r, lora_->config().alpha,
               lora_->layers().size(), targets, lora_->head_module());
}

// Mean cross-entropy, top-1 and top-5 accuracy over the validation images. With data parallelism the loader gives
// this rank its share of every validation batch, and the sums and the image count are summed over the ranks: one
// process's metrics.
Evaluated ImageTask::evaluate(int64_t step, EvaluationMicroBatch& micro) {
  auto validation = make_image_validation_loader(config(), dataset_->classes, spec_, config().training.batch_size,
                                                 shard());
  if (!validation) return {};
  at::NoGradGuard no_grad;
  model_->train(false);
  double loss_sum = 0, top1 = 0, top5 = 0;
  int64_t images = 0, batches = 0;
  while (auto batch = validation->next()) {
    const at::Tensor pixels =
        at::from_blob(batch->pixels.data(), {batch->size(), 3, batch->height, batch->width}, at::kFloat);
    const at::Tensor labels = at::from_blob(batch->labels.data(), {batch->size()}, at::kLong);
    double part_loss = 0, part_top1 = 0, part_top5 = 0;
    const bool fit = micro.run([&](int64_t size) {
      part_loss = part_top1 = part_top5 = 0;
      const auto parts = split_counts(batch->size(), size);
      // Fully sharded weights: every forward is a collective; as many as the rank with the most (agreed first), the
      // others one black image that counts nothing.
      const auto mine = static_cast<int64_t>(parts.size());
      const int64_t passes = sync_ && sync_->shards_weights() ? sync_->agree_passes(mine) : mine;
      for (const auto& [begin, count] : parts) {
        const at::Tensor logits =
            image_logits(*model_, pixels.narrow(0, begin, count), device_, config().precision.mode).cpu();
        const at::Tensor target = labels.narrow(0, begin, count);
        part_loss += at::cross_entropy_loss(logits, target, {}, at::Reduction::Sum).item<double>();
        const int64_t k = std::min<int64_t>(5, logits.size(1));
        const at::Tensor best = std::get<1>(logits.topk(k, 1));  // (B, k)
        const at::Tensor hit = best.eq(target.unsqueeze(1));
        part_top1 += hit.narrow(1, 0, 1).sum().item<double>();
        part_top5 += hit.any(1).sum().item<double>();
      }
      for (int64_t i = mine; i < passes; ++i)
        (void)image_logits(*model_, at::zeros({1, 3, batch->height, batch->width}), device_, config().precision.mode);
    });
    if (fit) {
      loss_sum += part_loss;
      top1 += part_top1;
      top5 += part_top5;
      images += batch->size();
    }
    if (config().evaluation.max_batches > 0 && ++batches >= config().evaluation.max_batches) break;
  }
  model_->train(true);
  if (world()) {
    spdlog::debug("evaluation: rank {} of {} evaluated its share: {} images", world()->rank(), world()->world_size(),
                  images);
    const auto sums = world()->all_reduce_sum(std::vector<double>{loss_sum, top1, top5, static_cast<double>(images)},
                                              "summing the validation metrics");
    loss_sum = sums[0];
    top1 = sums[1];
    top5 = sums[2];
    images = static_cast<int64_t>(std::llround(sums[3]));
  }
  if (images == 0) return {};
  const auto n = static_cast<double>(images);
  const double loss = loss_sum / n;
  top1 /= n;
  top5 /= n;
  return {loss, [=](Reporter& reporter) { reporter.on_eval_accuracy(step, loss, top1, top5, images); }};
}

}  // namespace

std::unique_ptr<Task> make_image_task(const TaskContext& context) { return std::make_unique<ImageTask>(context); }

}  // namespace trainer
