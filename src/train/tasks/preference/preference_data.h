// Preference records (training.objective=dpo) -> pairs, tokenized as TRL's DPOTrainer tokenizes them:
//   standard:        {"prompt": "...", "chosen": "...", "rejected": "..."}; the EOS text is appended to each
//                    completion that does not end with it, then prompt and prompt + completion are tokenized whole
//                    (with the tokenizer's special-token template, as tokenizer(text) adds it);
//   conversational:  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, rendered by the model's
//                    chat template (data.chat_template, else the tokenizer's): the prompt with the generation prompt,
//                    prompt + completion as a whole conversation; "tools" passed to the template as in chat records;
//   implicit prompt: no "prompt": chosen and rejected are whole texts or conversations, and the prompt is what they
//                    share at the start (TRL's extract_prompt: whole messages, or characters without a trailing
//                    space).
// The completion starts where the tokenized prompt and prompt + completion diverge (the shorter of the two pairs'
// common prefixes); for a conversation whose rendering does not begin with the prompt's (the template renders the
// prompt otherwise once an answer follows, Mistral v3 with a system message), only the completion's assistant spans
// are trained, found by the rule of chat records (chat/chat_template.h: prefix by prefix, else by probing). A pair whose prompt alone fills data.max_length is skipped (nothing to learn); otherwise each
// sequence keeps its first data.max_length tokens (TRL's keep_start), or with data.on_overlength=skip a pair with a
// longer sequence is skipped. No LibTorch; thread-safe (the loader's worker threads call it).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "data/record.h"
#include "trainer/config.h"
#include "trainer/tokenizer.h"

namespace trainer::data {
struct ChatSetup;
}

namespace trainer {

struct PreferenceSpec {
  std::int64_t max_length = 1024;
  OverlengthPolicy on_overlength = OverlengthPolicy::kTruncate;
  std::string eos_text;  // appended to standard completions; empty: the tokenizer has no EOS token
  std::shared_ptr<const data::ChatSetup> chat;  // conversational records
  bool keep_text = false;  // Outcome::chat_text: the prompt, chosen and rejected texts as rendered (trainer data --dump)
};
PreferenceSpec preference_spec(const Config& config, const Tokenizer& tokenizer);

// One JSONL line -> a pair (Example's input_ids/labels: prompt + chosen; rejected_ids/rejected_labels: prompt +
// rejected; labels -100 on the prompt). Never throws for bad data: a bad record is an Outcome (data/record.h).
data::Outcome map_preference(std::string_view line, const PreferenceSpec& spec, const Tokenizer& tokenizer);

// map_preference as the loader's and `trainer data`'s record mapping (holding its spec; `tokenizer` must outlive
// it). `keep_text`: the rendered texts too (--dump).
RecordMapper preference_mapper(const Config& config, const Tokenizer& tokenizer, bool keep_text = false);

}  // namespace trainer
