// Zero-shot scoring with CLIP (see clip_zero_shot.h).
#include "models/image/clip_zero_shot.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/image/clip.h"
#include "trainer/errors.h"
#include "trainer/tokenizer.h"

namespace trainer {

std::vector<std::string> zero_shot_class_texts(const std::vector<std::string>& class_names,
                                               const std::string& prompt_template) {
  if (prompt_template.find("{}") == std::string::npos)
    throw UsageError("the prompt template \"" + prompt_template + "\" has no {} for the class name",
                     "write it with {} where the class name goes, e.g. \"a photo of a {}.\"");
  std::vector<std::string> texts;
  texts.reserve(class_names.size());
  for (const auto& name : class_names) {
    std::string text = prompt_template;
    for (std::size_t at = text.find("{}"); at != std::string::npos; at = text.find("{}", at + name.size()))
      text.replace(at, 2, name);
    texts.push_back(std::move(text));
  }
  return texts;
}

ClipTextBatch clip_tokenize(const Tokenizer& tokenizer, const std::vector<std::string>& texts, int64_t max_length) {
  const SpecialTokenTemplate special = tokenizer.special_token_template();
  std::vector<std::vector<int64_t>> rows;
  std::size_t longest = 0;
  for (const auto& text : texts) {
    std::vector<int64_t> ids(special.prefix.begin(), special.prefix.end());
    for (const int32_t id : tokenizer.encode(text)) ids.push_back(id);
    ids.insert(ids.end(), special.suffix.begin(), special.suffix.end());
    if (max_length > 0 && static_cast<int64_t>(ids.size()) > max_length)
      throw UsageError("the text \"" + text + "\" is " + std::to_string(ids.size()) +
                           " tokens with its special tokens; the model's text tower takes at most " +
                           std::to_string(max_length) + " (text_config.max_position_embeddings)",
                       "shorten the text");
    longest = std::max(longest, ids.size());
    rows.push_back(std::move(ids));
  }
  const int64_t pad = tokenizer.pad_id().value_or(tokenizer.eos_id().value_or(0));
  const auto n = static_cast<int64_t>(rows.size());
  ClipTextBatch batch{at::full({n, static_cast<int64_t>(longest)}, pad, at::kLong),
                      at::zeros({n, static_cast<int64_t>(longest)}, at::kLong)};
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto mask = batch.attention_mask.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& row = rows[static_cast<std::size_t>(i)];
    for (std::size_t j = 0; j < row.size(); ++j) {
      ids[i][static_cast<int64_t>(j)] = row[j];
      mask[i][static_cast<int64_t>(j)] = 1;
    }
  }
  return batch;
}

at::Tensor clip_probabilities_from_features(const at::Tensor& image_features, const at::Tensor& text_features,
                                            const at::Tensor& logit_scale) {
  const at::Tensor images = image_features.to(at::kFloat), texts = text_features.to(at::kFloat);
  const at::Tensor image_embeds = images / images.pow(2).sum(-1, true).pow(0.5);
  const at::Tensor text_embeds = texts / texts.pow(2).sum(-1, true).pow(0.5);
  const at::Tensor logits = at::matmul(image_embeds, text_embeds.t()) * logit_scale.to(at::kFloat).exp();
  return at::softmax(logits, -1);
}

at::Tensor clip_image_text_probabilities(ClipModel& model, const at::Tensor& pixel_values,
                                         const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  at::NoGradGuard no_grad;
  return clip_probabilities_from_features(model.image_features(pixel_values),
                                          model.text_features(input_ids, attention_mask), model.logit_scale());
}

}  // namespace trainer
