// The memory-adaptive training step for image classification: one effective batch of images, split into
// micro-batches by the memory policy, cross-entropy summed per micro-batch and normalised by the effective batch's
// image count (so any split gives the same gradient), then clipping and the optimizer update. On
// c10::OutOfMemoryError the attempt's gradients are dropped, the policy shrinks (at the floor: activation
// checkpointing), and the same effective batch runs again: the step a run without the error would have taken.
// fp16-mixed scales the loss and skips steps whose gradients overflow, as the text step does (the optimizer phase
// is the text step's, apply_update in step.h).
// Dropout masks are keyed by (seed, step, the image's index in the effective batch), as for text (dropout.h).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "data/image_loader.h"
#include "memory/policy.h"
#include "models/image/image_model.h"
#include "train/optim/grad_scaler.h"
#include "train/optim/optimizer.h"
#include "train/engine/attempts.h"
#include "trainer/config.h"

namespace trainer {

struct ImageStepOptions {
  c10::Device device{c10::kCPU};
  PrecisionMode precision = PrecisionMode::kFp32;
  double max_grad_norm = 1.0;
  int64_t max_retries = 8;
  uint64_t seed = 0;
  bool linear_probe = false;  // the backbone is frozen: features run without autograd, only the head trains
  GradScaler* scaler = nullptr;  // precision.mode=fp16-mixed: dynamic loss scaling (train/optim/grad_scaler.h)
  // Data parallelism: the batch is this rank's share (ImageBatch::first, total); the ranks agree on out-of-memory
  // errors and sum the gradients, as in the text step. With fully sharded weights (StepSync::shards_weights) every
  // block's forward and backward is a collective: every rank runs as many micro-batches as the rank with the most,
  // the others empty ones (one black image whose loss counts zero times).
  StepSync* sync = nullptr;
};

class ImageTrainStep {
 public:
  ImageTrainStep(ImageClassifier& model, Optimizer& optimizer, MemoryPolicy& policy, ImageStepOptions options)
      : model_(model), optimizer_(optimizer), policy_(policy), options_(options) {}

  // StepResult::target_tokens counts the images of the step (all ranks'); loss is the mean cross-entropy per image.
  // With data parallelism `batch` is this rank's share, and the loss is normalised by the whole effective batch's
  // image count (batch.total), so the summed gradient is one process's.
  StepResult run(const ImageBatch& batch, int64_t step, double lr);

  // The summed cross-entropy of `labels.size(0)` images whose pixels (B, 3, H, W) are on the host, images
  // first_image.. of the effective batch, with gradients scaled by 1/normaliser accumulated into the parameters.
  double forward_backward(const at::Tensor& pixels, const at::Tensor& labels, int64_t first_image, int64_t step,
                          double normaliser);

  void set_device(const c10::Device& device) { options_.device = device; }

 private:
  // The summed cross-entropy of the images with its graph, under the step's dropout masks and autocast.
  at::Tensor summed_loss(const at::Tensor& pixels, const at::Tensor& labels, int64_t first_image, int64_t step);
  // Fully sharded weights: the micro-batches every rank runs (agreed), and `count` passes of one black image of
  // height x width pixels that add nothing to any gradient.
  std::size_t agreed_passes(std::size_t mine);
  void empty_passes(std::size_t count, int64_t height, int64_t width, int64_t step);
  bool escalate(int64_t step);
  friend class ImageStepWork;

  ImageClassifier& model_;
  Optimizer& optimizer_;
  MemoryPolicy& policy_;
  ImageStepOptions options_;
};

// Logits (fp32) of host pixels (B, 3, H, W) without autograd, on `device` (for evaluation and tests), under the
// autocast of the mixed precision modes.
at::Tensor image_logits(ImageClassifier& model, const at::Tensor& pixels, const c10::Device& device,
                        PrecisionMode precision);

}  // namespace trainer
