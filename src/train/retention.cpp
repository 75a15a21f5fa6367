// Checkpoint retention: keep_last and keep_best (see retention.h).
#include "train/retention.h"

#include <algorithm>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;

std::string describe_metric(const std::string& metric) { return metric == "loss" ? "validation loss" : metric; }

std::vector<std::pair<int64_t, fs::path>> checkpoint_dirs(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(dir)) return found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (!entry.is_directory() || !name.starts_with("checkpoint-")) continue;
    const auto digits = name.substr(11);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    found.emplace_back(std::stoll(digits), entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

CheckpointRetention::CheckpointRetention(fs::path output_dir, int64_t keep_last, bool keep_best, std::string metric,
                                         bool maximize)
    : output_dir_(std::move(output_dir)),
      keep_last_(keep_last),
      keep_best_(keep_best),
      metric_(std::move(metric)),
      maximize_(maximize) {}

void CheckpointRetention::start(std::optional<int64_t> resume_step) {
  best_.reset();
  if (!keep_best_) return;
  if (!resume_step) {
    fs::remove(record_path());
    return;
  }
  if (!fs::exists(record_path())) return;
  const auto record = read_json_file(record_path().string());
  const auto step = record.at("step").get<int64_t>();
  const auto path = output_dir_ / ("checkpoint-" + std::to_string(step));
  if (step > *resume_step || !fs::exists(path / "COMPLETE")) return;  // from a later, abandoned stretch of the run
  // Records before checkpoint.best_metric existed hold only the loss.
  const std::string metric = record.value("metric", std::string("loss"));
  if (metric != metric_) {
    spdlog::warn("checkpoint.keep_best: {} chose by {}, this run by {}; the best is chosen afresh",
                 record_path().string(), metric, metric_);
    return;
  }
  best_ = BestCheckpoint{step, record.contains("value") ? record.at("value").get<double>()
                                                        : record.at("eval_loss").get<double>(),
                         path};
  spdlog::info("checkpoint.keep_best: the best so far is {} ({} {:.4f})", path.string(), describe_metric(metric_),
               best_->value);
}

void CheckpointRetention::on_checkpoint(int64_t step, std::optional<double> value) {
  if (keep_best_ && value && (!best_ || better(*value, best_->value))) {
    best_ = BestCheckpoint{step, *value, output_dir_ / ("checkpoint-" + std::to_string(step))};
    write_record();  // before any pruning: the record never names a deleted checkpoint
    spdlog::info("best checkpoint so far: {} ({} {:.4f})", best_->path.string(), describe_metric(metric_),
                 best_->value);
  }
  // keep_last counts this stretch's complete checkpoints (up to `step`). An incomplete one before `step` is
  // debris of a crash and goes; ones after `step` (a resume from an older checkpoint) are left alone: pruning by
  // count must never delete the checkpoint just written in favour of them.
  std::vector<std::pair<int64_t, fs::path>> complete;
  for (const auto& [at, path] : checkpoint_dirs(output_dir_)) {
    if (at > step) continue;
    if (fs::exists(path / "COMPLETE")) complete.emplace_back(at, path);
    else if (at < step) fs::remove_all(path);
  }
  const std::size_t keep = static_cast<std::size_t>(std::max<int64_t>(keep_last_, 0));
  for (std::size_t i = 0; i + keep < complete.size(); ++i)
    if (!best_ || complete[i].first != best_->step) fs::remove_all(complete[i].second);
}

void CheckpointRetention::write_record() const {
  const auto temp = output_dir_ / ".best_checkpoint.json.tmp";
  {
    std::ofstream file(temp);
    nlohmann::json record = {{"step", best_->step}, {"metric", metric_}, {"value", best_->value},
                             {"path", best_->path.string()}};
    if (metric_ == "loss") record["eval_loss"] = best_->value;
    file << record.dump(2) << "\n";
  }
  fs::rename(temp, record_path());
}

}  // namespace trainer
