// How checkpoint-N directories are written and found, for text and image runs alike: the files go into a temporary
// directory that is renamed into place (a crash leaves the previous checkpoint whole), COMPLETE is written last (a
// directory without it is never trusted), and a write that fails (a full disk) removes its partial directory and
// says what the checkpoint needs against what is free.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <nlohmann/json_fwd.hpp>

namespace trainer {

class Module;
class Optimizer;

// The newest checkpoint-N in `dir` that was completely written.
std::optional<std::filesystem::path> newest_complete_checkpoint(const std::filesystem::path& dir);

struct CheckpointWrite {
  // Fills the temporary directory; may throw trainer::Error (a write error, parts of other ranks missing).
  std::function<void(const std::filesystem::path& temp_dir)> write_files;
  // Called when write_files failed, before the error is reported (data parallelism: tell the other ranks).
  std::function<void()> on_failure;
  // About what the checkpoint needs on disk (weights and optimizer state), for the message when it does not fit.
  int64_t needed_bytes = 0;
  // The temporary directory was prepared by the caller (other ranks write into it too): it is not emptied first.
  bool prepared = false;
};

// Writes output_dir/checkpoint-<step>. `on_disk`: this run's state at `step` is already that directory (a stop right
// after a periodic checkpoint, or right after resuming from it): it is kept as it is, never deleted and rewritten,
// so no moment exists without it. Another checkpoint-<step> (an earlier run's) is replaced only once the new one is
// whole. A failure is a DataError naming the step, the space needed and free, and the newest complete checkpoint.
// Returns the checkpoint's path.
std::filesystem::path write_checkpoint_dir(const std::filesystem::path& output_dir, int64_t step, bool on_disk,
                                           const CheckpointWrite& write);

// Tensors written beside the optimizer state in optimizer.safetensors (the engine's RNG state).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The checkpoint of a run whose whole state is in this process: `save_model` writes the model or adapter files into
// the temporary directory, then optimizer.safetensors (the optimizer's state tensors and `extra`) and
// train_state.json (`state`); the space it needs is the trained parameters' and the optimizer state's bytes.
std::filesystem::path write_training_checkpoint(const std::filesystem::path& output_dir, int64_t step, bool on_disk,
                                                const std::function<void(const std::filesystem::path&)>& save_model,
                                                Module& trained, const Optimizer& optimizer,
                                                const nlohmann::json& state, const NamedTensors& extra = {});

}  // namespace trainer
