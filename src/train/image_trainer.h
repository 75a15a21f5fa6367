// Image-classification training (ViT, CLIP vision): the same run as for text models (trainer.h) over images:
// model (full fine-tune or linear probe), threaded image loader, the memory-adaptive image step, evaluation with
// loss, top-1 and top-5 accuracy, checkpoints with exact resume, and the final model as a Hugging Face directory
// (config.json with id2label/label2id, preprocessor_config.json). train() hands over here when model.path's
// config.json is an image classifier.
#pragma once

#include <iosfwd>

#include "trainer/config.h"
#include "trainer/device.h"
#include "trainer/run.h"

namespace trainer {

namespace distributed {
class Communicator;
}

// `world`: data parallelism (every rank trains its share of each effective batch; rank 0 writes and reports); null
// in one process.
int train_image_classifier(const Config& config, const ResolvedDevice& device, const TrainOptions& options,
                           std::ostream& out, distributed::Communicator* world = nullptr);

}  // namespace trainer
