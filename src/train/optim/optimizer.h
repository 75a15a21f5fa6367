// The optimizers over a model's trainable parameters, behind one interface the training step holds: AdamW
// (decoupled weight decay, as torch.optim.AdamW) and Adafactor (as transformers.optimization.Adafactor), with no
// decay on norms, biases and embeddings by default.
//
// Contracts both keep:
// - The state is allocated when the optimizer is built, so an optimizer-state out-of-memory shows before step 1,
//   and the update itself allocates nothing (it works through fixed scratch buffers in chunks, or, for fp32
//   AdamW, ATen's fused kernel in place): an out-of-memory error cannot leave some parameters updated and others
//   not.
// - The update is computed in fp32 whatever the parameter's dtype. Into bf16 parameters (precision.mode=bf16) it is
//   written per optimizer.bf16_update: stochastic rounding (unbiased; the random bits are a pure function of
//   training.seed, the optimizer step, the parameter's index and the element's offset, so resume and any
//   micro-batch split give the same weights), Kahan compensation (a bf16 buffer per parameter holding what
//   rounding lost, added back before the next update; saved with the state), or round to nearest (small updates
//   are lost). bf16 AdamW moments are rounded the same way (stochastically unless nearest).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include "memory/optimizer_footprint.h"
#include "models/module.h"
#include "trainer/config.h"

namespace trainer {

// ZeRO-1 (distributed.shard_optimizer): this rank keeps optimizer state for, and updates, only the trainable
// parameters it owns. Whole parameters, not flat ranges: Adafactor's factored statistics and its update RMS are
// per parameter, stochastic rounding is keyed by (parameter, offset), and checkpoint names stay per parameter, so
// a sharded step computes exactly the unsharded step's numbers and any world size reads any checkpoint.
//
// Fully sharded weights (distributed.shard_weights) are the other way: the optimizer's parameters are this rank's
// pieces (flat ranges) of the model's parameters. `pieced` lists every sharded trainable parameter with its whole
// shape, the same list in the same order on every rank, and where this rank's piece starts in its flattened elements
// (-1: this rank holds none of it). AdamW needs none of it (element by element); Adafactor sums its row and column
// statistics and its RMS values over the ranks (`sum_floats` in place, `sum_doubles`), so that every rank computes
// the unsharded update's numbers for its elements.
struct PiecedParameter {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = -1;
  // The parameter's index among the model's trainable parameters: with where the piece starts, what a bf16 piece's
  // stochastic rounding is keyed by, so that each element rounds as it does in one process (-1: the piece's own).
  int64_t key = -1;
};
struct OptimizerShard {
  int rank = 0;
  int world = 1;
  std::vector<PiecedParameter> pieced;
  std::function<void(at::Tensor&)> sum_floats;
  std::function<void(std::vector<double>&)> sum_doubles;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual const char* name() const = 0;  // "AdamW", "Adafactor"
  // One update with learning rate `lr` from the gradients in the parameters' .grad().
  virtual void step(double lr) = 0;
  // Global L2 norm of all gradients; with max_norm > 0, scales them so the norm is at most max_norm.
  // Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // The two halves of clip_grad_norm, for data parallelism (the squared norms summed over the ranks in between):
  // the sum of squares of the gradients present (may run out of memory: small temporaries), then the scaling of
  // those gradients by the clip factor for `norm` (in place, allocates nothing). clip_to returns `norm`.
  double squared_grad_norm() const;
  double clip_to(double norm, double max_norm);
  void zero_grad();  // drops the gradients (frees their memory)
  // The trainable parameters' gradients that exist (views of the parameters' .grad(), for in-place changes).
  std::vector<at::Tensor> gradients() const;

  int64_t steps() const { return step_; }
  // Fully sharded weights: whether state tensor `name` is kept whole (not a piece of its parameter's elements, as
  // Adafactor's row and column statistics): checkpoints write it whole from every rank that holds it.
  virtual bool whole_state(const std::string& name) const {
    (void)name;
    return false;
  }
  // ZeRO-1: each trainable parameter's owner rank (all 0 unsharded), and whether this rank owns parameter i.
  const std::vector<int>& owners() const { return owners_; }
  bool owns(std::size_t i) const { return owners_[i] == shard_.rank; }
  const OptimizerShard& shard() const { return shard_; }
  int64_t trainable_parameters() const;
  // Bytes of optimizer state on this rank (its shard under ZeRO-1), Kahan compensation included.
  int64_t state_bytes() const;

  // For checkpoints: the state by tensor name, and the step count. load_state requires every state tensor of
  // every trainable parameter, with its shape (Kahan compensation may be absent: it starts at zero); otherwise it
  // throws DataError naming `source` and the first missing or mismatched tensor (and changes nothing).
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t steps,
                  const std::string& source);

  // Re-creates every tensor the optimizer owns (its state, Kahan compensation, the update's scratch buffers) on
  // `device` with the same values: a copy even onto the same device. The parameters are the model's and move with
  // it, before this (train/device_move.h); the optimizer reaches them through their slots.
  void move_to(const c10::Device& device);

 protected:
  struct Param {
    std::string name;
    at::Tensor* param;
    bool decay;
    at::Tensor compensation;  // bf16_update=kahan, bf16 parameters: what rounding lost (bf16, same shape)
  };
  // Collects the trainable parameters of `model`; `seed` keys stochastic rounding; `shard` picks the parameters
  // this rank keeps state for (derived constructors allocate state only where owns(i)).
  Optimizer(Module& model, const OptimizerConfig& config, uint64_t seed, OptimizerShard shard);

  // The optimizer's own state tensors, as named in checkpoints, in a fixed order.
  virtual std::vector<std::pair<std::string, at::Tensor>> own_state() const = 0;
  virtual int64_t own_state_bytes() const = 0;
  // Every tensor the derived optimizer holds (state and scratch), for move_to.
  virtual void for_each_own_tensor(const std::function<void(at::Tensor&)>& visit) = 0;

  // Derived constructors call this with their chunk size: Kahan compensation needs an fp32 copy of its chunk
  // (adding bf16 to fp32 in place would allocate a converted copy).
  void allocate_compensation_scratch(int64_t chunk);
  // A parameter chunk [begin, begin + n) as fp32 master values in `scratch` (the parameter itself when fp32; with
  // Kahan compensation, weight + compensation).
  at::Tensor load_master(std::size_t index, const at::Tensor& flat_param, int64_t begin, int64_t n, at::Tensor scratch);
  // Writes the updated master chunk back (a no-op for fp32 parameters, whose master is the parameter); `spare` is
  // an fp32 scratch chunk of at least n elements that may be overwritten.
  void store_master(std::size_t index, at::Tensor& flat_param, int64_t begin, int64_t n, const at::Tensor& master,
                    const at::Tensor& spare);
  // Rounds an fp32 chunk into a bf16 state chunk (stream: which state tensor of the parameter).
  void store_bf16_state(at::Tensor& dst, const at::Tensor& src, std::size_t index, uint64_t stream, int64_t begin);

  std::vector<Param> params_;
  // Per parameter, what stochastic rounding is keyed by: its index and the offset of its first element (a piece of a
  // sharded parameter: the whole parameter's index and the piece's place in it; else i and 0).
  std::vector<uint64_t> rounding_index_;
  std::vector<int64_t> rounding_offset_;
  OptimizerShard shard_;
  std::vector<int> owners_;  // per parameter
  at::Tensor compensation_scratch_;  // fp32, defined when some parameter has Kahan compensation
  OptimizerConfig config_;
  uint64_t seed_;
  int64_t step_ = 0;
};

class AdamW final : public Optimizer {
 public:
  // `allow_fused` false keeps the chunked update even where the fused kernel applies (for comparisons).
  AdamW(Module& model, const OptimizerConfig& config, uint64_t seed = 0, bool allow_fused = true,
        OptimizerShard shard = {});
  const char* name() const override { return "AdamW"; }
  void step(double lr) override;
  bool fused() const { return fused_; }

 private:
  void fused_step(double lr);
  std::vector<std::pair<std::string, at::Tensor>> own_state() const override;
  int64_t own_state_bytes() const override;
  void for_each_own_tensor(const std::function<void(at::Tensor&)>& visit) override;

  // state_dtype=int8: bitsandbytes' AdamW8bit (optim.AdamW8bit, its CPU update op for op) in ATen ops on the
  // parameters' own device, so a CUDA run never goes through the host: the 8-bit moments are dequantized (code *
  // block absmax), updated in fp32, applied, and quantized again, in chunks of whole 256-element blocks through
  // fixed scratch buffers. Parameters under 4096 elements (min_8bit_size) keep fp32 moments, as bitsandbytes does.
  void int8_step(double lr);
  void int8_update_chunk(std::size_t index, const at::Tensor& param, const at::Tensor& grad, int64_t begin,
                         int64_t n, double lr);

  struct Int8Moments {
    at::Tensor state1, state2;       // uint8 codes: signed dynamic map (first moment), unsigned (second)
    at::Tensor absmax1, absmax2;     // fp32, one per 256 elements
    at::Tensor exp_avg, exp_avg_sq;  // fp32 moments instead, for parameters under 4096 elements
    at::Tensor step;                 // 0-dim int64 on the CPU: this parameter's update count (bitsandbytes' "step")
  };
  std::vector<Int8Moments> int8_;  // per parameter, when state_dtype is int8
  // The two dynamic maps (256 fp32 each) and their quantization lookup tables (65536 uint8 each), and the chunk
  // scratch (fp32 moments and a temporary, int32 indices, fp64 for the exact rounding slot, fp32 block scales).
  at::Tensor int8_map1_, int8_map2_, int8_lut1_, int8_lut2_;
  at::Tensor int8_m_, int8_v_, int8_tmp_, int8_index_, int8_slot_, int8_inverse_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // per parameter: optimizer.state_dtype (fp32 or bf16)
  at::Tensor scratch_a_, scratch_b_;  // fp32 chunk buffers for the update
  at::Tensor scratch_m_, scratch_v_;  // fp32 copies of a chunk of bf16 moments (state_dtype bf16 only)
  at::Tensor eps_, decay_;            // 0-dim operands, refilled each step (no allocation during the update)
  bool fused_ = false;
  at::Tensor step_count_;             // fused: the step as a 0-dim fp32 tensor, the kernel's state_steps
};

// Adafactor as transformers.optimization.Adafactor: for parameters of 2 or more dimensions, second moments
// factored into row and column statistics over the last two dimensions; unfactored for vectors; beta2 at step t
// 1 - t^decay_rate; eps pair (adafactor_eps1, adafactor_eps2); update clipped to RMS clip_threshold; optional
// first moment (adafactor_beta1, with beta1); scale_parameter, relative_step, warmup_init. Its state is fp32.
//
// Over fully sharded weights (OptimizerShard::pieced) a parameter's row and column statistics are kept whole by every
// rank holding a piece of it (they are small: rows + columns per matrix), the unfactored statistics and the first
// moment as pieces; each step sums the pieces' row and column sums of g^2 + eps1 over the ranks, then their squares
// of the parameter and of the update (RMS): two collectives per step for all parameters.
class Adafactor final : public Optimizer {
 public:
  Adafactor(Module& model, const OptimizerConfig& config, uint64_t seed = 0, OptimizerShard shard = {});
  const char* name() const override { return "Adafactor"; }
  void step(double lr) override;
  bool whole_state(const std::string& name) const override;

 private:
  struct State {
    int64_t matrices = 1, rows = 1, cols = 1;  // factored: the parameter as (matrices, rows, cols)
    bool factored = false;
    at::Tensor row, col;     // factored: (..., rows) and (..., cols) as transformers shapes them
    at::Tensor sq;           // unfactored: same shape as the parameter (over sharded weights: as its piece)
    at::Tensor exp_avg;      // with adafactor_beta1
  };
  // A sharded parameter (OptimizerShard::pieced): its piece's index in params_ (-1: none on this rank), where the
  // piece starts, and where its row and column sums lie in sums_.
  struct Pieced {
    int64_t index = -1;
    int64_t offset = 0;
    int64_t numel = 0;  // the whole parameter's
    State layout;       // matrices, rows, cols, factored (no tensors)
    int64_t row_at = 0, col_at = 0;
  };
  void step_pieced(double relative, double beta2t);
  // rsqrt(row / mean(row)) and rsqrt(col) of matrix m into row_factor_ and col_factor_.
  void factors(const State& s, int64_t m);
  std::vector<std::pair<std::string, at::Tensor>> own_state() const override;
  int64_t own_state_bytes() const override;
  void for_each_own_tensor(const std::function<void(at::Tensor&)>& visit) override;
  // The unscaled update of rows [r0, r0 + n) of matrix `m` (factored) or elements [r0, r0 + n) (unfactored),
  // into `out` (fp32, n x cols or n elements); `scratch` (as large) holds an fp32 copy of a bf16 gradient chunk.
  void unscaled_update(const State& s, const at::Tensor& grad, int64_t m, int64_t r0, int64_t n, at::Tensor& out,
                       const at::Tensor& scratch);

  std::vector<State> state_;
  std::vector<Pieced> pieced_;
  std::vector<bool> is_piece_;  // per parameter: a piece of a sharded parameter (stepped by step_pieced)
  at::Tensor sums_;             // fp32: every sharded factored parameter's row sums, then column sums
  int64_t chunk_ = 0;
  at::Tensor scratch_a_, scratch_b_, scratch_c_;  // fp32 chunk buffers
  at::Tensor row_factor_, col_factor_, col_sum_;  // fp32, the largest rows / cols of one parameter
  at::Tensor sum_, scalar_a_, scalar_b_, scalar_c_;  // 0-dim fp32 operands
};

// The optimizer optimizer.name selects, over the trainable parameters of `model`. Logs a warning when
// optimizer.bf16_update=nearest meets bf16 parameters or moments.
std::unique_ptr<Optimizer> make_optimizer(Module& model, const OptimizerConfig& config, uint64_t seed,
                                          OptimizerShard shard = {});

// Whether a parameter is decayed by default: not norms, biases or embeddings (nor T5's relative bias table).
bool decays_by_default(const std::string& name);

// Learning rate at optimizer step `step` (0-based) of `total`: linear warmup, then constant, linear or cosine
// decay to lr x min_lr_ratio.
double scheduled_lr(const SchedulerConfig& scheduler, double peak_lr, int64_t step, int64_t total);

}  // namespace trainer
