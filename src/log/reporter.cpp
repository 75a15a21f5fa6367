// The run reporter (see reporter.h).
#include "log/reporter.h"

#include <unistd.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <ostream>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "log/console.h"
#include "log/tensorboard.h"
#include "log/webhook.h"
#include "trainer/errors.h"

namespace trainer {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kRedrawInterval = std::chrono::milliseconds(100);
constexpr std::size_t kDiscordContentLimit = 2000;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::string first_line(const std::string& text, std::size_t limit = 300) {
  auto line = text.substr(0, text.find('\n'));
  if (line.size() > limit) line = line.substr(0, limit - 3) + "...";
  return line;
}

std::string describe_seconds(double seconds) {
  return seconds < 60 ? fmt::format("{:.1f} s", seconds) : format_duration(seconds);
}

// Adds to `values` the TensorBoard scalar of every key of `record` that has a tag.
void add_scalars(const nlohmann::json& record, std::vector<std::pair<std::string, float>>& values) {
  for (const auto& name : scalar_names())
    if (auto it = record.find(name.key); it != record.end() && it->is_number())
      values.emplace_back(name.tag, it->get<float>());
}

}  // namespace

const std::vector<ScalarName>& scalar_names() {
  static const std::vector<ScalarName> table = [] {
    std::vector<ScalarName> names = {{"loss", "train/loss"},
            {"lr", "train/lr"},
            {"grad_norm", "train/grad_norm"},
            {"tokens_per_s", "train/tokens_per_s"},
            {"tokens", "train/tokens"},
            {"micro_batch", "memory/micro_batch"},
            {"micro_steps", "memory/micro_steps"},
            {"oom_retries", "memory/oom_retries"},
            {"loss_scale", "train/loss_scale"},
            {"skipped_steps", "train/skipped_steps"},
            {"adaptations", "memory/adaptations"},
            {"device_moves", "memory/device_moves"},
            {"memory_allocated", "memory/allocated_bytes"},
            {"memory_peak", "memory/peak_bytes"},
            {"eval_loss", "eval/loss"},
            {"eval_perplexity", "eval/perplexity"},
            {"eval_tokens", "eval/tokens"},
            {"eval_top1", "eval/top1"},
            {"eval_top5", "eval/top5"},
            {"eval_images", "eval/images"},
            {"eval_i2t_r1", "eval/image_to_text_recall@1"},
            {"eval_i2t_r5", "eval/image_to_text_recall@5"},
            {"eval_i2t_r10", "eval/image_to_text_recall@10"},
            {"eval_t2i_r1", "eval/text_to_image_recall@1"},
            {"eval_t2i_r5", "eval/text_to_image_recall@5"},
            {"eval_t2i_r10", "eval/text_to_image_recall@10"},
            {"eval_pairs", "eval/pairs"},
            {"eval_zero_shot_top1", "eval/zero_shot_top1"},
            {"eval_exact_match", "eval/exact_match"},
            {"eval_exact_match_normalized", "eval/exact_match_normalized"},
            {"eval_rouge1", "eval/rouge1"},
            {"eval_rouge2", "eval/rouge2"},
            {"eval_rougeL", "eval/rougeL"},
            {"eval_rougeLsum", "eval/rougeLsum"},
            {"eval_bleu", "eval/bleu"},
            {"eval_chrf", "eval/chrf"},
            {"eval_generated", "eval/generated"}};
    // DPO (TRL's names): per step, and eval_ + the name per evaluation.
    for (const char* name : kPreferenceMetricNames) {
      names.push_back({name, std::string("train/") + name});
      names.push_back({std::string("eval_") + name, std::string("eval/") + name});
    }
    names.push_back({"pairs", "train/pairs"});
    names.push_back({"pairs_per_s", "train/pairs_per_s"});
    return names;
  }();  // built once: every metrics record is looked up in it
  return table;
}

std::string format_summary(const RunSummary& s) {
  std::string text = fmt::format("\nDone: {} steps", s.steps);
  if (s.start_step > 0) text += fmt::format(" (resumed at step {})", s.start_step);
  text += fmt::format(", {} {}; this run {} in {} ({:.0f} {}/s)\n", s.seen, s.counted, s.seen_this_run,
                      describe_seconds(s.seconds),
                      s.seconds > 0 ? static_cast<double>(s.seen_this_run) / s.seconds : 0.0, s.counted_rate);
  if (s.eval_loss && s.eval_perplexity)
    text += fmt::format("  validation loss {:.4f} (perplexity {:.2f})\n", *s.eval_loss, std::exp(*s.eval_loss));
  else if (s.eval_loss)
    text += fmt::format("  validation loss {:.4f}\n", *s.eval_loss);
  text += fmt::format("  records {} read, bad records skipped {}, truncated {}, too long and skipped {}\n",
                      s.data.records_read, s.data.bad_records_skipped, s.data.truncated, s.data.overlength_skipped);
  for (const auto& problem : s.data.first_problems) text += "    " + problem + "\n";
  text += fmt::format("  peak memory {}; micro-batch adaptations: {}\n", human_bytes(static_cast<double>(s.memory_peak)),
                      s.adaptations.size());
  for (const auto& a : s.adaptations)
    text += fmt::format("    step {}: {} -> {} ({})\n", a.step, a.old_micro_batch, a.new_micro_batch, a.reason);
  if (!s.ranks.empty()) {
    // Up to 16 ranks one line each; beyond, the extremes (the rank that waited longest is usually the fastest one).
    text += fmt::format("  data parallelism: {} ranks ({}); peak memory and time in collectives (waiting included):\n",
                        s.ranks.size(), s.backend);
    bool tokenized = false;  // text runs: the records each rank tokenized (its share)
    for (const auto& r : s.ranks) tokenized = tokenized || r.records_tokenized > 0;
    const auto line = [&](std::size_t r) {
      return fmt::format("    rank {}: {}, {:.1f} s{}\n", r, human_bytes(static_cast<double>(s.ranks[r].memory_peak)),
                         s.ranks[r].communication_seconds,
                         tokenized ? fmt::format(", {} records tokenized", s.ranks[r].records_tokenized) : "");
    };
    if (s.ranks.size() <= 16) {
      for (std::size_t r = 0; r < s.ranks.size(); ++r) text += line(r);
    } else {
      std::size_t most_memory = 0, most_waiting = 0, least_waiting = 0;
      for (std::size_t r = 1; r < s.ranks.size(); ++r) {
        if (s.ranks[r].memory_peak > s.ranks[most_memory].memory_peak) most_memory = r;
        if (s.ranks[r].communication_seconds > s.ranks[most_waiting].communication_seconds) most_waiting = r;
        if (s.ranks[r].communication_seconds < s.ranks[least_waiting].communication_seconds) least_waiting = r;
      }
      text += line(0) + "    highest peak memory:\n  " + line(most_memory) + "    longest in collectives:\n  " +
              line(most_waiting) + "    shortest in collectives:\n  " + line(least_waiting);
    }
  }
  if (s.loss_scaling)
    text += fmt::format("  fp16 loss scaling: {} step{} skipped for inf/NaN gradients ({} in this run); loss scale {}\n",
                        s.loss_scaling->skipped_steps, s.loss_scaling->skipped_steps == 1 ? "" : "s",
                        s.loss_scaling->skipped_steps_this_run, s.loss_scaling->final_scale);
  if (!s.escalations.empty()) {
    text += "  turned on at the micro-batch floor:";
    for (const auto& e : s.escalations) text += " " + e;
    text += "\n";
  }
  if (!s.model_dir.empty())
    text += std::string(s.model_is_adapter ? "  LoRA adapter (PEFT format) saved to " : "  model saved to ") +
            s.model_dir + "\n";
  if (!s.merged_dir.empty()) text += "  merged model saved to " + s.merged_dir + "\n";
  text += "  last checkpoint " + (s.last_checkpoint.empty() ? std::string("(none)") : s.last_checkpoint) + "\n";
  if (!s.best_checkpoint.empty())
    text += fmt::format("  best checkpoint {} ({} {:.4f})\n", s.best_checkpoint,
                        s.best_metric == "loss" ? "validation loss" : s.best_metric, s.best_eval_loss);
  if (!s.metrics_file.empty()) text += "  metrics " + s.metrics_file + "\n";
  if (!s.tensorboard_dir.empty()) text += "  TensorBoard: tensorboard --logdir " + s.tensorboard_dir + "\n";
  return text;
}

Reporter::Reporter(const Config& config, std::ostream& out, bool primary)
    : config_(config), out_(out), start_(Clock::now()) {
  const auto& logging = config.logging;
  if (!primary) {
    console_ = Console::kOff;
    return;
  }
  sink_ = default_console_sink();
  switch (logging.progress) {
    case ProgressStyle::kOff: console_ = Console::kOff; break;
    case ProgressStyle::kPlain: console_ = Console::kPlain; break;
    case ProgressStyle::kBar: console_ = sink_ ? Console::kLive : Console::kPlain; break;
    case ProgressStyle::kAuto: console_ = sink_ && sink_->is_terminal() ? Console::kLive : Console::kPlain; break;
  }
  const fs::path output_dir(config.checkpoint.output_dir);
  fs::create_directories(output_dir);
  if (logging.metrics_jsonl) {
    metrics_.open(output_dir / "metrics.jsonl", std::ios::app);
    if (!metrics_)
      throw DataError("cannot write " + (output_dir / "metrics.jsonl").string(),
                      "make checkpoint.output_dir writable, or set logging.metrics_jsonl=false");
  }
  if (logging.tensorboard) tensorboard_ = std::make_unique<EventFileWriter>(output_dir / "tensorboard");
  if (const auto url = webhook_url_from_environment(); !url.empty()) {
    webhook_ = std::make_unique<Webhook>(url);
    spdlog::info("webhook: on ({} is set): start, checkpoints, finish and failure are posted",
                 kWebhookEnvironmentVariable);
  }
}

Reporter::~Reporter() { clear_status(); }

double Reporter::seconds_since_start() const { return seconds_between(start_, Clock::now()); }

void Reporter::on_start(const RunStart& start) {
  run_ = start;
  step_ = start.start_step;
  last_checkpoint_ = start.resumed_from;
  clock_.emplace(start.start_step, start.total_steps, seconds_since_start(),
                 static_cast<std::size_t>(config_.logging.every_steps));
  if (tensorboard_) tensorboard_->session_start(start.start_step + 1);
  out_ << "Training " << start.model_type << " (" << start.parameters << " parameters, " << start.trainable_parameters
       << " trainable) for " << start.total_steps << " steps of " << config_.training.batch_size
       << (start.unit == "tokens" ? " examples" : " " + start.unit) << "; ";
  if (config_.training.micro_batch_tokens > 0) out_ << "micro-batches of at most " << start.micro_batch << " padded tokens\n";
  else out_ << "micro-batch " << start.micro_batch << "\n";
  out_.flush();
  notify({{"event", "start"},
          {"model", start.model_type},
          {"parameters", start.parameters},
          {"total_steps", start.total_steps},
          {"batch_size", config_.training.batch_size},
          {"start_step", start.start_step}},
         fmt::format("{} {} ({} parameters) for {} steps{}", start.start_step > 0 ? "resumed" : "started",
                     start.model_type, start.parameters, start.total_steps,
                     start.start_step > 0 ? fmt::format(" from step {}", start.start_step) : std::string()));
}

void Reporter::on_step(const StepMetrics& m) {
  step_ = m.step;
  loss_ = m.loss;
  const double now = seconds_since_start();
  if (!clock_) clock_.emplace(m.step - 1, m.step, now);  // on_start was skipped (tests)
  clock_->add_step(m.step, m.counted, m.seconds, now);
  nlohmann::json record = {{"step", m.step},
                            {"loss", m.loss},
                            {"lr", m.lr},
                            {"grad_norm", m.grad_norm},
                            {"tokens", m.seen},
                            {"tokens_per_s", m.seconds > 0 ? static_cast<double>(m.counted) / m.seconds : 0.0},
                            {"micro_batch", m.micro_batch},
                            {"micro_steps", m.micro_steps},
                            {"oom_retries", m.oom_retries},
                            {"adaptations", m.adaptations},
                            {"device_moves", m.device_moves},
                            {"memory_allocated", m.memory_allocated},
                            {"memory_peak", m.memory_peak}};
  // Image and CLIP runs count images or pairs: those keys too ("tokens" stays, as the TensorBoard tags read it).
  if (run_.unit != "tokens") {
    record[run_.unit] = m.seen;
    record[run_.unit + "_per_s"] = record["tokens_per_s"];
  }
  if (m.loss_scaling) {
    // A skipped step has no gradient norm (its gradients overflowed): grad_norm is null there.
    record["loss_scale"] = m.loss_scaling->scale;
    record["skipped"] = m.loss_scaling->skipped;
    record["skipped_steps"] = m.loss_scaling->skipped_steps;
    if (m.loss_scaling->skipped) record["grad_norm"] = nullptr;
  }
  for (const auto& [name, value] : m.task_metrics) record[name] = value;
  write_metrics(record);
  if (console_ == Console::kOff) return;
  const ProgressSnapshot snapshot{m.step, run_.total_steps, m.loss, m.lr, m.grad_norm, clock_->tokens_per_second(),
                                  m.memory_allocated, m.memory_peak, m.micro_batch, m.micro_steps,
                                  clock_->eta_seconds(), run_.unit};
  const bool periodic = m.step % config_.logging.every_steps == 0 || m.step == run_.total_steps;
  if (console_ == Console::kPlain) {
    if (periodic) spdlog::info("{}", format_log_line(snapshot));
    return;
  }
  if (periodic) spdlog::debug("{}", format_log_line(snapshot));
  const auto now_point = Clock::now();
  if (now_point - last_draw_ >= kRedrawInterval || m.step == run_.total_steps) {
    sink_->set_status(format_status_line(snapshot));
    last_draw_ = now_point;
  }
}

void Reporter::on_eval(int64_t step, double loss, int64_t tokens) {
  eval_loss_ = loss;
  spdlog::info("eval step {}: loss {:.4f} perplexity {:.2f} ({} tokens)", step, loss, std::exp(loss), tokens);
  write_metrics({{"step", step}, {"eval_loss", loss}, {"eval_perplexity", std::exp(loss)}, {"eval_tokens", tokens}});
}

void Reporter::on_eval_values(int64_t step, double loss, const std::vector<std::pair<std::string, double>>& values,
                              int64_t count, const std::string& what) {
  eval_loss_ = loss;
  std::string shown;
  nlohmann::json record = {{"step", step}, {"eval_loss", loss}};
  for (const auto& [name, value] : values) {
    shown += fmt::format(" {} {:.4f}", name, value);
    record["eval_" + name] = value;
  }
  record["eval_" + what] = count;
  spdlog::info("eval step {}: loss {:.4f}{} ({} {})", step, loss, shown, count, what);
  write_metrics(record);
}

void Reporter::on_eval_accuracy(int64_t step, double loss, double top1, double top5, int64_t images) {
  eval_loss_ = loss;
  spdlog::info("eval step {}: loss {:.4f} top-1 {:.2f}% top-5 {:.2f}% ({} images)", step, loss, 100 * top1,
               100 * top5, images);
  write_metrics({{"step", step}, {"eval_loss", loss}, {"eval_top1", top1}, {"eval_top5", top5}, {"eval_images", images}});
}

void Reporter::on_eval_retrieval(int64_t step, const Retrieval& eval) {
  eval_loss_ = eval.loss;
  const auto* i2t = eval.image_to_text;
  const auto* t2i = eval.text_to_image;
  spdlog::info("eval step {}: loss {:.4f} image->text R@1/5/10 {:.1f}/{:.1f}/{:.1f}% text->image R@1/5/10 "
               "{:.1f}/{:.1f}/{:.1f}%{} ({} pairs)",
               step, eval.loss, 100 * i2t[0], 100 * i2t[1], 100 * i2t[2], 100 * t2i[0], 100 * t2i[1], 100 * t2i[2],
               eval.zero_shot_top1 ? fmt::format(" zero-shot top-1 {:.2f}%", 100 * *eval.zero_shot_top1) : "",
               eval.pairs);
  nlohmann::json record = {{"step", step},          {"eval_loss", eval.loss},    {"eval_i2t_r1", i2t[0]},
                           {"eval_i2t_r5", i2t[1]}, {"eval_i2t_r10", i2t[2]},    {"eval_t2i_r1", t2i[0]},
                           {"eval_t2i_r5", t2i[1]}, {"eval_t2i_r10", t2i[2]},    {"eval_pairs", eval.pairs}};
  if (eval.zero_shot_top1) record["eval_zero_shot_top1"] = *eval.zero_shot_top1;
  write_metrics(record);
}

void Reporter::on_eval_generation(int64_t step, const std::map<std::string, double>& metrics, int64_t examples,
                                  const std::string& predictions) {
  std::string values;
  nlohmann::json record = {{"step", step}};
  for (const auto& [name, value] : metrics) {
    values += fmt::format(" {} {:.4f}", name, value);
    record["eval_" + name] = value;
  }
  record["eval_generated"] = examples;
  spdlog::info("eval step {}: generated {} answers:{}{}", step, examples, values,
               predictions.empty() ? "" : " (" + predictions + ")");
  write_metrics(record);
}

void Reporter::on_sample(int64_t step, std::size_t index, const std::string& prompt, const std::string& generation) {
  spdlog::info("sample step {}: {:?} -> {:?}", step, prompt, generation);
  if (tensorboard_)
    tensorboard_->text(step, "samples/" + std::to_string(index),
                       "**prompt** " + prompt + "\n\n**generation** " + generation);
}

void Reporter::on_checkpoint(int64_t step, const std::string& path) {
  last_checkpoint_ = path;
  nlohmann::json body = {{"event", "checkpoint"}, {"step", step}, {"total_steps", run_.total_steps},
                         {"loss", loss_}, {"path", path}};
  if (eval_loss_) body["eval_loss"] = *eval_loss_;
  notify(std::move(body), fmt::format("checkpoint at step {}/{} (loss {:.4f}{}): {}", step, run_.total_steps, loss_,
                                      eval_loss_ ? fmt::format(", validation loss {:.4f}", *eval_loss_) : "", path));
}

void Reporter::on_stopped(int signal, int64_t step, const std::string& path) {
  clear_status();
  const char* name = signal == SIGINT ? "SIGINT" : "SIGTERM";
  out_ << "Stopped by " << name << " after step " << step << "; the checkpoint is in " << path
       << ".\nContinue with the same command and --resume.\n";
  out_.flush();
  notify({{"event", "stopped"}, {"signal", name}, {"step", step}, {"total_steps", run_.total_steps}, {"path", path}},
         fmt::format("stopped by {} after step {}/{}; checkpoint {} (continue with --resume)", name, step,
                     run_.total_steps, path));
}

void Reporter::on_finish(RunSummary summary) {
  clear_status();
  summary.seconds = seconds_since_start();
  summary.start_step = run_.start_step;
  summary.seen_this_run = summary.seen - run_.seen;
  summary.eval_loss = eval_loss_;
  summary.last_checkpoint = last_checkpoint_;
  const fs::path output_dir(config_.checkpoint.output_dir);
  if (metrics_.is_open()) summary.metrics_file = (output_dir / "metrics.jsonl").string();
  if (tensorboard_) summary.tensorboard_dir = (output_dir / "tensorboard").string();
  out_ << format_summary(summary);
  out_.flush();
  nlohmann::json body = {{"event", "finish"},
                         {"step", summary.steps},
                         {"total_steps", run_.total_steps},
                         {"loss", loss_},
                         {"tokens", summary.seen},
                         {"seconds", summary.seconds},
                         {"adaptations", summary.adaptations.size()},
                         {"memory_peak", summary.memory_peak},
                         {"model_dir", summary.model_dir},
                         {"last_checkpoint", summary.last_checkpoint}};
  if (summary.eval_loss) body["eval_loss"] = *summary.eval_loss;
  if (!summary.best_checkpoint.empty()) body["best_checkpoint"] = summary.best_checkpoint;
  if (!summary.ranks.empty()) {
    body["ranks"] = nlohmann::json::array();
    for (const auto& r : summary.ranks)
      body["ranks"].push_back({{"memory_peak", r.memory_peak},
                               {"communication_seconds", r.communication_seconds},
                               {"records_tokenized", r.records_tokenized}});
  }
  notify(std::move(body),
         fmt::format("finished {} steps in {} (loss {:.4f}{}){}", summary.steps, describe_seconds(summary.seconds),
                     loss_, summary.eval_loss ? fmt::format(", validation loss {:.4f}", *summary.eval_loss) : "",
                     summary.model_dir.empty() ? std::string() : "; model in " + summary.model_dir));
}

void Reporter::on_failure(const std::exception& error) {
  clear_status();
  int exit_code = kExitFailure;
  std::string message = error.what();
  if (const auto* e = dynamic_cast<const Error*>(&error)) {
    exit_code = e->exit_code();
  } else if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) {
    exit_code = dynamic_cast<const c10::OutOfMemoryError*>(&error) ? kExitOutOfMemory : kExitFailure;
    message = c10_error->what_without_backtrace();
  }
  notify({{"event", "failure"},
          {"exit_code", exit_code},
          {"message", message},
          {"step", step_},
          {"total_steps", run_.total_steps}},
         fmt::format("FAILED at step {}/{} (exit code {}): {}", step_, run_.total_steps, exit_code,
                     first_line(message)));
}

void Reporter::write_metrics(const nlohmann::json& record) {
  if (metrics_.is_open()) {
    metrics_ << record.dump() << "\n";
    metrics_.flush();
  }
  if (tensorboard_) {
    std::vector<std::pair<std::string, float>> values;
    add_scalars(record, values);
    tensorboard_->scalars(record.at("step").get<int64_t>(), values);
  }
}

void Reporter::notify(nlohmann::json body, const std::string& content) {
  if (!webhook_) return;
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  body["run"] = config_.checkpoint.output_dir;
  body["host"] = host;
  body["username"] = "trainer";                                         // Discord shows it as the sender
  body["allowed_mentions"] = nlohmann::json{{"parse", nlohmann::json::array()}};  // an "@everyone" in a message pings no one
  body["content"] = first_line("trainer " + config_.checkpoint.output_dir + " on " + host + ": " + content,
                               kDiscordContentLimit);
  webhook_->post(body);
}

void Reporter::clear_status() {
  if (console_ == Console::kLive && sink_) sink_->clear_status();
}

}  // namespace trainer
