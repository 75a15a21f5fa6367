// Which checkpoints stay in checkpoint.output_dir: the newest checkpoint.keep_last, and with checkpoint.keep_best
// also the best by checkpoint.best_metric (the lowest validation loss by default, or e.g. the highest ROUGE-L of
// evaluation by generation). The best is recorded in output_dir/best_checkpoint.json ({"step", "metric", "value",
// "path"}, and "eval_loss" when the metric is the loss), written atomically, so it survives --resume and tells the
// user which to take.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

// The checkpoint-N directories in `dir` (complete or not), oldest first; other names are left alone.
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoint_dirs(const std::filesystem::path& dir);

struct BestCheckpoint {
  int64_t step = 0;
  double value = 0;  // of the metric at that step
  std::filesystem::path path;
};

// "validation loss" for the loss, else the metric's own name: how logs and the summary name a best_metric.
std::string describe_metric(const std::string& metric);

class CheckpointRetention {
 public:
  // `metric`: what keep_best compares ("loss" or a generation metric such as "rougeL"); `maximize`: higher is better.
  CheckpointRetention(std::filesystem::path output_dir, int64_t keep_last, bool keep_best, std::string metric = "loss",
                      bool maximize = false);

  // At the start of a run. Resuming from `resume_step`: the best recorded so far is kept if it is a complete
  // checkpoint at or before that step. A fresh run forgets the record of an earlier run in the same directory.
  void start(std::optional<int64_t> resume_step);
  // After checkpoint-`step` was completely written. `value`: the metric at that step, when there was an evaluation
  // at it. Records a new best (strictly better only: on a tie the earlier stays), then deletes every checkpoint
  // that is neither among the newest keep_last nor the best.
  void on_checkpoint(int64_t step, std::optional<double> value);

  const std::optional<BestCheckpoint>& best() const { return best_; }
  const std::string& metric() const { return metric_; }
  std::filesystem::path record_path() const { return output_dir_ / "best_checkpoint.json"; }

 private:
  void write_record() const;
  bool better(double value, double than) const { return maximize_ ? value > than : value < than; }

  std::filesystem::path output_dir_;
  int64_t keep_last_;
  bool keep_best_;
  std::string metric_;
  bool maximize_;
  std::optional<BestCheckpoint> best_;
};

}  // namespace trainer
