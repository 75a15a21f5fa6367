// trainer_clip_parity: runs our CLIP on inputs tests/parity/test_clip.py prepares, for comparison with transformers.
//
//   trainer_clip_parity forward MODEL_DIR BATCH.safetensors OUT.safetensors [train] [checkpointing]
//       CLIPModel(return_loss=True): logits_per_image, image_embeds, text_embeds, loss and grad.<name> of every
//       parameter; `train`: training mode (keyed dropout of step 0, seed 0); `checkpointing`: activation
//       checkpointing installed from outside
//   trainer_clip_parity train-step MODEL_DIR BATCH.safetensors OUT_DIR LR [MAX_SHARD_BYTES]
//       one SGD step on the contrastive loss, save_clip to OUT_DIR (sharded above MAX_SHARD_BYTES), and
//       OUT_DIR/logits.safetensors: logits_per_image of the same batch after the step
//   trainer_clip_parity classify MODEL_DIR BATCH.safetensors OUT.safetensors
//       the image classifier load_image_classifier gives for MODEL_DIR: logits, loss (mean cross-entropy) and
//       grad.<name>
//   trainer_clip_parity classify-step MODEL_DIR BATCH.safetensors OUT_DIR LR [LABEL,LABEL,...]
//       loads the classifier (a new head for the given classes, if any), one SGD step, save_image_classifier to
//       OUT_DIR, and OUT_DIR/logits.safetensors: the logits of the same batch after the step
//   trainer_clip_parity bench BATCH MICRO REPEATS
//       scripts/bench/clip_negatives.py: a small random CLIP (64 px images, 32-token captions), one step's
//       forward and backward over an effective batch of BATCH pairs as one autograd graph, with gradient caching
//       in micro-batches of MICRO, and with micro-batch negatives; the sides alternate REPEATS times. Prints one
//       JSON line per side: the median seconds and the peak CPU tensor bytes above the weights (budget allocator)
//   trainer_clip_parity lora MODEL_DIR BATCH.safetensors OUT_DIR TOWERS R TARGET[,TARGET...]
//       apply_clip_lora on TOWERS (vision, text or both) with rank R, alpha 2R, lora_B drawn at random (so the
//       adapters act), write_clip_adapter to OUT_DIR, and OUT_DIR/out.safetensors: logits_per_image and loss of
//       CLIPModel(return_loss=True) on the batch, and grad.<PEFT name> of every adapter weight
//   trainer_clip_parity text MODEL_DIR TOKENIZER_DIR OUT.safetensors TEXT [TEXT ...]
//       our tokenizer's ids with the special tokens, padded to the longest (input_ids, attention_mask), and the
//       text features (get_text_features) of the model for them
//
// BATCH holds pixel_values (float32, B x C x H x W) and input_ids (int64, B x T), optionally attention_mask
// (int64, B x T) and labels (int64, B).
#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "models/image/clip.h"
#include "models/image/clip_lora.h"
#include "models/image/image_model.h"
#include "memory/cpu_budget.h"
#include "train/tasks/contrastive/contrastive.h"
#include "train/activation_checkpointing.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"
#include "trainer/tokenizer.h"

namespace {

struct ClipBatch {
  at::Tensor pixels, input_ids, attention_mask, labels;
};

ClipBatch read_batch(const std::string& path) {
  auto file = trainer::SafetensorsFile::open(path);
  ClipBatch batch;
  auto has = [&](const std::string& name) {
    for (const auto& t : file.tensors())
      if (t.name == name) return true;
    return false;
  };
  batch.pixels = file.load("pixel_values", at::kFloat);
  if (has("input_ids")) batch.input_ids = file.load("input_ids", at::kLong);
  if (has("attention_mask")) batch.attention_mask = file.load("attention_mask", at::kLong);
  if (has("labels")) batch.labels = file.load("labels", at::kLong);
  return batch;
}

std::vector<std::string> split_labels(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

void require_grad(trainer::Module& model) {
  model.for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
}

void sgd(trainer::Module& model, double lr) {
  at::NoGradGuard no_grad;
  model.for_each_parameter([&](const std::string&, at::Tensor& p) {
    if (p.grad().defined()) p.sub_(p.grad(), lr);
  });
}

void add_grads(trainer::Module& model, trainer::NamedTensors& out) {
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) out.emplace_back("grad." + name, p.grad().contiguous());
  });
}

int forward(const std::string& model_dir, const std::string& batch_path, const std::string& out_path, bool training,
            bool checkpointing) {
  auto model = trainer::load_clip(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(training);
  if (checkpointing) model->set_block_runner(trainer::activation_checkpointing_runner());
  require_grad(*model);
  const ClipBatch batch = read_batch(batch_path);
  const trainer::ClipOutput output = model->forward(batch.pixels, batch.input_ids, batch.attention_mask, true);
  output.loss.backward();
  trainer::NamedTensors out = {{"logits_per_image", output.logits_per_image.detach().contiguous()},
                               {"image_embeds", output.image_embeds.detach().contiguous()},
                               {"text_embeds", output.text_embeds.detach().contiguous()},
                               {"loss", output.loss.detach().reshape({1})}};
  add_grads(*model, out);
  trainer::write_safetensors(out_path, out, {});
  return 0;
}

int train_step(const std::string& model_dir, const std::string& batch_path, const std::string& out_dir, double lr,
               uint64_t shard_bytes) {
  auto model = trainer::load_clip(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  require_grad(*model);
  const ClipBatch batch = read_batch(batch_path);
  model->forward(batch.pixels, batch.input_ids, batch.attention_mask, true).loss.backward();
  sgd(*model, lr);
  trainer::save_clip(*model, out_dir, shard_bytes);
  at::NoGradGuard no_grad;
  const at::Tensor logits = model->forward(batch.pixels, batch.input_ids, batch.attention_mask, false).logits_per_image;
  trainer::write_safetensors(out_dir + "/logits.safetensors", {{"logits", logits.contiguous()}}, {});
  return 0;
}

int classify(const std::string& model_dir, const std::string& batch_path, const std::string& out_path) {
  auto model = trainer::load_image_classifier(model_dir, trainer::ModelInit::kPretrained,
                                              at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  require_grad(*model);
  const ClipBatch batch = read_batch(batch_path);
  const at::Tensor logits = model->forward(batch.pixels);
  const at::Tensor loss = at::cross_entropy_loss(logits, batch.labels);
  loss.backward();
  trainer::NamedTensors out = {{"logits", logits.detach().contiguous()}, {"loss", loss.detach().reshape({1})}};
  add_grads(*model, out);
  trainer::write_safetensors(out_path, out, {});
  return 0;
}

int classify_step(const std::string& model_dir, const std::string& batch_path, const std::string& out_dir, double lr,
                  const std::vector<std::string>& labels) {
  auto model = trainer::load_image_classifier(model_dir, trainer::ModelInit::kPretrained,
                                              at::TensorOptions().dtype(at::kFloat), /*seed=*/7, labels);
  model->train(false);
  require_grad(*model);
  const ClipBatch batch = read_batch(batch_path);
  at::cross_entropy_loss(model->forward(batch.pixels), batch.labels).backward();
  sgd(*model, lr);
  trainer::save_image_classifier(*model, out_dir);
  at::NoGradGuard no_grad;
  trainer::write_safetensors(out_dir + "/logits.safetensors", {{"logits", model->forward(batch.pixels).contiguous()}},
                             {});
  return 0;
}

int text(const std::string& model_dir, const std::string& tokenizer_dir, const std::string& out_path,
         const std::vector<std::string>& texts) {
  const auto tokenizer = trainer::load_tokenizer(tokenizer_dir);
  const trainer::SpecialTokenTemplate special = tokenizer->special_token_template();
  std::vector<std::vector<int64_t>> rows;
  std::size_t longest = 0;
  for (const auto& t : texts) {
    std::vector<int64_t> ids(special.prefix.begin(), special.prefix.end());
    for (const int32_t id : tokenizer->encode(t)) ids.push_back(id);
    ids.insert(ids.end(), special.suffix.begin(), special.suffix.end());
    longest = std::max(longest, ids.size());
    rows.push_back(std::move(ids));
  }
  const int64_t pad = tokenizer->pad_id().value_or(tokenizer->eos_id().value_or(0));
  const auto b = static_cast<int64_t>(rows.size()), t = static_cast<int64_t>(longest);
  at::Tensor ids = at::full({b, t}, pad, at::kLong), mask = at::zeros({b, t}, at::kLong);
  for (int64_t i = 0; i < b; ++i)
    for (std::size_t j = 0; j < rows[static_cast<std::size_t>(i)].size(); ++j) {
      ids[i][static_cast<int64_t>(j)] = rows[static_cast<std::size_t>(i)][j];
      mask[i][static_cast<int64_t>(j)] = 1;
    }
  auto model = trainer::load_clip(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  at::NoGradGuard no_grad;
  const at::Tensor features = model->text_features(ids, mask);
  trainer::write_safetensors(out_path, {{"input_ids", ids}, {"attention_mask", mask}, {"text_features", features.contiguous()}},
                             {});
  return 0;
}

int lora(const std::string& model_dir, const std::string& batch_path, const std::string& out_dir,
         const std::string& towers, int64_t r, const std::vector<std::string>& targets) {
  auto model = trainer::load_clip(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  trainer::LoraConfig config;
  config.r = r;
  config.alpha = 2.0 * static_cast<double>(r);
  config.dropout = 0.0;
  config.target_modules = targets;
  auto adapters = trainer::apply_clip_lora(*model, config, /*seed=*/3, towers != "text", towers != "vision");
  {
    at::NoGradGuard no_grad;
    at::manual_seed(11);
    for (const auto& [path, layer] : adapters->layers()) layer->lora_B.normal_(0.0, 0.2);
  }
  trainer::write_clip_adapter(out_dir, *adapters, model_dir);
  const ClipBatch batch = read_batch(batch_path);
  const trainer::ClipOutput output = model->forward(batch.pixels, batch.input_ids, batch.attention_mask, true);
  output.loss.backward();
  trainer::NamedTensors out = {{"logits_per_image", output.logits_per_image.detach().contiguous()},
                               {"loss", output.loss.detach().reshape({1})}};
  for (const auto& [path, layer] : adapters->layers()) {
    out.emplace_back("grad." + path + ".lora_A.weight", layer->lora_A.grad().contiguous());
    out.emplace_back("grad." + path + ".lora_B.weight", layer->lora_B.grad().contiguous());
  }
  trainer::write_safetensors(out_dir + "/out.safetensors", out, {});
  return 0;
}

int bench(int64_t batch, int64_t micro, int repeats) {
  const nlohmann::json config = {
      {"model_type", "clip"},
      {"projection_dim", 128},
      {"text_config",
       {{"hidden_size", 256}, {"intermediate_size", 1024}, {"num_attention_heads", 4}, {"num_hidden_layers", 4},
        {"vocab_size", 1000}, {"max_position_embeddings", 32}, {"eos_token_id", 999}}},
      {"vision_config",
       {{"hidden_size", 256}, {"intermediate_size", 1024}, {"num_attention_heads", 4}, {"num_hidden_layers", 4},
        {"image_size", 64}, {"patch_size", 8}}}};
  trainer::ClipModel model(config, at::TensorOptions().dtype(at::kFloat));
  at::manual_seed(0);
  model.init_weights();
  model.train(true);
  require_grad(model);
  const at::Tensor pixels = at::randn({batch, 3, 64, 64});
  at::Tensor ids = at::randint(2, 999, {batch, 32}, at::kLong);
  ids.select(1, 31).fill_(999);
  std::vector<trainer::ContrastiveMicroBatch> micro_batches;
  for (int64_t first = 0; first < batch; first += micro) {
    trainer::ContrastiveMicroBatch mb;
    mb.pixel_values = pixels.slice(0, first, std::min(batch, first + micro));
    mb.input_ids = ids.slice(0, first, std::min(batch, first + micro));
    mb.first_example = first;
    micro_batches.push_back(mb);
  }
  const std::vector<std::string> sides = {"full batch, one graph", "gradient caching (batch negatives)",
                                          "micro-batch negatives"};
  std::map<std::string, std::vector<double>> seconds;
  std::map<std::string, int64_t> peak;
  for (int r = 0; r < repeats; ++r) {
    for (const auto& side : sides) {
      model.for_each_parameter([](const std::string&, at::Tensor& p) { p.mutable_grad() = at::Tensor(); });
      const int64_t base = trainer::cpu_memory_stats().allocated;
      trainer::reset_cpu_peak();
      const auto start = std::chrono::steady_clock::now();
      if (side == sides[0]) {
        model.forward(pixels, ids, {}, true).loss.backward();
      } else {
        trainer::ContrastiveOptions options;
        options.negatives = side == sides[1] ? trainer::ContrastiveNegatives::kBatch : trainer::ContrastiveNegatives::kMicroBatch;
        trainer::contrastive_forward_backward(model, micro_batches, options);
      }
      seconds[side].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      peak[side] = std::max(peak[side], trainer::cpu_memory_stats().peak - base);
    }
  }
  for (const auto& side : sides) {
    auto& s = seconds[side];
    std::sort(s.begin(), s.end());
    std::cout << nlohmann::json{{"side", side}, {"batch", batch}, {"micro_batch", side == sides[0] ? batch : micro},
                                {"seconds", s[s.size() / 2]}, {"peak_bytes", peak[side]}}
                     .dump()
              << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  trainer::install_cpu_budget();  // before any tensor: peak statistics for `bench`
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 4 && args[0] == "bench") return bench(std::stoll(args[1]), std::stoll(args[2]), std::stoi(args[3]));
    if (args.size() >= 4 && args[0] == "forward") {
      bool training = false, checkpointing = false;
      for (std::size_t i = 4; i < args.size(); ++i) {
        training = training || args[i] == "train";
        checkpointing = checkpointing || args[i] == "checkpointing";
      }
      return forward(args[1], args[2], args[3], training, checkpointing);
    }
    if ((args.size() == 5 || args.size() == 6) && args[0] == "train-step")
      return train_step(args[1], args[2], args[3], std::stod(args[4]),
                        args.size() == 6 ? std::stoull(args[5]) : uint64_t{5'000'000'000});
    if (args.size() == 4 && args[0] == "classify") return classify(args[1], args[2], args[3]);
    if ((args.size() == 5 || args.size() == 6) && args[0] == "classify-step")
      return classify_step(args[1], args[2], args[3], std::stod(args[4]),
                           args.size() == 6 ? split_labels(args[5]) : std::vector<std::string>{});
    if (args.size() == 7 && args[0] == "lora")
      return lora(args[1], args[2], args[3], args[4], std::stoll(args[5]), split_labels(args[6]));
    if (args.size() >= 5 && args[0] == "text")
      return text(args[1], args[2], args[3], std::vector<std::string>(args.begin() + 4, args.end()));
    std::cerr << "usage: trainer_clip_parity forward|train-step|classify|classify-step|lora|text|bench ... (see the source)\n";
    return 2;
  } catch (const trainer::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    if (!e.hint().empty()) std::cerr << "hint: " << e.hint() << "\n";
    return e.exit_code();
  }
}
