// Training versions of chat templates that rendering prefix by prefix cannot split, as TRL's
// get_training_chat_template swaps them in for SFTTrainer(assistant_only_loss=True), and by the same rule (the
// assistant's text and end-of-turn marker) for templates TRL has no version of (Gemma 4's, Mistral v3's): each is
// the model's own template with {% generation %} around the assistant's text, plus the change, where there is one,
// that makes earlier turns render the same once the conversation goes on. A model's template is recognised by the
// SHA-256 of its exact text, so a template that differs by one byte is never replaced.
#pragma once

#include <string>
#include <string_view>

namespace trainer::chat {

struct TrainingTemplate {
  std::string_view family;           // "Qwen3", for the log and messages
  std::string_view original_sha256;  // of the model's template, 64 lowercase hex digits
  std::string_view text;             // the training version (Jinja, with {% generation %})
};

// The training version of the template whose text has this SHA-256, or nullptr.
const TrainingTemplate* training_template_for(std::string_view original_sha256);

// The families that have a training version, each once however many revisions it has, for hints:
// "Qwen3, Qwen3-Instruct-2507, DeepSeek-R1-Distill, ...".
std::string training_template_families();

}  // namespace trainer::chat
