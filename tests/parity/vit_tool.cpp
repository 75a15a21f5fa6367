// trainer_vit_parity: runs our ViT on inputs tests/parity/test_vit.py prepares, for comparison with transformers.
//
//   trainer_vit_parity forward MODEL_DIR BATCH.safetensors OUT.safetensors [train] [checkpointing]
//       logits, loss (mean cross-entropy over the batch, as transformers reports it) and grad.<name> of every
//       parameter; `train`: training mode (dropout on, keyed masks of step 0, seed 0); `checkpointing`: activation
//       checkpointing installed from outside
//   trainer_vit_parity train-step MODEL_DIR BATCH.safetensors OUT_DIR LR [LABEL,LABEL,...]
//       loads MODEL_DIR (with a new head for the given classes, if any), one SGD step on the mean loss, saves to
//       OUT_DIR, and writes OUT_DIR/logits.safetensors: the logits of the same batch after the step
//
// BATCH holds pixel_values (float32, B x C x H x W) and labels (int64, B).
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "models/image/vit.h"
#include "train/activation_checkpointing.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"

namespace {

struct ImageBatch {
  at::Tensor pixels, labels;
};

ImageBatch read_batch(const std::string& path) {
  auto file = trainer::SafetensorsFile::open(path);
  return {file.load("pixel_values", at::kFloat), file.load("labels", at::kLong)};
}

std::vector<std::string> split_labels(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

int forward(const std::string& model_dir, const std::string& batch_path, const std::string& out_path, bool training,
            bool checkpointing) {
  auto model = trainer::load_vit(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(training);
  if (checkpointing) model->set_block_runner(trainer::activation_checkpointing_runner());
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const ImageBatch batch = read_batch(batch_path);
  const at::Tensor logits = model->forward(batch.pixels);
  const at::Tensor loss = at::cross_entropy_loss(logits, batch.labels);
  loss.backward();
  trainer::NamedTensors out = {{"logits", logits.detach().contiguous()}, {"loss", loss.detach().reshape({1})}};
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) out.emplace_back("grad." + name, p.grad().contiguous());
  });
  trainer::write_safetensors(out_path, out, {});
  return 0;
}

int train_step(const std::string& model_dir, const std::string& batch_path, const std::string& out_dir, double lr,
               const std::vector<std::string>& labels) {
  auto model = trainer::load_vit(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat),
                                 /*seed=*/7, labels);
  model->train(false);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const ImageBatch batch = read_batch(batch_path);
  at::cross_entropy_loss(model->forward(batch.pixels), batch.labels).backward();
  {
    at::NoGradGuard no_grad;
    model->for_each_parameter([&](const std::string&, at::Tensor& p) {
      if (p.grad().defined()) p.sub_(p.grad(), lr);
    });
  }
  trainer::save_vit(*model, out_dir);
  at::NoGradGuard no_grad;
  trainer::write_safetensors(out_dir + "/logits.safetensors", {{"logits", model->forward(batch.pixels).contiguous()}},
                             {});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
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
                        args.size() == 6 ? split_labels(args[5]) : std::vector<std::string>{});
    std::cerr << "usage: trainer_vit_parity forward|train-step ... (see the source)\n";
    return 2;
  } catch (const trainer::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    if (!e.hint().empty()) std::cerr << "hint: " << e.hint() << "\n";
    return e.exit_code();
  }
}
