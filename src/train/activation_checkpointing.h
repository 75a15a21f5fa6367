// Activation checkpointing, applied to a built model from outside (as torchtitan's apply_ac): each transformer
// block runs without keeping its activations, and is recomputed in backward with the dropout context, RNG and
// autocast state of its forward, so dropout masks and precision are the same and the gradients equal those of a
// plain run.
#pragma once

#include "models/model.h"

namespace trainer {

void apply_activation_checkpointing(LanguageModel& model);
void remove_activation_checkpointing(LanguageModel& model);

// The block runner by itself, for models outside the LanguageModel interface (the image classifiers, CLIP): install
// it with the model's set_block_runner. apply_activation_checkpointing installs the same.
BlockRunner activation_checkpointing_runner();

}  // namespace trainer
