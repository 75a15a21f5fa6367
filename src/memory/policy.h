// The memory policy: which micro-batch the training step uses, how it shrinks after an out-of-memory error,
// what it turns on at the floor, and when it tries a larger one again. Every decision is recorded.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "trainer/config.h"
#include "trainer/data.h"

namespace trainer {

struct Adaptation {
  int64_t step = 0;
  int64_t old_micro_batch = 0;
  int64_t new_micro_batch = 0;
  std::string reason;  // "out of memory in backward", "regrow after 200 stable steps", "escalate: ..."
};

// The largest n in [1, limit] for which `fits(n)` holds, `fits` being monotone (what fits, any smaller size fits):
// 1, 2, 4, ... up to the first that does not fit, then bisection between. 0 when not even 1 fits. What
// micro_batch_size=auto runs, for text and images.
int64_t largest_that_fits(int64_t limit, const std::function<bool(int64_t)>& fits);

class MemoryPolicy {
 public:
  MemoryPolicy(const MemoryConfig& memory, const TrainingConfig& training);

  // The micro-batch size: examples, or in token-budget mode (training.micro_batch_tokens) padded tokens.
  int64_t micro_batch() const { return micro_batch_; }
  bool by_tokens() const { return by_tokens_; }
  void set_micro_batch(int64_t n, int64_t step, const std::string& reason);
  // The effective batch's micro-batches as consecutive (begin, count) parts: by count, or by padded tokens.
  std::vector<std::pair<int64_t, int64_t>> split(std::span<const Example> examples, bool seq2seq) const;
  // The same over packed rows (data.packing) of (input, target) tokens each: rows count as examples do.
  std::vector<std::pair<int64_t, int64_t>> split_rows(std::span<const std::pair<int64_t, int64_t>> sizes) const;

  // After an out-of-memory error at `step` in `where`: a smaller micro-batch (true), or false at the floor.
  // `single_examples`: the failed split already had one example per micro-batch (the floor in token mode).
  bool shrink(int64_t step, const std::string& where, bool single_examples = false);
  // At the floor: the next escalation step from memory.escalation not yet on, or empty when none is left.
  // smaller_loss_chunks is returned again each time it halves loss_chunk_size(), until that reaches
  // kMinLossChunkSize.
  std::string next_escalation(int64_t step);
  // The end of the ladder (train/device_move.h): records the device move `escalation` ("move_to_cpu", ...) made at
  // `step`, described as `what` ("cuda:0 -> cpu"). next_escalation never returns a device move.
  void record_device_move(int64_t step, const std::string& escalation, const std::string& what);
  bool escalated(const std::string& escalation) const;
  // Trained tokens per chunk of the chunked loss: training.loss_chunk_size until the escalation lowers it.
  int64_t loss_chunk_size() const { return loss_chunk_size_; }
  // After a step that completed; may grow the micro-batch back (memory.regrow_after_steps).
  void step_succeeded(int64_t step, int64_t batch_size);

  const std::vector<Adaptation>& adaptations() const { return adaptations_; }
  const std::vector<std::string>& escalations() const { return escalated_; }

  // The learned state, saved with checkpoints and restored on resume. A resumed run starts on the device its config
  // picks, so restore() keeps the record of earlier device moves in the adaptations but not as escalations used:
  // they can be made again.
  nlohmann::json state() const;
  void restore(const nlohmann::json& state);

 private:
  MemoryConfig memory_;
  bool by_tokens_;
  int64_t micro_batch_;
  int64_t largest_ok_;      // the largest micro-batch that has run out of memory: regrowth stays below it
  int64_t stable_steps_ = 0;
  int64_t loss_chunk_size_;
  std::vector<std::string> escalated_;
  std::vector<Adaptation> adaptations_;
};

// Whether `escalation` is one of the device moves that end the ladder (kDeviceEscalationSteps).
bool is_device_escalation(const std::string& escalation);

// Splits `count` examples into consecutive parts of at most `micro` (the last may be smaller).
std::vector<std::pair<int64_t, int64_t>> split_counts(int64_t count, int64_t micro);
// Splits examples into consecutive parts whose padded size (examples x (longest input + longest labels for
// seq2seq; longest input for causal)) stays within `tokens`; a part holds at least one example.
std::vector<std::pair<int64_t, int64_t>> split_tokens(std::span<const Example> examples, int64_t tokens, bool seq2seq);
// The same over units of (input, target) tokens.
std::vector<std::pair<int64_t, int64_t>> split_token_sizes(std::span<const std::pair<int64_t, int64_t>> sizes,
                                                           int64_t tokens);

}  // namespace trainer
