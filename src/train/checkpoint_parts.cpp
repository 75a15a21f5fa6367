// Checkpoints of data-parallel runs (see checkpoint_parts.h).
#include "train/checkpoint_parts.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "distributed/process_group.h"
#include "models/image/clip.h"
#include "models/image/image_model.h"
#include "models/model.h"
#include "models/module.h"
#include "models/weights.h"
#include "train/checkpoint_dir.h"
#include "train/optim/optimizer.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/safetensors.h"

namespace trainer::distributed {

namespace fs = std::filesystem;

std::string optimizer_part_file(int rank, int world) {
  return rank == 0 ? "optimizer.safetensors"
                   : "optimizer-rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

namespace {

// Every listed part on disk, or DataError naming the missing ones.
void require_parts(const fs::path& checkpoint, const std::vector<std::string>& files) {
  std::string missing;
  for (const auto& f : files)
    if (!fs::exists(checkpoint / f)) missing += (missing.empty() ? "" : ", ") + (checkpoint / f).string();
  if (!missing.empty())
    throw DataError("checkpoint " + checkpoint.string() + " is incomplete: its state is in " +
                        std::to_string(files.size()) + " part(s) (one per rank that wrote it), and " + missing +
                        " is missing",
                    "copy the missing part(s) from where the ranks wrote them (checkpoint.output_dir must be one "
                    "directory for every rank), or use an earlier complete checkpoint");
}

}  // namespace

void load_optimizer_parts(const fs::path& checkpoint, const nlohmann::json& state, Optimizer& optimizer,
                          const std::map<std::string, int64_t>& piece_offsets) {
  const std::vector<std::string> files = part_files(state);
  require_parts(checkpoint, files);
  std::string source = (checkpoint / files.front()).string();
  if (files.size() > 1) source += " (and " + std::to_string(files.size() - 1) + " other part(s))";
  std::map<std::string, at::Tensor> wanted;  // name -> this optimizer's tensor (for its shape)
  for (const auto& [name, tensor] : optimizer.state_tensors()) wanted[name] = tensor;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  bool pieces_on_disk = false;
  for (const auto& f : files)
    if (SafetensorsFile::open((checkpoint / f).string()).metadata().contains("piece_offsets")) pieces_on_disk = true;
  if (!pieces_on_disk && piece_offsets.empty()) {
    // Whole parameters on both sides: each tensor is read as it is.
    for (const auto& f : files) {
      const auto file = SafetensorsFile::open((checkpoint / f).string());
      for (const auto& t : file.tensors())
        if (wanted.contains(t.name)) tensors.emplace_back(t.name, file.load(t.name, at::kFloat));
    }
    optimizer.load_state(tensors, state.at("optimizer_steps").get<int64_t>(), source);
    return;
  }
  // Pieces on one side or both: each wanted tensor is the range [offset, offset + numel) of its parameter's
  // flattened elements, assembled from the parts' ranges that overlap it. One left incomplete is left out, and
  // load_state names it.
  std::map<std::string, at::Tensor> into;
  for (const auto& [name, tensor] : wanted) into[name] = at::zeros({tensor.numel()}, at::kFloat);
  const auto incomplete = read_ranges(checkpoint, files, into, piece_offsets);
  for (auto& [name, values] : into)
    if (std::find(incomplete.begin(), incomplete.end(), name) == incomplete.end())
      tensors.emplace_back(name, values.view(wanted.at(name).sizes()));
  optimizer.load_state(tensors, state.at("optimizer_steps").get<int64_t>(), source);
}

std::vector<std::string> read_ranges(const fs::path& checkpoint, const std::vector<std::string>& files,
                                     const std::map<std::string, at::Tensor>& into,
                                     const std::map<std::string, int64_t>& offsets) {
  at::NoGradGuard no_grad;
  // Which elements some part gave (a tensor kept whole on every rank is in every part: counted once).
  std::map<std::string, at::Tensor> covered;
  for (const auto& f : files) {
    const auto file = SafetensorsFile::open((checkpoint / f).string());
    nlohmann::json on_disk = nlohmann::json::object();
    if (const auto it = file.metadata().find("piece_offsets"); it != file.metadata().end())
      on_disk = nlohmann::json::parse(it->second);
    for (const auto& t : file.tensors()) {
      const auto want = into.find(t.name);
      if (want == into.end()) continue;
      const int64_t begin = offsets.contains(t.name) ? offsets.at(t.name) : 0;
      const int64_t numel = want->second.numel();
      const int64_t from = on_disk.value(t.name, int64_t{0});
      const int64_t length = c10::multiply_integers(t.shape);
      const int64_t lo = std::max(begin, from), hi = std::min(begin + numel, from + length);
      if (hi <= lo) continue;
      const at::Tensor values = file.load(t.name).reshape({-1});
      want->second.reshape({-1}).narrow(0, lo - begin, hi - lo).copy_(values.narrow(0, lo - from, hi - lo));
      at::Tensor& mask = covered[t.name];
      if (!mask.defined()) mask = at::zeros({numel}, at::kBool);
      mask.narrow(0, lo - begin, hi - lo).fill_(true);
    }
  }
  std::vector<std::string> incomplete;
  for (const auto& [name, tensor] : into)
    if (!covered.contains(name) || !covered.at(name).all().item<bool>()) incomplete.push_back(name);
  return incomplete;
}

int64_t export_checkpoint(const fs::path& checkpoint, const fs::path& output_dir, uint64_t max_shard_bytes) {
  const fs::path state_file = checkpoint / "train_state.json";
  if (!fs::exists(state_file))
    throw DataError(checkpoint.string() + " is not a checkpoint of trainer (no train_state.json)",
                    "name a checkpoint-N directory of a run's checkpoint.output_dir");
  const nlohmann::json state = read_json_file(state_file.string());
  if (state.contains("base_model_config"))
    throw DataError(checkpoint.string() + " holds a LoRA adapter, which PEFT loads as it is",
                    "merge it into its base with trainer merge --adapter " + checkpoint.string());
  if (!state.value("weights_in_parts", false))
    throw DataError(checkpoint.string() + " holds its model as Hugging Face files already (only checkpoints of "
                                          "distributed.shard_weights keep their weights in the ranks' parts)",
                    "load it as it is: model.path=" + checkpoint.string() + " or from_pretrained");
  at::NoGradGuard no_grad;
  // The pieces are the runs' fp32 master values (sharded weights train fp32 or bf16-mixed). The model's architecture
  // is the task's: an image classifier, a CLIPModel, or a text model (built from config.json; the image models with
  // throwaway values, which the parts then replace).
  const auto fp32 = at::TensorOptions().dtype(at::kFloat);
  const std::string task = state.value("task", std::string("text"));
  std::unique_ptr<Module> model;
  std::function<void()> save;
  if (task == "image") {
    auto classifier = load_image_classifier(checkpoint.string(), ModelInit::kRandom, fp32);
    save = [&, m = classifier.get()] { save_image_classifier(*m, output_dir.string()); };
    model = std::move(classifier);
  } else if (task == "contrastive") {
    auto clip = load_clip(checkpoint.string(), ModelInit::kRandom, fp32);
    save = [&, m = clip.get()] { save_clip(*m, output_dir.string(), max_shard_bytes); };
    model = std::move(clip);
  } else {
    auto language = build_model(read_json_file((checkpoint / "config.json").string()), fp32);
    save = [&, m = language.get()] { save_model(*m, output_dir.string(), max_shard_bytes); };
    model = std::move(language);
  }
  std::map<std::string, at::Tensor> into;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) { into["weights." + name] = p; });
  require_parts(checkpoint, part_files(state));
  const auto incomplete = read_ranges(checkpoint, part_files(state), into, {});
  if (!incomplete.empty())
    throw DataError("checkpoint " + checkpoint.string() + " does not hold all of " + incomplete.front().substr(8) +
                        (incomplete.size() > 1 ? " (and " + std::to_string(incomplete.size() - 1) + " more)" : "") +
                        " in its parts " + nlohmann::json(part_files(state)).dump(),
                    "copy every rank's part into the checkpoint (checkpoint.output_dir must be one directory for "
                    "every rank), or export an earlier complete checkpoint");
  save();
  copy_tokenizer_files(checkpoint.string(), output_dir.string());
  // The image models' preprocessing, and CLIP's BPE files beside its tokenizer.json (what the task's save writes).
  for (const char* name : {"preprocessor_config.json", "vocab.json", "merges.txt"})
    if (task != "text" && fs::exists(checkpoint / name))
      fs::copy_file(checkpoint / name, output_dir / name, fs::copy_options::overwrite_existing);
  return count_parameters(*model);
}

std::vector<std::string> part_files(const nlohmann::json& state) {
  std::vector<std::string> files = {"optimizer.safetensors"};
  if (state.contains("optimizer_files")) files = state.at("optimizer_files").get<std::vector<std::string>>();
  return files;
}

fs::path write_checkpoint_on_ranks(const fs::path& output_dir, int64_t step, bool on_disk,
                                   const std::function<void(const fs::path&)>& save_model, Module& trained,
                                   const Optimizer& optimizer, nlohmann::json state, Communicator* world,
                                   const NamedTensors& extra, const std::map<std::string, int64_t>& piece_offsets,
                                   const NamedTensors& rank_tensors) {
  const fs::path final_dir = output_dir / ("checkpoint-" + std::to_string(step));
  const bool primary = !world || world->rank() == 0;
  if (!world || (optimizer.shard().world <= 1 && piece_offsets.empty())) {
    // Every rank holds the same weights and optimizer state: rank 0 writes them.
    if (!primary) return final_dir;
    return write_training_checkpoint(output_dir, step, on_disk, save_model, trained, optimizer, state, extra);
  }
  // Sharded: no rank holds the whole optimizer state; each writes its part into the directory rank 0 prepares.
  std::map<std::string, std::string> metadata;
  if (!piece_offsets.empty()) metadata["piece_offsets"] = nlohmann::json(piece_offsets).dump();
  const int ranks = world->world_size();
  // The same answer on every rank (one directory): either all write or none does.
  if (on_disk && world->all_reduce_max({fs::exists(final_dir / "COMPLETE") ? 1 : 0})[0]) {
    if (primary) spdlog::info("checkpoint step {}: {} (already written)", step, final_dir.string());
    return final_dir;
  }
  const fs::path temp_dir = output_dir / (".checkpoint-" + std::to_string(step) + ".tmp");
  if (primary) {
    fs::remove_all(temp_dir);
    fs::create_directories(temp_dir);
  }
  world->barrier();
  std::vector<std::string> files;
  for (int r = 0; r < ranks; ++r) files.push_back(optimizer_part_file(r, ranks));
  // Every rank's outcome, once all have tried: the parts that could not be written ("" when none).
  auto agree_on_parts = [&](bool failed) {
    std::vector<int64_t> flags(static_cast<std::size_t>(ranks), 0);
    flags[static_cast<std::size_t>(world->rank())] = failed ? 1 : 0;
    const auto all = world->all_reduce_max(flags);
    std::string missing;
    for (int r = 0; r < ranks; ++r)
      if (all[static_cast<std::size_t>(r)])
        missing += (missing.empty() ? "" : ", ") + files[static_cast<std::size_t>(r)];
    return missing;
  };
  if (!primary) {
    std::string failure;
    try {
      auto tensors = optimizer.state_tensors();
      tensors.insert(tensors.end(), rank_tensors.begin(), rank_tensors.end());
      write_safetensors((temp_dir / files[static_cast<std::size_t>(world->rank())]).string(), tensors, metadata);
    } catch (const Error& e) {
      failure = e.what();
      spdlog::error("checkpoint step {}: this rank's optimizer state could not be written: {}", step, failure);
    }
    if (const std::string missing = agree_on_parts(!failure.empty()); !missing.empty())
      throw DataError("checkpoint step " + std::to_string(step) +
                          " could not be written: the optimizer state part(s) " + missing + " failed" +
                          (failure.empty() ? "" : ": " + failure),
                      "free space in checkpoint.output_dir, then continue with --resume");
    world->barrier();  // rank 0 has renamed it and written COMPLETE
    return final_dir;
  }
  state["optimizer_files"] = files;
  bool agreed = false;
  CheckpointWrite write;
  write.write_files = [&](const fs::path& dir) {
    save_model(dir);
    auto tensors = optimizer.state_tensors();
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    tensors.insert(tensors.end(), rank_tensors.begin(), rank_tensors.end());
    write_safetensors((dir / files.front()).string(), tensors, metadata);
    write_text_file((dir / "train_state.json").string(), state.dump(2) + "\n");
    agreed = true;
    if (const std::string missing = agree_on_parts(false); !missing.empty())
      throw DataError("the optimizer state part(s) " + missing + " could not be written by their ranks",
                      "see those ranks' errors");
  };
  write.on_failure = [&] {
    if (!agreed) agree_on_parts(true);  // the other ranks learn that this checkpoint failed
  };
  trained.for_each_parameter(
      [&](const std::string&, at::Tensor& p) { write.needed_bytes += static_cast<int64_t>(p.nbytes()); });
  for (const auto& [name, tensor] : optimizer.state_tensors())
    write.needed_bytes += static_cast<int64_t>(tensor.nbytes());
  write.prepared = true;
  const fs::path written = write_checkpoint_dir(output_dir, step, false, write);
  world->barrier();
  return written;
}

}  // namespace trainer::distributed
