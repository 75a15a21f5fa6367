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
  double reference_weights = 0;  // training.objective=dpo, full fine-tune: the frozen reference copy (in `weights`)
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
// config.json (`hf_config`); builds the architecture on the meta device only.
MemoryPlan plan_memory(const Config& config, const nlohmann::json& hf_config, const c10::Device& device,
                       double capacity, const std::string& capacity_source);

// memory.dequantized_base for a run whose frozen 4-bit weights take `copies` bytes dequantized, given `plan` (which
// does not count them): keep, per_use, or auto: keep when the configured micro-batch's peak (micro_batch_size=auto:
// the largest micro-batch the plan allows) still fits capacity minus the safety margin with the copies resident,
// and the micro-batch auto would pick does not shrink; an unknown capacity (the CPU without memory.limit) is the
// machine's RAM. Sets `reason` to a line for the log and the plan.
bool keep_dequantized_base(const MemoryPlan& plan, const Config& config, double copies, std::string& reason);

// The choice above for a run on `device` (the capacity as the run sees it: memory.limit, else the device's total,
// else the RAM), planned from model.path's config.json; per_use with the reason when the plan cannot be made.
bool choose_dequantized_base(const Config& config, const c10::Device& device, double copies, std::string& reason);

// The budget table and the recommendation, as `trainer plan` prints them.
void print_plan(const MemoryPlan& plan, const Config& config, std::ostream& out);

// The precision and optimizer choices (fp32 / bf16-mixed / bf16 with Kahan or stochastic updates; AdamW with fp32 or
// bf16 moments, Adafactor) with their fixed memory and the largest micro-batch each allows, least loss of precision
// first, and the first that fits, as `trainer plan` prints them after the plan.
void print_optimizer_choices(const Config& config, const nlohmann::json& hf_config, const c10::Device& device,
                             double capacity, const std::string& capacity_source, std::ostream& out);

// `trainer plan --config FILE`: resolves the device (without waiting), reads model.path/config.json, prints.
// With `world_size` > 1 (data parallelism) the figures are per rank: each rank trains its share of every
// effective batch and holds the whole model, its gradients and the optimizer state.
int run_plan(const Config& config, std::ostream& out, int64_t world_size = 1);

}  // namespace trainer
