// LoRA on a whole CLIP (CLIPModel: either tower or both), applied from outside as for the text models (lora.h) and
// the image classifiers (image_lora.h), and saved as a PEFT adapter of transformers' CLIPModel.
//
// Contract:
// - apply_clip_lora freezes every parameter of the model (both towers, visual_projection, text_projection,
//   logit_scale: no gradients, no optimizer state) and adds adapters to the linear layers of the chosen towers
//   whose last names are in config.target_modules (PEFT's rule: a module whose name equals a target or ends with
//   "." + target; empty: q_proj, v_proj). CLIP's linear layers: q_proj, k_proj, v_proj, out_proj (attention),
//   fc1, fc2 (MLP), in vision_model.encoder.layers.N and text_model.encoder.layers.N. The projections are not
//   linear modules here (and PEFT's default leaves them out too).
// - The adapters (fp32, lora_A from a generator seeded with `seed` as PEFT initialises it, lora_B zero, so the model
//   starts equal to the base) are what trains: pass the returned module's parameters to the optimizer. Dropout on
//   the adapters' input follows config.dropout, keyed by the adapted layer's path like the model's own dropout.
// - Neither tower chosen, a target that matches no linear layer of the chosen towers, or lora.base_in_bf16 (not
//   supported for CLIP) is a UsageError naming what to change. A model is adapted once.
// - write_clip_adapter writes adapter_config.json and adapter_model.safetensors in PEFT's format under
//   transformers' CLIPModel names ("base_model.model.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"),
//   so peft.PeftModel.from_pretrained(CLIPModel.from_pretrained(base), dir) computes our logits. target_modules is
//   the list of last names when both towers are adapted, else a regular expression PEFT full-matches that names
//   the one tower (so the other tower stays unadapted on load).
// - load_clip_adapter copies a written adapter back into adapters of the same layout (resume): DataError naming the
//   file when a tensor is missing or has another shape.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "models/lora.h"

namespace trainer {

class ClipModel;

// The adapters of a CLIP and which towers they are on.
class ClipLoraAdapters : public LoraAdapters {
 public:
  ClipLoraAdapters(LoraConfig config, bool vision, bool text)
      : LoraAdapters(std::move(config)), vision_(vision), text_(text) {}
  bool vision() const { return vision_; }
  bool text() const { return text_; }

 private:
  bool vision_, text_;
};

std::unique_ptr<ClipLoraAdapters> apply_clip_lora(ClipModel& model, const LoraConfig& config, uint64_t seed,
                                                  bool vision, bool text);

void write_clip_adapter(const std::string& dir, const ClipLoraAdapters& adapters,
                        const std::string& base_model_name_or_path);

void load_clip_adapter(const std::string& dir, ClipLoraAdapters& adapters);

}  // namespace trainer
