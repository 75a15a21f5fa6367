// `trainer evaluate` (see evaluate.h).
#include "cli/evaluate.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <ostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "models/lora.h"
#include "models/weights.h"
#include "train/engine/task.h"
#include "train/tasks/text/generation_eval.h"
#include "train/tasks/text/text_task.h"
#include "trainer/data.h"
#include "trainer/device.h"
#include "trainer/errors.h"
#include "trainer/hub.h"
#include "trainer/peft.h"
#include "trainer/tokenizer.h"

namespace trainer {
namespace fs = std::filesystem;

namespace {

struct LoadedModel {
  std::unique_ptr<LanguageModel> model;
  fs::path config_dir;  // where config.json and generation_config.json are
};

LoadedModel load_evaluated_model(const Config& config, const std::string& dir, const c10::TensorOptions& options) {
  if (is_peft_adapter_dir(dir)) {
    const auto adapter = read_peft_adapter(dir);
    std::string named = adapter.config.base_model_name_or_path;
    if (!adapter.config.revision.empty() && !named.empty() && !fs::exists(named) && hub::parse_hub_id(named) &&
        named.find('@') == std::string::npos)
      named += "@" + adapter.config.revision;  // the commit it was trained on (PEFT's "revision")
    if (!named.empty() && !fs::exists(named) && hub::parse_hub_id(named)) {
      // PEFT names a Hub base by its id; when it cannot be had (offline, not cached), model.path is the base.
      try {
        hub::ResolveOptions resolve;
        resolve.what = "the adapter's base_model_name_or_path";
        named = hub::resolve(named, resolve).local_path;
      } catch (const Error& e) {
        spdlog::warn("the adapter's base {} is not available ({}); using model.path", named, e.what());
      }
    }
    std::string base = !named.empty() && fs::exists(fs::path(named) / "config.json") ? named : config.model.path;
    if (base == config.model.path) {
      // model.path by Hub id was fetched without weights (--model named the evaluated model): now they are needed.
      if (const auto origin = hub::snapshot_origin(base)) {
        hub::ResolveOptions resolve;
        resolve.what = "model.path (the adapter's base)";
        base = hub::resolve(origin->repo_id + "@" + origin->commit, resolve).local_path;
      }
    }
    auto model = load_model(base, ModelInit::kPretrained, options);
    auto adapters = apply_peft_adapter(*model, adapter, dir);
    merge_lora(*adapters);  // the adapted weights, computed once: generation runs the plain model
    return {std::move(model), base};
  }
  const bool is_model_path = fs::equivalent(fs::absolute(dir), fs::absolute(config.model.path));
  return {load_model(dir, is_model_path ? config.model.init : ModelInit::kPretrained, options,
                     static_cast<uint64_t>(config.training.seed)),
          dir};
}

}  // namespace

int run_evaluate(const Config& config, const EvaluateOptions& options, std::ostream& out) {
  if (config.data.validation_files.empty() && config.data.validation_fraction <= 0)
    throw UsageError("evaluate needs validation data: data.validation_files or data.validation_fraction",
                     "add --set data.validation_files=FILE.jsonl");
  const std::string dir = options.model_dir.empty() ? config.model.path : options.model_dir;
  const auto device = resolve_device(config.device).device;
  const auto dtype = config.precision.mode == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat;
  auto tokenizer = load_run_tokenizer(config, /*samples=*/false);
  auto [model, config_dir] = load_evaluated_model(config, dir, at::TensorOptions().dtype(dtype).device(device));
  model->train(false);
  const auto family = model->family() == ModelFamily::kSeq2Seq ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  const int32_t pad_id = tokenizer->pad_id().value_or(tokenizer->eos_id().value_or(0));
  const auto& micro_config = config.evaluation.micro_batch_size;
  EvaluationMicroBatch micro(micro_config.is_auto ? 8 : micro_config.value, nullptr);

  auto validation = make_validation_loader(config, *tokenizer, family, config.training.batch_size);
  const auto loss = validation_loss(*model, *validation, micro, config, device, pad_id,
                                    config.training.chunked_loss ? config.training.loss_chunk_size : 0);
  nlohmann::json scores = {{"model", dir}, {"eval_loss", loss.loss}, {"eval_tokens", loss.tokens}};
  out << fmt::format("{}: validation loss {:.4f} perplexity {:.2f} ({} tokens)\n", dir, loss.loss,
                     std::exp(loss.loss), loss.tokens);
  const fs::path output =
      options.output_dir.empty() ? fs::path(config.checkpoint.output_dir) / "evaluations" / "evaluate"
                                 : fs::path(options.output_dir);
  fs::create_directories(output);
  if (config.evaluation.generate) {
    auto examples = make_validation_loader(config, *tokenizer, family, config.training.batch_size);
    const auto generate_options = evaluation_generate_options(config, model->family(), config_dir);
    const auto generated = evaluate_by_generation(*model, *tokenizer, *examples, config, generate_options, micro, nullptr,
                                                  output / "predictions.jsonl");
    std::string line;
    for (const auto& [name, value] : generated.metrics) {
      line += fmt::format(" {} {:.4f}", name, value);
      scores["eval_" + name] = value;
    }
    scores["eval_generated"] = generated.examples;
    out << fmt::format("generated {} answers:{} ({})\n", generated.examples, line,
                       (output / "predictions.jsonl").string());
  }
  std::ofstream(output / "metrics.json") << scores.dump(2) << "\n";
  out << scores.dump() << "\n";
  return kExitOk;
}

}  // namespace trainer
