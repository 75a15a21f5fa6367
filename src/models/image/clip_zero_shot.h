// Zero-shot scoring with CLIP: each image's probability over a set of texts (captions, or class names put into a
// prompt such as "a photo of a {}."), the softmax over the texts of CLIPModel's logits_per_image
// (exp(logit_scale) * cosine similarity). What `trainer predict --text` prints and what zero-shot classification
// accuracy is computed from.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trainer {

class ClipModel;
class Tokenizer;

// CLIP's usual prompt for a class name.
inline constexpr const char* kClipDefaultPrompt = "a photo of a {}.";

// One text per class: `prompt_template` with every "{}" replaced by the class name ("a photo of a {}." and "daisy"
// give "a photo of a daisy."). A template without "{}" is a UsageError naming it (every class would get the same
// text).
std::vector<std::string> zero_shot_class_texts(const std::vector<std::string>& class_names,
                                               const std::string& prompt_template = kClipDefaultPrompt);

// Texts as CLIP's text tower takes them: the tokenizer's special-token template around each text's ids
// (<|startoftext|> ... <|endoftext|>), right-padded with the tokenizer's pad id (its EOS when it has none) to the
// longest; attention_mask 1 on the tokens. input_ids and attention_mask are (n_texts, longest), int64, as
// CLIPTokenizer(texts, padding=True) gives them. A text longer than max_length tokens (the model's
// max_position_embeddings) is a UsageError naming it: truncating would drop its end-of-text token, which is where
// CLIP pools.
struct ClipTextBatch {
  at::Tensor input_ids, attention_mask;
};
ClipTextBatch clip_tokenize(const Tokenizer& tokenizer, const std::vector<std::string>& texts, int64_t max_length);

// (n_images, n_texts): the softmax over the texts of exp(logit_scale) * cos(image, text), from the projected (not
// necessarily normalised) features of get_image_features/get_text_features. Computed in fp32. Text features can
// be computed once and reused for every batch of images.
at::Tensor clip_probabilities_from_features(const at::Tensor& image_features, const at::Tensor& text_features,
                                            const at::Tensor& logit_scale);

// (n_images, n_texts): softmax(logits_per_image, -1) of CLIPModel on pixel_values (n_images, 3, H, W) and the
// tokenised texts, without autograd; the model's train/eval mode is the caller's (eval for inference).
at::Tensor clip_image_text_probabilities(ClipModel& model, const at::Tensor& pixel_values,
                                         const at::Tensor& input_ids, const at::Tensor& attention_mask);

}  // namespace trainer
