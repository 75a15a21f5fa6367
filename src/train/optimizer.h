// AdamW (decoupled weight decay, as torch.optim.AdamW) over a model's trainable parameters, with no decay on
// norms, biases and embeddings by default. The state (two moments, fp32 or bf16) is allocated when the optimizer is built, so
// an optimizer-state out-of-memory shows before step 1, and the update itself allocates nothing (it works through
// a fixed scratch buffer in chunks): an out-of-memory error cannot leave some parameters updated and others not.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "models/module.h"
#include "trainer/config.h"

namespace trainer {

class AdamW {
 public:
  AdamW(Module& model, const OptimizerConfig& config);

  // One update with learning rate `lr` from the gradients in the parameters' .grad().
  void step(double lr);
  // Global L2 norm of all gradients; with max_norm > 0, scales them so the norm is at most max_norm.
  // Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  void zero_grad();  // drops the gradients (frees their memory)

  int64_t steps() const { return step_; }
  int64_t trainable_parameters() const;
  int64_t state_bytes() const;

  // For checkpoints: moments by parameter name, and the step count. load_state requires both moments of every
  // trainable parameter, with its shape; otherwise it throws DataError naming `source` and the first missing
  // or mismatched tensor (and changes nothing).
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t steps,
                  const std::string& source);

 private:
  struct Slot {
    std::string name;
    at::Tensor* param;
    at::Tensor exp_avg, exp_avg_sq;  // optimizer.state_dtype (fp32 or bf16), same shape
    bool decay;
  };
  std::vector<Slot> slots_;
  OptimizerConfig config_;
  int64_t step_ = 0;
  at::Tensor scratch_a_, scratch_b_;  // fp32 chunk buffers for the update
  at::Tensor scratch_m_, scratch_v_;  // fp32 copies of a chunk of bf16 moments (state_dtype bf16 only)
  at::Tensor eps_, decay_;            // 0-dim operands, refilled each step (no allocation during the update)
};

// Whether a parameter is decayed by default: not norms, biases or embeddings (nor T5's relative bias table).
bool decays_by_default(const std::string& name);

// Learning rate at optimizer step `step` (0-based) of `total`: linear warmup, then constant, linear or cosine
// decay to lr x min_lr_ratio.
double scheduled_lr(const SchedulerConfig& scheduler, double peak_lr, int64_t step, int64_t total);

}  // namespace trainer
