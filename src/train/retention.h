// Which checkpoints stay in checkpoint.output_dir: the newest checkpoint.keep_last, and with checkpoint.keep_best
// also the one with the lowest validation loss. The best is recorded in output_dir/best_checkpoint.json
// ({"step", "eval_loss", "path"}), written atomically, so it survives --resume and tells the user which to take.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <utility>
#include <vector>

namespace trainer {

// The checkpoint-N directories in `dir` (complete or not), oldest first; other names are left alone.
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoint_dirs(const std::filesystem::path& dir);

struct BestCheckpoint {
  int64_t step = 0;
  double eval_loss = 0;
  std::filesystem::path path;
};

class CheckpointRetention {
 public:
  CheckpointRetention(std::filesystem::path output_dir, int64_t keep_last, bool keep_best);

  // At the start of a run. Resuming from `resume_step`: the best recorded so far is kept if it is a complete
  // checkpoint at or before that step. A fresh run forgets the record of an earlier run in the same directory.
  void start(std::optional<int64_t> resume_step);
  // After checkpoint-`step` was completely written. `eval_loss`: the validation loss at that step, when there was
  // an evaluation at it. Records a new best, then deletes every checkpoint that is neither among the newest
  // keep_last nor the best.
  void on_checkpoint(int64_t step, std::optional<double> eval_loss);

  const std::optional<BestCheckpoint>& best() const { return best_; }
  std::filesystem::path record_path() const { return output_dir_ / "best_checkpoint.json"; }

 private:
  void write_record() const;

  std::filesystem::path output_dir_;
  int64_t keep_last_;
  bool keep_best_;
  std::optional<BestCheckpoint> best_;
};

}  // namespace trainer
