// CLIP contrastive training (training.objective = contrastive): image-caption JSONL pairs through the threaded
// image loader, captions through the model directory's tokenizer, each effective batch split by the memory policy
// and trained by contrastive_forward_backward (train/contrastive.h: gradient caching with contrastive.negatives =
// batch, so any split, and any out-of-memory retry, trains the full batch's loss), clipping, the optimizer step
// and CLIP's cap on the logit scale; evaluation by image->text and text->image recall@1/5/10, the validation loss
// and zero-shot accuracy; checkpoints with exact resume; the result a CLIPModel directory transformers loads.
// The run's shape is the image classifier's (image_trainer.h), sharing its loader, checkpoint writer, resume
// checks and reporter.
#pragma once

#include <iosfwd>

#include <nlohmann/json_fwd.hpp>

#include "trainer/config.h"
#include "trainer/device.h"
#include "trainer/run.h"

namespace trainer {
namespace distributed {
class Communicator;
}

// Whether a config.json is a whole CLIP (CLIPModel: model_type "clip" with a text_config), what the contrastive
// objective trains.
bool is_clip_model_config(const nlohmann::json& config);

// With `world` (data parallelism, docs/clip.md "Data parallelism"): this rank trains its share of every effective
// batch, the embeddings are gathered so the negatives are the global batch's, gradients are summed once per step;
// rank 0 alone reports and writes checkpoints.
int train_contrastive(const Config& config, const ResolvedDevice& device, const TrainOptions& options,
                      std::ostream& out, distributed::Communicator* world = nullptr);

}  // namespace trainer
