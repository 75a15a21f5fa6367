// Gradient caching and micro-batch negatives for the CLIP objective (see contrastive.h).
#include "train/contrastive.h"

#include <mutex>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "models/clip.h"
#include "models/dropout.h"
#include "train/rng.h"
#include "trainer/errors.h"

namespace trainer {
namespace {

// Seeds LibTorch's default generator of `device` with `seed` for the scope's lifetime and puts its previous state
// back afterwards: a forward run twice under the same seed draws the same numbers, and the caller's stream of
// random numbers is not disturbed.
class GeneratorReplay {
 public:
  GeneratorReplay(const c10::Device& device, uint64_t seed) : device_(device), saved_(get_rng_state(device)) {
    at::Generator gen =
        device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  ~GeneratorReplay() { set_rng_state(device_, saved_); }
  GeneratorReplay(const GeneratorReplay&) = delete;
  GeneratorReplay& operator=(const GeneratorReplay&) = delete;

 private:
  c10::Device device_;
  at::Tensor saved_;
};

// The two towers draw from different seeds of the micro-batch (so their order in a pass does not matter).
constexpr uint64_t kTextSeedOffset = 0x9E3779B97F4A7C15ull;

at::Tensor embed_images(ClipModel& model, const ContrastiveMicroBatch& mb, const ContrastiveOptions& options,
                        const c10::Device& device) {
  const DropoutScope dropout(options.dropout_seed, options.step, mb.first_example, mb.pixel_values.size(0), device);
  const GeneratorReplay replay(device, mb.rng_seed);
  return model.image_features(mb.pixel_values);
}

at::Tensor embed_texts(ClipModel& model, const ContrastiveMicroBatch& mb, const ContrastiveOptions& options,
                       const c10::Device& device) {
  const DropoutScope dropout(options.dropout_seed, options.step, mb.first_example, mb.input_ids.size(0), device);
  const GeneratorReplay replay(device, mb.rng_seed + kTextSeedOffset);
  return model.text_features(mb.input_ids, mb.attention_mask);
}

int64_t check_batch(const std::vector<ContrastiveMicroBatch>& micro_batches) {
  if (micro_batches.empty()) throw UsageError("contrastive step: the effective batch has no micro-batches");
  int64_t total = 0;
  for (std::size_t i = 0; i < micro_batches.size(); ++i) {
    const auto& mb = micro_batches[i];
    if (!mb.pixel_values.defined() || !mb.input_ids.defined() || mb.pixel_values.size(0) != mb.input_ids.size(0) ||
        mb.pixel_values.size(0) == 0)
      throw UsageError("contrastive step: micro-batch " + std::to_string(i) + " holds " +
                       (mb.pixel_values.defined() ? std::to_string(mb.pixel_values.size(0)) : "no") + " images and " +
                       (mb.input_ids.defined() ? std::to_string(mb.input_ids.size(0)) : "no") +
                       " texts; it needs one caption per image and at least one pair");
    total += mb.pixel_values.size(0);
  }
  return total;
}

ContrastiveResult cached_batch_negatives(ClipModel& model, const std::vector<ContrastiveMicroBatch>& micro_batches,
                                         const ContrastiveOptions& options, int64_t total) {
  ContrastiveResult result;
  result.examples = total;
  const c10::Device device = model.logit_scale().device();
  // (a) Embeddings of the whole batch, no autograd: activations of one micro-batch at a time.
  std::vector<at::Tensor> images, texts;
  {
    at::NoGradGuard no_grad;
    for (const auto& mb : micro_batches) {
      images.push_back(embed_images(model, mb, options, device));
      texts.push_back(embed_texts(model, mb, options, device));
      result.tower_forwards += 2;
    }
  }
  // (b) The batch's loss and its gradient with respect to the embeddings; logit_scale's lands in its .grad.
  const at::Tensor all_images = at::cat(images).to(at::kFloat).requires_grad_(options.image_tower_trainable);
  const at::Tensor all_texts = at::cat(texts).to(at::kFloat).requires_grad_(options.text_tower_trainable);
  images.clear();
  texts.clear();
  at::Tensor image_grads, text_grads;
  {
    at::AutoGradMode grad_on(true);
    const at::Tensor loss = clip_contrastive_loss(all_images, all_texts, model.logit_scale());
    result.loss = loss.item<double>();
    if (loss.requires_grad()) (loss * options.loss_scale).backward();
    image_grads = all_images.grad();
    text_grads = all_texts.grad();
  }
  // (c) Each micro-batch again, with autograd, back-propagating its slice of the embedding gradients. One tower at a
  // time, so only one tower's activations are alive.
  int64_t offset = 0;
  for (const auto& mb : micro_batches) {
    const int64_t b = mb.pixel_values.size(0);
    if (options.image_tower_trainable && image_grads.defined()) {
      const at::Tensor embeds = embed_images(model, mb, options, device);
      if (embeds.requires_grad())
        torch::autograd::backward({embeds}, {image_grads.slice(0, offset, offset + b).to(embeds.scalar_type())});
      ++result.tower_forwards;
    }
    if (options.text_tower_trainable && text_grads.defined()) {
      const at::Tensor embeds = embed_texts(model, mb, options, device);
      if (embeds.requires_grad())
        torch::autograd::backward({embeds}, {text_grads.slice(0, offset, offset + b).to(embeds.scalar_type())});
      ++result.tower_forwards;
    }
    offset += b;
  }
  return result;
}

ContrastiveResult micro_batch_negatives(ClipModel& model, const std::vector<ContrastiveMicroBatch>& micro_batches,
                                        const ContrastiveOptions& options, int64_t total) {
  ContrastiveResult result;
  result.examples = total;
  const c10::Device device = model.logit_scale().device();
  for (const auto& mb : micro_batches) {
    at::Tensor images, texts;
    {
      at::AutoGradMode grad(options.image_tower_trainable);
      images = embed_images(model, mb, options, device);
    }
    {
      at::AutoGradMode grad(options.text_tower_trainable);
      texts = embed_texts(model, mb, options, device);
    }
    result.tower_forwards += 2;
    // Weighted by the micro-batch's share: the sum over micro-batches is the mean of per-example losses.
    const double weight = static_cast<double>(mb.pixel_values.size(0)) / static_cast<double>(total);
    const at::Tensor loss = clip_contrastive_loss(images, texts, model.logit_scale()) * weight;
    result.loss += loss.item<double>();
    if (loss.requires_grad()) (loss * options.loss_scale).backward();
  }
  return result;
}

}  // namespace

ContrastiveResult contrastive_forward_backward(ClipModel& model,
                                               const std::vector<ContrastiveMicroBatch>& micro_batches,
                                               const ContrastiveOptions& options) {
  const int64_t total = check_batch(micro_batches);
  // One micro-batch holding the whole batch: its own loss is the batch's, so the direct path gives the same
  // gradients without gradient caching's second forward.
  if (options.negatives == ContrastiveNegatives::kMicroBatch || micro_batches.size() == 1)
    return micro_batch_negatives(model, micro_batches, options, total);
  return cached_batch_negatives(model, micro_batches, options, total);
}

}  // namespace trainer
