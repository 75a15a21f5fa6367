// Image-classification training (see image_trainer.h).
#include "train/image_trainer.h"

#include <chrono>
#include <cstdio>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <ostream>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "data/image_loader.h"
#include "distributed/checkpoint_parts.h"
#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "log/reporter.h"
#include "memory/cpu_budget.h"
#include "memory/cuda_extras.h"
#include "memory/policy.h"
#include "models/image_lora.h"
#include "models/image_model.h"
#include "train/checkpoint_dir.h"
#include "train/checkpointing_runner.h"
#include "train/grad_scaler.h"
#include "train/image_step.h"
#include "train/optimizer.h"
#include "train/resume_check.h"
#include "train/retention.h"
#include "train/signals.h"
#include "trainer/device.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kImageCheckpointVersion = 1;

// A directory transformers loads: the model (config.json with the classes) and its preprocessing.
void save_classifier_dir(ImageClassifier& model, const data::ImageProcessorSpec& spec, const fs::path& dir) {
  save_image_classifier(model, dir.string());
  write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec));
}


struct Evaluation {
  double loss = 0, top1 = 0, top5 = 0;
  int64_t images = 0;
};

// Mean cross-entropy, top-1 and top-5 accuracy over the validation images, in micro-batches of `micro` (halved on
// out-of-memory; the training policy is never touched). With data parallelism the loader gives this rank its share of
// every validation batch, and the sums and the image count are summed over the ranks: one process's metrics.
Evaluation evaluate_images(ImageClassifier& model, ImageLoader& loader, int64_t& micro, const Config& config,
                           const c10::Device& device, distributed::Communicator* world) {
  at::NoGradGuard no_grad;
  model.train(false);
  Evaluation result;
  double loss_sum = 0, top1 = 0, top5 = 0;
  int64_t batches = 0;
  while (auto batch = loader.next()) {
    const at::Tensor pixels =
        at::from_blob(batch->pixels.data(), {batch->size(), 3, batch->height, batch->width}, at::kFloat);
    const at::Tensor labels = at::from_blob(batch->labels.data(), {batch->size()}, at::kLong);
    for (;;) {
      try {
        double part_loss = 0, part_top1 = 0, part_top5 = 0;
        for (const auto& [begin, count] : split_counts(batch->size(), std::max<int64_t>(1, micro))) {
          const at::Tensor logits =
              image_logits(model, pixels.narrow(0, begin, count), device, config.precision.mode).cpu();
          const at::Tensor target = labels.narrow(0, begin, count);
          part_loss += at::cross_entropy_loss(logits, target, {}, at::Reduction::Sum).item<double>();
          const int64_t k = std::min<int64_t>(5, logits.size(1));
          const at::Tensor best = std::get<1>(logits.topk(k, 1));  // (B, k)
          const at::Tensor hit = best.eq(target.unsqueeze(1));
          part_top1 += hit.narrow(1, 0, 1).sum().item<double>();
          part_top5 += hit.any(1).sum().item<double>();
        }
        loss_sum += part_loss;
        top1 += part_top1;
        top5 += part_top5;
        result.images += batch->size();
        break;
      } catch (const c10::OutOfMemoryError&) {
        release_cached_memory();
        if (micro <= 1) throw;
        spdlog::warn("evaluation: out of memory; evaluation micro-batch {} -> {}", micro, micro / 2);
        micro /= 2;
      }
    }
    if (config.evaluation.max_batches > 0 && ++batches >= config.evaluation.max_batches) break;
  }
  model.train(true);
  if (world) {
    spdlog::debug("evaluation: rank {} of {} evaluated its share: {} images", world->rank(), world->world_size(),
                  result.images);
    const auto sums = world->all_reduce_sum(std::vector<double>{loss_sum, top1, top5, static_cast<double>(result.images)},
                                            "summing the validation metrics");
    loss_sum = sums[0];
    top1 = sums[1];
    top5 = sums[2];
    result.images = static_cast<int64_t>(std::llround(sums[3]));
  }
  if (result.images > 0) {
    const auto n = static_cast<double>(result.images);
    result.loss = loss_sum / n;
    result.top1 = top1 / n;
    result.top5 = top5 / n;
  }
  return result;
}

// One image-classification run over explicit state, in the phases of the text run (trainer.cpp). With data
// parallelism (`world`) every rank runs the same phases on its share of each effective batch; rank 0 alone writes
// files and reports.
class ImageTrainingRun {
 public:
  ImageTrainingRun(const Config& config, const c10::Device& device, const TrainOptions& options, Reporter& reporter,
                   distributed::Communicator* world)
      : config_(config), device_(device), options_(options), reporter_(reporter), world_(world),
        primary_(!world || world->rank() == 0), output_dir_(config.checkpoint.output_dir) {}

  void set_up();
  int loop();
  int finish();

 private:
  void build_model();
  void choose_trainable();
  void apply_lora_to_model();
  void save_trained(const fs::path& dir);
  void restore_or_probe();
  bool train_one_step();
  int agreed_stop_signal();
  // Data parallelism: this rank's share of each effective batch (none in one process).
  ImageShard shard() const;
  void evaluate();
  std::string checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state);

  const Config& config_;
  c10::Device device_;
  const TrainOptions& options_;
  Reporter& reporter_;
  distributed::Communicator* world_;
  const bool primary_;
  const fs::path output_dir_;

  std::optional<fs::path> resume_dir_;
  nlohmann::json resume_state_;
  std::shared_ptr<const data::ImageDataset> dataset_;
  nlohmann::json fingerprint_;  // image_data_fingerprint of the training data
  std::unique_ptr<ImageClassifier> model_;
  std::unique_ptr<ImageLoraAdapters> lora_;
  std::string lora_base_;  // the adapter's base_model_name_or_path
  data::ImageProcessorSpec spec_;
  std::unique_ptr<ImageLoader> loader_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<MemoryPolicy> policy_;
  std::unique_ptr<ImageTrainStep> step_;
  std::unique_ptr<distributed::DataParallel> data_parallel_;
  std::unique_ptr<GradScaler> scaler_;  // precision.mode=fp16-mixed
  int64_t skipped_at_start_ = 0;        // the scaler's skipped steps when this process started (resume)
  std::unique_ptr<CheckpointRetention> retention_;
  int64_t total_steps_ = 0, step_index_ = 0, images_seen_ = 0, eval_micro_ = 1;
  double last_eval_ = std::nan("");
  int64_t last_eval_step_ = -1;
  std::optional<int64_t> on_disk_step_;
};

void ImageTrainingRun::set_up() {
  if (options_.merge)
    throw UsageError("--merge is not implemented for image classifiers",
                     "drop --merge; PEFT merges the adapter in final/: PeftModel.from_pretrained(<classifier>."
                     "from_pretrained(base), \"final\").merge_and_unload()");
  if (config_.lora.enabled && config_.training.linear_probe)
    throw UsageError("lora.enabled=true and training.linear_probe=true both choose what trains",
                     "pick one: LoRA adapters plus the head, or the head alone");
  if (config_.training.micro_batch_tokens > 0 || config_.data.packing)
    throw UsageError("training.micro_batch_tokens and data.packing count tokens; an image classifier's micro-batch "
                     "counts images",
                     "set training.micro_batch_tokens=0 and data.packing=false");
  if (!options_.resume_from.empty()) {
    resume_dir_ = fs::path(options_.resume_from);
    if (!fs::exists(*resume_dir_ / "COMPLETE"))
      throw DataError(options_.resume_from + " is not a complete checkpoint (no COMPLETE marker)",
                      "resume from a checkpoint-N directory that trainer finished writing");
  } else if (options_.resume || options_.resume_if_present) {
    resume_dir_ = newest_complete_checkpoint(output_dir_);
    if (!resume_dir_ && !options_.resume_if_present)
      throw DataError("--resume: no complete checkpoint in " + config_.checkpoint.output_dir,
                      "start without --resume, or point checkpoint.output_dir at the run to continue");
  }
  if (resume_dir_) {
    resume_state_ = read_json_file((*resume_dir_ / "train_state.json").string());
    if (resume_state_.value("version", 0) != kImageCheckpointVersion || resume_state_.value("task", "") != "image")
      throw DataError(resume_dir_->string() + " is not an image-classification checkpoint of this trainer",
                      "resume from a checkpoint this image run wrote");
    // The settings that would make it another run are refused (unless --allow-config-change), as for text.
    check_resume_config(resume_state_.at("config"), config_, resume_dir_->string(), options_.allow_config_change);
  }
  build_model();
  loader_ = make_image_train_loader(config_, dataset_, spec_, shard());
  const auto per_epoch = static_cast<int64_t>((loader_->examples_per_epoch() +
                                               static_cast<uint64_t>(config_.training.batch_size) - 1) /
                                              static_cast<uint64_t>(config_.training.batch_size));
  total_steps_ = config_.training.max_steps > 0 ? config_.training.max_steps : per_epoch * config_.training.epochs;
  Module& trainable = lora_ ? static_cast<Module&>(*lora_) : *model_;
  // distributed.shard_optimizer (ZeRO-1): this rank's state covers its share of the parameters only.
  OptimizerShard optimizer_shard;
  if (world_ && config_.distributed.shard_optimizer) optimizer_shard = {world_->rank(), world_->world_size()};
  optimizer_ = make_optimizer(trainable, config_.optimizer, static_cast<uint64_t>(config_.training.seed),
                              optimizer_shard);
  policy_ = std::make_unique<MemoryPolicy>(config_.memory, config_.training);
  ImageStepOptions step_options;
  step_options.device = device_;
  step_options.precision = config_.precision.mode;
  step_options.max_grad_norm = config_.training.max_grad_norm;
  step_options.max_retries = config_.memory.max_retries;
  step_options.seed = static_cast<uint64_t>(config_.training.seed);
  step_options.linear_probe = config_.training.linear_probe;
  if (world_) {
    // Their gradients are summed once per optimizer step.
    data_parallel_ = distributed::make_data_parallel(
        *world_, trainable, static_cast<int64_t>(config_.distributed.bucket_size.bytes),
        optimizer_shard.world > 1 ? optimizer_->owners() : std::vector<int>{});
    step_options.sync = data_parallel_.get();
  }
  if (config_.precision.mode == PrecisionMode::kFp16Mixed) {
    GradScalerOptions scaling;
    scaling.init_scale = config_.precision.initial_loss_scale;
    scaling.growth_interval = config_.precision.loss_scale_growth_interval;
    scaler_ = std::make_unique<GradScaler>(scaling);
    step_options.scaler = scaler_.get();
  }
  step_ = std::make_unique<ImageTrainStep>(*model_, *optimizer_, *policy_, step_options);
  restore_or_probe();
  eval_micro_ = config_.evaluation.micro_batch_size.is_auto ? policy_->micro_batch()
                                                            : config_.evaluation.micro_batch_size.value;
  fs::create_directories(output_dir_);
  retention_ = std::make_unique<CheckpointRetention>(output_dir_, config_.checkpoint.keep_last,
                                                     config_.checkpoint.keep_best);
  if (primary_) retention_->start(resume_dir_ ? std::optional<int64_t>(step_index_) : std::nullopt);
  std::error_code same_error;
  if (resume_dir_ &&
      fs::equivalent(*resume_dir_, output_dir_ / ("checkpoint-" + std::to_string(step_index_)), same_error))
    on_disk_step_ = step_index_;
}

// The classes come from the training data; the model gets a head for them (a pretrained head for the same classes
// is kept). Resuming loads the checkpoint's weights. A linear probe freezes everything but the head.
void ImageTrainingRun::build_model() {
  dataset_ = open_training_images(config_, {});
  if (dataset_->classes.size() < 2)
    throw DataError("data.train_files: " + std::to_string(dataset_->classes.size()) +
                        " class(es); a classifier needs at least 2",
                    "an image folder holds one subfolder per class; JSONL records need a \"label\"");
  fingerprint_ = image_data_fingerprint(*dataset_);
  if (resume_dir_ && resume_state_.contains("data_fingerprint") && resume_state_.at("data_fingerprint") != fingerprint_) {
    const auto& saved = resume_state_.at("data_fingerprint");
    const std::string what = "the training images differ from those " + resume_dir_->string() + " was trained on (" +
                             saved.at("records").dump() + " records in " +
                             std::to_string(saved.at("classes").size()) + " classes then, " +
                             std::to_string(dataset_->records.size()) + " in " +
                             std::to_string(dataset_->classes.size()) + " now" +
                             (saved.at("classes") == fingerprint_.at("classes") ? "; same classes" : "; other classes") +
                             ")";
    if (!options_.allow_data_change || saved.at("classes") != fingerprint_.at("classes"))
      throw DataError(what, saved.at("classes") != fingerprint_.at("classes")
                                ? "restore the data, or start a new run (another checkpoint.output_dir) from the "
                                  "checkpoint's weights: other classes need another head"
                                : "restore the data, or pass --allow-data-change to continue on the new images (the "
                                  "rest of this epoch follows the new order: some images may come twice or not at "
                                  "all)");
    spdlog::warn("{}: continuing (--allow-data-change)", what);
  }
  const auto options = at::TensorOptions()
                           .dtype(config_.precision.mode == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat)
                           .device(device_);
  // With LoRA the base always comes from model.path (a checkpoint holds the adapter and the head).
  model_ = resume_dir_ && !config_.lora.enabled
                       ? load_image_classifier(resume_dir_->string(), ModelInit::kPretrained, options,
                                               static_cast<uint64_t>(config_.training.seed), dataset_->classes)
                       : load_image_classifier(config_.model.path, config_.model.init, options,
                                               static_cast<uint64_t>(config_.training.seed), dataset_->classes);
  spec_ = image_processor_for(config_.model.path, *model_);
  model_->train(true);
  if (config_.lora.enabled) {
    apply_lora_to_model();
  } else {
    choose_trainable();
  }
  if (world_) {  // rank 0's weights on every rank
    std::vector<at::Tensor> all;
    model_->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    if (lora_) lora_->for_each_parameter([&](const std::string&, at::Tensor& p) { all.push_back(p); });
    world_->broadcast(all);
  }
}

// Full fine-tune, or with training.linear_probe the head alone.
void ImageTrainingRun::choose_trainable() {
  const std::string head = model_->head_prefix();
  int64_t trainable = 0;
  model_->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    const bool train = !config_.training.linear_probe || name.starts_with(head);
    p.requires_grad_(train);
    if (train) trainable += p.numel();
  });
  if (config_.training.activation_checkpointing && !config_.training.linear_probe)
    model_->set_block_runner(activation_checkpointing_runner());
  spdlog::info("{} classes ({}{}); {} images for training, each {} x {} pixels; {}", dataset_->classes.size(),
               dataset_->classes.front(), dataset_->classes.size() > 1 ? ", ..." : "", dataset_->records.size(),
               spec_.output_size().second, spec_.output_size().first,
               config_.training.linear_probe ? fmt::format("linear probe: the backbone is frozen, {} parameters of "
                                                           "the head ({}) train", trainable, head)
                                             : std::string("full fine-tune"));
}

// LoRA adapters on the frozen backbone, the head trained in full; saved as a PEFT adapter. A randomly initialised
// base (the demo) or a CLIPVisionModel tower is saved to output_dir/base first as a classifier (a resume finds it
// there, or recreates the same one from training.seed), so the adapter has a base that transformers loads.
void ImageTrainingRun::apply_lora_to_model() {
  lora_base_ = fs::absolute(config_.model.path).lexically_normal().string();
  // A CLIPVisionModel directory holds the tower alone: CLIPForImageClassification.from_pretrained cannot read its
  // config, so the adapter gets the classifier as its base, saved like a random one.
  const bool tower_only =
      config_.model.init != ModelInit::kRandom &&
      read_json_file((fs::path(config_.model.path) / "config.json").string()).value("model_type", "") ==
          "clip_vision_model";
  if (config_.model.init == ModelInit::kRandom || tower_only) {
    const fs::path saved = fs::absolute(output_dir_ / "base").lexically_normal();
    if (primary_ && !fs::exists(saved / "model.safetensors")) save_classifier_dir(*model_, spec_, saved);
    lora_base_ = saved.string();
  }
  lora_ = apply_image_lora(*model_, config_.lora, static_cast<uint64_t>(config_.training.seed));
  if (resume_dir_) load_image_adapter(resume_dir_->string(), *lora_, *model_);
  if (config_.training.activation_checkpointing) model_->set_block_runner(activation_checkpointing_runner());
  std::string targets;
  for (const auto& t : lora_->config().target_modules) targets += (targets.empty() ? "" : ",") + t;
  spdlog::info("{} classes; {} images for training, each {} x {} pixels; LoRA r={} alpha={} on {} layers ({}) and "
               "the head ({}) in full; base frozen", dataset_->classes.size(), dataset_->records.size(),
               spec_.output_size().second, spec_.output_size().first, lora_->config().r, lora_->config().alpha,
               lora_->layers().size(), targets, lora_->head_module());
}

// What checkpoints and the final save hold: the model with its preprocessing, or with LoRA the PEFT adapter.
void ImageTrainingRun::save_trained(const fs::path& dir) {
  if (lora_) {
    write_image_adapter(dir.string(), *lora_, *model_, lora_base_);
    write_text_file((dir / "preprocessor_config.json").string(), data::image_processor_json(spec_));
  } else {
    save_classifier_dir(*model_, spec_, dir);
  }
}

void ImageTrainingRun::restore_or_probe() {
  if (resume_dir_) {
    // optimizer.safetensors, or the parts a sharded run wrote (any world size then and now).
    distributed::load_optimizer_parts(*resume_dir_, resume_state_, *optimizer_);
    loader_->restore(cursor_from_json(resume_state_.at("data_cursor")));
    policy_->restore(resume_state_.at("memory_policy"));
    // fp16-mixed: the loss scale and its growth tracker, so the resumed run scales and skips as the uninterrupted one.
    if (scaler_ && resume_state_.contains("loss_scaler")) {
      scaler_->restore(resume_state_.at("loss_scaler"), (*resume_dir_ / "train_state.json").string());
      skipped_at_start_ = scaler_->skipped_steps();
    } else if (scaler_) {
      spdlog::info("fp16-mixed: {} holds no loss scale (another precision mode); starting at {}",
                   resume_dir_->string(), scaler_->scale());
    }
    step_index_ = resume_state_.at("step").get<int64_t>();
    images_seen_ = resume_state_.at("images_seen").get<int64_t>();
    spdlog::info("resuming from {} at step {} (micro-batch {})", resume_dir_->string(), step_index_,
                 policy_->micro_batch());
    return;
  }
  if (!config_.training.micro_batch_size.is_auto) return;
  // micro_batch_size=auto: the largest micro-batch whose forward and backward fit and leave the safety margin
  // (doubling, then bisecting), as for text; images have one size, so any pixels are the worst case.
  const int64_t height = spec_.output_size().first, width = spec_.output_size().second;
  // With data parallelism a micro-batch never holds more than a rank's share of the effective batch.
  const int64_t batch_size = world_ ? (config_.training.batch_size + world_->world_size() - 1) / world_->world_size()
                                    : config_.training.batch_size;
  const int64_t capacity = config_.memory.limit.bytes > 0 ? static_cast<int64_t>(config_.memory.limit.bytes)
                           : device_.is_cpu()           ? 0
                                                        : static_cast<int64_t>(at::accelerator::getMemoryInfo(device_.index()).second);
  const double allowed = static_cast<double>(capacity) * (1.0 - config_.memory.auto_safety_margin);
  auto fits = [&](int64_t n) {
    reset_peak(device_);
    try {
      step_->forward_backward(at::zeros({n, 3, height, width}), at::zeros({n}, at::kLong), 0, 0, 1.0);
      optimizer_->zero_grad();
    } catch (const c10::OutOfMemoryError&) {
      optimizer_->zero_grad();
      release_cached_memory();
      spdlog::info("micro_batch_size=auto: {} does not fit (out of memory)", n);
      return false;
    }
    const auto peak = static_cast<double>(memory_now(device_).peak);
    return capacity == 0 || peak <= allowed;
  };
  int64_t good = largest_that_fits(batch_size, fits);
  if (world_) good = -world_->all_reduce_max({-good})[0];  // what fits on every rank
  if (good == 0)
    throw OutOfMemoryAtFloor("not even one image fits for micro_batch_size=auto",
                             "turn on training.activation_checkpointing, use a smaller image size, or raise "
                             "memory.limit");
  policy_->set_micro_batch(good, 0, "micro_batch_size=auto probe");
}

int ImageTrainingRun::loop() {
  reset_peak(device_);
  reporter_.on_start({model_->model_type(), count_parameters(*model_), optimizer_->trainable_parameters(),
                      total_steps_, policy_->micro_batch(), step_index_, images_seen_,
                      resume_dir_ ? resume_dir_->string() : ""});
  while (step_index_ < total_steps_) {
    if (const int signal = agreed_stop_signal()) {
      reporter_.on_stopped(signal, step_index_, checkpoint(loader_->cursor(), policy_->state()));
      return signal == SIGINT ? kExitInterrupted : kExitOk;
    }
    if (!train_one_step()) break;
  }
  return -1;
}

// A signal on any rank stops every rank after the same step.
int ImageTrainingRun::agreed_stop_signal() {
  const int signal = stop_requested();
  if (!world_) return signal;
  return static_cast<int>(world_->all_reduce_max({signal})[0]);
}

ImageShard ImageTrainingRun::shard() const {
  if (!world_) return {};
  return {world_->rank(), world_->world_size(),
          distributed::kept_counts_exchange(world_, "counting the decoded images of the effective batch")};
}

bool ImageTrainingRun::train_one_step() {
  const auto start = Clock::now();
  const LoaderCursor cursor_before = loader_->cursor();
  const nlohmann::json policy_before = policy_->state();
  auto batch = loader_->next();
  if (!batch) return false;
  const double lr = scheduled_lr(config_.scheduler, config_.optimizer.lr, step_index_, total_steps_);
  StepResult result;
  try {
    result = step_->run(*batch, step_index_ + 1, lr);
  } catch (const OutOfMemoryAtFloor& e) {
    const auto saved = checkpoint(cursor_before, policy_before);
    throw OutOfMemoryAtFloor(std::string(e.what()) + "\nthe last completed step (" + std::to_string(step_index_) +
                                 ") is saved in " + saved + "; after changing the config, continue with --resume-from " +
                                 saved,
                             e.hint());
  }
  ++step_index_;
  images_seen_ += result.target_tokens;
  const auto memory = memory_now(device_);
  reporter_.on_step({step_index_, result.loss, lr, result.grad_norm, result.target_tokens, images_seen_,
                     result.micro_batch, result.micro_steps, result.retries,
                     static_cast<int64_t>(policy_->adaptations().size()), 0, memory.allocated, memory.peak,
                     std::chrono::duration<double>(Clock::now() - start).count(),
                     scaler_ ? std::optional(LossScaling{result.loss_scale, result.skipped, scaler_->skipped_steps()})
                             : std::nullopt});
  const bool eval_now = config_.evaluation.every_steps > 0 && step_index_ % config_.evaluation.every_steps == 0;
  if (eval_now || step_index_ == total_steps_) evaluate();
  if (config_.checkpoint.every_steps > 0 && step_index_ % config_.checkpoint.every_steps == 0 &&
      step_index_ < total_steps_)
    checkpoint(loader_->cursor(), policy_->state());
  return true;
}

void ImageTrainingRun::evaluate() {
  auto validation =
      make_image_validation_loader(config_, dataset_->classes, spec_, config_.training.batch_size, shard());
  if (!validation) return;
  const auto eval = evaluate_images(*model_, *validation, eval_micro_, config_, device_, world_);
  last_eval_ = eval.loss;
  last_eval_step_ = step_index_;
  reporter_.on_eval_accuracy(step_index_, eval.loss, eval.top1, eval.top5, eval.images);
}

// checkpoint-N: the model as a Hugging Face directory, the optimizer state and the train state, written to a
// temporary directory and renamed into place (a crash leaves the previous one whole); COMPLETE is written last.
std::string ImageTrainingRun::checkpoint(const LoaderCursor& cursor, const nlohmann::json& policy_state) {
  nlohmann::json state = {{"version", kImageCheckpointVersion},
                          {"task", "image"},
                          {"step", step_index_},
                          {"optimizer_steps", optimizer_->steps()},
                          {"images_seen", images_seen_},
                          {"data_cursor", cursor_to_json(cursor)},
                          {"memory_policy", policy_state},
                          {"config", nlohmann::json::parse(config_to_json(config_))},
                          {"data_fingerprint", fingerprint_}};
  if (scaler_) state["loss_scaler"] = scaler_->state();
  Module& trained = lora_ ? static_cast<Module&>(*lora_) : *model_;
  // Rank 0 writes it; with sharded optimizer state every rank writes its part (distributed/checkpoint_parts.h).
  const fs::path final_dir = distributed::write_checkpoint_on_ranks(
      output_dir_, step_index_, on_disk_step_ == step_index_, [&](const fs::path& dir) { save_trained(dir); }, trained,
      *optimizer_, std::move(state), world_);
  on_disk_step_ = step_index_;
  if (!primary_) return final_dir.string();
  retention_->on_checkpoint(step_index_,
                            last_eval_step_ == step_index_ ? std::optional<double>(last_eval_) : std::nullopt);
  reporter_.on_checkpoint(step_index_, final_dir.string());
  return final_dir.string();
}

int ImageTrainingRun::finish() {
  checkpoint(loader_->cursor(), policy_->state());
  if (primary_ && config_.checkpoint.save_final) save_trained(output_dir_ / "final");
  RunSummary summary;
  summary.counted = "images";
  summary.counted_rate = "images";
  summary.steps = step_index_;
  summary.tokens_seen = images_seen_;
  summary.data = loader_->stats();
  summary.memory_peak = memory_now(device_).peak;
  summary.adaptations = policy_->adaptations();
  summary.escalations = policy_->escalations();
  if (scaler_)
    summary.loss_scaling = RunSummary::LossScalingSummary{scaler_->skipped_steps(),
                                                          scaler_->skipped_steps() - skipped_at_start_, scaler_->scale()};
  if (config_.checkpoint.save_final) summary.model_dir = (output_dir_ / "final").string();
  summary.model_is_adapter = lora_ != nullptr;
  if (const auto& best = retention_->best()) {
    summary.best_checkpoint = best->path.string();
    summary.best_eval_loss = best->eval_loss;
  }
  distributed::add_rank_figures(world_, summary);
  reporter_.on_finish(std::move(summary));
  return kExitOk;
}

}  // namespace

int train_image_classifier(const Config& config, const ResolvedDevice& resolved, const TrainOptions& options,
                           std::ostream& out, distributed::Communicator* world) {
  install_stop_handlers();
  if (config.memory.limit.bytes > 0) {
    if (resolved.device.is_cpu()) set_cpu_budget_limit(static_cast<int64_t>(config.memory.limit.bytes));
    else cap_device_memory(resolved.device, static_cast<int64_t>(config.memory.limit.bytes));
  }
  // Rank 0 alone prints the progress and writes metrics and TensorBoard; the others log warnings.
  std::ostream null_stream(nullptr);
  const bool primary = !world || world->rank() == 0;
  Reporter reporter(config, primary ? out : null_stream, primary);
  try {
    ImageTrainingRun run(config, resolved.device, options, reporter, world);
    run.set_up();
    int code = run.loop();
    if (code < 0) code = run.finish();
    if (world) world->barrier();  // rank 0, which hosts the rendezvous, leaves last
    return code;
  } catch (const std::exception& error) {
    reporter.on_failure(error);
    throw;
  }
}

}  // namespace trainer
