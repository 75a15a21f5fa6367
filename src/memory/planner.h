// `trainer plan`: the memory a training run needs, estimated before any weight is loaded or any device time is
// spent. Weights, gradients and optimizer state are counted exactly from the architecture built on the meta device;
// activations come from a per-architecture model of what our forward pass keeps for backward, calibrated against
// the CPU budget allocator (the coefficients and how they were measured are in planner.cpp).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <nlohmann/json_fwd.hpp>

#include "trainer/config.h"

namespace trainer {

// What one example of a task is to the planner, as its kind says (train/engine/task_kind.h): a text example is one
// sequence; a preference pair (DPO) is two, with the reference's forward beside them and, for a full fine-tune, a
// frozen copy of the weights.
struct ExampleShape {
  int64_t sequences = 1;           // sequences of the maximum lengths through forward and backward
  bool reference_forward = false;  // a forward of the sequences without autograd beside them (a reference model)
  bool reference_weights = false;  // a second, frozen copy of the weights, the size of the model's
  std::string unit = "example";    // the plan's rows: "activations per pair"
  std::string unit_note = "at the maximum lengths";
};

struct MemoryPlan {
  int64_t parameters = 0;
  int64_t trainable_parameters = 0;
  double weights = 0;          // bytes
  double gradients = 0;        // bytes, kept across the micro-batches of a step
  double optimizer_state = 0;  // bytes: optimizer_state_bytes() of every trainable parameter
  // Per trainable tensor, in the optimizer's order: elements and optimizer-state bytes (for ZeRO-1's shares).
  std::vector<int64_t> trainable_numels;
  std::vector<double> trainable_state_bytes;
  // Per example at the maximum lengths: what forward keeps for backward, plus the largest transient of backward.
  double activations_per_example = 0;
  double activations_per_example_checkpointed = 0;
  double loss_per_example = 0;   // logits, log-probabilities and their gradients without chunked loss
  // Chunked (fused) loss: per trained token of a chunk, its fp32 logits (turned into their gradient in place) and
  // the compute-dtype copy the head's matmuls take; per example, the hidden states' gradient it fills; once per
  // micro-batch, transients that do not depend on the chunk (the head weight's gradient in the compute dtype).
  double loss_chunk_bytes_per_token = 0;
  double loss_rows_per_example = 0;
  double loss_fixed = 0;
  int64_t loss_chunk_size = 0;       // training.loss_chunk_size
  int64_t targets_per_example = 0;   // trained positions of one example at the maximum lengths
  double workspace = 0;          // allocator and library workspaces outside the tensors above
  double capacity = 0;           // memory.limit, else the device's total; 0: unknown
  std::string capacity_source;
  int64_t longest_example_tokens = 0;  // input (+ target for seq2seq) at the maximum lengths
  double safety_margin = 0;      // fraction of capacity left free (memory.auto_safety_margin)
  int64_t batch_size = 0;
  // model.quantize: the bytes of every 4-bit weight dequantized to the compute dtype, whether the run keeps them
  // resident (memory.dequantized_base; then they are counted in `weights`) and why.
  double dequantized_base = 0;
  bool keeps_dequantized_base = false;
  double reference_weights = 0;  // ExampleShape::reference_weights: the frozen reference copy (in `weights`)
  std::string unit = "example";  // ExampleShape::unit and unit_note, for the plan's rows
  std::string unit_note = "at the maximum lengths";
  std::string dequantized_base_reason;

  // The chunked loss's bytes with `micro` examples per micro-batch and chunks of `chunk` tokens (0: the config's).
  double loss_chunked(int64_t micro, int64_t chunk = 0) const;
  // Peak bytes of a training step with `micro` examples per micro-batch (chunked loss: chunks of `chunk` tokens,
  // 0: the config's).
  double peak(int64_t micro, bool checkpointing, bool chunked_loss, int64_t chunk = 0) const;
  // The largest micro-batch (at most batch_size) whose peak fits in capacity minus the margin; 0 when none.
  int64_t largest_micro_batch(bool checkpointing, bool chunked_loss, int64_t chunk = 0) const;
  // The largest loss chunk, halving from the config's down to kMinLossChunkSize as the smaller_loss_chunks
  // escalation does, with which `micro` examples fit (checkpointing and chunked loss on); 0 when none does.
  int64_t fitting_loss_chunk_size(int64_t micro) const;
};

// Estimates the run `config` describes on `device` with `capacity` bytes (0: unknown) from the model's
// config.json (`hf_config`), an example being `shape`; builds the architecture on the meta device only.
MemoryPlan plan_memory(const Config& config, const nlohmann::json& hf_config, const c10::Device& device,
                       double capacity, const std::string& capacity_source, const ExampleShape& shape = {});

// memory.dequantized_base for a run whose frozen 4-bit weights take `copies` bytes dequantized, given `plan` (which
// does not count them): keep, per_use, or auto: keep when the configured micro-batch's peak (micro_batch_size=auto:
// the largest micro-batch the plan allows) still fits capacity minus the safety margin with the copies resident,
// and the micro-batch auto would pick does not shrink; an unknown capacity (the CPU without memory.limit) is the
// machine's RAM. Sets `reason` to a line for the log and the plan.
bool keep_dequantized_base(const MemoryPlan& plan, const Config& config, double copies, std::string& reason);

// The choice above for a run on `device` (the capacity as the run sees it: memory.limit, else the device's total,
// else the RAM), planned from model.path's config.json; per_use with the reason when the plan cannot be made.
bool choose_dequantized_base(const Config& config, const c10::Device& device, double copies, std::string& reason,
                             const ExampleShape& shape = {});

// Fully sharded weights on `world` ranks (distributed.shard_weights): `plan` (the whole model's) becomes one rank's.
// Each rank keeps 1/N of the weights, gradients and optimizer state, and holds beside them what is gathered at once:
// the root (what no unit holds: the final norm, a tied embedding and head) for a whole attempt with its full
// gradient, and the largest unit (a block; an untied model's embeddings or head) with its gradient during its
// backward, twice with distributed.prefetch (the next unit's weights gathered while one computes; with
// distributed.reshard_after_forward=false every unit from its forward to its backward); gathered
// weights and gradients take distributed.param_dtype's and reduce_dtype's bytes. Returns a line that says so.
std::string plan_fully_sharded(MemoryPlan& plan, const Config& config, const nlohmann::json& hf_config, int64_t world);

// The budget table and the recommendation, as `trainer plan` prints them.
void print_plan(const MemoryPlan& plan, const Config& config, std::ostream& out);

// The precision and optimizer choices (fp32 / bf16-mixed / bf16 with Kahan or stochastic updates; AdamW with fp32 or
// bf16 moments, Adafactor) with their fixed memory and the largest micro-batch each allows, least loss of precision
// first, and the first that fits, as `trainer plan` prints them after the plan.
void print_optimizer_choices(const Config& config, const nlohmann::json& hf_config, const c10::Device& device,
                             double capacity, const std::string& capacity_source, std::ostream& out,
                             const ExampleShape& shape = {});

// What `trainer plan` plans against: memory.limit, else the device's total (0 when neither: the CPU without a
// limit), and a line that says which.
struct PlanCapacity {
  c10::Device device{c10::kCPU};
  std::string device_description;
  double capacity = 0;
  std::string source;
};
PlanCapacity plan_capacity(const Config& config);

// `trainer plan --config FILE` for a language model (text and preference tasks): resolves the device (without
// waiting), reads model.path/config.json, prints. With `world_size` > 1 (data parallelism) the figures are per
// rank: each rank trains its share of every effective batch and holds the whole model, its gradients and the
// optimizer state.
int run_plan(const Config& config, std::ostream& out, int64_t world_size = 1, const ExampleShape& shape = {});

// `trainer plan` for an image classifier, or the image tower of a CLIP (`contrastive`): the fixed memory of the
// mode, activations per image at the model's image size, and what fits.
int run_image_plan(const Config& config, std::ostream& out, int64_t world_size, bool contrastive);

// The fixed part of an image classifier's (or with `clip`, a CLIP's) run, counted on a shape-only model (the meta
// device: nothing is allocated): weights in their precision; the trained parameters' fp32 gradients and AdamW
// moments (a linear probe trains the head, a locked image tower leaves CLIP's vision side out; LoRA adapters are
// small beside the base and are not counted; Adafactor's row and column statistics neither).
MemoryPlan plan_image_run(const Config& config, bool clip);

}  // namespace trainer
