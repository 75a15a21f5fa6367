// Checkpoints of data-parallel runs whose model and train state are the same on every rank (image classification;
// usable by any run whose whole state is one model, one optimizer and one JSON state): rank 0 writes the model and
// train_state.json; the optimizer state comes from rank 0 alone, or with sharded optimizer state
// (distributed.shard_optimizer, ZeRO-1) as one part per rank, listed in train_state.json's "optimizer_files", so that
// any world size (one process included) resumes from it. COMPLETE is written only once every part is on disk.
// In train/ (it writes checkpoint_dir's format and the Optimizer's state, over distributed/'s Communicator); its
// functions keep the namespace distributed::, which says at each call that every rank takes part.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "train/checkpoint_dir.h"

namespace trainer {
class Module;
class Optimizer;
}  // namespace trainer

namespace trainer::distributed {

class Communicator;

// The file rank `rank` of `world` writes its optimizer state part to (rank 0's is optimizer.safetensors).
std::string optimizer_part_file(int rank, int world);

// The optimizer state of `checkpoint` into `optimizer`: from optimizer.safetensors, or the union of the parts a
// sharded run listed in `state` (train_state.json)'s "optimizer_files", whatever the world size and sharding then and
// now; only the tensors this rank's optimizer holds are read. A missing part is refused by name (DataError) before
// anything changes.
// `piece_offsets`: with sharded weights (distributed.shard_weights), where each of this optimizer's state tensors (this
// rank's pieces, flat) starts in its parameter's flattened elements; empty when the optimizer holds whole parameters.
// Parts written by a run with sharded weights say the same of theirs (metadata "piece_offsets"), so any world size,
// sharded or not, assembles its tensors from any other's parts.
void load_optimizer_parts(const std::filesystem::path& checkpoint, const nlohmann::json& state, Optimizer& optimizer,
                          const std::map<std::string, int64_t>& piece_offsets = {});

// Writes output_dir/checkpoint-<step> as write_training_checkpoint (train/checkpoint_dir.h) does, on every rank of
// `world` (null: one process). Every rank calls it at the same step. Unsharded, rank 0 alone writes and the others
// return at once; sharded, each rank writes its optimizer part and rank 0 the rest (`state` gets "optimizer_files"),
// and all return once COMPLETE is written (or all throw DataError naming the parts that failed). `on_disk`: as for
// write_checkpoint_dir. `extra`: tensors rank 0 writes beside its optimizer state (optimizer.safetensors). Returns the
// checkpoint's path.
std::filesystem::path write_checkpoint_on_ranks(const std::filesystem::path& output_dir, int64_t step, bool on_disk,
                                                const std::function<void(const std::filesystem::path&)>& save_model,
                                                Module& trained, const Optimizer& optimizer, nlohmann::json state,
                                                Communicator* world, const NamedTensors& extra = {},
                                                const std::map<std::string, int64_t>& piece_offsets = {},
                                                const NamedTensors& rank_tensors = {});

// The parts of a checkpoint's per-rank state (train_state.json's "optimizer_files", else optimizer.safetensors).
std::vector<std::string> part_files(const nlohmann::json& state);
// Each tensor of `into` (name -> destination, filled in place through reshape(-1)) read as the range [offset, offset +
// numel) of the flattened tensor of that name (`offsets`: where each starts, 0 when absent), from the ranges of that
// name the parts hold (their metadata "piece_offsets" says where each starts; 0 when absent: whole tensors). Returns
// the names not covered entirely.
// `trainer export`: the model of a checkpoint of fully sharded weights (held in the ranks' parts) as Hugging Face
// files in `output_dir` (config.json, the weights sharded above max_shard_bytes, the tokenizer files; an image
// classifier's or CLIP's preprocessing too: the checkpoint's task names the architecture), offline, in
// one process: assembled parameter by parameter (the whole model once in memory, fp32). Throws DataError naming the
// checkpoint when it is not one, holds a LoRA adapter or Hugging Face files already, or misses a part. Returns the
// number of parameters written.
int64_t export_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& output_dir,
                          uint64_t max_shard_bytes);

std::vector<std::string> read_ranges(const std::filesystem::path& checkpoint, const std::vector<std::string>& files,
                                     const std::map<std::string, at::Tensor>& into,
                                     const std::map<std::string, int64_t>& offsets);

}  // namespace trainer::distributed
