// CLI11 front end. `train` is the default subcommand, so `trainer --config x.json` trains.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <iomanip>
#include <ostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include "chat/chat_template.h"
#include "cli/evaluate.h"
#include "cli/hub_command.h"
#include "cli/predict.h"
#include "distributed/launch.h"
#include "log/console.h"
#include "memory/planner.h"
#include "models/inspect.h"
#include "models/lora.h"
#include "models/model.h"
#include "models/weights.h"
#include "train/checkpoint_parts.h"
#include "train/engine/task_kind.h"
#include "trainer/cli.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"
#include "trainer/run.h"
#include "trainer/tokenizer.h"
#include "trainer/version.h"

namespace trainer {

void print_config_reference_markdown(std::ostream& out) {
  out << "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const auto& key : config_keys()) {
    std::string type = key.type;
    for (std::size_t pos = 0; (pos = type.find('|', pos)) != std::string::npos; pos += 2) type.replace(pos, 1, "\\|");
    out << "| `" << key.path << "` | " << type << " | `" << key.default_value << "` | " << key.description << " |\n";
  }
}

void print_config_reference(std::ostream& out) {
  out << "Configuration keys (JSON sections; override any with --set section.key=value):\n";
  std::string section;
  for (const auto& key : config_keys()) {
    const auto this_section = key.path.substr(0, key.path.find('.'));
    if (this_section != section) {
      section = this_section;
      out << "\n[" << section << "]\n";
    }
    out << "  " << std::left << std::setw(34) << key.path << " " << key.type << ", default " << key.default_value
        << "\n      " << key.description << "\n";
  }
  out << "\nSizes accept bytes or units: 24GiB, 512MiB, 5GB. micro_batch_size accepts \"auto\".\n"
         "Secrets (webhook URLs, API keys) are read from the environment only, never from the config:\n"
         "TRAINER_WEBHOOK_URL turns on the notification webhook.\n";
}

namespace {

constexpr const char* kTrainEnvironmentHelp =
    "Environment: TRAINER_WEBHOOK_URL=https://... POSTs JSON on start, every checkpoint, finish and failure\n"
    "(a Discord webhook works as is); the URL is never printed. TRAINER_NUM_THREADS=N sets the intra-op threads\n"
    "(default: one per core; OMP_WAIT_POLICY=passive on shared machines, docs/benchmarks.md#threads).\n"
    "TRAINER_FUSED_KERNELS=0 runs ATen's unfused RMSNorm instead of the fused CPU kernel. TRAINER_CPU_CACHE=0\n"
    "stops the CPU allocator keeping freed blocks of 1 MiB and more for reuse (less memory, slower steps).\n"
    "TRAINER_PACKED_ATTENTION=per-example|whole-row forces a path for packed rows (default auto: varlen flash\n"
    "attention on a CUDA card, docs/packing.md). TRAINER_BITSANDBYTES=FILE|DIR|none: where bitsandbytes' library\n"
    "for 4-bit layers is (default: the bitsandbytes package beside torch), none for ATen ops (docs/quantization.md).\n";

constexpr const char* kHubEnvironmentHelp =
    "Models by Hub id (model.path, tokenizer.path, --model, --adapter, --base): an existing local path wins;\n"
    "else ORG/NAME[@REVISION] is looked up in the Hugging Face cache that Python shares (HF_HUB_CACHE, else\n"
    "HF_HOME/hub, else ~/.cache/huggingface/hub) and what it lacks is downloaded from HF_ENDPOINT (default\n"
    "https://huggingface.co): config, tokenizer and safetensors files only, never pickled weights. HF_TOKEN (else\n"
    "HF_TOKEN_PATH, else HF_HOME/token) for gated or private repos, never printed. HF_HUB_OFFLINE=1 uses the cache\n"
    "only (docs/models.md).\n";

constexpr const char* kExitCodeHelp =
    "Exit codes: 0 success; 2 usage or configuration error; 3 data, model or checkpoint error;\n"
    "4 out of memory after every adaptation; 130 interrupted; 1 internal error.";

struct GenerateCommand {
  std::string model_dir;
  std::vector<int64_t> ids;
  std::string prompt;
  std::string chat;           // --chat: one user message, rendered by the model's chat template
  std::string messages_file;  // --messages: a JSON list of messages, or {"messages": [...], "tools": [...]}
  std::string system;         // --system: a system message before them
  std::string tokenizer;
  GenerateOptions options;
  std::optional<uint64_t> seed;
  bool random_init = false;
  std::string dtype = "fp32";
};

// The end-of-turn ids a chat model stops at: generation_config.json's eos_token_id (an id or a list), which replace
// the model's EOS as in transformers' generate; nothing when the file has none (then the model's EOS stops).
std::vector<int64_t> generation_stop_ids(const std::string& model_dir) {
  const auto path = std::filesystem::path(model_dir) / "generation_config.json";
  if (!std::filesystem::exists(path)) return {};
  const nlohmann::json config = read_json_file(path.string());
  std::vector<int64_t> ids;
  const auto it = config.find("eos_token_id");
  if (it == config.end()) return ids;
  if (it->is_number_integer()) ids.push_back(it->get<int64_t>());
  if (it->is_array())
    for (const auto& id : *it)
      if (id.is_number_integer()) ids.push_back(id.get<int64_t>());
  return ids;
}

// --chat / --messages / --system: the conversation rendered by the model's chat template with the generation
// prompt (as apply_chat_template(add_generation_prompt=True)), tokenized without added special tokens.
std::vector<int64_t> chat_prompt_ids(const GenerateCommand& command, const Tokenizer& tokenizer, std::ostream& out) {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools = nullptr;
  if (!command.messages_file.empty()) {
    std::ifstream in(command.messages_file, std::ios::binary);
    if (!in) throw UsageError("--messages: cannot read " + command.messages_file);
    nlohmann::ordered_json file;
    try {
      file = nlohmann::ordered_json::parse(in);
    } catch (const nlohmann::json::parse_error& e) {
      throw DataError(command.messages_file + ": invalid JSON (" + e.what() + ")",
                      "give a JSON list of {\"role\", \"content\"} messages, or {\"messages\": [...], \"tools\": [...]}");
    }
    if (file.is_object() && file.contains("messages")) {
      if (file.contains("tools")) tools = file["tools"];
      file = file["messages"];
    }
    if (!file.is_array())
      throw DataError(command.messages_file + ": the messages must be a JSON list, not " + file.type_name(),
                      "give a JSON list of {\"role\", \"content\"} messages, or {\"messages\": [...]}");
    messages = std::move(file);
  }
  if (!command.system.empty()) {
    const nlohmann::ordered_json system = {{"role", "system"}, {"content", command.system}};
    messages.insert(messages.begin(), system);
  }
  if (!command.chat.empty()) {
    const nlohmann::ordered_json user = {{"role", "user"}, {"content", command.chat}};
    messages.push_back(user);
  }
  std::filesystem::path dir(command.tokenizer.empty() ? command.model_dir : command.tokenizer);
  if (std::filesystem::is_regular_file(dir)) dir = dir.parent_path();
  const chat::ModelChatTemplate found = chat::load_chat_template(dir, !tools.is_null());
  chat::ChatOptions options;
  options.add_generation_prompt = true;
  options.tools = tools;
  options.special_tokens = found.special_tokens;
  const std::string text = chat::render_chat(found.source, messages, options).text;
  const auto ids = tokenizer.encode(text);
  out << "chat prompt: " << messages.size() << " message(s), " << ids.size() << " tokens (template " << found.origin
      << ")\n";
  return {ids.begin(), ids.end()};
}

int run_generate(GenerateCommand& command, std::ostream& out) {
  const auto dtype = command.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  auto model = load_model(command.model_dir, command.random_init ? ModelInit::kRandom : ModelInit::kPretrained,
                          at::TensorOptions().dtype(dtype), command.seed.value_or(0));
  for (const auto id : command.ids)
    if (id < 0 || id >= model->vocab_size())
      throw UsageError("--ids: token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                       std::to_string(model->vocab_size() - 1) + ")");
  std::unique_ptr<Tokenizer> tokenizer;
  const bool chat = !command.chat.empty() || !command.messages_file.empty();
  const bool text = !command.prompt.empty() || chat;
  if (text && command.tokenizer.empty() && !has_tokenizer(command.model_dir))
    throw UsageError(std::string(chat ? "--chat and --messages need" : "--prompt needs") +
                         " a tokenizer to turn the text into ids, and " + command.model_dir +
                         " has no tokenizer files (tokenizer.json, spiece.model or tokenizer.model)",
                     "pass the model's tokenizer with --tokenizer FILE_OR_DIR, or give the prompt as ids: --ids 5,17,42");
  if (text || !command.tokenizer.empty())
    tokenizer = load_tokenizer(command.tokenizer.empty() ? command.model_dir : command.tokenizer);
  if (!command.prompt.empty()) command.ids = prompt_ids(*model, *tokenizer, command.prompt, /*add_eos=*/true);
  if (chat) {
    command.ids = chat_prompt_ids(command, *tokenizer, out);
    if (auto stops = generation_stop_ids(command.model_dir); !stops.empty())
      command.options.eos_token_ids = std::move(stops);
  }
  if (command.ids.empty())
    throw UsageError("generate needs a prompt: --prompt TEXT, --ids 1,2,3, --chat TEXT or --messages FILE");
  command.options.seed = command.seed;
  const at::Tensor prompt = at::tensor(command.ids, at::kLong).unsqueeze(0);
  const auto tokens = generate(*model, prompt, command.options);
  out << "ids:";
  for (const auto t : tokens) out << " " << t;
  out << "\n";
  if (tokenizer) out << "text: " << tokenizer->decode(std::vector<int32_t>(tokens.begin(), tokens.end())) << "\n";
  return kExitOk;
}

bool is_top_level_flag(const std::string& arg) {
  return arg == "-h" || arg == "--help" || arg == "--version" || arg.starts_with("--help-config");
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  std::string model_types;
  for (const auto& [type, family] : supported_model_types()) model_types += (model_types.empty() ? "" : ", ") + type;
  CLI::App app{"trainer: fine-tune Hugging Face seq2seq (T5), causal (Llama, Qwen2/3, Mistral, Gemma 2/3/4, Phi-3/4,\n"
               "SmolLM3, OLMo 2, Granite; mixtures of experts Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE), image (ViT) and CLIP\n"
               "models with LibTorch, adapting the micro-batch to the memory it has instead of dying of out-of-memory.\n"
               "Text model types (config.json's model_type): " +
                   model_types,
               "trainer"};
  app.set_version_flag("--version", std::string("trainer ") + kVersion + " (LibTorch " + kTorchBuildVersion + ", " +
                                        kTorchBuild + ")");
  app.footer(std::string("`train` is the default subcommand: `trainer --config FILE` trains.\n") + kExitCodeHelp);
  bool help_config = false, help_config_markdown = false;
  app.add_flag("--help-config", help_config, "List every configuration key with its type, default and meaning");
  app.add_flag("--help-config-markdown", help_config_markdown, "The same as a Markdown table (docs/configuration.md)");
  app.require_subcommand(0, 1);

  std::string config_path;
  std::vector<std::string> overrides;
  TrainOptions train_options;
  auto* train = app.add_subcommand("train", "Fine-tune a model as the config says (the default subcommand)");
  train->add_option("-c,--config", config_path, "JSON config file (see configs/ and --help-config)");
  train->add_option("--set", overrides, "Override one key: --set training.batch_size=64 (repeatable)")
      ->type_name("SECTION.KEY=VALUE")
      ->allow_extra_args(false);
  train->add_flag("--dry-run", train_options.dry_run,
                  "Validate the config, resolve model, data and device, print the plan; train nothing");
  train->add_flag("--resume", train_options.resume,
                  "Continue from the newest complete checkpoint in checkpoint.output_dir");
  train->add_option("--resume-from", train_options.resume_from, "Continue from this checkpoint directory");
  train->add_flag("--resume-if-present", train_options.resume_if_present,
                  "As --resume when checkpoint.output_dir holds a complete checkpoint, else a fresh start: one "
                  "command for a job's first start and its restarts (torchrun --max-restarts, Slurm --requeue)");
  train->add_flag("--allow-config-change", train_options.allow_config_change,
                  "Resume although settings that make it another run differ from the checkpoint's (model, "
                  "tokenizer, precision, optimizer name or state dtype, seed, batch size, max lengths, field "
                  "mapping); every difference is listed either way, and lr, schedule, length, evaluation, logging, "
                  "checkpoint and memory settings may always change");
  train->add_flag("--allow-data-change", train_options.allow_data_change,
                  "Resume although the train files or the tokenizer changed since the checkpoint: training goes on "
                  "from its step with a new epoch over the data as it is now (without it: exit 3 naming what "
                  "changed)");
  train->add_flag("--merge", train_options.merge,
                  "LoRA: after the final adapter (output_dir/final), also write output_dir/final-merged, a full "
                  "Hugging Face model with the adapters merged into the base weights");
  bool print_config = false;
  train->add_flag("--print-config", print_config,
                  "Print the resolved configuration (file + --set + defaults) as JSON and exit");
  train->footer(std::string(kTrainEnvironmentHelp) + kHubEnvironmentHelp + kExitCodeHelp);

  std::string evaluate_config_path;
  std::vector<std::string> evaluate_overrides;
  EvaluateOptions evaluate_options;
  auto* evaluate_cmd = app.add_subcommand(
      "evaluate", "Evaluate a saved model, checkpoint or PEFT adapter as training evaluates (validation loss; with "
                  "evaluation.generate, generated answers scored by exact match, ROUGE, BLEU, chrF); trains nothing");
  evaluate_cmd->add_option("-c,--config", evaluate_config_path, "JSON config file (data, evaluation, device)")
      ->required();
  evaluate_cmd->add_option("--model", evaluate_options.model_dir,
                           "Model directory, checkpoint-N, PEFT adapter or Hub id ORG/NAME[@REV] (default: "
                           "model.path); an adapter is applied over its base_model_name_or_path, else model.path");
  evaluate_cmd->add_option("--output", evaluate_options.output_dir,
                           "Where predictions.jsonl and metrics.json go (default: "
                           "checkpoint.output_dir/evaluations/evaluate)");
  evaluate_cmd->add_option("--set", evaluate_overrides, "Override one key: --set evaluation.generate=true (repeatable)")
      ->type_name("SECTION.KEY=VALUE")
      ->allow_extra_args(false);
  evaluate_cmd->footer(kExitCodeHelp);

  std::string data_config_path;
  std::vector<std::string> data_overrides;
  auto* data_cmd = app.add_subcommand("data", "Stream the configured data once through the loader: counts, bad "
                                              "records (file:line), truncation, throughput; trains nothing");
  data_cmd->add_option("-c,--config", data_config_path, "JSON config file")->required();
  data_cmd->add_option("--set", data_overrides, "Override one key: --set data.num_workers=4 (repeatable)")
      ->type_name("SECTION.KEY=VALUE")
      ->allow_extra_args(false);
  DataCommandOptions data_options;
  data_cmd->add_option("--dump", data_options.dump,
                       "Write the first N examples of FILE (default: the train files, in order) as JSON lines: "
                       "input_ids, labels (-100: not trained) and, for chat records, the rendered text; with several "
                       "files each line names its file; streams nothing else")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber);
  data_cmd->add_option("file", data_options.dump_file,
                       "With --dump: the data file to read (JSONL, plain or .gz; Parquet; Arrow), a glob, or a "
                       "datasets folder (DIR, DIR:SPLIT)")
      ->type_name("FILE");
  data_cmd->footer(kExitCodeHelp);

  std::string plan_config_path;
  std::vector<std::string> plan_overrides;
  auto* plan_cmd = app.add_subcommand("plan", "Estimate the memory of the configured run (weights, gradients, "
                                              "optimizer state, activations per example, logits) against the device "
                                              "or memory.limit, and recommend a micro-batch; loads no weights");
  plan_cmd->add_option("-c,--config", plan_config_path, "JSON config file")->required();
  plan_cmd->add_option("--set", plan_overrides, "Override one key: --set data.max_length=1024 (repeatable)")
      ->type_name("SECTION.KEY=VALUE")
      ->allow_extra_args(false);
  int64_t plan_world_size = 0;
  plan_cmd->add_option("--world-size,--nproc-per-node", plan_world_size,
                       "Plan per rank for N data-parallel ranks, sharded as the config says (default: WORLD_SIZE "
                       "from the environment, else 1)")
      ->check(CLI::PositiveNumber);
  plan_cmd->footer(kExitCodeHelp);

  InspectOptions inspect_options;
  std::string inspect_dir;
  auto* inspect = app.add_subcommand("inspect", "Describe a Hugging Face model directory: architecture, parameters, "
                                                "checkpoint size, training memory by precision (loads no weights)");
  inspect->add_option("model_dir", inspect_dir,
                      "Model directory (config.json, safetensors) or Hub id ORG/NAME[@REV] (fetches config.json, not "
                      "the weights)")
      ->required();
  inspect->add_option("--lora-r", inspect_options.lora_r, "LoRA rank for the LoRA memory row")->capture_default_str();
  inspect->add_option("--lora-targets", inspect_options.lora_targets,
                      "LoRA target modules for the LoRA row, comma-separated (default: q,v for T5, q_proj,v_proj "
                      "for the decoder families; Phi-3: qkv_proj,o_proj,gate_up_proj,down_proj for every layer)")
      ->delimiter(',');
  inspect->add_option("--lora-parameters", inspect_options.lora_parameters,
                      "A mixture of experts' experts for the LoRA row, as lora.target_parameters, comma-separated "
                      "(e.g. mlp.experts.gate_up_proj,mlp.experts.down_proj)")
      ->delimiter(',');

  MergeOptions merge_options;
  auto* merge_cmd = app.add_subcommand("merge", "Merge a LoRA adapter (PEFT format) into its base model and write a "
                                                "full Hugging Face model (W + scale * B A)");
  merge_cmd->add_option("--adapter", merge_options.adapter_dir,
                        "Adapter directory (adapter_config.json, adapter_model.safetensors) or Hub id")
      ->required();
  merge_cmd->add_option("--base", merge_options.base_dir,
                        "Base model directory or Hub id (default: the adapter's base_model_name_or_path)");
  merge_cmd->add_option("--output", merge_options.output_dir, "Directory for the merged model")->required();
  merge_cmd->add_option("--dtype", merge_options.dtype, "Weights of the merged model: auto (the base's), fp32 or bf16")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}))
      ->capture_default_str();
  std::string merge_quantize = "none";
  int64_t merge_block_size = 64;
  merge_cmd->add_option("--quantize", merge_quantize,
                        "The adapter was trained over a base quantized on load (model.quantize): quantize the base "
                        "the same way (nf4 or fp4, block size --quantize-block-size, double quantization) before "
                        "merging, so the merged weights are the dequantized ones it was trained with")
      ->check(CLI::IsMember({"none", "nf4", "fp4"}))
      ->capture_default_str();
  merge_cmd->add_option("--quantize-block-size", merge_block_size, "Block size of --quantize")
      ->check(CLI::IsMember({64, 128, 256, 512, 1024, 2048, 4096}))
      ->capture_default_str();
  merge_cmd->footer(kExitCodeHelp);

  std::string export_checkpoint_dir, export_output;
  auto* export_cmd = app.add_subcommand(
      "export", "Write the model of a checkpoint of fully sharded weights (distributed.shard_weights: each rank's "
                "pieces in its part) as Hugging Face files, offline, in one process");
  export_cmd->add_option("checkpoint", export_checkpoint_dir, "A checkpoint-N directory")->required();
  export_cmd->add_option("--output", export_output, "Directory for the model (config.json, safetensors, tokenizer)")
      ->required();
  export_cmd->footer(kExitCodeHelp);

  std::string quantize_model_dir, quantize_output, quantize_type = "nf4";
  int64_t quantize_block_size = 64;
  bool quantize_no_double = false;
  auto* quantize_cmd = app.add_subcommand(
      "quantize", "Write a model with its linear layers in 4 bits, in the layout transformers + bitsandbytes save "
                  "(load_in_4bit): transformers loads it with from_pretrained, trainer trains LoRA on it");
  quantize_cmd->add_option("--model", quantize_model_dir, "Full-precision model directory or Hub id ORG/NAME[@REV]")
      ->required();
  quantize_cmd->add_option("--output", quantize_output, "Directory for the 4-bit model")->required();
  quantize_cmd->add_option("--type", quantize_type, "nf4 or fp4")
      ->check(CLI::IsMember({"nf4", "fp4"}))
      ->capture_default_str();
  quantize_cmd->add_option("--block-size", quantize_block_size, "Values per 4-bit scale")
      ->check(CLI::IsMember({64, 128, 256, 512, 1024, 2048, 4096}))
      ->capture_default_str();
  quantize_cmd->add_flag("--no-double-quant", quantize_no_double, "Keep the block scales in fp32");
  quantize_cmd->footer(kExitCodeHelp);

  GenerateCommand generate_command;
  auto* generate_cmd = app.add_subcommand("generate", "Generate tokens from a model with a key-value cache "
                                                      "(greedy, or temperature/top-p sampling)");
  generate_cmd->add_option("--model", generate_command.model_dir, "Model directory or Hub id ORG/NAME[@REV]")
      ->required();
  auto* prompt_option = generate_cmd->add_option("--prompt", generate_command.prompt,
                                                 "Prompt text, tokenized with the model's tokenizer");
  auto* ids_option =
      generate_cmd->add_option("--ids", generate_command.ids, "Or prompt token ids, comma-separated: --ids 5,17,42")
          ->delimiter(',')
      ->excludes(prompt_option);
  auto* chat_option = generate_cmd->add_option(
      "--chat", generate_command.chat,
      "Or one user message, rendered by the model's chat template with the generation prompt; stops at "
      "generation_config.json's eos_token_id list (the model's end-of-turn ids)");
  auto* messages_option = generate_cmd->add_option(
      "--messages", generate_command.messages_file,
      "Or a JSON file: a list of messages, or {\"messages\": [...], \"tools\": [...]}, rendered the same way "
      "(--chat adds a user message after them)");
  generate_cmd->add_option("--system", generate_command.system, "With --chat or --messages: a system message first");
  chat_option->excludes(prompt_option)->excludes(ids_option);
  messages_option->excludes(prompt_option)->excludes(ids_option);
  generate_cmd->add_option("--tokenizer", generate_command.tokenizer,
                           "Tokenizer file, directory or Hub id (default: the model directory); decodes the output");
  generate_cmd->add_option("--max-new-tokens", generate_command.options.max_new_tokens, "Stop after N new tokens")
      ->capture_default_str();
  generate_cmd->add_option("--temperature", generate_command.options.temperature, "0: greedy; above 0: sampling")
      ->capture_default_str();
  generate_cmd->add_option("--top-p", generate_command.options.top_p, "Nucleus sampling mass (with temperature)")
      ->capture_default_str();
  generate_cmd->add_option("--seed", generate_command.seed, "Sampling seed");
  generate_cmd->add_flag("--random-init", generate_command.random_init,
                         "Initialise from config.json alone instead of loading weights");
  generate_cmd->add_option("--dtype", generate_command.dtype, "fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();

  PredictOptions predict_options;
  auto* predict_cmd = app.add_subcommand(
      "predict", "Classify images with an image classifier (ViT, CLIP classifier): top-k classes and probabilities; "
                 "or, with a CLIPModel directory and --text, each image's probabilities over the texts (zero-shot, "
                 "docs/images.md, docs/clip.md)");
  predict_cmd->add_option("--model", predict_options.model_dir,
                          "Model directory or Hub id: an image classifier (config.json with id2label, weights, "
                          "preprocessor_config.json) or a CLIPModel (with tokenizer.json)")
      ->required();
  predict_cmd->add_option("--image", predict_options.images, "Image file (JPEG, PNG, WebP); repeat for more")
      ->required();
  predict_cmd->add_option("--text", predict_options.texts,
                          "CLIPModel directories only: a candidate text, e.g. --text \"a photo of a cat\"; repeat "
                          "for more (each image's probabilities are a softmax over them)");
  auto* top_k_option =
      predict_cmd->add_option("--top-k", predict_options.top_k, "Classes to show per image (with --text: all "
                                                                "texts unless given)")
          ->capture_default_str();
  predict_cmd->add_flag("--json", predict_options.json, "One JSON object a line: {image, predictions}");
  predict_cmd->footer(kExitCodeHelp);
  DownloadOptions download_options;
  auto* download_cmd = app.add_subcommand(
      "download", "Fetch a model (with --dataset: a dataset's data files) from the Hugging Face Hub into the cache "
                  "ahead of a run (a login node, a docker build) and print its snapshot directory");
  download_cmd->add_option("name", download_options.name,
                           "Hub id: ORG/NAME, or ORG/NAME@REVISION (branch, tag, commit)")
      ->required();
  download_cmd->add_option("--include", download_options.include,
                           "Only the files matching this glob (repeatable), e.g. --include '*.json'; default: the "
                           "files trainer reads (config, tokenizer, chat template, safetensors weights)")
      ->type_name("GLOB")
      ->allow_extra_args(false);
  download_cmd->add_flag("--dry-run", download_options.dry_run,
                         "List the files that would be downloaded and their sizes; download nothing");
  download_cmd->add_flag("--dataset", download_options.dataset,
                         "NAME is a dataset repo (datasets--ORG--NAME in the cache): its Parquet files, of one split "
                         "with ORG/NAME:SPLIT or ORG/NAME:CONFIG:SPLIT (the Hub's refs/convert/parquet branch when "
                         "the repo has none)");
  download_cmd->footer(kHubEnvironmentHelp + std::string(kExitCodeHelp));
  distributed::LaunchOptions launch_options;
  auto* launch_cmd = app.add_subcommand(
      "launch", "Start N data-parallel ranks of trainer on this machine (what torchrun does, without Python): "
                "trainer launch --nproc-per-node 2 -- --config FILE");
  launch_cmd->add_option("--nproc-per-node", launch_options.nproc_per_node, "Ranks to start on this machine")
      ->required();
  launch_cmd->add_option("--master-port", launch_options.master_port,
                         "Rendezvous port on 127.0.0.1 (default: a free one)");
  launch_cmd->add_option("trainer_args", launch_options.args, "Everything after --: the arguments of each rank");
  launch_cmd->footer("Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and "
                     "MASTER_PORT; SIGINT/SIGTERM are forwarded to every rank; when one rank fails the others are "
                     "stopped and launch exits with its code. docs/distributed.md\n" +
                     std::string(kExitCodeHelp));

  // `trainer --config x` means `trainer train --config x`.
  std::vector<std::string> args;
  for (int i = argc - 1; i > 0; --i) args.emplace_back(argv[i]);  // CLI11 takes them reversed
  const bool has_subcommand =
      !args.empty() && (args.back() == "train" || args.back() == "data" || args.back() == "plan" ||
                        args.back() == "inspect" || args.back() == "generate" || args.back() == "merge" ||
                        args.back() == "evaluate" || args.back() == "predict" || args.back() == "quantize" ||
                        args.back() == "launch" || args.back() == "download" || args.back() == "export" ||
                        is_top_level_flag(args.back()));
  if (!args.empty() && !has_subcommand) args.push_back("train");

  try {
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    out << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::CallForVersion&) {
    out << app.version() << "\n";
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    err << "error: " << e.what() << "\nhint: run `trainer --help` (or `trainer train --help`)\n";
    return kExitUsage;
  }

  if (help_config) {
    print_config_reference(out);
    return kExitOk;
  }
  if (help_config_markdown) {
    print_config_reference_markdown(out);
    return kExitOk;
  }
  if (train->parsed()) {
    if (config_path.empty())
      throw UsageError("train needs a config file: trainer --config FILE",
                       "start from configs/tiny-t5.json; `trainer --help-config` lists every key");
    Config config = load_config(config_path, overrides);
    if (print_config) {
      out << config_to_json(config) << "\n";
      return kExitOk;
    }
    configure_logging(config.logging);
    if (!resolve_config_paths(config, train_options.dry_run, /*metadata_only=*/false, out).complete) {
      out << "Dry run: the files above are not in the Hugging Face cache yet; the plan needs them (`trainer download "
             "ID` fetches them ahead). Nothing was downloaded or trained.\n";
      return kExitOk;
    }
    train_options.config_file = config_path;
    train_options.overrides = overrides;
    return run_train(config, train_options, out);
  }
  if (evaluate_cmd->parsed()) {
    Config config = load_config(evaluate_config_path, evaluate_overrides);
    configure_logging(config.logging);
    if (evaluate_options.model_dir.empty()) {
      resolve_config_paths(config, false, /*metadata_only=*/false, out);
    } else {
      // --model replaces model.path's weights: model.path is then only the fallback base of an adapter.
      resolve_config_paths(config, false, /*metadata_only=*/true, out);
      evaluate_options.model_dir = resolve_flag_path(evaluate_options.model_dir, "--model");
    }
    return run_evaluate(config, evaluate_options, out);
  }
  if (data_cmd->parsed()) {
    Config config = load_config(data_config_path, data_overrides);
    configure_logging(config.logging);
    resolve_config_paths(config, false, /*metadata_only=*/true, out);
    if (!data_options.dump_file.empty() && data_options.dump < 0)
      throw UsageError("trainer data: a FILE is only read with --dump N", "add --dump N, or leave the FILE out");
    const TaskKind& kind = task_kind(config);
    data_options.mapper = kind.record_mapper;
    return kind.data(config, out, data_options);
  }
  if (plan_cmd->parsed()) {
    if (plan_world_size == 0) {
      const char* world = std::getenv("WORLD_SIZE");
      plan_world_size = world && std::strlen(world) > 0 ? std::max<int64_t>(1, std::atoll(world)) : 1;
    }
    Config config = load_config(plan_config_path, plan_overrides);
    resolve_config_paths(config, false, /*metadata_only=*/true, out);
    return task_kind(config).plan(config, out, plan_world_size);
  }
  if (inspect->parsed()) {
    inspect_model(resolve_flag_path(inspect_dir, "inspect", hub::FileSet::kMetadata), inspect_options, out);
    return kExitOk;
  }
  if (generate_cmd->parsed()) {
    generate_command.model_dir = resolve_flag_path(generate_command.model_dir, "--model",
                                                   generate_command.random_init ? hub::FileSet::kMetadata
                                                                                : hub::FileSet::kModel);
    if (!generate_command.tokenizer.empty())
      generate_command.tokenizer = resolve_flag_path(generate_command.tokenizer, "--tokenizer", hub::FileSet::kMetadata);
    return run_generate(generate_command, out);
  }
  if (download_cmd->parsed()) return run_download(download_options, out);
  if (predict_cmd->parsed()) {
    predict_options.top_k_given = top_k_option->count() > 0;
    predict_options.model_dir = resolve_flag_path(predict_options.model_dir, "--model");
    return run_predict(predict_options, out);
  }
  if (launch_cmd->parsed()) return distributed::run_launch(launch_options);
  if (export_cmd->parsed()) {
    const int64_t parameters = distributed::export_checkpoint(export_checkpoint_dir, export_output,
                                                              kDefaultMaxShardBytes);
    out << "Exported " << parameters << " parameters of " << export_checkpoint_dir << " to " << export_output
        << " (Hugging Face files)\n";
    return kExitOk;
  }
  if (quantize_cmd->parsed()) {
    const Quantize4bitOptions options{quant::parse_quant_type(quantize_type), quantize_block_size, !quantize_no_double};
    const auto result =
        quantize_model_dir_to(resolve_flag_path(quantize_model_dir, "--model"), quantize_output, options);
    out << "Quantized " << result.layers << " linear layers of " << quantize_model_dir << " to "
        << quantize_type << " (" << human_bytes(static_cast<double>(result.bytes)) << " in 4 bits with scales): "
        << quantize_output << "\n";
    return kExitOk;
  }
  if (merge_cmd->parsed()) {
    if (merge_quantize != "none")
      merge_options.quantize = Quantize4bitOptions{quant::parse_quant_type(merge_quantize), merge_block_size, true};
    merge_options.adapter_dir = resolve_flag_path(merge_options.adapter_dir, "--adapter");
    if (!merge_options.base_dir.empty()) merge_options.base_dir = resolve_flag_path(merge_options.base_dir, "--base");
    const auto merged = merge_adapter(merge_options);
    out << "Merged " << merged.layers << " LoRA layers of " << merge_options.adapter_dir << " into "
        << merged.base_dir << " (" << (merged.dtype == at::kBFloat16 ? "bf16" : merged.dtype == at::kFloat ? "fp32" : c10::toString(merged.dtype))
        << "): " << merge_options.output_dir << "\n";
    return kExitOk;
  }
  out << app.help();
  return kExitUsage;
}

}  // namespace trainer
