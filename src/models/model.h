// What every architecture provides to the rest of trainer, and how models are built from a config.json.
// Models hold only the maths: precision, activation checkpointing, LoRA and the memory policy wrap them from
// outside (ARCHITECTURE.md).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <nlohmann/json.hpp>

#include "models/module.h"
#include "trainer/tokenizer.h"

namespace trainer {

enum class ModelFamily { kSeq2Seq, kCausal };

// One collated micro-batch, on the model's device. Padding is on the right.
struct Batch {
  at::Tensor input_ids;       // (B, T) long: encoder input (seq2seq) or the whole sequence (causal)
  at::Tensor attention_mask;  // (B, T) 0/1
  at::Tensor labels;          // seq2seq: (B, L) decoder targets; causal: (B, T) unshifted, as transformers takes them;
                              // -100 = not trained on (padding, causal prompt tokens)
  at::Tensor decoder_attention_mask;  // seq2seq, optional (B, L): without it the decoder mask is causal only
  // Packed rows (data.packing, data/packing.h), else undefined. Segment ids (B, T) number the examples of a row
  // from 1 (0: padding); position ids (B, T) restart at 0 per example. Attention stays within a segment, RoPE and
  // T5's relative positions count within it, and a segment's first decoder input is the decoder start token.
  at::Tensor segment_ids{}, position_ids{};
  at::Tensor decoder_segment_ids{}, decoder_position_ids{};  // seq2seq (B, L)
};

// Per-sequence state of incremental decoding (key-value caches); generation only, never in training.
struct GenerationState {
  virtual ~GenerationState() = default;
};

class Linear;

// A mixture of experts' experts, held here as one linear layer per expert (as the Hub files store them), seen as
// transformers 5 holds them: per sparse block two stacked parameters under `path`, gate_up_proj (E, 2I, D: each
// expert's gate rows, then its up rows) and down_proj (E, D, I). PEFT's target_parameters name them so.
struct StackedExpertLayers {
  std::string path;                     // transformers' module path ("model.layers.0.mlp.experts")
  std::vector<Linear*> gate, up, down;  // per expert, this model's layers (owned by the model)
  // Called before each pass over the experts (a forward of the block, or its recomputation), when set.
  std::function<void()>* pass_hook = nullptr;
};

// One transformer block as a function of its tensor inputs (hidden states first), for wrappers such as
// activation checkpointing. It must capture nothing that needs gradients: every such tensor is an input.
using BlockFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
// Runs a block; the default calls it. Activation checkpointing installs one that recomputes it in backward.
using BlockRunner = std::function<at::Tensor(const BlockFn&, const std::vector<at::Tensor>&)>;

// Fully sharded data parallelism (distributed.shard_weights, src/distributed/fully_sharded.h) around each block:
// `run` is called with the block's module (a unit whose weights live sharded over the ranks) and the block as the
// block runner would run it; it gathers the unit's weights before, releases them after, and arranges the same for
// backward. Installed from outside, like the block runner, and independent of it.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual at::Tensor run(const Module& unit, const BlockFn& block, const std::vector<at::Tensor>& inputs) = 0;
};

// A model made of blocks that wrappers applied from outside wrap one by one: activation checkpointing (the block
// runner) and fully sharded data parallelism (the unit hooks, whose units are the blocks). The text models, the image
// classifiers (image/image_model.h) and CLIP (image/clip.h) are: each runs every block through run_block.
class ShardableModule : public Module {
 public:
  // config.json's model_type ("qwen2", "vit", "clip"): what messages about the model name.
  virtual const std::string& model_type() const = 0;

  // Wrappers applied from outside (activation checkpointing); an empty runner calls blocks directly.
  void set_block_runner(BlockRunner runner) { block_runner_ = std::move(runner); }
  bool has_block_runner() const { return static_cast<bool>(block_runner_); }
  void set_unit_hooks(std::shared_ptr<UnitHooks> hooks) { unit_hooks_ = std::move(hooks); }
  bool has_unit_hooks() const { return static_cast<bool>(unit_hooks_); }
  // The units of fully sharded data parallelism, in forward order: the blocks run through run_block, and modules run
  // through run_unit (a decoder's untied embeddings and head). Their parameters are used inside the unit alone,
  // except those named by parameters_used_outside_blocks (T5's relative attention bias, read once per stack before
  // its blocks run), which belong to no unit (the root). Empty: no units.
  virtual std::vector<const Module*> blocks() const { return {}; }
  virtual std::vector<std::string> parameters_used_outside_blocks() const { return {}; }

 protected:
  // `unit`: the block's module (for the unit hooks).
  at::Tensor run_block(const BlockFn& block, const std::vector<at::Tensor>& inputs, const Module* unit) const {
    if (unit_hooks_ && unit)
      return unit_hooks_->run(*unit, [this, &block](const std::vector<at::Tensor>& in) {
        return block_runner_ ? block_runner_(block, in) : block(in);
      }, inputs);
    return block_runner_ ? block_runner_(block, inputs) : block(inputs);
  }
  // A unit that is not a block (no activation checkpointing): the unit hooks alone. Its first input may be ids (an
  // embedding): then its parameters' gradients are final when they have accumulated.
  at::Tensor run_unit(const BlockFn& f, const std::vector<at::Tensor>& inputs, const Module* unit) const {
    return unit_hooks_ ? unit_hooks_->run(*unit, f, inputs) : f(inputs);
  }

 private:
  BlockRunner block_runner_;
  std::shared_ptr<UnitHooks> unit_hooks_;
};

class LanguageModel : public ShardableModule {
 public:
  virtual ModelFamily family() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual const nlohmann::json& hf_config() const = 0;

  // Final hidden states (B, L, D) and the targets (B, L) they predict. Causal models shift the labels by one
  // here (the last position predicts nothing: -100), so the logits line up with transformers' logits.
  virtual std::pair<at::Tensor, at::Tensor> hidden_and_targets(const Batch& batch) = 0;
  // The LM head: (..., D) -> (..., V); T5 with tied embeddings rescales by d_model^-0.5 first.
  virtual at::Tensor lm_head(const at::Tensor& hidden) = 0;
  // What lm_head computes, in parts: logits = (hidden * lm_head_scale()) @ lm_head_weight()^T. The fused loss
  // (train/fused_loss.h) uses them to compute the head's gradients itself; the weight is the input embedding when
  // the head is tied.
  virtual at::Tensor lm_head_weight() const = 0;
  virtual double lm_head_scale() const = 0;
  // Final-logit soft-capping (Gemma 2): lm_head returns cap * tanh(logits / cap); the fused loss applies it too.
  virtual std::optional<double> final_logit_softcap() const { return std::nullopt; }

  // Checkpoint names that are other names of one of our parameters (tied embeddings): (alias, canonical).
  // A checkpoint may hold them or not; saving writes only the canonical names.
  virtual std::vector<std::pair<std::string, std::string>> aliases() const = 0;
  // Whether the output projection shares the input embedding (then no lm_head.weight of its own).
  virtual bool lm_head_tied() const = 0;
  // Unties the LM head: gives it its own parameter, e.g. when a checkpoint holds a distinct lm_head.weight.
  virtual void untie_lm_head() = 0;

  // Hugging Face's initialisation scheme for this architecture, from the global generator (seed it first).
  virtual void init_weights() = 0;

  // Where the checkpoint's names differ from the module tree's (a multimodal checkpoint whose language model is
  // trained: transformers' files say "language_model.model.layers.0...", its modules "model.language_model.layers.0..."):
  // the checkpoint name of parameter `name`, and the parameter a checkpoint name stands for, or nullopt for a
  // tensor the model carries without using it (the vision tower and projector), loaded as stored and saved back
  // unchanged. The defaults: the same names, nothing carried.
  virtual std::string checkpoint_name(const std::string& name) const { return name; }
  virtual std::optional<std::string> parameter_name(const std::string& checkpoint_name) const {
    return checkpoint_name;
  }
  // The module path of the text model inside a multimodal model ("model.language_model"), else empty: PEFT
  // adapters then name their targets within it (the towers have layers of the same names).
  virtual std::string text_model_path() const { return {}; }
  // The experts of every sparse block that are linear layers here (StackedExpertLayers), in layer order; empty for
  // a dense model (and for Gemma 4, whose experts are stacked tensors here too).
  virtual std::vector<StackedExpertLayers> stacked_expert_layers() { return {}; }
  // The carried tensors by checkpoint name, in the checkpoint's dtype (filled by load_model).
  std::vector<std::pair<std::string, at::Tensor>>& carried_tensors() { return carried_; }

  // A mixture of experts' load-balancing loss (output_router_logits), which must be the effective batch's however
  // it is split and over however many ranks. routing_counts: the routing of one forward over `batch` without
  // gradients, per expert its top-k assignments over the sparse layers' real tokens, then the rows (sparse layers x
  // real tokens). set_routing_totals: the effective batch's counts (every micro-batch, every rank) for the training
  // forwards that follow; empty: each forward counts its own (the micro-batch is the batch). routing_loss: after a
  // training forward, this micro-batch's share of router_aux_loss_coef x the loss (a scalar with its gradient; the
  // shares of the effective batch's micro-batches add up to it), or undefined.
  virtual bool has_routing_loss() const { return false; }
  virtual int64_t routing_experts() const { return 0; }  // routing_counts() gives this many + 1 numbers
  virtual std::vector<double> routing_counts(const Batch& batch) {
    (void)batch;
    return {};
  }
  virtual void set_routing_totals(std::vector<double> totals) { (void)totals; }
  virtual at::Tensor routing_loss() { return {}; }
  // Since the last set_routing_totals: the effective batch's top-k assignments per expert (over the sparse layers'
  // real tokens) and this process's shares of the load-balancing loss (without its coefficient), summed.
  struct RoutingSummary {
    std::vector<double> assignments;
    double balancing_loss = 0;
  };
  virtual RoutingSummary routing_summary() const { return {}; }

  // Generation with a key-value cache over a batch of prompts (B, T) with their attention mask (B, T): causal
  // prompts padded on the left (positions count the real tokens, as transformers derives position ids from the
  // mask), seq2seq prompts padded anywhere (the encoder runs once). The cache is allocated for `new_tokens` more
  // decoding steps (more grow it). Returns the state and the logits (B, V) of each row's next token.
  virtual std::pair<std::unique_ptr<GenerationState>, at::Tensor> prefill(const at::Tensor& prompt_ids,
                                                                          const at::Tensor& attention_mask,
                                                                          int64_t new_tokens) = 0;
  // Feeds one token per row (B, 1); returns the logits (B, V) of the next.
  virtual at::Tensor decode_step(GenerationState& state, const at::Tensor& tokens) = 0;
  // Keeps the rows `rows` (long, on any device; the CPU saves seq2seq models a copy) of the state, in that order:
  // repeats rows for beam search, reorders beams, drops finished rows.
  virtual void select_rows(GenerationState& state, const at::Tensor& rows) = 0;
  virtual std::optional<int64_t> eos_token_id() const = 0;

 private:
  std::vector<std::pair<std::string, at::Tensor>> carried_;
};

// The sum of token losses (fp32) and the number of target tokens of one micro-batch. The training step divides
// by the target tokens of the whole effective batch, so any split gives the same gradient.
struct LossSum {
  at::Tensor loss_sum;  // scalar, fp32
  int64_t target_tokens = 0;
  at::Tensor routing_loss;  // LanguageModel::routing_loss() of the forward: added to the mean, not divided
  at::Tensor logits;    // (B, L, V) when asked for
};
LossSum forward_loss(LanguageModel& model, const Batch& batch, bool keep_logits = false);

// Builds the architecture that config.json names, with uninitialised parameters of `options` (dtype, device).
// Throws DataError for an unsupported model_type or a config value the model cannot honour.
std::unique_ptr<LanguageModel> build_model(const nlohmann::json& config, const c10::TensorOptions& options);

// precision.mode=fp16-mixed is refused for the T5 family (t5, mt5, umt5, longt5, ...): their activations overflow
// fp16 in the forward pass itself, where no loss scale helps. Throws UsageError (exit 2) naming `config_json` and
// the model_type, with the modes that work.
void check_fp16_supported(const std::string& model_type, const std::string& config_json);

// Fully sharded weights' units (distributed.shard_weights): for each parameter, in for_each_parameter's order, 0 when
// it belongs to the root (not in a block, or named by parameters_used_outside_blocks), i + 1 in block i.
std::vector<std::size_t> parameter_units(ShardableModule& model);

// Parameter counts for `inspect` and `plan`.
int64_t count_parameters(Module& model);

// How generate() chooses tokens; the names and meanings are transformers' GenerationConfig's.
enum class EarlyStopping {
  kHeuristic,  // false: stop a prompt's beams when no running beam can beat the worst kept one at today's length
  kWhenFull,   // true: stop as soon as num_beams hypotheses are finished
  kNever,      // "never": as the heuristic, but assume the longest length when length_penalty > 0
};
struct GenerateOptions {
  int64_t max_new_tokens = 32;
  double temperature = 0.0;  // 0: greedy or beam search; above 0: sampling
  double top_p = 1.0;
  int64_t top_k = 0;  // sampling from the k likeliest tokens only; 0: all
  std::optional<uint64_t> seed;
  int64_t num_beams = 1;  // above 1: beam search (greedy only, not with sampling)
  double length_penalty = 1.0;
  EarlyStopping early_stopping = EarlyStopping::kHeuristic;
  int64_t no_repeat_ngram_size = 0;     // no n-gram of this size occurs twice in a sequence (prompt included)
  std::vector<int64_t> eos_token_ids;   // empty: the model's eos_token_id
  std::optional<int64_t> pad_token_id;  // fills left padding; default the model's pad, else its EOS, else 0
  // Fully sharded weights, where every forward is a collective: called before each decoding step after the first
  // with whether this batch needs it; returns whether any rank's does (every rank calls it alike). While another
  // rank's batch goes on, a finished one steps on with its outputs unused. Empty: each batch stops by itself.
  std::function<bool(bool)> pace;
};
// A text prompt as the model saw inputs in training: a seq2seq input with its EOS (when add_eos), a causal
// prompt without one (the model continues it).
std::vector<int64_t> prompt_ids(const LanguageModel& model, const Tokenizer& tokenizer, std::string_view prompt,
                                bool add_eos);

// New token ids after the prompt (1, T), ending at EOS (included) or max_new_tokens. Batched generation:
// models/generation.h.
std::vector<int64_t> generate(LanguageModel& model, const at::Tensor& prompt_ids, const GenerateOptions& options);

}  // namespace trainer
