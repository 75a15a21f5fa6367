// The configuration: one struct per JSON section, one member per key, defaults written once here.
//
// Every struct lists its keys in visit(), in file order, with a one-line description. Parsing, --set overrides,
// serialisation, the start-up table and the README's reference all walk visit(), so a key added here is
// parsed, checked, printed and saved everywhere at once.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "trainer/errors.h"

namespace trainer {

// ---- value types with their own JSON spelling --------------------------------------------------------------

// A number of bytes; JSON accepts an integer or a string with a unit: "24GiB", "512MiB", "5GB", "1.5GiB".
struct ByteSize {
  std::uint64_t bytes = 0;
  bool operator==(const ByteSize&) const = default;
};
// Parses "24GiB" and friends; throws std::invalid_argument with the reason.
ByteSize parse_byte_size(const std::string& text);
// The shortest exact spelling: "24GiB", "5GB", "1536B"; "0" for zero.
std::string format_byte_size(ByteSize size);
// Rounded for people: "1.50 GiB".
std::string human_bytes(double bytes);

// A micro-batch size: a fixed count, or "auto" (the memory policy probes for the largest that fits).
struct MicroBatchSize {
  bool is_auto = true;
  std::int64_t value = 0;  // meaningful when !is_auto
  static MicroBatchSize automatic() { return {}; }
  static MicroBatchSize fixed(std::int64_t n) { return {false, n}; }
  bool operator==(const MicroBatchSize&) const = default;
};

// Enumerations are spelled in JSON by these names.
template <class E>
struct EnumName {
  E value;
  const char* name;
};

// Beam search's stopping rule, as transformers' GenerationConfig.early_stopping spells it: false, true or "never".
enum class GenerateEarlyStopping { kFalse, kTrue, kNever };

// How checkpoint.keep_best compares checkpoint.best_metric: auto is min for the loss, max for any other metric.
enum class BestMode { kAuto, kMin, kMax };
inline constexpr EnumName<BestMode> kBestModeNames[] = {
    {BestMode::kAuto, "auto"}, {BestMode::kMin, "min"}, {BestMode::kMax, "max"}};
inline std::span<const EnumName<BestMode>> enum_names(BestMode) { return kBestModeNames; }

enum class ModelInit { kPretrained, kRandom };
inline constexpr EnumName<ModelInit> kModelInitNames[] = {{ModelInit::kPretrained, "pretrained"},
                                                          {ModelInit::kRandom, "random"}};
inline std::span<const EnumName<ModelInit>> enum_names(ModelInit) { return kModelInitNames; }

// model.quantize: the frozen base's linear layers in 4 bits, as bitsandbytes' Linear4bit holds them (QLoRA).
enum class QuantizeMode { kNone, kNf4, kFp4 };
inline constexpr EnumName<QuantizeMode> kQuantizeModeNames[] = {
    {QuantizeMode::kNone, "none"}, {QuantizeMode::kNf4, "nf4"}, {QuantizeMode::kFp4, "fp4"}};
inline std::span<const EnumName<QuantizeMode>> enum_names(QuantizeMode) { return kQuantizeModeNames; }

enum class TokenizerKind { kAuto, kSentencePiece, kBpe };
inline constexpr EnumName<TokenizerKind> kTokenizerKindNames[] = {{TokenizerKind::kAuto, "auto"},
                                                                  {TokenizerKind::kSentencePiece, "sentencepiece"},
                                                                  {TokenizerKind::kBpe, "bpe"}};
inline std::span<const EnumName<TokenizerKind>> enum_names(TokenizerKind) { return kTokenizerKindNames; }

enum class OverlengthPolicy { kTruncate, kSkip };
inline constexpr EnumName<OverlengthPolicy> kOverlengthPolicyNames[] = {{OverlengthPolicy::kTruncate, "truncate"},
                                                                        {OverlengthPolicy::kSkip, "skip"}};
inline std::span<const EnumName<OverlengthPolicy>> enum_names(OverlengthPolicy) { return kOverlengthPolicyNames; }

enum class BadRecordPolicy { kError, kSkip };
inline constexpr EnumName<BadRecordPolicy> kBadRecordPolicyNames[] = {{BadRecordPolicy::kError, "error"},
                                                                      {BadRecordPolicy::kSkip, "skip"}};
inline std::span<const EnumName<BadRecordPolicy>> enum_names(BadRecordPolicy) { return kBadRecordPolicyNames; }

// Which tokens of a chat record (`messages`) the loss trains on: every assistant turn, the last one, or all tokens.
enum class TrainOn { kAssistant, kLastAssistant, kAll };
inline constexpr EnumName<TrainOn> kTrainOnNames[] = {
    {TrainOn::kAssistant, "assistant"}, {TrainOn::kLastAssistant, "last_assistant"}, {TrainOn::kAll, "all"}};
inline std::span<const EnumName<TrainOn>> enum_names(TrainOn) { return kTrainOnNames; }

enum class OptimizerName { kAdamW, kAdafactor };
inline constexpr EnumName<OptimizerName> kOptimizerNames[] = {{OptimizerName::kAdamW, "adamw"},
                                                              {OptimizerName::kAdafactor, "adafactor"}};
inline std::span<const EnumName<OptimizerName>> enum_names(OptimizerName) { return kOptimizerNames; }

// The dtype AdamW keeps its two moments in; int8: blockwise 8-bit moments as bitsandbytes' AdamW8bit.
enum class StateDtype { kFp32, kBf16, kInt8 };
inline constexpr EnumName<StateDtype> kStateDtypeNames[] = {
    {StateDtype::kFp32, "fp32"}, {StateDtype::kBf16, "bf16"}, {StateDtype::kInt8, "int8"}};
inline std::span<const EnumName<StateDtype>> enum_names(StateDtype) { return kStateDtypeNames; }

// How an update computed in fp32 is written into bf16 weights (precision.mode=bf16, bf16 LoRA adapters): rounded
// stochastically (unbiased), with a Kahan compensation buffer carrying the rounding error, or to nearest (small
// updates vanish: only to reproduce old runs).
enum class Bf16Update { kStochastic, kKahan, kNearest };
inline constexpr EnumName<Bf16Update> kBf16UpdateNames[] = {
    {Bf16Update::kStochastic, "stochastic"}, {Bf16Update::kKahan, "kahan"}, {Bf16Update::kNearest, "nearest"}};
inline std::span<const EnumName<Bf16Update>> enum_names(Bf16Update) { return kBf16UpdateNames; }

// Fully sharded weights' mixed precision (distributed.param_dtype, reduce_dtype: FSDP2's MixedPrecisionPolicy): the
// dtype weights are gathered in and gradients reduce-scattered in. auto: the compute dtype of precision.mode.
enum class ShardDtype { kAuto, kFp32, kBf16, kFp16 };
inline constexpr EnumName<ShardDtype> kShardDtypeNames[] = {
    {ShardDtype::kAuto, "auto"}, {ShardDtype::kFp32, "fp32"}, {ShardDtype::kBf16, "bf16"}, {ShardDtype::kFp16, "fp16"}};
inline std::span<const EnumName<ShardDtype>> enum_names(ShardDtype) { return kShardDtypeNames; }

enum class SchedulerName { kConstant, kLinear, kCosine };
inline constexpr EnumName<SchedulerName> kSchedulerNames[] = {{SchedulerName::kConstant, "constant"},
                                                              {SchedulerName::kLinear, "linear"},
                                                              {SchedulerName::kCosine, "cosine"}};
inline std::span<const EnumName<SchedulerName>> enum_names(SchedulerName) { return kSchedulerNames; }

// fp16-mixed (fp32 master weights, fp16 autocast, dynamic loss scaling: train/grad_scaler.h) is for GPUs without
// bf16 (T4, V100, RTX 20xx); it is refused for the T5 family when the model is loaded. Pure fp16 weights are absent.
enum class PrecisionMode { kFp32, kBf16Mixed, kBf16, kFp16Mixed };
inline constexpr EnumName<PrecisionMode> kPrecisionModeNames[] = {{PrecisionMode::kFp32, "fp32"},
                                                                  {PrecisionMode::kBf16Mixed, "bf16-mixed"},
                                                                  {PrecisionMode::kBf16, "bf16"},
                                                                  {PrecisionMode::kFp16Mixed, "fp16-mixed"}};
inline std::span<const EnumName<PrecisionMode>> enum_names(PrecisionMode) { return kPrecisionModeNames; }

// What an image model trains: its classification head (ViT, CLIP vision classifier), or CLIP's image-text
// contrastive loss (docs/clip.md).
enum class TrainingObjective { kClassification, kContrastive, kDpo };
inline constexpr EnumName<TrainingObjective> kTrainingObjectiveNames[] = {
    {TrainingObjective::kClassification, "classification"},
    {TrainingObjective::kContrastive, "contrastive"},
    {TrainingObjective::kDpo, "dpo"}};
inline std::span<const EnumName<TrainingObjective>> enum_names(TrainingObjective) { return kTrainingObjectiveNames; }

// Contrastive training: which negatives each pair is scored against when the effective batch is split.
enum class ContrastiveNegativesMode { kBatch, kMicroBatch };
inline constexpr EnumName<ContrastiveNegativesMode> kContrastiveNegativesNames[] = {
    {ContrastiveNegativesMode::kBatch, "batch"}, {ContrastiveNegativesMode::kMicroBatch, "micro-batch"}};
inline std::span<const EnumName<ContrastiveNegativesMode>> enum_names(ContrastiveNegativesMode) {
  return kContrastiveNegativesNames;
}

enum class OomPolicy { kAdapt, kFail };
inline constexpr EnumName<OomPolicy> kOomPolicyNames[] = {{OomPolicy::kAdapt, "adapt"}, {OomPolicy::kFail, "fail"}};
inline std::span<const EnumName<OomPolicy>> enum_names(OomPolicy) { return kOomPolicyNames; }

// model.quantize's frozen 4-bit weights: dequantized on every use (forward, and again in backward), or dequantized
// once and kept resident in the compute dtype while the memory budget allows (auto: the planner decides).
enum class DequantizedBase { kAuto, kKeep, kPerUse };
inline constexpr EnumName<DequantizedBase> kDequantizedBaseNames[] = {
    {DequantizedBase::kAuto, "auto"}, {DequantizedBase::kKeep, "keep"}, {DequantizedBase::kPerUse, "per_use"}};
inline std::span<const EnumName<DequantizedBase>> enum_names(DequantizedBase) { return kDequantizedBaseNames; }

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError };
inline constexpr EnumName<LogLevel> kLogLevelNames[] = {{LogLevel::kTrace, "trace"},
                                                        {LogLevel::kDebug, "debug"},
                                                        {LogLevel::kInfo, "info"},
                                                        {LogLevel::kWarn, "warn"},
                                                        {LogLevel::kError, "error"}};
inline std::span<const EnumName<LogLevel>> enum_names(LogLevel) { return kLogLevelNames; }

enum class ProgressStyle { kAuto, kBar, kPlain, kOff };
inline constexpr EnumName<ProgressStyle> kProgressStyleNames[] = {{ProgressStyle::kAuto, "auto"},
                                                                  {ProgressStyle::kBar, "bar"},
                                                                  {ProgressStyle::kPlain, "plain"},
                                                                  {ProgressStyle::kOff, "off"}};
inline std::span<const EnumName<ProgressStyle>> enum_names(ProgressStyle) { return kProgressStyleNames; }

template <class E>
const char* enum_name(E value) {
  for (const auto& entry : enum_names(value))
    if (entry.value == value) return entry.name;
  return "?";
}

// The steps of memory escalation, in the order the user lists them in memory.escalation. smaller_loss_chunks
// halves training.loss_chunk_size each time it is reached, down to kMinLossChunkSize. The device moves
// (kDeviceEscalationSteps) are the end of the ladder: they come after the others in the list, and move the run
// to another device instead of changing how it computes (train/device_move.h).
inline constexpr const char* kEscalationSteps[] = {"activation_checkpointing", "chunked_loss", "smaller_loss_chunks",
                                                   "move_to_other_gpu", "move_to_cpu"};
inline constexpr const char* kDeviceEscalationSteps[] = {"move_to_other_gpu", "move_to_cpu"};
inline constexpr std::int64_t kMinLossChunkSize = 128;

// ---- sections -------------------------------------------------------------------------------------------------

struct ModelConfig {
  std::string path;
  ModelInit init = ModelInit::kPretrained;
  QuantizeMode quantize = QuantizeMode::kNone;
  std::int64_t quantize_block_size = 64;
  bool double_quant = true;

  template <class V>
  void visit(V& v) {
    v("path", path,
      "Hugging Face model directory (config.json, safetensors weights, tokenizer files), or a Hub id ORG/NAME[@REV] "
      "resolved in the Hugging Face cache and downloaded when missing (docs/models.md#hub-ids-and-the-cache)");
    v("init", init, "pretrained: load the weights in path; random: initialise from path/config.json alone");
    v("quantize", quantize,
      "none, nf4 or fp4: the frozen base's linear layers held in 4 bits as bitsandbytes' Linear4bit (QLoRA; "
      "needs lora.enabled)");
    v("quantize_block_size", quantize_block_size, "values per 4-bit scale: 64 (bitsandbytes' default) to 4096, a power of two");
    v("double_quant", double_quant, "quantize the 4-bit block scales to 8 bits too (bnb_4bit_use_double_quant)");
  }
  bool operator==(const ModelConfig&) const = default;
};

struct TokenizerConfig {
  std::string path;
  TokenizerKind kind = TokenizerKind::kAuto;
  bool add_eos = true;

  template <class V>
  void visit(V& v) {
    v("path", path, "directory or file of the tokenizer, or a Hub id ORG/NAME[@REV]; empty: model.path");
    v("kind", kind, "auto (tokenizer.json -> bpe, spiece.model/tokenizer.model -> sentencepiece), sentencepiece, bpe");
    v("add_eos", add_eos, "append the end-of-sequence token as the model family does in transformers");
  }
  bool operator==(const TokenizerConfig&) const = default;
};

struct DataConfig {
  std::vector<std::string> train_files;
  std::vector<std::string> validation_files;
  double validation_fraction = 0.0;
  std::string input_field = "input";
  std::string target_field = "target";
  std::string text_field = "text";
  std::string prompt_field = "prompt";
  std::string completion_field = "completion";
  std::string chat_template;
  TrainOn train_on = TrainOn::kAssistant;
  std::int64_t max_input_length = 512;
  std::int64_t max_target_length = 128;
  std::int64_t max_length = 1024;
  OverlengthPolicy on_overlength = OverlengthPolicy::kTruncate;
  BadRecordPolicy on_bad_record = BadRecordPolicy::kError;
  bool shuffle = true;
  bool group_by_length = false;
  bool packing = false;
  bool augment = false;
  std::int64_t num_workers = 2;

  template <class V>
  void visit(V& v) {
    v("train_files", train_files,
      "data files or globs to train on: JSONL (plain or .gz), Parquet, Arrow; datasets folders (DIR, DIR:SPLIT); "
      "Hub datasets (ORG/NAME[@REV][:CONFIG][:SPLIT], default split train)");
    v("validation_files", validation_files,
      "data files, globs, datasets folders or Hub datasets for evaluation (as train_files; default split validation)");
    v("validation_fraction", validation_fraction, "hold out this fraction of train_files when validation_files is empty");
    v("input_field", input_field, "seq2seq: record field with the encoder input");
    v("target_field", target_field, "seq2seq: record field with the target");
    v("text_field", text_field, "causal: record field with the whole text (all tokens trained)");
    v("prompt_field", prompt_field, "causal: record field with the prompt (masked out of the loss)");
    v("completion_field", completion_field, "causal: record field with the completion (trained)");
    v("chat_template", chat_template,
      "causal chat records (\"messages\"): a Jinja template file to render them with instead of the model's own "
      "(tokenizer_config.json's chat_template or chat_template.jinja); docs/data.md");
    v("train_on", train_on,
      "chat records: the tokens the loss trains on: assistant (every assistant turn and its end-of-turn marker), "
      "last_assistant, or all");
    v("max_input_length", max_input_length, "seq2seq: encoder tokens per example");
    v("max_target_length", max_target_length, "seq2seq: decoder tokens per example");
    v("max_length", max_length, "causal: tokens per example");
    v("on_overlength", on_overlength, "truncate or skip examples longer than the maximum (counted either way)");
    v("on_bad_record", on_bad_record, "error: stop at the first bad record (exit 3); skip: count and go on");
    v("shuffle", shuffle, "shuffle the examples every epoch (seeded by training.seed)");
    v("group_by_length", group_by_length, "group similar lengths into batches, longest batch first");
    v("packing", packing,
      "training packs several examples into each row up to the maximum lengths (attention and positions stay per "
      "example, the same weights as padded rows; the micro-batch counts rows); docs/packing.md");
    v("augment", augment,
      "images: random resized crop and horizontal flip of training images, seeded by (training.seed, epoch, index); "
      "docs/images.md");
    v("num_workers", num_workers, "tokenizer (images: decoding) worker threads");
  }
  bool operator==(const DataConfig&) const = default;
};

// The tokens one example stands for at the maximum lengths: encoder input + decoder target for seq2seq models,
// the one sequence for causal ones (what micro-batch token budgets and the planner count).
inline std::int64_t max_example_tokens(const DataConfig& data, bool seq2seq) {
  return seq2seq ? data.max_input_length + data.max_target_length : data.max_length;
}

struct TrainingConfig {
  std::int64_t batch_size = 32;
  MicroBatchSize micro_batch_size = MicroBatchSize::automatic();
  std::int64_t gradient_accumulation_steps = 0;
  std::int64_t micro_batch_tokens = 0;
  std::int64_t max_steps = 0;
  std::int64_t epochs = 1;
  std::int64_t seed = 42;
  double max_grad_norm = 1.0;
  bool activation_checkpointing = false;
  bool chunked_loss = true;
  std::int64_t loss_chunk_size = 1024;
  bool linear_probe = false;
  TrainingObjective objective = TrainingObjective::kClassification;

  template <class V>
  void visit(V& v) {
    v("batch_size", batch_size, "examples per optimizer step (the effective batch); fixed for the whole run");
    v("micro_batch_size", micro_batch_size, "examples per forward/backward: an integer, or \"auto\" to probe memory");
    v("gradient_accumulation_steps", gradient_accumulation_steps,
      "0: follows from batch_size and the micro-batch; else batch_size must equal micro x steps (without "
      "batch_size in the config, batch_size = micro_batch_size x steps)");
    v("micro_batch_tokens", micro_batch_tokens,
      "token-budget mode: each micro-batch takes the next examples while examples x longest (input + target) "
      "<= this; the memory policy halves it on out-of-memory; 0: micro-batches count examples");
    v("max_steps", max_steps, "optimizer steps to run; 0: run `epochs` epochs");
    v("epochs", epochs, "passes over train_files when max_steps is 0");
    v("seed", seed, "seed for initialisation, shuffling and dropout");
    v("max_grad_norm", max_grad_norm, "clip gradients to this global norm; 0 turns clipping off");
    v("activation_checkpointing", activation_checkpointing, "recompute each block's activations in backward");
    v("chunked_loss", chunked_loss,
      "fused LM head and loss over chunks of loss_chunk_size trained tokens (trained positions only): no full "
      "tokens x vocabulary logits; the same loss and gradients as false, faster and smaller (docs/benchmarks.md)");
    v("loss_chunk_size", loss_chunk_size,
      "trained tokens per chunk of the chunked loss (memory: chunk x vocabulary fp32 logits); the "
      "smaller_loss_chunks escalation halves it down to 128");
    v("linear_probe", linear_probe,
      "image classifiers: train only the classification head, the backbone frozen (docs/images.md)");
    v("objective", objective,
      "image models: classification (a classifier head over the training classes), or contrastive (CLIP's "
      "image-text loss on {\"image\", \"caption\"} JSONL records; model.path must be a CLIPModel directory; "
      "docs/clip.md); causal language models: dpo (preference tuning on {\"prompt\", \"chosen\", \"rejected\"} "
      "records, the dpo section; docs/training.md#preference-tuning-dpo); text runs leave it at classification");
  }
  bool operator==(const TrainingConfig&) const = default;
};

struct EvaluationConfig {
  std::int64_t every_steps = 0;
  MicroBatchSize micro_batch_size = MicroBatchSize::automatic();
  std::int64_t max_batches = 0;
  std::vector<std::string> sample_prompts;
  std::int64_t max_new_tokens = 64;
  std::vector<std::string> class_prompts;
  // Evaluation by generation (text task). Unset (null) decoding keys take the model's generation_config.json,
  // else transformers' defaults.
  bool generate = false;
  std::int64_t generate_examples = 0;
  std::optional<std::int64_t> generate_max_new_tokens;
  std::optional<std::int64_t> generate_num_beams;
  std::optional<double> generate_length_penalty;
  std::optional<GenerateEarlyStopping> generate_early_stopping;
  std::optional<std::int64_t> generate_no_repeat_ngram_size;
  std::optional<bool> generate_do_sample;
  std::optional<double> generate_temperature;
  std::optional<double> generate_top_p;
  std::optional<std::int64_t> generate_top_k;
  std::vector<std::string> generate_metrics = {"exact_match", "rouge1", "rouge2", "rougeL"};
  bool generate_use_stemmer = true;

  template <class V>
  void visit(V& v) {
    v("every_steps", every_steps, "evaluate every N optimizer steps; 0: only at the end when there is validation data");
    v("micro_batch_size", micro_batch_size, "evaluation micro-batch, adapted on its own (never shrinks training)");
    v("max_batches", max_batches, "evaluate on at most N micro-batches; 0: the whole validation set");
    v("sample_prompts", sample_prompts, "prompts whose generations are logged at every evaluation");
    v("max_new_tokens", max_new_tokens, "length limit of the sample generations");
    v("class_prompts", class_prompts,
      "contrastive: prompt templates with {} for the class name (e.g. \"a photo of a {}.\"); with labelled "
      "validation records, evaluation adds zero-shot accuracy over the validation labels (templates averaged)");
    v("generate", generate,
      "text: generate an answer for validation examples at every evaluation and score it against the record's "
      "target or completion (metrics.jsonl, TensorBoard, the log, evaluations/step-N/predictions.jsonl)");
    v("generate_examples", generate_examples, "validation examples to generate for; 0: all");
    v("generate_max_new_tokens", generate_max_new_tokens,
      "length limit of generated answers; null: generation_config.json's max_new_tokens, else data.max_target_length "
      "(seq2seq) or 64");
    v("generate_num_beams", generate_num_beams, "beam search with N beams; 1: greedy; null: generation_config.json");
    v("generate_length_penalty", generate_length_penalty,
      "beam search: exponent of the length a finished beam's log-probability is divided by (above 0 favours longer)");
    v("generate_early_stopping", generate_early_stopping,
      "beam search: true stops at num_beams finished answers, false when none can improve, \"never\" at the "
      "longest possible (transformers' early_stopping)");
    v("generate_no_repeat_ngram_size", generate_no_repeat_ngram_size,
      "no n-gram of this size appears twice in an answer (prompt included for causal models); 0: off");
    v("generate_do_sample", generate_do_sample, "sample instead of greedy or beam search (seeded by training.seed)");
    v("generate_temperature", generate_temperature, "sampling temperature (do_sample); transformers' default 1.0");
    v("generate_top_p", generate_top_p, "sampling: nucleus probability mass; 1.0: off");
    v("generate_top_k", generate_top_k, "sampling: only the k likeliest tokens; 0: off; transformers' default 50");
    v("generate_metrics", generate_metrics,
      "what to score: exact_match, exact_match_normalized (SQuAD normalisation), rouge1, rouge2, rougeL, rougeLsum "
      "(rouge_score's, mean F-measure 0..1), bleu, chrf (sacrebleu's, 0..100)");
    v("generate_use_stemmer", generate_use_stemmer, "ROUGE with rouge_score's Porter stemmer (use_stemmer=True)");
  }
  bool operator==(const EvaluationConfig&) const = default;
};

struct OptimizerConfig {
  OptimizerName name = OptimizerName::kAdamW;
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decay_norms_biases_embeddings = false;
  StateDtype state_dtype = StateDtype::kFp32;
  Bf16Update bf16_update = Bf16Update::kStochastic;
  // Adafactor (transformers.optimization.Adafactor's parameters; beta1 and weight_decay above are shared).
  bool adafactor_beta1 = false;
  double adafactor_eps1 = 1e-30;
  double adafactor_eps2 = 1e-3;
  double clip_threshold = 1.0;
  double decay_rate = -0.8;
  bool scale_parameter = false;  // false, relative_step false: what transformers' Trainer passes (optim=adafactor)
  bool relative_step = false;
  bool warmup_init = false;

  template <class V>
  void visit(V& v) {
    v("name", name, "optimizer: adamw, or adafactor (factored second moments: a few bytes per matrix row and column)");
    v("lr", lr, "peak learning rate");
    v("beta1", beta1, "AdamW beta1");
    v("beta2", beta2, "AdamW beta2");
    v("eps", eps, "AdamW epsilon");
    v("weight_decay", weight_decay, "decoupled weight decay");
    v("decay_norms_biases_embeddings", decay_norms_biases_embeddings,
      "also decay norm weights, biases and embeddings (off, as is usual)");
    v("state_dtype", state_dtype,
      "dtype of the two AdamW moments: fp32 (8 bytes per parameter), bf16 (4; the update is still computed in fp32) "
      "or int8 (about 2: bitsandbytes' AdamW8bit, blockwise 8-bit moments; fp32 parameters only)");
    v("bf16_update", bf16_update,
      "how fp32 updates reach bf16 weights and bf16 moments: stochastic (unbiased rounding), kahan (+2 bytes per "
      "bf16 parameter of compensation) or nearest (small updates are lost; old behaviour)");
    v("adafactor_beta1", adafactor_beta1, "Adafactor: keep a first moment with optimizer.beta1 (+4 bytes per parameter)");
    v("adafactor_eps1", adafactor_eps1, "Adafactor: regularisation added to the squared gradient");
    v("adafactor_eps2", adafactor_eps2, "Adafactor: floor of the parameter scale (scale_parameter)");
    v("clip_threshold", clip_threshold, "Adafactor: RMS threshold of the update");
    v("decay_rate", decay_rate, "Adafactor: second-moment decay 1 - t^decay_rate");
    v("scale_parameter", scale_parameter, "Adafactor: scale the learning rate by the parameter's RMS");
    v("relative_step", relative_step,
      "Adafactor: time-dependent learning rate min(1e-2, 1/sqrt(t)) instead of optimizer.lr and the scheduler");
    v("warmup_init", warmup_init, "Adafactor with relative_step: warm up from 1e-6 * t");
  }
  bool operator==(const OptimizerConfig&) const = default;
};

struct SchedulerConfig {
  SchedulerName name = SchedulerName::kLinear;
  std::int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;
  double min_lr_ratio = 0.0;

  template <class V>
  void visit(V& v) {
    v("name", name, "learning-rate schedule after warmup: constant, linear or cosine decay");
    v("warmup_steps", warmup_steps, "linear warmup steps from 0 to optimizer.lr");
    v("warmup_ratio", warmup_ratio, "warmup as a fraction of all steps (used when warmup_steps is 0)");
    v("min_lr_ratio", min_lr_ratio, "decay ends at lr x min_lr_ratio");
  }
  bool operator==(const SchedulerConfig&) const = default;
};

struct PrecisionConfig {
  PrecisionMode mode = PrecisionMode::kFp32;
  double initial_loss_scale = 65536.0;
  std::int64_t loss_scale_growth_interval = 2000;

  template <class V>
  void visit(V& v) {
    v("mode", mode,
      "fp32; bf16-mixed (fp32 master weights, bf16 autocast); bf16 (bf16 weights); fp16-mixed (fp32 master "
      "weights, fp16 autocast, dynamic loss scaling: for GPUs without bf16; not for T5)");
    v("initial_loss_scale", initial_loss_scale,
      "fp16-mixed: the loss scale of the first step (2^16, as torch.amp.GradScaler); halved at every step whose "
      "gradients overflow (that step is skipped)");
    v("loss_scale_growth_interval", loss_scale_growth_interval,
      "fp16-mixed: the loss scale doubles after this many steps in a row without inf/NaN gradients");
  }
  bool operator==(const PrecisionConfig&) const = default;
};

struct LoraConfig {
  bool enabled = false;
  std::int64_t r = 8;
  double alpha = 16.0;
  double dropout = 0.05;
  std::vector<std::string> target_modules;
  std::vector<std::string> target_parameters;
  bool rslora = false;
  bool base_in_bf16 = false;

  template <class V>
  void visit(V& v) {
    v("enabled", enabled, "train LoRA adapters instead of the full model (saved in PEFT's format)");
    v("r", r, "adapter rank");
    v("alpha", alpha, "scaling numerator: scale = alpha / r (alpha / sqrt(r) with rslora)");
    v("dropout", dropout, "dropout on the adapter input");
    v("target_modules", target_modules,
      "module names to adapt; empty: q,v (T5), q_proj,v_proj (decoder families, CLIP), qkv_proj (Phi-3) or "
      "query,value (ViT)");
    v("target_parameters", target_parameters,
      "a mixture of experts' experts to adapt, as PEFT's target_parameters names transformers 5's stacked "
      "parameters: mlp.experts.gate_up_proj, mlp.experts.down_proj (needs dropout 0)");
    v("rslora", rslora, "rank-stabilised scaling alpha / sqrt(r)");
    v("base_in_bf16", base_in_bf16, "hold the frozen base weights in bf16 to save memory");
  }
  bool operator==(const LoraConfig&) const = default;
};

struct MemoryConfig {
  ByteSize limit;
  OomPolicy on_oom = OomPolicy::kAdapt;
  double shrink_factor = 0.5;
  std::int64_t min_micro_batch_size = 1;
  std::int64_t max_retries = 8;
  // chunked_loss is not in the default ladder: training.chunked_loss is on by default, and smaller_loss_chunks turns
  // it on (at half the chunk) where a config turned it off. Listed explicitly, it turns it on at the chunk size.
  std::vector<std::string> escalation = {"activation_checkpointing", "smaller_loss_chunks", "move_to_other_gpu",
                                         "move_to_cpu"};
  std::int64_t regrow_after_steps = 0;
  double auto_safety_margin = 0.1;
  std::int64_t empty_cache_every = 0;
  std::string allocator_conf;
  bool snapshot_on_oom = false;
  DequantizedBase dequantized_base = DequantizedBase::kAuto;

  template <class V>
  void visit(V& v) {
    v("limit", limit, "memory budget: on CPU a hard cap on tensor memory, on a GPU a cap on the process; 0: none");
    v("on_oom", on_oom, "adapt: shrink the micro-batch and retry the same batch; fail: stop (exit 4)");
    v("shrink_factor", shrink_factor, "the micro-batch is multiplied by this after an out-of-memory error");
    v("min_micro_batch_size", min_micro_batch_size, "the floor; below it the policy escalates, then stops");
    v("max_retries", max_retries, "out-of-memory retries of one optimizer step before giving up");
    v("escalation", escalation,
      "what to turn on at the floor, in order: activation_checkpointing, chunked_loss (only where "
      "training.chunked_loss=false; not in the default), smaller_loss_chunks (halve training.loss_chunk_size, "
      "repeatedly, down to 128; turns chunked_loss on); then, last, the device moves: "
      "move_to_other_gpu (device.type=auto: the GPU with the most free memory, if it has more than this one gives "
      "the run) and move_to_cpu (device.allow_cpu_fallback=true), which continue the same step on the new device");
    v("regrow_after_steps", regrow_after_steps, "try a larger micro-batch after N steps without OOM; 0: never");
    v("auto_safety_margin", auto_safety_margin, "fraction of memory micro_batch_size=auto leaves free");
    v("empty_cache_every", empty_cache_every, "release cached device memory every N steps; 0: only after an OOM");
    v("allocator_conf", allocator_conf, "exported as PYTORCH_ALLOC_CONF unless it is set, e.g. expandable_segments:True");
    v("snapshot_on_oom", snapshot_on_oom, "CUDA builds: record allocations and dump a memory_viz snapshot on OOM");
    v("dequantized_base", dequantized_base,
      "model.quantize: keep (every 4-bit weight dequantized once and kept in the compute dtype: faster steps, the "
      "full-precision size resident), per_use (dequantized for each forward and backward: the 4-bit size), auto "
      "(keep when the memory plan fits with the copies, else per_use)");
  }
  bool operator==(const MemoryConfig&) const = default;
};

struct DeviceConfig {
  std::string type = "auto";
  ByteSize min_free_memory;
  bool wait_for_device = false;
  double wait_timeout_s = 600.0;
  double poll_interval_s = 10.0;
  bool allow_cpu_fallback = false;

  template <class V>
  void visit(V& v) {
    v("type", type, "auto (the accelerator with most free memory, else CPU), cpu, cuda or cuda:N");
    v("min_free_memory", min_free_memory, "a device with less free memory is not taken");
    v("wait_for_device", wait_for_device, "wait for a device with min_free_memory instead of failing");
    v("wait_timeout_s", wait_timeout_s, "how long to wait for a device");
    v("poll_interval_s", poll_interval_s, "how often to look while waiting");
    v("allow_cpu_fallback", allow_cpu_fallback,
      "run on the CPU (with a loud warning) when no device is available, and move a running job to the CPU when a "
      "step does not fit on its device even at the floor (memory.escalation's move_to_cpu)");
  }
  bool operator==(const DeviceConfig&) const = default;
};

struct CheckpointConfig {
  std::string output_dir = "runs/default";
  std::int64_t every_steps = 0;
  std::int64_t keep_last = 2;
  bool keep_best = false;
  std::string best_metric = "loss";
  BestMode best_mode = BestMode::kAuto;
  bool save_final = true;
  ByteSize max_shard_size{5'000'000'000};

  template <class V>
  void visit(V& v) {
    v("output_dir", output_dir, "where checkpoints, the final model, metrics and TensorBoard files go");
    v("every_steps", every_steps, "checkpoint every N optimizer steps and at the end; 0: only at the end");
    v("keep_last", keep_last, "complete checkpoints to keep (older ones are deleted)");
    v("keep_best", keep_best,
      "also keep the checkpoint with the lowest validation loss (named in output_dir/best_checkpoint.json); "
      "checkpoint.every_steps must be a multiple of evaluation.every_steps");
    v("best_metric", best_metric,
      "what keep_best compares: loss (the validation loss) or a metric of evaluation.generate_metrics, e.g. rougeL");
    v("best_mode", best_mode, "keep_best: min or max of best_metric; auto: min for loss, max for the others");
    v("save_final", save_final, "save the final model (or LoRA adapter) in Hugging Face format");
    v("max_shard_size", max_shard_size, "split saved weights into safetensors shards of at most this size");
  }
  bool operator==(const CheckpointConfig&) const = default;
};

struct LoggingConfig {
  LogLevel level = LogLevel::kInfo;
  std::int64_t every_steps = 10;
  ProgressStyle progress = ProgressStyle::kAuto;
  bool metrics_jsonl = true;
  bool tensorboard = true;
  std::string log_file;

  template <class V>
  void visit(V& v) {
    v("level", level, "trace, debug, info, warn or error");
    v("every_steps", every_steps, "plain progress: a log line every N optimizer steps (and at the last)");
    v("progress", progress,
      "auto (a live status line on a terminal, plain log lines otherwise), bar (always the live line), plain, "
      "off (no progress lines)");
    v("metrics_jsonl", metrics_jsonl, "write output_dir/metrics.jsonl: one JSON object per step and per evaluation");
    v("tensorboard", tensorboard, "write TensorBoard event files (scalars, sample texts) to output_dir/tensorboard");
    v("log_file", log_file, "also write the log to this file (appended; its directory is created)");
  }
  bool operator==(const LoggingConfig&) const = default;
};

// Data parallelism (docs/distributed.md). Valid in a single process too, where it is moot: one config serves any
// number of ranks.
struct DistributedConfig {
  double timeout_s = 600.0;
  ByteSize bucket_size{25'000'000};
  bool shard_optimizer = false;
  bool shard_weights = false;
  bool reshard_after_forward = true;
  bool prefetch = true;
  ShardDtype param_dtype = ShardDtype::kAuto;
  ShardDtype reduce_dtype = ShardDtype::kFp32;
  bool overlap_grad_reduce = true;

  template <class V>
  void visit(V& v) {
    v("timeout_s", timeout_s,
      "data parallelism: how long the rendezvous and every collective wait for the other ranks before the run stops "
      "with an error (a rank that died or hangs)");
    v("bucket_size", bucket_size, "data parallelism: gradients are summed over the ranks in buckets of this size");
    v("shard_optimizer", shard_optimizer,
      "data parallelism (ZeRO-1): each rank keeps the optimizer state of about 1/N of the trainable parameters (whole "
      "parameters) and updates those; gradients are summed to their owner and the updated parameters broadcast. "
      "Same weights as unsharded; moot in a single process");
    v("shard_weights", shard_weights,
      "fully sharded data parallelism (ZeRO-3, as PyTorch's FSDP2): each rank keeps 1/N of every weight, gradient and "
      "optimizer state; a block's weights are gathered just before its forward and its backward and released after, "
      "its gradients reduce-scattered to their shards. A full fine-tune larger than one card. Same weights as one "
      "process (fp32). Checkpoints hold each rank's shards; final/ is the Hugging Face model. Text, image and CLIP "
      "tasks (full, LoRA, QLoRA; DPO with LoRA, or as a full fine-tune with dpo.precompute_reference), AdamW or "
      "Adafactor; moot in a single process (docs/distributed.md)");
    v("reshard_after_forward", reshard_after_forward,
      "with shard_weights: release each block's gathered weights after its forward and gather them again for its "
      "backward (false keeps them from forward to backward: less communication, more memory)");
    v("prefetch", prefetch,
      "with shard_weights: gather the next unit's weights while the current one computes, in forward and in backward "
      "order (FSDP2's prefetch): communication overlaps compute, at the memory of one more unit gathered (skipped "
      "where a rank has not that memory, and off for the rest of the run after an out-of-memory error); false gathers "
      "each unit when it is needed");
    v("param_dtype", param_dtype,
      "with shard_weights: the dtype fp32 weights are gathered in for compute (FSDP2's param_dtype): auto is the "
      "compute dtype of precision.mode (bf16 under bf16-mixed, fp16 under fp16-mixed, else fp32): half the gathered "
      "memory and traffic, the same products autocast computes; the shards (master weights) stay fp32");
    v("reduce_dtype", reduce_dtype,
      "with shard_weights: the dtype gradients are accumulated in and reduce-scattered in (FSDP2's reduce_dtype): "
      "fp32 (default) sums exactly what one process sums; bf16 halves the gradient buffers and traffic at bf16's "
      "rounding; auto is param_dtype's");
    v("overlap_grad_reduce", overlap_grad_reduce,
      "data parallelism: during the last micro-batch's backward of each optimizer step, each gradient bucket starts "
      "its sum over the ranks as soon as its gradients are final, overlapping communication with backward (not "
      "under activation checkpointing); false sums every bucket after backward. Same weights either way");
  }
  bool operator==(const DistributedConfig&) const = default;
};

// training.objective = contrastive (CLIP; docs/clip.md).
struct ContrastiveConfig {
  ContrastiveNegativesMode negatives = ContrastiveNegativesMode::kBatch;
  bool freeze_image_tower = false;

  template <class V>
  void visit(V& v) {
    v("negatives", negatives,
      "batch: every pair of the effective batch is a negative of every other, whatever the micro-batch (gradient "
      "caching: one more forward); micro-batch: only the pairs of the same micro-batch (faster, but the objective "
      "changes with the split)");
    v("freeze_image_tower", freeze_image_tower,
      "lock the image tower and its projection (LiT): only the text tower, its projection and the logit scale train");
  }
  bool operator==(const ContrastiveConfig&) const = default;
};

// training.objective = dpo (preference tuning; docs/training.md "Preference tuning (DPO)"). The names are TRL's
// DPOConfig's.
struct DpoConfig {
  double beta = 0.1;
  std::vector<std::string> loss_type = {"sigmoid"};
  std::vector<double> loss_weights;
  double label_smoothing = 0.0;
  bool disable_dropout = true;
  std::string reference_model;
  bool precompute_reference = false;

  template <class V>
  void visit(V& v) {
    v("beta", beta,
      "how far the policy may move from the reference: the rewards are beta x (policy - reference) log-probabilities "
      "(IPO: the regularisation tau)");
    v("loss_type", loss_type,
      "sigmoid (DPO), hinge (SLiC), ipo (per-token averaged log-ratios), robust (rDPO, with label_smoothing), sft "
      "(the NLL of the chosen completions: [\"sigmoid\", \"sft\"] with loss_weights is RPO); several are summed");
    v("loss_weights", loss_weights, "one weight per loss_type; empty: 1 each");
    v("label_smoothing", label_smoothing,
      "robust: the probability that a pair's preference is flipped, in [0, 0.5)");
    v("disable_dropout", disable_dropout,
      "turn every dropout off (the model's and LoRA's) for the policy and the reference, as TRL does by default");
    v("reference_model", reference_model,
      "a model directory or Hub id (ORG/NAME@REV) to use as the reference instead of the starting weights (TRL's "
      "ref_model): loaded frozen beside the trained model, also with LoRA; its tokenizer and vocabulary must be "
      "model.path's. Empty: model.path's weights (with LoRA: the base under the adapters, no copy)");
    v("precompute_reference", precompute_reference,
      "compute the reference's log-probabilities of every train and validation pair in one pass before training "
      "(TRL's precompute_ref_log_probs) into checkpoint.output_dir/dpo-reference, reused on resume: no reference "
      "copy and no reference forward during training");
  }
  bool operator==(const DpoConfig&) const = default;
};

struct Config {
  ModelConfig model;
  TokenizerConfig tokenizer;
  DataConfig data;
  TrainingConfig training;
  EvaluationConfig evaluation;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  PrecisionConfig precision;
  LoraConfig lora;
  MemoryConfig memory;
  DeviceConfig device;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  DistributedConfig distributed;
  ContrastiveConfig contrastive;
  DpoConfig dpo;

  template <class V>
  void visit(V& v) {
    v.section("model", model, "the model to fine-tune");
    v.section("tokenizer", tokenizer, "how text becomes token ids");
    v.section("data", data, "JSONL training and validation data");
    v.section("training", training, "the effective batch, length of the run, and what the memory policy may use");
    v.section("evaluation", evaluation, "validation loss, evaluation by generation and sample generations");
    v.section("optimizer", optimizer, "AdamW or Adafactor");
    v.section("scheduler", scheduler, "learning-rate schedule");
    v.section("precision", precision, "numeric precision of weights and compute");
    v.section("lora", lora, "LoRA adapters (PEFT-compatible)");
    v.section("memory", memory, "the memory budget and what happens on out-of-memory");
    v.section("device", device, "which device to run on");
    v.section("checkpoint", checkpoint, "checkpoints and the saved model");
    v.section("logging", logging, "console, metrics and TensorBoard output");
    v.section("distributed", distributed, "data parallelism over several processes (torchrun, trainer launch)");
    v.section("contrastive", contrastive, "CLIP image-text training (training.objective = contrastive)");
    v.section("dpo", dpo, "preference tuning of causal models (training.objective = dpo)");
  }
  bool operator==(const Config&) const = default;
};

// ---- reading, checking, writing -----------------------------------------------------------------------------

// One key of the configuration, for documentation and suggestions.
struct ConfigKey {
  std::string path;          // "training.batch_size"
  std::string type;          // "integer", "size", ...
  std::string default_value; // as JSON
  std::string description;
};
std::vector<ConfigKey> config_keys();

// Reads a JSON file (comments allowed), applies `--set section.key=value` overrides, then validates.
// Throws ConfigError listing every problem: syntax (file:line:column), unknown keys (with the closest known key),
// wrong types and invalid values (with the key path).
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from JSON text already in memory; `source` names it in messages.
Config parse_config(const std::string& json_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

// Semantic checks on a complete config (ranges, consistency). Empty when the config is valid.
std::vector<ConfigProblem> validate(const Config& config);

// The config as JSON text in file order; parse_config(config_to_json(c)) == c.
std::string config_to_json(const Config& config, int indent = 2);

// The keys whose resolved value differs from the default, as a table: key, value, default, and where the value
// came from (`--set` when one of `overrides` set it, else `source`, the config file). `--print-config` prints
// every key.
std::string format_config_table(const Config& config, const std::string& source = "",
                                const std::vector<std::string>& overrides = {});

}  // namespace trainer
