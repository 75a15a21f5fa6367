// Contrastive (CLIP) training over an effective batch split into micro-batches. A contrastive loss is not a sum
// over examples: every image is scored against every caption of the batch, so plain accumulation over
// micro-batches changes the objective. Two modes (docs/clip.md):
//
//   negatives = batch (gradient caching, Gao et al. 2021 "Scaling Deep Contrastive Learning Batch Size under
//     Memory Limited Setup"): (a) embed every micro-batch without autograd, (b) compute the symmetric InfoNCE loss
//     of the whole effective batch and its gradient with respect to the concatenated image and text embeddings
//     (and logit_scale, whose gradient lands in its .grad here), (c) re-run each micro-batch with autograd and
//     back-propagate its slice of the embedding gradients. The parameter gradients equal a full-batch autograd
//     run's, for any split; memory: one micro-batch of activations plus the batch's embeddings; cost: one more
//     forward of each tower. A batch in one micro-batch takes the direct path below (the same objective, one
//     forward).
//   negatives = micro-batch (the common approximation): each micro-batch's own loss (its examples are each
//     other's only negatives), weighted by its share of the batch and back-propagated at once. One forward; a
//     different, easier objective that depends on the split.
//
// Randomness replays exactly in the second pass: each micro-batch's forwards run under the keyed-dropout context of
// its examples (DropoutScope: seed, step, index in the effective batch), and with LibTorch's default generator
// seeded from the micro-batch's rng_seed (its state around the call is left as it was), so dropout, and anything a
// forward draws from the generator, is the same in (a) and (c). Augmentations belong to the pixels the caller
// passes (seeded by (seed, epoch, index) in the loader): both passes read the same tensors.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trainer {

class ClipModel;

enum class ContrastiveNegatives { kBatch, kMicroBatch };

// One micro-batch of matching image-text pairs (row i of each is pair i).
struct ContrastiveMicroBatch {
  at::Tensor pixel_values;    // (b, C, H, W), on the model's device
  at::Tensor input_ids;       // (b, T)
  at::Tensor attention_mask;  // (b, T) of 0/1, or undefined (no padding)
  int64_t first_example = 0;  // index of row 0 in the effective batch: the key of its dropout masks
  uint64_t rng_seed = 0;      // seeds LibTorch's default generator around this micro-batch's forwards, both passes
};

// Data parallelism (docs/clip.md "Data parallelism"): the micro-batches are this rank's share [offset, offset +
// its pairs) of a global effective batch of `batch` pairs that the ranks train together (a share may be empty).
//   negatives = batch: after pass (a) every rank calls `agree` once with whether its pass fit; when all fit, each
//     rank's embeddings are placed at its rows of a (batch, 2 x width) zero matrix (images, then texts) and `sum`
//     adds the ranks' matrices in place: every rank then holds the global batch's embeddings, computes the global
//     loss and its gradient, and back-propagates its own rows in pass (c). The gradient with respect to
//     logit_scale is the same on every rank: it is accumulated only where `logit_scale_gradient` is set (one rank),
//     so the ranks' gradient sum counts it once.
//   negatives = micro-batch: no collective; each micro-batch's loss is weighted by its share of the global batch.
// The parameter gradients summed over the ranks are then those of one process training the global batch.
struct ContrastiveRanks {
  int64_t batch = 0;
  int64_t offset = 0;
  int64_t width = 0;                  // the embeddings' width (projection_dim)
  bool logit_scale_gradient = true;
  std::function<bool(bool fit)> agree;       // every rank's pass (a) fit
  std::function<void(at::Tensor&)> sum;      // element-wise sum over the ranks, in place
};

struct ContrastiveOptions {
  ContrastiveNegatives negatives = ContrastiveNegatives::kBatch;
  // Keyed dropout context of the step (DropoutScope(dropout_seed, step, first_example, b, device)).
  uint64_t dropout_seed = 0;
  int64_t step = 0;
  // The gradients are those of loss * loss_scale (fp16 loss scaling; divide by it before the optimizer step).
  double loss_scale = 1.0;
  // A frozen tower (LiT locks the image tower): its forward runs once, without autograd, and never again.
  bool image_tower_trainable = true;
  bool text_tower_trainable = true;
  const ContrastiveRanks* ranks = nullptr;  // data parallelism; none in a single process
  // Fully sharded weights (with `ranks`): every block's forward and backward is a collective, so every rank runs as
  // many micro-batches as the rank with the most. This rank runs `empty_passes` more of `empty` (one pair) after its
  // own, in each pass and with each tower as for a micro-batch of its own, adding nothing to any gradient.
  int64_t empty_passes = 0;
  ContrastiveMicroBatch empty;
};

struct ContrastiveResult {
  double loss = 0.0;            // the objective's value, unscaled: the batch's loss, or the weighted micro-batch sum
  int64_t examples = 0;         // pairs in the effective batch
  int64_t tower_forwards = 0;   // tower forward passes run (image and text counted separately)
  // Data parallelism, negatives = batch: another rank ran out of memory in pass (a); this rank's attempt trained
  // nothing (no gradient changed), and the caller drops it as if it had run out of memory itself.
  bool dropped = false;
};

// Accumulates into the .grad of the model's parameters (those that require grad, logit_scale included) the gradient
// of the chosen objective over the effective batch `micro_batches` (in order; sizes may differ). The model's
// training flag decides whether dropout is on. Throws UsageError when a micro-batch's images and texts differ in
// number or the batch is empty (with `options.ranks`: this rank's share may be empty).
//
// Out of memory: c10::OutOfMemoryError propagates from either pass. An error in (a) or (b) has changed no
// gradient; one in (c) (or in micro-batch mode) leaves a partial sum in .grad: the caller restores the gradients
// it had before the call (as the training step does for accumulation), re-splits the same effective batch
// smaller and calls again. With `options.ranks` and negatives = batch, an error in (a) is first agreed with the
// other ranks (`agree`), then rethrown; errors in (b) and (c) follow no collective of this call.
ContrastiveResult contrastive_forward_backward(ClipModel& model,
                                               const std::vector<ContrastiveMicroBatch>& micro_batches,
                                               const ContrastiveOptions& options);

}  // namespace trainer
