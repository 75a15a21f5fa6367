// Loading and saving a model as a Hugging Face directory.
#include "models/weights.h"

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "models/layers.h"
#include "quant/blockwise.h"
#include "trainer/errors.h"
#include "trainer/hf_weights.h"
#include "trainer/safetensors.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace fs = std::filesystem;
namespace {

QuantState4bit state_to(QuantState4bit state, const c10::Device& device) {
  for (at::Tensor* t : {&state.absmax, &state.quant_map, &state.nested_absmax, &state.nested_quant_map,
                        &state.state_json})
    if (t->defined()) *t = t->to(device);
  return state;
}

// Quantizes `linear` in place: its full-precision weight is replaced by the 4-bit one.
void quantize_layer(Linear& linear, const at::Tensor& full, const Quantize4bitOptions& options,
                    const c10::Device& device) {
  auto [packed, state] = quantize_weight(full, options, device);
  linear.set_quantized(std::move(packed), state);
}

// A layer to be quantized when fully sharded weights read it (load_model with on_demand): the packed codes and the
// state's tensors on the meta device with the shapes quantization gives them (the JSON's length depends on the
// values: empty until read).
void quantize_later(Linear& linear, const Quantize4bitOptions& options, at::ScalarType dtype) {
  const auto meta = at::TensorOptions().device(at::kMeta);
  QuantState4bit state;
  state.type = options.type;
  state.blocksize = options.blocksize;
  state.out_features = linear.out_features();
  state.in_features = linear.in_features();
  state.dtype = dtype;
  state.nested = options.double_quant;
  const int64_t blocks = (state.numel() + state.blocksize - 1) / state.blocksize;
  state.absmax = at::empty({blocks}, meta.dtype(state.nested ? at::kByte : at::kFloat));
  state.quant_map = at::empty({16}, meta.dtype(at::kFloat));
  if (state.nested) {
    const int64_t nested = quant::Quantized4bit::kNestedBlocksize;
    state.nested_absmax = at::empty({(blocks + nested - 1) / nested}, meta.dtype(at::kFloat));
    state.nested_quant_map = at::empty({256}, meta.dtype(at::kFloat));
  }
  state.state_json = at::empty({0}, meta.dtype(at::kByte));
  linear.set_quantized(at::empty({(state.numel() + 1) / 2, 1}, meta.dtype(at::kByte)), state);
}

std::string tensor_text(const at::Tensor& bytes) {
  const at::Tensor t = bytes.contiguous().to(at::kByte);
  return {reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<std::size_t>(t.numel())};
}

}  // namespace

std::unique_ptr<LanguageModel> load_model(const std::string& dir, ModelInit init, const c10::TensorOptions& options,
                                          uint64_t seed, const std::optional<Quantize4bitOptions>& quantize,
                                          WeightReader* on_demand) {
  const auto info = inspect_model_dir(dir, init == ModelInit::kPretrained);
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  const auto device = options.device();
  at::NoGradGuard no_grad;
  if (init == ModelInit::kRandom) {
    // Initialise in fp32 and convert, so bf16 models start from the same numbers as fp32 ones.
    auto model = build_model(read_json_file((fs::path(dir) / "config.json").string()), options.dtype(at::kFloat));
    at::manual_seed(seed);
    model->init_weights();
    model->for_each_parameter([&](const std::string&, at::Tensor& p) { p = p.to(options); });
    if (quantize) {
      const auto layers = linear_layers(*model);
      for (const auto& path : quantizable_layers(*model, quantize->experts)) {
        Linear& linear = *layers.at(path);
        quantize_layer(linear, linear.weight, *quantize, device);
      }
    }
    return model;
  }
  auto model = build_model(read_json_file((fs::path(dir) / "config.json").string()), options.device(at::kMeta));

  // Every tensor's file and shape from the headers alone (no data read yet).
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<std::size_t, const TensorInfo*>> where;  // name -> (file, tensor)
  for (const auto& path : info.weight_files) files.push_back(SafetensorsFile::open(path));
  ShapeMap got;
  // Keyed by parameter name (models whose files name them otherwise map them: LanguageModel::parameter_name);
  // the tensors the model carries unused are read as stored.
  std::vector<std::pair<std::string, std::pair<std::size_t, const TensorInfo*>>> carried;
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (const auto& tensor : files[f].tensors()) {
      const auto name = model->parameter_name(tensor.name);
      if (!name) {
        carried.push_back({tensor.name, {f, &tensor}});
        continue;
      }
      if (where.count(*name))
        throw DataError(tensor.name + " is in both " + files[where[*name].first].path() + " and " +
                        files[f].path());
      where[*name] = {f, &tensor};
      got[*name] = tensor.shape;
    }
  }
  // A checkpoint with its own lm_head.weight has an untied head even where config.json says tied (transformers
  // does the same); one without it uses the embedding.
  if (model->lm_head_tied() && where.count("lm_head.weight")) model->untie_lm_head();
  // Tied aliases (older T5 checkpoints repeat shared.weight as encoder/decoder.embed_tokens.weight) stand for
  // their canonical parameter when that is missing, and are ignored when it is there.
  for (const auto& [alias, canonical] : model->aliases()) {
    auto it = where.find(alias);
    if (it == where.end()) continue;
    if (!where.count(canonical)) {
      where[canonical] = it->second;
      got[canonical] = got[alias];
    }
    where.erase(it);
    got.erase(alias);
  }
  // 4-bit layers saved by transformers + bitsandbytes: "X.weight" packed, the state under "X.weight.*". They
  // stand for an (out, in) weight in the name and shape check.
  const auto layers = linear_layers(*model);
  std::map<std::string, std::pair<std::string, nlohmann::json>> prequantized;  // layer -> (state key, JSON)
  for (const auto& [path, linear] : layers) {
    for (const char* type : {"nf4", "fp4"}) {
      const std::string key = path + ".weight.quant_state.bitsandbytes__" + type;
      const auto it = where.find(key);
      if (it == where.end()) continue;
      const auto& file = files[it->second.first];
      nlohmann::json state;
      try {
        state = nlohmann::json::parse(tensor_text(file.load(it->second.second->name)));
        const auto shape = state.at("shape").get<std::vector<int64_t>>();
        for (auto g = got.begin(); g != got.end();)
          g = g->first.starts_with(path + ".weight.") ? got.erase(g) : std::next(g);
        got[path + ".weight"] = shape;
      } catch (const nlohmann::json::exception& e) {
        throw DataError(file.path() + ": " + key + " is not bitsandbytes' quant_state JSON with a shape (" + e.what() +
                        ")");
      }
      prequantized[path] = {key, state};
    }
  }
  ShapeMap expected;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) { expected[name] = p.sizes().vec(); });
  check_state_dict(expected, got, info.dir);

  // 4-bit layers first: loaded as saved, or quantized one at a time from their full-precision weight.
  std::set<std::string> to_quantize;
  std::map<std::string, Linear*> deferred;  // on_demand: quantized when read
  if (quantize)
    for (const auto& path : quantizable_layers(*model, quantize->experts)) to_quantize.insert(path);
  for (const auto& [path, linear] : layers) {
    const std::string weight = path + ".weight";
    if (const auto pre = prequantized.find(path); pre != prequantized.end()) {
      const auto& [state_key, state_json] = pre->second;
      const auto& file = files[where.at(weight).first];
      auto load = [&](const std::string& suffix) {
        const auto it = where.find(weight + "." + suffix);
        return it == where.end() ? at::Tensor() : files[it->second.first].load(it->second.second->name);
      };
      QuantState4bit state = state_from_saved(weight, state_json, load("absmax"), load("quant_map"),
                                              load("nested_absmax"), load("nested_quant_map"), load(state_key.substr(weight.size() + 1)),
                                              file.path());
      const at::Tensor packed = file.load(where.at(weight).second->name);
      if (packed.scalar_type() != at::kByte || packed.numel() != (state.numel() + 1) / 2)
        throw DataError(file.path() + ": " + weight + " holds " + std::to_string(packed.numel()) + " " +
                            std::string(c10::toString(packed.scalar_type())) + " values; a 4-bit " +
                            std::to_string(state.out_features) + " x " + std::to_string(state.in_features) +
                            " weight packs into " + std::to_string((state.numel() + 1) / 2) + " bytes",
                        "the checkpoint is damaged or not in bitsandbytes' 4-bit layout");
      linear->set_quantized(packed.to(device), state_to(std::move(state), device));
    } else if (to_quantize.count(path) && on_demand) {
      quantize_later(*linear, *quantize, dtype);
      deferred[path] = linear;
    } else if (to_quantize.count(path)) {
      const auto& [file, tensor] = where.at(weight);
      quantize_layer(*linear, files[file].load(tensor->name, dtype), *quantize, device);
    }
  }

  // Carried tensors stay on the CPU in their stored dtype: never computed with, written back as they were.
  for (const auto& [name, location] : carried)
    model->carried_tensors().emplace_back(name, files[location.first].load(name));
  if (on_demand) {
    // The parameters stay on the meta device; each is read when asked for, on the CPU (the caller moves it). A layer
    // to quantize is quantized at the first of its tensors asked for (its nested_offset set then), and kept until
    // each of them was handed out: one block's layers at a time.
    using Quantized = std::pair<at::Tensor, QuantState4bit>;
    auto pending = std::make_shared<std::map<std::string, std::pair<int, Quantized>>>();
    std::optional<Quantize4bitOptions> options = quantize;
    *on_demand = [files, where, dtype, deferred, pending, options](const std::string& name) -> at::Tensor {
      std::string path, part;
      if (name.ends_with(".weight") && deferred.contains(name.substr(0, name.size() - 7))) {
        path = name.substr(0, name.size() - 7);
      } else if (const auto at = name.rfind(".weight."); at != std::string::npos &&
                                                         deferred.contains(name.substr(0, at))) {
        path = name.substr(0, at);
        part = name.substr(at + 8);
      }
      if (path.empty()) {
        const auto& [file, tensor] = where.at(name);
        return files[file].load(tensor->name, dtype);
      }
      auto it = pending->find(path);
      if (it == pending->end()) {
        const auto& [file, tensor] = where.at(path + ".weight");
        Quantized q = quantize_weight(files[file].load(tensor->name, dtype), *options, at::kCPU);
        QuantState4bit& laid_out = *deferred.at(path)->quantized();
        if (q.second.nested != laid_out.nested || q.second.absmax.numel() != laid_out.absmax.numel())
          throw Error("4-bit layer " + path + ": quantized to other shapes than laid out for sharding");
        laid_out.nested_offset = q.second.nested_offset;
        it = pending->emplace(path, std::pair<int, Quantized>{0, std::move(q)}).first;
      }
      auto& [served, q] = it->second;
      const QuantState4bit& state = q.second;
      at::Tensor out = part.empty()                  ? q.first
                       : part == "absmax"            ? state.absmax
                       : part == "quant_map"         ? state.quant_map
                       : part == "nested_absmax"     ? state.nested_absmax
                       : part == "nested_quant_map"  ? state.nested_quant_map
                       : part == state.state_key()   ? state.state_json
                                                     : at::Tensor();
      if (!out.defined()) throw Error("4-bit layer " + path + " has no tensor " + part);
      if (++served == (state.nested ? 6 : 4)) pending->erase(it);
      return out;
    };
    return model;
  }
  // The model was built on the meta device: each parameter becomes its loaded tensor, converted once, so the
  // weights never exist twice (peak: the model plus one tensor in conversion).
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (!p.is_meta()) return;  // a 4-bit layer's, loaded above
    const auto& [file, tensor] = where.at(name);
    at::Tensor loaded = files[file].load(tensor->name, dtype);
    p = device.is_cpu() ? loaded : loaded.to(device);
  });
  return model;
}

void save_model(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  model.for_each_parameter(
      [&](const std::string& name, at::Tensor& p) { tensors.emplace_back(model.checkpoint_name(name), p.detach()); });
  for (const auto& [name, tensor] : model.carried_tensors()) tensors.emplace_back(name, tensor);
  save_state_dict(dir, tensors, max_shard_bytes);
  save_model_config(model, dir);
}

void save_model_streamed(LanguageModel& model, const std::string& dir, uint64_t max_shard_bytes,
                         const std::function<at::Tensor(const std::string&)>& parameter, bool write) {
  NamedTensors planned;
  std::vector<std::string> parameters;  // planned[i]'s parameter name, or "" for a carried tensor
  model.for_each_parameter([&](const std::string& name, at::Tensor& p) {
    planned.emplace_back(model.checkpoint_name(name), at::empty(p.sizes(), p.options().device(at::kMeta)));
    parameters.push_back(name);
  });
  for (const auto& [name, tensor] : model.carried_tensors()) {
    planned.emplace_back(name, tensor);
    parameters.emplace_back();
  }
  save_state_dict_streamed(dir, planned, [&](std::size_t i) {
    return parameters[i].empty() ? planned[i].second : parameter(parameters[i]);
  }, max_shard_bytes, write);
  if (write) save_model_config(model, dir);
}

void save_model_config(LanguageModel& model, const std::string& dir) {
  nlohmann::json config = model.hf_config();
  config.erase("quantization_config");
  // With 4-bit layers, the quantization_config transformers needs to load them, naming the linear layers that are
  // not quantized (and the LM head) as the ones to skip.
  std::optional<Quantize4bitOptions> options;
  at::ScalarType compute_dtype = at::kFloat;
  std::vector<std::string> skipped = {"lm_head"};
  for (const auto& [path, linear] : linear_layers(model)) {
    if (const QuantState4bit* state = linear->quantized()) {
      if (path.find(".experts.") != std::string::npos)
        throw UsageError(dir + ": a mixture of experts with 4-bit experts cannot be written in a layout transformers "
                         "loads (its bitsandbytes integration keeps the experts in full precision)",
                         "write the model without quantized experts (trainer quantize keeps them in full precision)");
      if (!options) options = Quantize4bitOptions{state->type, state->blocksize, state->nested};
      compute_dtype = state->dtype;
    } else {
      skipped.push_back(path);
    }
  }
  if (options) config["quantization_config"] = bnb_quantization_config(*options, compute_dtype, skipped);
  write_text_file((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

QuantizeDirResult quantize_model_dir_to(const std::string& model_dir, const std::string& output_dir,
                                        const Quantize4bitOptions& options, uint64_t max_shard_bytes) {
  const auto info = inspect_model_dir(model_dir, /*need_weights=*/true);
  if (read_json_file((fs::path(model_dir) / "config.json").string()).contains("quantization_config"))
    throw DataError(model_dir + "/config.json has a quantization_config: the model is quantized already",
                    "quantize the full-precision model it came from");
  // The checkpoint's own float dtype (the dtype bitsandbytes records as the weights'): the first float tensor's.
  at::ScalarType dtype = at::kFloat;
  const auto file = SafetensorsFile::open(info.weight_files.front());
  for (const auto& tensor : file.tensors())
    if (at::isFloatingType(tensor.dtype)) {
      dtype = tensor.dtype;
      break;
    }
  Quantize4bitOptions written = options;
  written.experts = false;  // as transformers + bitsandbytes write a mixture of experts
  auto model = load_model(model_dir, ModelInit::kPretrained, at::TensorOptions().dtype(dtype), 0, written);
  QuantizeDirResult result;
  for (const auto& [path, linear] : linear_layers(*model))
    if (const QuantState4bit* state = linear->quantized()) {
      ++result.layers;
      result.bytes += state->bytes();
    }
  save_model(*model, output_dir, max_shard_bytes);
  copy_tokenizer_files(model_dir, output_dir);
  return result;
}

}  // namespace trainer
