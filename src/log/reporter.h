// Everything a training run reports, behind one small interface: the console (a live status line on a terminal,
// plain log lines otherwise), output_dir/metrics.jsonl, TensorBoard event files in output_dir/tensorboard, the
// webhook (TRAINER_WEBHOOK_URL), and the final summary. train() calls on_* at the moments that matter; what goes
// where is decided here, from the logging section of the config.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <fstream>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "log/progress.h"
#include "memory/policy.h"
#include "trainer/config.h"
#include "trainer/data.h"

namespace trainer {

class ConsoleSink;
class EventFileWriter;
class Webhook;

struct RunStart {
  std::string model_type;
  int64_t parameters = 0;
  int64_t trainable_parameters = 0;
  int64_t total_steps = 0;
  int64_t micro_batch = 0;
  int64_t start_step = 0;         // above 0 when resuming
  int64_t seen = 0;               // what the task counts (unit), at start_step
  std::string resumed_from;       // the checkpoint directory, when resuming
  std::string unit = "tokens";    // what seen and the rate count: tokens, images, pairs (engine/task.h)
};

// fp16-mixed's dynamic loss scaling at one step (train/optim/grad_scaler.h).
struct LossScaling {
  double scale = 0;           // the loss scale this step's backward used
  bool skipped = false;       // its gradients held an inf or NaN: no update
  int64_t skipped_steps = 0;  // skipped steps of the whole run so far
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  int64_t counted = 0;        // what the task counts in this step: target tokens, images, pairs (RunStart::unit)
  int64_t seen = 0;           // since step 0
  int64_t micro_batch = 0;
  int64_t micro_steps = 0;
  int64_t oom_retries = 0;    // attempts of this step lost to out-of-memory errors
  int64_t adaptations = 0;    // micro-batch adaptations of the memory policy so far
  int64_t device_moves = 0;   // moves of the run to another device in this process (train/device_move.h)
  int64_t memory_allocated = 0;
  int64_t memory_peak = 0;
  double seconds = 0;         // the step itself: batch, forward, backward, update
  std::optional<LossScaling> loss_scaling;  // precision.mode=fp16-mixed
  std::vector<std::pair<std::string, double>> task_metrics;  // the task's own ("rewards/chosen", ...)
};

struct RunSummary {
  int64_t steps = 0;
  int64_t start_step = 0;
  int64_t seen = 0;
  int64_t seen_this_run = 0;
  double seconds = 0;
  std::optional<double> eval_loss;  // the last evaluation's
  // What seen counts, in the "Done:" line: "target tokens" (text), "images", "image-caption pairs"; and
  // whether exp(eval_loss) is a perplexity (a language model's loss per token; not for a contrastive loss).
  std::string counted = "target tokens";
  std::string counted_rate = "tokens";
  bool eval_perplexity = true;
  DataStats data;                   // of this run (since the resume)
  int64_t memory_peak = 0;
  std::vector<Adaptation> adaptations;
  std::vector<std::string> escalations;
  std::string model_dir;        // the final model; empty when checkpoint.save_final=false
  bool model_is_adapter = false;  // model_dir holds a LoRA adapter (PEFT format)
  std::string merged_dir;       // train --merge: the full model with the adapter merged
  std::string last_checkpoint;  // empty when none
  std::string best_checkpoint;  // checkpoint.keep_best: the best by checkpoint.best_metric
  double best_eval_loss = 0;    // that metric's value there (the validation loss by default)
  std::string best_metric = "loss";
  std::string metrics_file;     // empty when off
  std::string tensorboard_dir;  // empty when off
  struct LossScalingSummary {
    int64_t skipped_steps = 0;           // of the whole run (resumes included)
    int64_t skipped_steps_this_run = 0;  // since this process started
    double final_scale = 0;
  };
  std::optional<LossScalingSummary> loss_scaling;  // precision.mode=fp16-mixed
  // Data parallelism: every rank's peak memory, seconds in collectives (waiting for the others included) and the
  // training records it tokenized itself (text runs: its share, RecordShare; 0 for image runs), in rank order; empty
  // in a single process.
  struct RankFigures {
    int64_t memory_peak = 0;
    double communication_seconds = 0;
    int64_t records_tokenized = 0;
  };
  std::vector<RankFigures> ranks;
  std::string backend;  // "gloo" or "nccl" with ranks
};

// The summary a finished run prints: steps, tokens, wall time, throughput, data problems, memory, every
// adaptation, where the model and the checkpoints are.
std::string format_summary(const RunSummary& summary);

// The names of the metrics.jsonl keys and the TensorBoard tags they are written under (also the parity test's).
struct ScalarName {
  std::string key;
  std::string tag;
};
const std::vector<ScalarName>& scalar_names();
// What a DPO step and evaluation report beside the loss, as TRL names them.
inline constexpr const char* kPreferenceMetricNames[] = {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                         "rewards/margins", "logps/chosen",    "logps/rejected",
                                                         "logits/chosen",  "logits/rejected"};

class Reporter {
 public:
  // Opens metrics.jsonl and the TensorBoard file in config.checkpoint.output_dir as the logging section says, and
  // starts the webhook when TRAINER_WEBHOOK_URL is set. `out` gets the start line, the stop message and the summary.
  // `primary` false (a rank other than 0 of a data-parallel run): no files, no webhook, no progress lines.
  Reporter(const Config& config, std::ostream& out, bool primary = true);
  ~Reporter();
  Reporter(const Reporter&) = delete;
  Reporter& operator=(const Reporter&) = delete;

  void on_start(const RunStart& start);
  void on_step(const StepMetrics& metrics);
  void on_eval(int64_t step, double loss, int64_t tokens);
  // An evaluation that measured named values beside its loss (DPO: "rewards/accuracies", ...) over `count` `what`
  // ("pairs"): metrics.jsonl and TensorBoard as eval_<name>.
  void on_eval_values(int64_t step, double loss, const std::vector<std::pair<std::string, double>>& values,
                      int64_t count, const std::string& what);
  // Image classification: mean cross-entropy per image, top-1 and top-5 accuracy over `images`.
  void on_eval_accuracy(int64_t step, double loss, double top1, double top5, int64_t images);
  // Contrastive (CLIP) evaluation: the validation loss, image->text and text->image recall@1/5/10 over the
  // validation pairs, and zero-shot top-1 accuracy when it was measured.
  struct Retrieval {
    double loss = 0;
    double image_to_text[3] = {0, 0, 0};  // recall@1, @5, @10
    double text_to_image[3] = {0, 0, 0};
    int64_t pairs = 0;
    std::optional<double> zero_shot_top1;
  };
  void on_eval_retrieval(int64_t step, const Retrieval& eval);
  // Evaluation by generation (evaluation.generate): the metrics ("rougeL" -> 0.41, ...) over `examples` answers,
  // written as eval_<metric> (TensorBoard eval/<metric>), and where the answers are (predictions.jsonl).
  void on_eval_generation(int64_t step, const std::map<std::string, double>& metrics, int64_t examples,
                          const std::string& predictions);
  void on_sample(int64_t step, std::size_t index, const std::string& prompt, const std::string& generation);
  void on_checkpoint(int64_t step, const std::string& path);
  // A SIGINT or SIGTERM stopped the run after `step` with a checkpoint in `path`.
  void on_stopped(int signal, int64_t step, const std::string& path);
  void on_finish(RunSummary summary);
  // The run ends with `error` (main turns it into the exit code and message).
  void on_failure(const std::exception& error);

  double seconds_since_start() const;
  const std::string& last_checkpoint() const { return last_checkpoint_; }

 private:
  enum class Console { kLive, kPlain, kOff };
  void write_metrics(const nlohmann::json& record);
  void notify(nlohmann::json body, const std::string& content);
  void clear_status();

  const Config& config_;
  std::ostream& out_;
  std::chrono::steady_clock::time_point start_;
  Console console_ = Console::kPlain;
  std::shared_ptr<ConsoleSink> sink_;
  std::ofstream metrics_;
  std::unique_ptr<EventFileWriter> tensorboard_;
  std::optional<ProgressClock> clock_;
  RunStart run_;
  int64_t step_ = 0;
  double loss_ = 0;
  std::optional<double> eval_loss_;
  std::chrono::steady_clock::time_point last_draw_;
  std::string last_checkpoint_;
  std::unique_ptr<Webhook> webhook_;  // last: destroyed first, so its last messages go out while the rest exists
};

}  // namespace trainer
