// The memory-adaptive image-classification step (see image_step.h).
#include "train/tasks/image/image_step.h"

#include <algorithm>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "models/dropout.h"
#include "train/activation_checkpointing.h"
#include "train/precision.h"

namespace trainer {

at::Tensor ImageTrainStep::summed_loss(const at::Tensor& pixels, const at::Tensor& labels, int64_t first_image,
                                       int64_t step) {
  const int64_t count = labels.size(0);
  const DropoutScope dropout(options_.seed, step, first_image, count, options_.device);
  at::Tensor loss_sum;
  {
    const auto dtype = autocast_dtype(options_.precision);
    AutocastScope autocast(dtype.has_value(), options_.device.type(), dtype.value_or(at::kBFloat16));
    // bf16 weights (precision.mode=bf16) take bf16 pixels; autocast handles bf16-mixed and fp16-mixed.
    const at::Tensor input =
        pixels.to(options_.device, options_.precision == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat);
    at::Tensor logits;
    if (options_.linear_probe) {
      at::Tensor features;
      {
        at::NoGradGuard no_grad;  // the frozen backbone keeps no activations
        features = model_.features(input);
      }
      logits = model_.head(features);
    } else {
      logits = model_.forward(input);
    }
    loss_sum = at::cross_entropy_loss(logits.to(at::kFloat), labels.to(options_.device), {}, at::Reduction::Sum);
  }
  return loss_sum;
}

double ImageTrainStep::forward_backward(const at::Tensor& pixels, const at::Tensor& labels, int64_t first_image,
                                        int64_t step, double normaliser) {
  const at::Tensor sum = summed_loss(pixels, labels, first_image, step);
  // fp16-mixed: times the loss scale, so small gradients survive fp16; apply_update divides them by it again.
  (options_.scaler ? sum * (options_.scaler->scale() / normaliser) : sum / normaliser).backward();
  return sum.item<double>();
}

std::size_t ImageTrainStep::agreed_passes(std::size_t mine) {
  if (!options_.sync || !options_.sync->shards_weights()) return mine;
  return static_cast<std::size_t>(options_.sync->agree_passes(static_cast<int64_t>(mine)));
}

void ImageTrainStep::empty_passes(std::size_t count, int64_t height, int64_t width, int64_t step) {
  for (std::size_t i = 0; i < count; ++i)
    (summed_loss(at::zeros({1, 3, height, width}), at::zeros({1}, at::kLong), 0, step) * 0.0).backward();
}

bool ImageTrainStep::escalate(int64_t step) {
  // Only activation checkpointing applies to a classifier (its loss is over a handful of classes: nothing to chunk).
  for (std::string escalation = policy_.next_escalation(step); !escalation.empty();
       escalation = policy_.next_escalation(step)) {
    if (escalation == "activation_checkpointing" && !model_.has_block_runner() && !options_.linear_probe) {
      model_.set_block_runner(activation_checkpointing_runner());
      return true;
    }
  }
  return false;
}

// The image task's part of an attempt (StepWork for run_attempts): the share's images in micro-batches of the
// policy's size.
class ImageStepWork final : public StepWork {
 public:
  ImageStepWork(ImageTrainStep& step, const at::Tensor& pixels, const at::Tensor& labels, int64_t first,
                double normaliser)
      : step_(step), pixels_(pixels), labels_(labels), first_(first), normaliser_(normaliser) {}
  void forward_backward(int64_t step, AttemptOutcome& outcome) override {
    const auto parts = split_counts(labels_.size(0), step_.policy_.micro_batch());
    for (const auto& part : parts) outcome.largest_part = std::max(outcome.largest_part, part.second);
    outcome.micro_steps = static_cast<int64_t>(parts.size());
    outcome.at_floor = outcome.largest_part <= 1;
    const std::size_t passes = step_.agreed_passes(parts.size());
    // Dropout masks follow each image's place in the effective batch, so neither the split nor the ranks change them.
    for (const auto& [begin, count] : parts)
      outcome.loss_sum += step_.forward_backward(pixels_.narrow(0, begin, count), labels_.narrow(0, begin, count),
                                                 first_ + begin, step, normaliser_);
    step_.empty_passes(passes - parts.size(), pixels_.size(2), pixels_.size(3), step);
  }
  bool escalate(int64_t step) override { return step_.escalate(step); }
  std::string floor_hint() const override {
    return "a smaller image size, training.activation_checkpointing=true, training.linear_probe=true or "
           "lora.enabled=true, or a larger memory.limit";
  }

 private:
  ImageTrainStep& step_;
  at::Tensor pixels_, labels_;
  int64_t first_;
  double normaliser_;
};

StepResult ImageTrainStep::run(const ImageBatch& batch, int64_t step, double lr) {
  const int64_t images = batch.size();
  const at::Tensor pixels =
      at::from_blob(const_cast<float*>(batch.pixels.data()), {images, 3, batch.height, batch.width}, at::kFloat);
  const at::Tensor labels = at::from_blob(const_cast<int64_t*>(batch.labels.data()), {images}, at::kLong);
  // The whole effective batch's images (every rank's share): what the loss is normalised by.
  const int64_t total = options_.sync ? batch.total : std::max(batch.total, images);
  const double normaliser = static_cast<double>(std::max<int64_t>(1, total));
  ImageStepWork work(*this, pixels, labels, batch.first, normaliser);
  return run_attempts(work, {optimizer_, policy_, options_.scaler, options_.sync, options_.max_grad_norm,
                             options_.max_retries, step, lr, total, normaliser, total});
}

at::Tensor image_logits(ImageClassifier& model, const at::Tensor& pixels, const c10::Device& device,
                        PrecisionMode precision) {
  at::NoGradGuard no_grad;
  const auto dtype = autocast_dtype(precision);
  AutocastScope autocast(dtype.has_value(), device.type(), dtype.value_or(at::kBFloat16));
  return model.forward(pixels.to(device, precision == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat))
      .to(at::kFloat);
}

}  // namespace trainer
