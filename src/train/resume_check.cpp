// The checks a resume makes on settings and data (see resume_check.h).
#include "train/resume_check.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "data/chat_record.h"
#include "data/dataset.h"
#include "data/jsonl.h"
#include "trainer/errors.h"
#include "trainer/hub.h"

namespace trainer {
namespace fs = std::filesystem;

// ---- settings --------------------------------------------------------------------------------------------------

std::string resume_refusal_reason(const std::string& key) {
  // Whole sections first: the model and the tokenizer are what the weights mean; precision is their numerics.
  if (key.starts_with("model.")) return "the checkpoint's weights belong to the model it names";
  if (key.starts_with("tokenizer.")) return "the token ids the model was trained on";
  // The loss scaler's settings are tuning, as the learning rate is (a resume continues from the saved scale).
  if (key == "precision.initial_loss_scale" || key == "precision.loss_scale_growth_interval") return {};
  if (key.starts_with("precision.")) return "the numerics of the weights, gradients and optimizer state";
  static const std::map<std::string, std::string> reasons = {
      {"optimizer.name", "the optimizer state in the checkpoint is this optimizer's"},
      {"optimizer.state_dtype", "the dtype of the optimizer state in the checkpoint"},
      {"training.batch_size", "the effective batch: the data position and the schedule count in it"},
      {"training.seed", "the shuffle order, the held-out split and dropout"},
      {"lora.enabled", "the checkpoint holds a full model or an adapter"},
      {"lora.r", "the adapter's shape"},
      {"lora.alpha", "the adapter's scaling"},
      {"lora.target_modules", "the adapter's shape"},
      {"lora.target_parameters", "the adapter's shape"},
      {"lora.rslora", "the adapter's scaling"},
      {"lora.base_in_bf16", "the numerics of the frozen base"},
      {"data.input_field", "which text becomes the examples"},
      {"data.target_field", "which text becomes the examples"},
      {"data.text_field", "which text becomes the examples"},
      {"data.prompt_field", "which text becomes the examples"},
      {"data.completion_field", "which text becomes the examples"},
      {"data.chat_template", "how chat records become token ids"},
      {"data.train_on", "which tokens of chat records are trained"},
      {"data.max_input_length", "the examples' lengths (truncation)"},
      {"data.max_target_length", "the examples' lengths (truncation)"},
      {"data.max_length", "the examples' lengths (truncation)"},
      {"data.on_overlength", "which examples are trained, and how long"},
      {"data.shuffle", "the epoch's order"},
      {"data.group_by_length", "the epoch's order"},
      {"data.validation_fraction", "which records are trained and which held out"},
      {"training.objective", "what the model is trained for (classification or contrastive)"},
      {"contrastive.negatives", "the contrastive objective: which negatives each pair is scored against"},
      {"contrastive.freeze_image_tower", "which parameters train and have optimizer state"},
  };
  const auto it = reasons.find(key);
  return it == reasons.end() ? std::string() : it->second;
}

std::vector<ConfigChange> config_changes(const nlohmann::json& saved_config, const nlohmann::json& current_config) {
  std::vector<ConfigChange> changes;
  for (const auto& known : config_keys()) {  // in config order (nlohmann::json objects are sorted by name)
    const auto dot = known.path.find('.');
    const auto section = known.path.substr(0, dot), key = known.path.substr(dot + 1);
    auto find = [&](const nlohmann::json& config) -> const nlohmann::json* {
      if (!config.contains(section) || !config[section].is_object() || !config[section].contains(key)) return nullptr;
      return &config[section][key];
    };
    const auto* before = find(saved_config);
    const auto* after = find(current_config);
    if (!before || !after || *before == *after) continue;
    std::string reason = resume_refusal_reason(known.path);
    if (known.path == "model.path" && before->is_string() && after->is_string()) {
      // A Hub id resolves to snapshots/<commit>: the same repo at another commit is other weights (a moved branch).
      const auto was = hub::snapshot_origin(before->get<std::string>());
      const auto now = hub::snapshot_origin(after->get<std::string>());
      if (was && now && was->repo_id == now->repo_id && was->commit != now->commit)
        reason = "the Hub revision of " + now->repo_id + " moved from commit " + was->commit + " to " + now->commit +
                 ": other base weights (pin the checkpoint's with model.path=" + now->repo_id + "@" + was->commit + ")";
    }
    changes.push_back({known.path, before->dump(), after->dump(), reason});
  }
  return changes;
}

void check_resume_config(const nlohmann::json& saved_config, const Config& config, const std::string& checkpoint,
                         bool allow_change) {
  const auto changes = config_changes(saved_config, nlohmann::json::parse(config_to_json(config)));
  if (changes.empty()) return;
  std::string line;
  for (const auto& c : changes) line += (line.empty() ? "" : ", ") + c.key + " " + c.before + " -> " + c.after;
  spdlog::info("resume: {} setting(s) differ from {}: {}", changes.size(), checkpoint, line);
  std::string refused;
  for (const auto& c : changes)
    if (!c.refused_because.empty())
      refused += "\n  " + c.key + ": checkpoint " + c.before + ", now " + c.after + " (" + c.refused_because + ")";
  if (refused.empty()) return;
  if (allow_change) {
    spdlog::warn("--allow-config-change: continuing {} with settings that change the run:{}\nthe run goes on from "
                 "the checkpoint's weights and step, but it is no longer the run the checkpoint began",
                 checkpoint, refused);
    return;
  }
  throw UsageError("resuming " + checkpoint + " with settings that would not continue the same run:" + refused,
                   "resume with the checkpoint's values (" + checkpoint +
                       "/train_state.json holds its resolved config), or add --allow-config-change to continue from "
                       "its weights and step anyway");
}

// ---- data --------------------------------------------------------------------------------------------------------

namespace {

// FNV-1a, 64 bits: a stable content hash without a dependency (tokenizer files are at most tens of MB, read once).
std::string fnv1a64_of_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(path + ": cannot open (" + std::strerror(errno) + ")", "check the tokenizer path");
  std::uint64_t hash = 14695981039346656037ull;
  std::vector<unsigned char> block(1 << 20);
  for (;;) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      throw DataError(path + ": read error (" + std::strerror(errno) + ")");
    }
    if (n == 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      hash ^= block[static_cast<std::size_t>(i)];
      hash *= 1099511628211ull;
    }
  }
  ::close(fd);
  return fmt::format("{:016x}", hash);
}

std::string fnv1a64_of_text(std::string_view text) {
  std::uint64_t hash = 14695981039346656037ull;
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ull;
  }
  return fmt::format("{:016x}", hash);
}

// How chat records become examples: data.train_on and the template text (whichever file it came from:
// data.chat_template, chat_template.jinja or tokenizer_config.json). Empty when there is none (no chat records).
nlohmann::json chat_fingerprint(const Config& config) {
  const auto setup = data::load_chat_setup(config);
  std::string train_on;
  for (const auto& entry : enum_names(config.data.train_on))
    if (entry.value == config.data.train_on) train_on = entry.name;
  return {{"train_on", train_on},
          {"template", setup->error.empty() ? setup->plain_origin : std::string()},
          {"template_fnv1a64", setup->error.empty() ? fnv1a64_of_text(setup->plain_source + '\0' + setup->tools_source)
                                                    : std::string()}};
}

std::string absolute_path(const std::string& path) { return fs::absolute(path).lexically_normal().string(); }

std::string file_summary(const nlohmann::json& file) {
  return fmt::format("{} records ({} bytes)", file.value("records", std::uint64_t{0}), file.value("size", std::uint64_t{0}));
}

}  // namespace

nlohmann::json data_fingerprint(const Config& config, const Tokenizer& tokenizer) {
  const auto start = std::chrono::steady_clock::now();
  nlohmann::json files = nlohmann::json::array();
  std::uint64_t train_records = 0;
  if (!config.data.train_files.empty()) {
    const auto paths = data::expand_globs(config.data.train_files, "data.train_files");
    const bool split = config.data.validation_files.empty() && config.data.validation_fraction > 0;
    const auto dataset =
        data::open_dataset(paths, split ? data::Dataset::Subset::kTrain : data::Dataset::Subset::kAll,
                           config.data.validation_fraction, static_cast<std::uint64_t>(config.training.seed));
    for (const auto& index : dataset->files)
      files.push_back({{"path", absolute_path(index.path)},
                       {"size", index.file_size},
                       {"mtime_ns", index.mtime_ns},
                       {"records", index.records}});
    train_records = dataset->size();
  }
  const auto indexed = std::chrono::steady_clock::now();
  // The tokenizer file and the settings beside it (special tokens, add_eos) that decide the ids.
  nlohmann::json tokenizer_files = nlohmann::json::array();
  fs::path source(tokenizer.source());
  std::vector<fs::path> candidates = {source};
  if (fs::is_regular_file(source)) candidates.push_back(source.parent_path() / "tokenizer_config.json");
  for (const auto& path : candidates) {
    if (!fs::is_regular_file(path)) continue;
    tokenizer_files.push_back({{"path", absolute_path(path.string())},
                               {"size", fs::file_size(path)},
                               {"fnv1a64", fnv1a64_of_file(path.string())}});
  }
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  spdlog::debug("data fingerprint: {} train file(s), {} records ({:.1f} ms); {} tokenizer file(s) hashed ({:.1f} ms)",
                files.size(), train_records, ms(start, indexed), tokenizer_files.size(),
                ms(indexed, std::chrono::steady_clock::now()));
  return {{"train_files", files},
          {"train_records", train_records},
          {"tokenizer_files", tokenizer_files},
          {"chat", chat_fingerprint(config)}};
}

std::vector<std::string> data_changes(const nlohmann::json& saved, const nlohmann::json& current,
                                      std::vector<std::string>& warnings) {
  std::vector<std::string> changes;
  const auto& before = saved.at("train_files");
  const auto& now = current.at("train_files");
  std::map<std::string, nlohmann::json> before_by_path, now_by_path;
  for (const auto& f : before) before_by_path[f.at("path").get<std::string>()] = f;
  for (const auto& f : now) now_by_path[f.at("path").get<std::string>()] = f;
  // The same files in another place (a copied run): same count, and position by position the same name, size and
  // records. The epoch order is the same; only a warning.
  bool moved = before.size() == now.size() && !before.empty();
  bool same_paths = moved;
  for (std::size_t i = 0; same_paths && i < before.size(); ++i) same_paths = before[i].at("path") == now[i].at("path");
  moved = moved && !same_paths;
  for (std::size_t i = 0; moved && i < before.size(); ++i)
    moved = fs::path(before[i].at("path").get<std::string>()).filename() ==
                fs::path(now[i].at("path").get<std::string>()).filename() &&
            before[i].at("size") == now[i].at("size") && before[i].at("records") == now[i].at("records");
  if (moved) {
    warnings.push_back("the train files are in another place, with the same names, sizes and records (first: " +
                       before[0].at("path").get<std::string>() + " then, " + now[0].at("path").get<std::string>() +
                       " now)");
  } else {
    for (const auto& f : before) {
      const auto path = f.at("path").get<std::string>();
      const auto it = now_by_path.find(path);
      if (it == now_by_path.end()) {
        changes.push_back(path + ": trained on in the checkpoint (" + file_summary(f) + "), not among the train files now");
        continue;
      }
      const auto& g = it->second;
      if (f.at("size") != g.at("size") || f.at("records") != g.at("records"))
        changes.push_back(path + ": " + file_summary(f) + " in the checkpoint, " + file_summary(g) + " now");
      else if (f.at("mtime_ns") != g.at("mtime_ns"))
        warnings.push_back(path + " was modified since the checkpoint, with the same size and records");
    }
    for (const auto& g : now)
      if (!before_by_path.count(g.at("path").get<std::string>()))
        changes.push_back(g.at("path").get<std::string>() + ": new among the train files (" + file_summary(g) + ")");
    if (changes.empty() && before != now) {
      bool reordered = false;
      for (std::size_t i = 0; i < before.size() && i < now.size(); ++i)
        reordered = reordered || before[i].at("path") != now[i].at("path");
      if (reordered) changes.push_back("the train files are listed in another order (records are numbered across them)");
    }
  }
  if (changes.empty() && saved.value("train_records", std::uint64_t{0}) != current.value("train_records", std::uint64_t{0}))
    changes.push_back(fmt::format("the training part holds {} records now, {} in the checkpoint (the validation split "
                                  "changed: data.validation_files or data.validation_fraction)",
                                  current.value("train_records", std::uint64_t{0}),
                                  saved.value("train_records", std::uint64_t{0})));
  // Tokenizer files, by name: the same file with other bytes gives other ids.
  std::map<std::string, nlohmann::json> tokenizer_before;
  for (const auto& f : saved.value("tokenizer_files", nlohmann::json::array()))
    tokenizer_before[fs::path(f.at("path").get<std::string>()).filename().string()] = f;
  for (const auto& g : current.value("tokenizer_files", nlohmann::json::array())) {
    const auto it = tokenizer_before.find(fs::path(g.at("path").get<std::string>()).filename().string());
    if (it == tokenizer_before.end() || it->second.at("fnv1a64") == g.at("fnv1a64")) continue;
    changes.push_back(g.at("path").get<std::string>() + ": the tokenizer file changed (" +
                      it->second.at("size").dump() + " bytes, hash " + it->second.at("fnv1a64").get<std::string>() +
                      " in the checkpoint; " + g.at("size").dump() + " bytes, hash " +
                      g.at("fnv1a64").get<std::string>() + " now)");
  }
  // Chat records: another data.train_on or another template gives other labels or ids (older checkpoints have none).
  if (saved.contains("chat") && current.contains("chat")) {
    const auto& a = saved.at("chat");
    const auto& b = current.at("chat");
    if (a.value("train_on", std::string()) != b.value("train_on", std::string()))
      changes.push_back("data.train_on is " + b.value("train_on", std::string()) + " now, " +
                        a.value("train_on", std::string()) + " in the checkpoint (chat records train other tokens)");
    if (a.value("template_fnv1a64", std::string()) != b.value("template_fnv1a64", std::string()))
      changes.push_back("the chat template changed (" + a.value("template", std::string("none")) + ", hash " +
                        a.value("template_fnv1a64", std::string()) + " in the checkpoint; " +
                        b.value("template", std::string("none")) + ", hash " +
                        b.value("template_fnv1a64", std::string()) + " now)");
  }
  return changes;
}

bool check_resume_data(const nlohmann::json& train_state, const nlohmann::json& current, const std::string& checkpoint,
                       bool allow_change, const DataChanges& compare) {
  if (!train_state.contains("data_fingerprint")) {
    spdlog::warn("{} was written before checkpoints recorded their data: resuming without checking that the train "
                 "files and the tokenizer are those it was trained on",
                 checkpoint);
    return false;
  }
  std::vector<std::string> warnings;
  std::vector<std::string> changes;
  try {
    changes = compare(train_state.at("data_fingerprint"), current, warnings);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(checkpoint + "/train_state.json: data_fingerprint is malformed (" + e.what() + ")",
                    "the file was edited or damaged; resume from another checkpoint");
  }
  for (const auto& w : warnings) spdlog::warn("resume: {}", w);
  if (changes.empty()) return false;
  std::string listed;
  for (const auto& c : changes) listed += "\n  " + c;
  if (allow_change) {
    spdlog::warn("--allow-data-change: the data changed since {} was written:{}\ncontinuing from its step with a new "
                 "epoch over the data as it is now",
                 checkpoint, listed);
    return true;
  }
  throw DataError("the data changed since " + checkpoint + " was written:" + listed +
                      "\nthe rest of the checkpoint's epoch is a permutation over the records it had; with other data, "
                      "some records would be trained twice and others never",
                  "train on the data the checkpoint was trained on, or add --allow-data-change to continue from its "
                  "step with a new epoch over the data as it is now");
}

LoaderCursor new_epoch_cursor(const LoaderCursor& saved) {
  LoaderCursor cursor = saved;
  if (cursor.position > 0) ++cursor.epoch;
  cursor.position = 0;
  return cursor;
}

}  // namespace trainer
