// The activation-checkpointing block runner by itself, for models outside the LanguageModel interface (the image
// classifiers): install it with the model's set_block_runner. apply_activation_checkpointing installs the same.
#pragma once

#include "models/model.h"

namespace trainer {

BlockRunner activation_checkpointing_runner();

}  // namespace trainer
