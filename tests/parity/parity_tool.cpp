// trainer_parity: runs our models on inputs the parity tests (pytest) prepare, and writes what transformers
// must reproduce. Like llm.c's comparison against a PyTorch dump, but the other way round: Python drives.
//
//   trainer_parity forward    MODEL_DIR BATCH.safetensors OUT.safetensors [bf16]
//       logits, loss (mean over target tokens, as transformers reports it) and grad.<name> of every parameter
//   trainer_parity chunked-forward MODEL_DIR BATCH.safetensors OUT.safetensors CHUNK
//       the same loss and grad.<name> through the training step's fused chunked loss (training.chunked_loss, the
//       default) with chunks of CHUNK trained tokens, as training computes them
//   trainer_parity train-step MODEL_DIR BATCH.safetensors OUT_DIR LR
//       one SGD step on the mean loss, then the model saved to OUT_DIR and OUT_DIR/logits.safetensors holding the
//       logits of the same batch after the step
//   trainer_parity lora-forward MODEL_DIR ADAPTER_DIR BATCH.safetensors OUT.safetensors
//       the base with a PEFT adapter applied: logits, loss and grad.<PEFT key> of every adapter weight
//   trainer_parity lora-train MODEL_DIR BATCH.safetensors OUT_DIR LORA_JSON
//       LoRA applied as training applies it ({"r", "alpha", "rslora", "target_modules", "target_parameters", "steps",
//       "lr", "seed"}),
//       `steps` SGD steps on the adapters, the adapter saved to OUT_DIR in PEFT's format, and
//       OUT_DIR/logits.safetensors holding the adapted logits of the same batch after the steps (and "losses": the
//       mean loss before each step). QLoRA: "quantize" (nf4 | fp4), "block_size", "double_quant" quantize the
//       base on load; a MODEL_DIR saved in 4 bits loads as it is.
//
//   trainer_parity activations MODEL_DIR B T L
//       bytes that forward keeps for backward (CPU budget allocator: allocated after forward minus the weights) for a
//       batch of B sequences of T tokens (seq2seq: T input, L target tokens); scripts/bench/calibrate_planner.py
//       fits the planner's coefficients to these
//
//   trainer_parity dropout-cost MODEL_DIR B T L ROUNDS LORA_DROPOUT
//       training steps (micro-batch B, sequences of T tokens, seq2seq targets of L) alternating keyed dropout and
//       LibTorch's generator dropout (the behaviour before keyed masks), the order swapped every round; prints the
//       seconds of every step of each side as JSON (scripts/bench/dropout.py). LORA_DROPOUT > 0: LoRA r=8 on the
//       attention projections with that dropout, the base frozen.
//
//   trainer_parity adamw-cost MODEL_DIR B T L ROUNDS
//       whole training steps (micro-batch B, sequences of T tokens, seq2seq targets of L; fp32, full fine-tuning)
//       alternating AdamW through ATen's fused kernel and through the chunked update, the order swapped every round;
//       prints the seconds of every step and of its optimizer update alone, per side, as JSON
//       (scripts/bench/fused_adamw.py)
//
//   trainer_parity norm-cost MODEL_DIR B T L ROUNDS PRECISION
//       the fused RMSNorm (models/fused_ops.h) against the ATen composition, alternating in one process, the order
//       swapped every round: the norm alone (forward + backward on (B*T, hidden) rows of the model's width, x
//       and weight in the precision's dtypes) and whole training steps (micro-batch B, sequences of T tokens,
//       seq2seq targets of L; PRECISION fp32, bf16-mixed or bf16). Seconds are the CPU time of the calling
//       thread (run with one intra-op thread), so other processes on a shared machine change them little.
//       Prints JSON (scripts/bench/fused_norm.py).
//
//   trainer_parity optimizer IN.safetensors OUT.safetensors OPTIMIZER_JSON
//       our optimizer (optimizer.* keys of the JSON, e.g. {"name": "adafactor", "weight_decay": 0.1}, plus
//       "lrs": one learning rate per step) over the tensors param.<name> of IN, stepping with the gradients
//       grad.<step>.<name>; OUT holds param.<name> after the steps and state.<tensor> of the optimizer state
//
//   trainer_parity generate MODEL_DIR REQUEST.json OUT.json
//       batched generation (models/generation.h): REQUEST holds "prompts" (lists of ids, unpadded), "seed" and the
//       generation_config.json keys (max_new_tokens, num_beams, length_penalty, early_stopping,
//       no_repeat_ngram_size, do_sample, temperature, top_p, top_k, eos_token_id, pad_token_id) and optionally
//       "batch_size" (batches of that many prompts, longest first, as evaluation by generation runs them), "device"
//       ("cpu" or "cuda", the model's device) and "dtype" ("fp32" or "bf16", its weights); OUT holds
//       {"outputs": the new ids of each prompt, "seconds": the generation's wall time, "cpu_seconds": its CPU time,
//       all threads (with one intra-op thread, little changed by other processes on a shared machine)}
//
// BATCH holds input_ids, attention_mask, labels (int64) and optionally decoder_attention_mask.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "memory/cpu_budget.h"
#include "models/dropout.h"
#include "models/fused_ops.h"
#include "models/generation.h"
#include "models/layers.h"
#include "models/lora.h"
#include "models/model.h"
#include "models/weights.h"
#include "train/optim/optimizer.h"
#include "train/tasks/text/text_step.h"
#include "trainer/errors.h"
#include "trainer/peft.h"
#include "trainer/safetensors.h"

namespace {

trainer::Batch read_batch(const std::string& path) {
  auto file = trainer::SafetensorsFile::open(path);
  trainer::Batch batch;
  batch.input_ids = file.load("input_ids", at::kLong);
  batch.attention_mask = file.load("attention_mask", at::kLong);
  batch.labels = file.load("labels", at::kLong);
  if (file.find("decoder_attention_mask")) batch.decoder_attention_mask = file.load("decoder_attention_mask", at::kLong);
  return batch;
}

int forward(const std::string& model_dir, const std::string& batch_path, const std::string& out_path, bool bf16) {
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  auto model = trainer::load_model(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(dtype));
  model->train(false);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const auto batch = read_batch(batch_path);
  const auto result = trainer::forward_loss(*model, batch, /*keep_logits=*/true);
  const at::Tensor loss = result.loss_sum / static_cast<double>(result.target_tokens);
  loss.backward();
  std::vector<std::pair<std::string, at::Tensor>> out = {{"logits", result.logits.detach().to(at::kFloat)},
                                                         {"loss", loss.detach().reshape({1})}};
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) out.emplace_back("grad." + name, p.grad().to(at::kFloat));
  });
  trainer::write_safetensors(out_path, out, {});
  return 0;
}

int chunked_forward(const std::string& model_dir, const std::string& batch_path, const std::string& out_path,
                    int64_t chunk) {
  using namespace trainer;
  auto model = load_model(model_dir, ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const auto batch = read_batch(batch_path);
  int64_t target_tokens = 0;
  {
    at::NoGradGuard no_grad;
    target_tokens = forward_loss(*model, batch).target_tokens;
  }
  AdamW optimizer(*model, OptimizerConfig{});  // unused: the step's forward/backward alone runs
  TrainingConfig training;
  training.loss_chunk_size = chunk;
  MemoryPolicy policy(MemoryConfig{}, training);
  StepOptions options;
  options.chunked_loss = true;
  TrainStep step(*model, optimizer, policy, options);
  const double normaliser = static_cast<double>(target_tokens);
  const double loss = step.forward_backward(batch, normaliser) / normaliser;
  std::vector<std::pair<std::string, at::Tensor>> out = {{"loss", at::full({1}, loss, at::kFloat)}};
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (p.grad().defined()) out.emplace_back("grad." + name, p.grad().to(at::kFloat));
  });
  write_safetensors(out_path, out, {});
  return 0;
}

int train_step(const std::string& model_dir, const std::string& batch_path, const std::string& out_dir, double lr) {
  auto model = trainer::load_model(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  model->train(false);  // no dropout: the step must be reproducible in Python
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const auto batch = read_batch(batch_path);
  auto result = trainer::forward_loss(*model, batch);
  (result.loss_sum / static_cast<double>(result.target_tokens)).backward();
  {
    at::NoGradGuard no_grad;
    model->for_each_parameter([&](const std::string&, at::Tensor& p) {
      if (p.grad().defined()) p.sub_(p.grad(), lr);
    });
  }
  trainer::save_model(*model, out_dir, 1ull << 40);
  at::NoGradGuard no_grad;
  const auto after = trainer::forward_loss(*model, batch, /*keep_logits=*/true);
  trainer::write_safetensors(out_dir + "/logits.safetensors", {{"logits", after.logits.contiguous()}}, {});
  return 0;
}

int lora_forward(const std::string& model_dir, const std::string& adapter_dir, const std::string& batch_path,
                 const std::string& out_path) {
  auto model = trainer::load_model(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat));
  auto adapters = trainer::apply_peft_adapter(*model, trainer::read_peft_adapter(adapter_dir), adapter_dir);
  model->train(false);
  adapters->train(false);
  const auto result = trainer::forward_loss(*model, read_batch(batch_path), /*keep_logits=*/true);
  const at::Tensor loss = result.loss_sum / static_cast<double>(result.target_tokens);
  loss.backward();
  std::vector<std::pair<std::string, at::Tensor>> out = {{"logits", result.logits.detach()},
                                                         {"loss", loss.detach().reshape({1})}};
  adapters->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    out.emplace_back(std::string("grad.") + trainer::kPeftKeyPrefix + name, p.grad());
  });
  trainer::write_safetensors(out_path, out, {});
  return 0;
}

int lora_train(const std::string& model_dir, const std::string& batch_path, const std::string& out_dir,
               const std::string& settings_json) {
  const auto settings = nlohmann::json::parse(settings_json);
  trainer::LoraConfig config;
  config.enabled = true;
  config.r = settings.at("r").get<int64_t>();
  config.alpha = settings.at("alpha").get<double>();
  config.dropout = 0.0;
  config.rslora = settings.value("rslora", false);
  config.target_modules = settings.value("target_modules", std::vector<std::string>{});
  config.target_parameters = settings.value("target_parameters", std::vector<std::string>{});
  std::optional<trainer::Quantize4bitOptions> quantize;
  if (settings.contains("quantize"))
    quantize = trainer::Quantize4bitOptions{trainer::quant::parse_quant_type(settings.at("quantize").get<std::string>()),
                                            settings.value("block_size", int64_t{64}),
                                            settings.value("double_quant", true)};
  auto model = trainer::load_model(model_dir, trainer::ModelInit::kPretrained, at::TensorOptions().dtype(at::kFloat), 0,
                                   quantize);
  auto adapters = trainer::apply_lora(*model, config, settings.value("seed", uint64_t{0}));
  model->train(false);  // no dropout: the result must be reproducible in Python
  const auto batch = read_batch(batch_path);
  const double lr = settings.at("lr").get<double>();
  std::vector<double> losses;
  for (int64_t step = 0; step < settings.at("steps").get<int64_t>(); ++step) {
    auto result = trainer::forward_loss(*model, batch);
    const at::Tensor loss = result.loss_sum / static_cast<double>(result.target_tokens);
    losses.push_back(loss.item<double>());
    loss.backward();
    at::NoGradGuard no_grad;
    adapters->for_each_parameter([&](const std::string&, at::Tensor& p) {
      p.sub_(p.grad(), lr);
      p.mutable_grad() = at::Tensor();
    });
  }
  trainer::write_peft_adapter(out_dir, trainer::to_peft_adapter(*adapters, *model, model_dir));
  at::NoGradGuard no_grad;
  const auto after = trainer::forward_loss(*model, batch, /*keep_logits=*/true);
  trainer::NamedTensors out = {{"logits", after.logits.contiguous()}};
  if (!losses.empty()) out.emplace_back("losses", at::tensor(losses, at::TensorOptions().dtype(at::kDouble)));
  trainer::write_safetensors(out_dir + "/logits.safetensors", out, {});
  return 0;
}

}  // namespace

int activations(const std::string& model_dir, int64_t b, int64_t t, int64_t l) {
  using namespace trainer;
  install_cpu_budget();
  auto model = load_model(model_dir, ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 1);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const bool seq2seq = model->family() == ModelFamily::kSeq2Seq;
  const int64_t before = cpu_memory_stats().allocated;
  const Batch batch{at::full({b, t}, 5, at::kLong), at::ones({b, t}, at::kLong), at::full({b, seq2seq ? l : t}, 7, at::kLong), {}};
  const auto out = forward_loss(*model, batch);
  std::cout << "{\"saved\": " << cpu_memory_stats().allocated - before << "}\n";
  return 0;
}

// A batch of b random sequences of t tokens (seq2seq: targets of the first l of them), the same every call.
trainer::EffectiveBatch random_batch(const trainer::LanguageModel& model, int64_t b, int64_t t, int64_t l) {
  using namespace trainer;
  const bool seq2seq = model.family() == ModelFamily::kSeq2Seq;
  EffectiveBatch batch;
  at::manual_seed(3);
  for (int64_t i = 0; i < b; ++i) {
    Example e;
    const at::Tensor ids = at::randint(3, std::min<int64_t>(model.vocab_size(), 30000), {t}, at::kInt);
    e.input_ids.assign(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + t);
    e.labels = seq2seq ? std::vector<int32_t>(e.input_ids.begin(), e.input_ids.begin() + std::min(t, l)) : e.input_ids;
    batch.target_tokens += target_tokens(e, seq2seq ? DataFamily::kSeq2Seq : DataFamily::kCausal);
    batch.examples.push_back(std::move(e));
  }
  return batch;
}

int dropout_cost(const std::string& model_dir, int64_t b, int64_t t, int64_t l, int64_t rounds, double lora_dropout) {
  using namespace trainer;
  auto model = load_model(model_dir, ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 1);
  model->train(true);
  std::unique_ptr<LoraAdapters> adapters;
  if (lora_dropout > 0) {
    LoraConfig config;
    config.r = 8;
    config.dropout = lora_dropout;
    config.target_modules = model->family() == ModelFamily::kSeq2Seq ? std::vector<std::string>{"q", "k", "v", "o"}
                                                                   : std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"};
    adapters = apply_lora(*model, config, 0);
  } else {
    model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  }
  Module& trained = adapters ? static_cast<Module&>(*adapters) : *model;
  OptimizerConfig adam;
  AdamW optimizer(trained, adam);
  TrainingConfig training;
  training.batch_size = b;
  training.micro_batch_size = MicroBatchSize::fixed(b);
  MemoryPolicy policy(MemoryConfig{}, training);
  StepOptions options;
  options.seed = 42;
  TrainStep step(*model, optimizer, policy, options);
  const EffectiveBatch batch = random_batch(*model, b, t, l);
  std::vector<double> keyed, generator;
  for (int64_t r = 0; r < rounds; ++r) {
    for (int side = 0; side < 2; ++side) {
      const bool use_keyed = (side == 0) == (r % 2 == 0);
      set_dropout_source(use_keyed ? DropoutSource::kKeyed : DropoutSource::kGlobalGenerator);
      const auto start = std::chrono::steady_clock::now();
      step.run(batch, r + 1, 1e-5);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      (use_keyed ? keyed : generator).push_back(seconds);
    }
  }
  set_dropout_source(DropoutSource::kKeyed);
  std::cout << nlohmann::json{{"keyed", keyed}, {"generator", generator}}.dump() << "\n";
  return 0;
}

int adamw_cost(const std::string& model_dir, int64_t b, int64_t t, int64_t l, int64_t rounds) {
  using namespace trainer;
  auto model = load_model(model_dir, ModelInit::kRandom, at::TensorOptions().dtype(at::kFloat), 1);
  model->train(true);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  OptimizerConfig adam;
  adam.weight_decay = 0.01;
  AdamW fused(*model, adam), chunked(*model, adam, 0, /*allow_fused=*/false);
  if (!fused.fused() || chunked.fused()) throw Error("adamw-cost: expected one fused and one chunked optimizer", "");
  TrainingConfig training;
  training.batch_size = b;
  training.micro_batch_size = MicroBatchSize::fixed(b);
  MemoryPolicy fused_policy(MemoryConfig{}, training), chunked_policy(MemoryConfig{}, training);
  StepOptions options;
  options.seed = 42;
  TrainStep fused_step(*model, fused, fused_policy, options), chunked_step(*model, chunked, chunked_policy, options);
  const EffectiveBatch batch = random_batch(*model, b, t, l);
  std::map<std::string, std::vector<double>> seconds;
  const auto timed = [](const auto& f) {
    const auto start = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (int64_t r = 0; r < rounds; ++r) {
    for (int side = 0; side < 2; ++side) {
      const bool use_fused = (side == 0) == (r % 2 == 0);
      const std::string name = use_fused ? "fused" : "chunked";
      seconds[name + "_step"].push_back(timed([&] { (use_fused ? fused_step : chunked_step).run(batch, r + 1, 1e-5); }));
      // The update alone, on gradients of the parameters' shapes.
      model->for_each_parameter([](const std::string&, at::Tensor& p) { p.mutable_grad() = at::ones_like(p) * 1e-3; });
      seconds[name + "_update"].push_back(timed([&] { (use_fused ? static_cast<Optimizer&>(fused) : chunked).step(1e-5); }));
      model->for_each_parameter([](const std::string&, at::Tensor& p) { p.mutable_grad() = at::Tensor(); });
    }
  }
  std::cout << nlohmann::json(seconds).dump() << "\n";
  return 0;
}

double process_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

double thread_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

int norm_cost(const std::string& model_dir, int64_t b, int64_t t, int64_t l, int64_t rounds, const std::string& precision) {
  using namespace trainer;
  const PrecisionMode mode = precision == "bf16" ? PrecisionMode::kBf16
                             : precision == "bf16-mixed" ? PrecisionMode::kBf16Mixed : PrecisionMode::kFp32;
  const auto weight_dtype = mode == PrecisionMode::kBf16 ? at::kBFloat16 : at::kFloat;
  auto model = load_model(model_dir, ModelInit::kRandom, at::TensorOptions().dtype(weight_dtype), 1);
  model->train(true);
  model->for_each_parameter([](const std::string&, at::Tensor& p) { p.requires_grad_(true); });
  const bool seq2seq = model->family() == ModelFamily::kSeq2Seq;
  OptimizerConfig adam;
  AdamW optimizer(*model, adam);
  TrainingConfig training;
  training.batch_size = b;
  training.micro_batch_size = MicroBatchSize::fixed(b);
  MemoryPolicy policy(MemoryConfig{}, training);
  StepOptions options;
  options.seed = 42;
  options.precision = mode;
  TrainStep step(*model, optimizer, policy, options);
  const EffectiveBatch batch = random_batch(*model, b, t, l);
  // The norm alone at the model's width: the residual stream is fp32 under bf16-mixed, bf16 in pure bf16.
  int64_t width = 0;
  model->for_each_parameter([&](const std::string& name, at::Tensor& p) {
    if (width == 0 && name.find("norm") != std::string::npos) width = p.size(0);
  });
  const at::Tensor x = at::randn({b * t, width}).to(weight_dtype).requires_grad_(true);
  const at::Tensor w = (1.0 + 0.1 * at::randn({width})).to(weight_dtype).requires_grad_(true);
  const at::Tensor g = at::randn({b * t, width}).to(weight_dtype);
  std::map<std::string, std::vector<double>> seconds;
  const auto timed = [](const auto& f) {
    const double start = thread_seconds();
    f();
    return thread_seconds() - start;
  };
  for (int64_t r = 0; r < rounds; ++r) {
    for (int side = 0; side < 2; ++side) {
      const bool fused = (side == 0) == (r % 2 == 0);
      set_fused_kernels_enabled(fused);
      const std::string name = fused ? "fused" : "unfused";
      seconds[name + "_norm"].push_back(timed([&] {
        for (int k = 0; k < 10; ++k) {
          const at::Tensor y = seq2seq ? t5_rms_norm(x, w, 1e-6) : llama_rms_norm(x, w, 1e-6);
          y.backward(g);
        }
      }) / 10);
      x.mutable_grad() = at::Tensor();
      w.mutable_grad() = at::Tensor();
      seconds[name + "_step"].push_back(timed([&] { step.run(batch, r + 1, 1e-5); }));
    }
  }
  set_fused_kernels_enabled(true);
  std::cout << nlohmann::json(seconds).dump() << "\n";
  return 0;
}

// Free-standing tensors as a module's parameters (what the optimizer parity test steps).
class TensorBag : public trainer::Module {
 public:
  explicit TensorBag(std::size_t capacity) { tensors_.reserve(capacity); }  // slots must not move
  at::Tensor& add(const std::string& name, at::Tensor t) {
    tensors_.push_back(std::move(t));
    register_parameter(name, &tensors_.back());
    return tensors_.back();
  }

 private:
  std::vector<at::Tensor> tensors_;
};

int optimizer(const std::string& in_path, const std::string& out_path, const std::string& json_text) {
  const auto spec = nlohmann::json::parse(json_text);
  trainer::OptimizerConfig config;
  for (const auto& [key, value] : spec.items()) {
    if (key == "lrs") continue;
    if (key == "name") config.name = value == "adafactor" ? trainer::OptimizerName::kAdafactor : trainer::OptimizerName::kAdamW;
    else if (key == "beta1") config.beta1 = value.get<double>();
    else if (key == "beta2") config.beta2 = value.get<double>();
    else if (key == "eps") config.eps = value.get<double>();
    else if (key == "weight_decay") config.weight_decay = value.get<double>();
    else if (key == "adafactor_beta1") config.adafactor_beta1 = value.get<bool>();
    else if (key == "adafactor_eps1") config.adafactor_eps1 = value.get<double>();
    else if (key == "adafactor_eps2") config.adafactor_eps2 = value.get<double>();
    else if (key == "clip_threshold") config.clip_threshold = value.get<double>();
    else if (key == "decay_rate") config.decay_rate = value.get<double>();
    else if (key == "scale_parameter") config.scale_parameter = value.get<bool>();
    else if (key == "relative_step") config.relative_step = value.get<bool>();
    else if (key == "warmup_init") config.warmup_init = value.get<bool>();
    else if (key == "state_dtype")
      config.state_dtype = value == "int8"   ? trainer::StateDtype::kInt8
                           : value == "bf16" ? trainer::StateDtype::kBf16
                                             : trainer::StateDtype::kFp32;
    else throw trainer::UsageError("optimizer JSON: unknown key " + key, "");
  }
  config.decay_norms_biases_embeddings = true;  // transformers decays every parameter of the group
  const auto lrs = spec.at("lrs").get<std::vector<double>>();
  auto file = trainer::SafetensorsFile::open(in_path);
  std::vector<std::string> names;
  for (const auto& t : file.tensors())
    if (t.name.starts_with("param.")) names.push_back(t.name.substr(6));
  TensorBag bag(names.size());
  std::vector<at::Tensor*> params;
  for (const auto& name : names) params.push_back(&bag.add(name, file.load("param." + name).requires_grad_(true)));
  auto opt = trainer::make_optimizer(bag, config, 0);
  for (std::size_t step = 0; step < lrs.size(); ++step) {
    for (std::size_t i = 0; i < names.size(); ++i)
      params[i]->mutable_grad() = file.load("grad." + std::to_string(step) + "." + names[i]);
    opt->step(lrs[step]);
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < names.size(); ++i) out.emplace_back("param." + names[i], params[i]->detach());
  for (const auto& [name, t] : opt->state_tensors()) out.emplace_back("state." + name, t);
  trainer::write_safetensors(out_path, out, {});
  return 0;
}

int generate(const std::string& model_dir, const std::string& request_path, const std::string& out_path) {
  using namespace trainer;
  std::ifstream in(request_path);
  const auto request = nlohmann::json::parse(in);
  // "device" (default "cpu") and "dtype" ("fp32", the default, or "bf16"): where and in what the model generates,
  // as evaluation by generation runs it there (scripts/bench/generate_eval.py --device cuda --dtype bf16).
  const c10::Device device(request.value("device", std::string("cpu")));
  const std::string dtype = request.value("dtype", std::string("fp32"));
  if (dtype != "fp32" && dtype != "bf16") throw std::runtime_error("generate: dtype must be fp32 or bf16, got " + dtype);
  auto model = load_model(model_dir, ModelInit::kPretrained,
                          at::TensorOptions().dtype(dtype == "bf16" ? at::kBFloat16 : at::kFloat).device(device));
  GenerateOptions options;
  apply_generation_config(request, model->family(), options);
  if (request.contains("seed")) options.seed = request.at("seed").get<uint64_t>();
  const auto prompts = request.at("prompts").get<std::vector<std::vector<int64_t>>>();
  // "batch_size": as evaluation by generation runs, in batches of that many prompts, longest first; timed.
  const auto batch = request.value("batch_size", static_cast<int64_t>(prompts.size()));
  std::vector<std::size_t> order(prompts.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return prompts[a].size() > prompts[b].size(); });
  std::vector<std::vector<int64_t>> outputs(prompts.size());
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = process_seconds();
  for (std::size_t begin = 0; begin < order.size(); begin += static_cast<std::size_t>(batch)) {
    std::vector<std::vector<int64_t>> part;
    const std::size_t end = std::min(order.size(), begin + static_cast<std::size_t>(batch));
    for (std::size_t i = begin; i < end; ++i) part.push_back(prompts[order[i]]);
    auto answers = generate_batch(*model, part, options);
    for (std::size_t i = begin; i < end; ++i) outputs[order[i]] = std::move(answers[i - begin]);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu_seconds = process_seconds() - cpu_start;
  std::ofstream(out_path) << nlohmann::json{{"outputs", outputs}, {"seconds", seconds}, {"cpu_seconds", cpu_seconds}}.dump()
                          << "\n";
  return 0;
}

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 5 && args[0] == "activations")
      return activations(args[1], std::stoll(args[2]), std::stoll(args[3]), std::stoll(args[4]));
    if (args.size() == 7 && args[0] == "dropout-cost")
      return dropout_cost(args[1], std::stoll(args[2]), std::stoll(args[3]), std::stoll(args[4]), std::stoll(args[5]),
                          std::stod(args[6]));
    if (args.size() >= 4 && args[0] == "forward") return forward(args[1], args[2], args[3], args.size() > 4 && args[4] == "bf16");
    if (args.size() == 5 && args[0] == "chunked-forward")
      return chunked_forward(args[1], args[2], args[3], std::stoll(args[4]));
    if (args.size() == 5 && args[0] == "train-step") return train_step(args[1], args[2], args[3], std::stod(args[4]));
    if (args.size() == 5 && args[0] == "lora-forward") return lora_forward(args[1], args[2], args[3], args[4]);
    if (args.size() == 4 && args[0] == "optimizer") return optimizer(args[1], args[2], args[3]);
    if (args.size() == 6 && args[0] == "adamw-cost")
      return adamw_cost(args[1], std::stoll(args[2]), std::stoll(args[3]), std::stoll(args[4]), std::stoll(args[5]));
    if (args.size() == 7 && args[0] == "norm-cost")
      return norm_cost(args[1], std::stoll(args[2]), std::stoll(args[3]), std::stoll(args[4]), std::stoll(args[5]), args[6]);
    if (args.size() == 4 && args[0] == "generate") return generate(args[1], args[2], args[3]);
    if (args.size() == 5 && args[0] == "lora-train") return lora_train(args[1], args[2], args[3], args[4]);
  } catch (const trainer::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    if (!e.hint().empty()) std::cerr << "hint: " << e.hint() << "\n";
    return e.exit_code();
  }
  std::cerr << "usage: trainer_parity forward MODEL_DIR BATCH OUT [bf16] | chunked-forward MODEL_DIR BATCH OUT CHUNK |\n"
               "       train-step MODEL_DIR BATCH OUT_DIR LR |\n"
               "       activations MODEL_DIR B T L | lora-forward MODEL_DIR ADAPTER_DIR BATCH OUT |\n"
               "       lora-train MODEL_DIR BATCH OUT_DIR LORA_JSON | dropout-cost MODEL_DIR B T L ROUNDS LORA_DROPOUT |\n"
               "       optimizer IN OUT OPTIMIZER_JSON | adamw-cost MODEL_DIR B T L ROUNDS |\n"
               "       norm-cost MODEL_DIR B T L ROUNDS PRECISION | generate MODEL_DIR REQUEST.json OUT.json\n";
  return 2;
}
