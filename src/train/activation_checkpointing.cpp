// Activation checkpointing as a custom autograd Function (LibTorch has no torch.utils.checkpoint).
#include "train/activation_checkpointing.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "models/dropout.h"
#include "train/precision.h"
#include "train/rng.h"

namespace trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The block function travels through the autograd context as a capsule (IValue needs no registration for it),
// with the dropout context of its forward: backward may run on another thread (the autograd engine's device
// threads), where the step's context is not current.
struct BlockHolder : torch::CustomClassHolder {
  BlockHolder(BlockFn f, std::shared_ptr<const DropoutContext> d) : fn(std::move(f)), dropout(std::move(d)) {}
  BlockFn fn;
  std::shared_ptr<const DropoutContext> dropout;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // inputs[0] is a dummy that requires grad, so backward runs even when no real input needs a gradient (frozen
  // embeddings under LoRA); the block's inputs follow.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<BlockHolder> holder, at::TensorList inputs) {
    const at::Device device = inputs[1].device();
    ctx->saved_data["block"] = at::IValue::make_capsule(holder);
    ctx->saved_data["rng"] = get_rng_state(device);
    if (!device.is_cpu()) ctx->saved_data["rng_cpu"] = get_rng_state(at::Device(at::kCPU));
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(device.type());
    ctx->saved_data["autocast_dtype"] = static_cast<int64_t>(at::autocast::get_autocast_dtype(device.type()));
    ctx->save_for_backward(inputs.vec());
    // Run exactly as the recomputation will (gradients on, detached inputs), so that kernels that choose their
    // algorithm by grad mode (scaled_dot_product_attention on the CPU) draw the same dropout masks; the graph is
    // dropped with the local tensors at once, so only the output outlives the block.
    at::AutoGradMode grad_on(true);
    return {holder->fn(detached(inputs)).detach()};
  }

  // The block's inputs (after the dummy), cut from the outer graph, requiring grad where the originals did.
  static std::vector<at::Tensor> detached(at::TensorList all) {
    std::vector<at::Tensor> inputs;
    for (std::size_t i = 1; i < all.size(); ++i) {
      const at::Tensor& t = all[i];
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    }
    return inputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Device device = saved[1].device();
    auto holder = c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());

    const std::vector<at::Tensor> inputs = detached(saved);
    // Recompute with the forward's dropout context (the same keyed masks), RNG state (what LibTorch's generator
    // draws, for the benchmark's generator dropout) and autocast state, then put the current RNG state back.
    const at::Tensor rng_now = get_rng_state(device);
    const at::Tensor cpu_rng_now = device.is_cpu() ? at::Tensor() : get_rng_state(at::Device(at::kCPU));
    set_rng_state(device, ctx->saved_data["rng"].toTensor());
    if (!device.is_cpu()) set_rng_state(at::Device(at::kCPU), ctx->saved_data["rng_cpu"].toTensor());
    at::Tensor output;
    {
      at::AutoGradMode grad_on(true);
      const DropoutScope dropout(holder->dropout);
      AutocastScope autocast(ctx->saved_data["autocast"].toBool(), device.type(),
                             static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt()));
      output = holder->fn(inputs);
    }
    set_rng_state(device, rng_now);
    if (!device.is_cpu()) set_rng_state(at::Device(at::kCPU), cpu_rng_now);

    if (output.requires_grad()) torch::autograd::backward({output}, {grad_outputs[0]});
    variable_list grads = {at::Tensor(), at::Tensor()};  // the holder, the dummy
    for (const auto& input : inputs) grads.push_back(input.defined() && input.requires_grad() ? input.grad() : at::Tensor());
    return grads;
  }
};

}  // namespace

BlockRunner activation_checkpointing_runner() {
  return [](const BlockFn& fn, const std::vector<at::Tensor>& inputs) {
    if (!at::GradMode::is_enabled()) return fn(inputs);  // evaluation and generation keep nothing anyway
    std::vector<at::Tensor> all;
    all.push_back(at::empty({0}, inputs[0].options().dtype(at::kFloat)).requires_grad_(true));
    all.insert(all.end(), inputs.begin(), inputs.end());
    return CheckpointFunction::apply(c10::make_intrusive<BlockHolder>(fn, current_dropout_context()),
                                     at::TensorList(all))[0];
  };
}

void apply_activation_checkpointing(LanguageModel& model) { model.set_block_runner(activation_checkpointing_runner()); }

void remove_activation_checkpointing(LanguageModel& model) { model.set_block_runner({}); }

}  // namespace trainer
