// Writing and finding checkpoint-N directories (see checkpoint_dir.h).
#include "train/checkpoint_dir.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "models/module.h"
#include "train/optim/optimizer.h"
#include "train/retention.h"
#include "trainer/config.h"
#include "trainer/errors.h"
#include "trainer/safetensors.h"

namespace trainer {

namespace fs = std::filesystem;

std::optional<fs::path> newest_complete_checkpoint(const fs::path& dir) {
  const auto all = checkpoint_dirs(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (fs::exists(it->second / "COMPLETE")) return it->second;
  return std::nullopt;
}

fs::path write_checkpoint_dir(const fs::path& output_dir, int64_t step, bool on_disk, const CheckpointWrite& write) {
  const fs::path final_dir = output_dir / ("checkpoint-" + std::to_string(step));
  if (on_disk && fs::exists(final_dir / "COMPLETE")) {
    spdlog::info("checkpoint step {}: {} (already written)", step, final_dir.string());
    return final_dir;
  }
  const fs::path temp_dir = output_dir / (".checkpoint-" + std::to_string(step) + ".tmp");
  const auto started = std::chrono::steady_clock::now();
  if (!write.prepared) fs::remove_all(temp_dir);
  try {
    write.write_files(temp_dir);
  } catch (const Error& e) {
    if (write.on_failure) write.on_failure();
    // A full disk (or any write error): the partial directory goes, the previous checkpoint stays the newest, and
    // the message says what the checkpoint needs against what is free.
    std::error_code ignored;
    fs::remove_all(temp_dir, ignored);
    const auto space = fs::space(output_dir, ignored);
    const auto previous = newest_complete_checkpoint(output_dir);
    throw DataError(fmt::format("checkpoint step {} could not be written: {}\n  the checkpoint needs about {} "
                                "(weights and optimizer state); {} {}\n  {}",
                                step, e.what(), human_bytes(static_cast<double>(write.needed_bytes)),
                                ignored ? std::string("free space unknown on")
                                        : human_bytes(static_cast<double>(space.available)) + " free on",
                                output_dir.string(),
                                previous ? "the newest complete checkpoint is still " + previous->string()
                                         : std::string("no earlier checkpoint of this run exists")),
                    "free space there (or set checkpoint.output_dir to a disk with room), then continue with "
                    "--resume");
  }
  const fs::path replaced = output_dir / (".checkpoint-" + std::to_string(step) + ".replaced");
  fs::remove_all(replaced);
  if (fs::exists(final_dir)) fs::rename(final_dir, replaced);
  fs::rename(temp_dir, final_dir);
  // Written last: a checkpoint without it is not trusted.
  write_text_file((final_dir / "COMPLETE").string(), std::to_string(step) + "\n");
  fs::remove_all(replaced);
  // Its size and the time to write it (weights, optimizer state, the rename): what a large model's checkpoint costs.
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::uintmax_t bytes = 0;
  std::error_code ignored;
  for (const auto& entry : fs::recursive_directory_iterator(final_dir, ignored))
    if (entry.is_regular_file(ignored)) bytes += entry.file_size(ignored);
  spdlog::info("checkpoint step {}: {} ({} written in {:.1f} s)", step, final_dir.string(),
               human_bytes(static_cast<double>(bytes)), seconds);
  return final_dir;
}

std::filesystem::path write_training_checkpoint(const std::filesystem::path& output_dir, int64_t step, bool on_disk,
                                                const std::function<void(const std::filesystem::path&)>& save_model,
                                                Module& trained, const Optimizer& optimizer,
                                                const nlohmann::json& state, const NamedTensors& extra) {
  CheckpointWrite write;
  write.write_files = [&](const std::filesystem::path& temp_dir) {
    save_model(temp_dir);
    auto tensors = optimizer.state_tensors();
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    write_safetensors((temp_dir / "optimizer.safetensors").string(), tensors, {});
    write_text_file((temp_dir / "train_state.json").string(), state.dump(2) + "\n");
  };
  trained.for_each_parameter(
      [&](const std::string&, at::Tensor& p) { write.needed_bytes += static_cast<int64_t>(p.nbytes()); });
  for (const auto& [name, tensor] : optimizer.state_tensors())
    write.needed_bytes += static_cast<int64_t>(tensor.nbytes());
  return write_checkpoint_dir(output_dir, step, on_disk, write);
}

}  // namespace trainer
