// The shipped tiny models (configs/models/tiny-*) with random weights, and a padded batch for them, for tests.
#pragma once

#include <memory>
#include <string>

#include <ATen/ATen.h>

#include "models/model.h"
#include "models/weights.h"
#include "support/paths.h"

namespace trainer::test {

// configs/models/<name> with its random initialisation from `seed`, in evaluation mode.
inline std::unique_ptr<LanguageModel> tiny_model(const std::string& name, uint64_t seed = 3) {
  auto model = load_model(source_path("configs/models/" + name), ModelInit::kRandom,
                          at::TensorOptions().dtype(at::kFloat), seed);
  model->train(false);
  return model;
}

// Three rows padded on the right to 10 tokens; seq2seq labels with padding, causal labels masking the padding.
inline Batch padded_batch(bool seq2seq) {
  at::manual_seed(11);
  Batch b;
  b.input_ids = at::randint(3, 200, {3, 10}, at::kLong);
  b.attention_mask = at::ones({3, 10}, at::kLong);
  b.attention_mask[1].narrow(0, 6, 4).zero_();
  b.attention_mask[2].narrow(0, 3, 7).zero_();
  b.input_ids.masked_fill_(b.attention_mask == 0, 0);
  if (seq2seq) {
    b.labels = at::randint(3, 200, {3, 7}, at::kLong);
    b.labels[2].narrow(0, 4, 3).fill_(-100);
  } else {
    b.labels = b.input_ids.masked_fill(b.attention_mask == 0, -100);
  }
  return b;
}

}  // namespace trainer::test
