// Gradient caching and micro-batch negatives for the CLIP objective (see contrastive.h).
#include "train/tasks/contrastive/contrastive.h"

#include <exception>
#include <mutex>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "models/image/clip.h"
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

int64_t check_batch(const std::vector<ContrastiveMicroBatch>& micro_batches, bool share) {
  if (micro_batches.empty() && !share) throw UsageError("contrastive step: the effective batch has no micro-batches");
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

// Pass (c) of gradient caching: each micro-batch's towers run again with autograd and back-propagate their rows
// (from `offset` on) of the gradients of the whole batch's embeddings. One tower at a time, so only one tower's
// activations are alive.
void backward_micro_batches(ClipModel& model, const std::vector<ContrastiveMicroBatch>& micro_batches,
                            const ContrastiveOptions& options, const at::Tensor& image_grads,
                            const at::Tensor& text_grads, int64_t offset, ContrastiveResult& result) {
  const c10::Device device = model.logit_scale().device();
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
}

// Fully sharded weights: pass (c) of the empty micro-batches, each tower back-propagating a zero gradient.
void backward_empty_passes(ClipModel& model, const ContrastiveOptions& options, const at::Tensor& image_grads,
                           const at::Tensor& text_grads) {
  const c10::Device device = model.logit_scale().device();
  for (int64_t i = 0; i < options.empty_passes; ++i) {
    if (options.image_tower_trainable && image_grads.defined()) {
      const at::Tensor embeds = embed_images(model, options.empty, options, device);
      if (embeds.requires_grad()) torch::autograd::backward({embeds}, {at::zeros_like(embeds)});
    }
    if (options.text_tower_trainable && text_grads.defined()) {
      const at::Tensor embeds = embed_texts(model, options.empty, options, device);
      if (embeds.requires_grad()) torch::autograd::backward({embeds}, {at::zeros_like(embeds)});
    }
  }
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
  // (c) Each micro-batch again, with autograd, back-propagating its slice of the embedding gradients.
  backward_micro_batches(model, micro_batches, options, image_grads, text_grads, 0, result);
  return result;
}

// Data parallelism with negatives = batch (ContrastiveRanks in contrastive.h): pass (a) on this rank's share, the
// ranks' agreement and the gather, then the global batch's loss and its gradient (the same on every rank), and pass
// (c) on this rank's rows of that gradient.
ContrastiveResult gathered_batch_negatives(ClipModel& model, const std::vector<ContrastiveMicroBatch>& micro_batches,
                                           const ContrastiveOptions& options, int64_t local) {
  const ContrastiveRanks& ranks = *options.ranks;
  ContrastiveResult result;
  result.examples = ranks.batch;
  const c10::Device device = model.logit_scale().device();
  const int64_t width = ranks.width;
  if (ranks.offset < 0 || ranks.offset + local > ranks.batch)
    throw UsageError("contrastive step: this rank's share [" + std::to_string(ranks.offset) + ", " +
                     std::to_string(ranks.offset + local) + ") lies outside the global batch of " +
                     std::to_string(ranks.batch) + " pairs");
  // (a) This rank's embeddings, no autograd, in its rows of the (batch, 2 x width) matrix the ranks sum. The matrix
  // is allocated here, before the agreement, so that an out-of-memory error is one the ranks agree on.
  at::Tensor shared;
  std::exception_ptr out_of_memory;
  try {
    at::NoGradGuard no_grad;
    shared = at::zeros({ranks.batch, 2 * width}, at::TensorOptions().dtype(at::kFloat).device(device));
    int64_t row = ranks.offset;
    for (const auto& mb : micro_batches) {
      const int64_t b = mb.pixel_values.size(0);
      const at::Tensor images = embed_images(model, mb, options, device);
      shared.narrow(0, row, b).narrow(1, 0, width).copy_(images);
      const at::Tensor texts = embed_texts(model, mb, options, device);
      shared.narrow(0, row, b).narrow(1, width, width).copy_(texts);
      result.tower_forwards += 2;
      row += b;
    }
    for (int64_t i = 0; i < options.empty_passes; ++i) {
      embed_images(model, options.empty, options, device);
      embed_texts(model, options.empty, options, device);
    }
  } catch (const c10::OutOfMemoryError&) {
    shared = at::Tensor();
    out_of_memory = std::current_exception();
  }
  const bool all_fit = ranks.agree(!out_of_memory);
  if (out_of_memory) std::rethrow_exception(out_of_memory);
  if (!all_fit) {
    result.dropped = true;
    return result;
  }
  ranks.sum(shared);
  // (b) The global batch's loss and its gradient with respect to every rank's embeddings (identical on every rank);
  // logit_scale's only where this rank counts it.
  const at::Tensor all_images = shared.narrow(1, 0, width).clone().requires_grad_(options.image_tower_trainable);
  const at::Tensor all_texts = shared.narrow(1, width, width).clone().requires_grad_(options.text_tower_trainable);
  shared = at::Tensor();
  at::Tensor image_grads, text_grads;
  {
    at::AutoGradMode grad_on(true);
    const at::Tensor loss = clip_contrastive_loss(all_images, all_texts, model.logit_scale());
    result.loss = loss.item<double>();
    std::vector<at::Tensor> inputs;
    if (options.image_tower_trainable) inputs.push_back(all_images);
    if (options.text_tower_trainable) inputs.push_back(all_texts);
    if (ranks.logit_scale_gradient && model.logit_scale().requires_grad()) inputs.push_back(model.logit_scale());
    if (loss.requires_grad() && !inputs.empty())
      torch::autograd::backward({loss * options.loss_scale}, {}, std::nullopt, false, inputs);
    image_grads = all_images.grad();
    text_grads = all_texts.grad();
  }
  // (c) This rank's micro-batches again, with autograd, each with its rows of the embedding gradients.
  backward_micro_batches(model, micro_batches, options, image_grads, text_grads, ranks.offset, result);
  backward_empty_passes(model, options, image_grads, text_grads);
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
  // Fully sharded weights: the empty micro-batches run the same graph, their loss counted zero times.
  for (int64_t i = 0; i < options.empty_passes; ++i) {
    at::Tensor images, texts;
    {
      at::AutoGradMode grad(options.image_tower_trainable);
      images = embed_images(model, options.empty, options, device);
    }
    {
      at::AutoGradMode grad(options.text_tower_trainable);
      texts = embed_texts(model, options.empty, options, device);
    }
    const at::Tensor loss = clip_contrastive_loss(images, texts, model.logit_scale()) * 0.0;
    if (loss.requires_grad()) loss.backward();
  }
  return result;
}

}  // namespace

ContrastiveResult contrastive_forward_backward(ClipModel& model,
                                               const std::vector<ContrastiveMicroBatch>& micro_batches,
                                               const ContrastiveOptions& options) {
  const int64_t local = check_batch(micro_batches, options.ranks != nullptr);
  if (options.ranks) {
    // Data parallelism: negatives over the gathered global batch, or within each micro-batch of this rank's share
    // (weighted by its share of the global batch).
    if (options.negatives == ContrastiveNegatives::kBatch)
      return gathered_batch_negatives(model, micro_batches, options, local);
    return micro_batch_negatives(model, micro_batches, options, options.ranks->batch);
  }
  const int64_t total = local;
  // One micro-batch holding the whole batch: its own loss is the batch's, so the direct path gives the same
  // gradients without gradient caching's second forward.
  if (options.negatives == ContrastiveNegatives::kMicroBatch || micro_batches.size() == 1)
    return micro_batch_negatives(model, micro_batches, options, total);
  return cached_batch_negatives(model, micro_batches, options, total);
}

}  // namespace trainer
