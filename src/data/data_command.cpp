// `trainer data --config FILE`: streams the configured data once through the real loader (same tokenizer, field
// mapping, length policy and collation as training) and prints the counts, the first problems and the
// throughput. For checking a data set before spending GPU time on it, and for the loader benchmark. An image
// classifier's config streams its images through the image loader (decode, preprocess, augment) instead.
// `--dump N [FILE]` writes the first N examples as JSON lines (input_ids, labels, and a chat record's rendered text),
// so a user sees exactly what is trained; the pass prints the first chat record with its trained tokens marked.
#include <sys/resource.h>

#include <charconv>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "chat/jinja.h"
#include "data/chat_record.h"
#include "data/dataset.h"
#include "data/image_loader.h"
#include "data/jsonl.h"
#include "data/packing.h"
#include "data/record.h"
#include "models/image/image_model.h"
#include "trainer/data.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

// Peak resident memory of this process (VmHWM), in bytes.
std::uint64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

struct PassResult {
  DataStats stats;
  std::uint64_t batches = 0, tokens = 0, target_tokens = 0, padded_tokens = 0;
  PackingFigures packing;  // every effective batch packed into rows of the maximum lengths (data.packing)
  PackCapacity capacity;
  double seconds = 0;
};

PassResult stream_all(DataLoader& loader, int32_t pad_id, DataFamily family, PackCapacity capacity) {
  PassResult result;
  result.capacity = capacity;
  const auto start = std::chrono::steady_clock::now();
  while (auto batch = loader.next()) {
    ++result.batches;
    result.target_tokens += static_cast<std::uint64_t>(batch->target_tokens);
    for (const auto& e : batch->examples) result.tokens += e.input_ids.size() + e.labels.size();
    const CollatedBatch collated = collate(batch->examples, pad_id, c10::Device(c10::kCPU));
    result.padded_tokens += static_cast<std::uint64_t>(collated.input_ids.numel() + collated.labels.numel());
    const PackingFigures packed = packing_figures(batch->examples, family, capacity);
    result.packing.rows += packed.rows;
    result.packing.tokens += packed.tokens;
    result.packing.capacity_tokens += packed.capacity_tokens;
    result.packing.padded_tokens += packed.padded_tokens;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.stats = loader.stats();
  return result;
}

void print_pass(const char* name, const PassResult& r, std::ostream& out) {
  const DataStats& s = r.stats;
  const double seconds = std::max(r.seconds, 1e-9);
  out << fmt::format("{}:\n", name);
  out << fmt::format("  records read        {}\n", s.records_read);
  out << fmt::format("  examples            {}\n", s.examples);
  out << fmt::format("  bad records skipped {}\n", s.bad_records_skipped);
  out << fmt::format("  truncated           {}\n", s.truncated);
  out << fmt::format("  over-length skipped {}\n", s.overlength_skipped);
  out << fmt::format("  batches             {}\n", r.batches);
  out << fmt::format("  tokens              {} ({} target; {:.1f}% padding after collation)\n", r.tokens,
                     r.target_tokens,
                     r.padded_tokens ? 100.0 * (1.0 - static_cast<double>(r.tokens) / static_cast<double>(r.padded_tokens)) : 0.0);
  const PackingFigures& p = r.packing;
  auto percent = [](int64_t part, int64_t whole) { return whole ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0; };
  out << fmt::format("  packing             {} rows for {} examples (data.packing, rows of {}): {:.1f}% of the row "
                     "capacity is real tokens; {:.1f}% padding after collation\n",
                     p.rows, s.examples,
                     r.capacity.labels ? fmt::format("{} + {} tokens", r.capacity.input, r.capacity.labels)
                                       : fmt::format("{} tokens", r.capacity.input),
                     percent(p.tokens, p.capacity_tokens), 100.0 - percent(p.tokens, p.padded_tokens));
  out << fmt::format("  time                {:.2f} s: {:.0f} examples/s, {:.0f} tokens/s\n", r.seconds,
                     static_cast<double>(s.examples) / seconds, static_cast<double>(r.tokens) / seconds);
  for (const auto& problem : s.first_problems) out << "  problem: " << problem << "\n";
}

// One pass of an image loader: the images of every effective batch decoded and preprocessed, as training does.
void stream_images(const char* name, ImageLoader& loader, std::ostream& out) {
  int64_t batches = 0, images = 0, height = 0, width = 0;
  const auto start = std::chrono::steady_clock::now();
  while (auto batch = loader.next()) {
    ++batches;
    images += batch->size();
    height = batch->height;
    width = batch->width;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const DataStats s = loader.stats();
  out << fmt::format("{}:\n", name);
  out << fmt::format("  records read        {}\n", s.records_read);
  out << fmt::format("  images              {} ({} x {} pixels)\n", images, width, height);
  out << fmt::format("  bad records skipped {}\n", s.bad_records_skipped);
  out << fmt::format("  batches             {}\n", batches);
  out << fmt::format("  time                {:.2f} s: {:.0f} images/s\n", seconds,
                     static_cast<double>(images) / std::max(seconds, 1e-9));
  for (const auto& problem : s.first_problems) out << "  problem: " << problem << "\n";
}


// The text of `ids` with the trained tokens (labels not -100) between [[ and ]].
std::string mark_trained(const Tokenizer& tokenizer, const Example& example) {
  std::string marked;
  std::size_t t = 0;
  const std::span<const std::int32_t> ids(example.input_ids);
  while (t < ids.size()) {
    const bool trained = example.labels[t] != -100;
    std::size_t end = t;
    while (end < ids.size() && (example.labels[end] != -100) == trained) ++end;
    const std::string text = tokenizer.decode(ids.subspan(t, end - t), /*skip_special=*/false);
    marked += trained ? "[[" + text + "]]" : text;
    t = end;
  }
  return marked;
}

// Appends ids as a JSON list, as nlohmann's dump() writes one ("[1,2,-100]"), without a JSON value per id: the
// digits go straight into room made for the longest possible list, which is then cut to what was written.
void append_ids(std::string& out, const std::vector<std::int32_t>& ids) {
  constexpr std::size_t kMaxIdChars = 12;  // "-2147483648" and a comma
  const std::size_t start = out.size();
  out.resize(start + 2 + ids.size() * kMaxIdChars);
  char* at = out.data() + start;
  char* const end = out.data() + out.size();
  *at++ = '[';
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) *at++ = ',';
    at = std::to_chars(at, end, ids[i]).ptr;
  }
  *at++ = ']';
  out.resize(static_cast<std::size_t>(at - out.data()));
}

// Appends a string as nlohmann's dump() writes it (ensure_ascii off). Valid UTF-8 takes the chat interpreter's
// escaper (the same bytes); other text takes dump() itself, whose error handler writes U+FFFD for the bad bytes.
void append_json_string(std::string& out, std::string_view text) {
  if (data::find_invalid_utf8(text) != std::string_view::npos) {
    out += nlohmann::ordered_json(std::string(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return;
  }
  chat::append_json_string(out, text);
}

void dump_file_examples(const Config& config, const Tokenizer& tokenizer, const data::MappingSpec& spec,
                        const DataCommandOptions& options, const std::string& path, bool name_file,
                        const RecordMapper& map, int64_t& written, std::ostream& out) {
  data::OrderedRecordReader reader(path);
  // JSONL records are named by their 1-based line, Parquet/Arrow records by their 0-based row.
  const char* number_key = reader.table() ? "row" : "line";
  const auto where = [&](std::uint64_t number) {
    return path + (reader.table() ? ": row " : ":") + std::to_string(number);
  };
  std::string record;
  std::uint64_t line = 0;
  // Lines are gathered and written a megabyte at a time; what was gathered is written before an error stops the dump.
  std::string buffer;
  const auto flush = [&] {
    out.write(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    buffer.clear();
  };
  while (written < options.dump && reader.next(record, line)) {
    const data::Outcome outcome = map ? map(record) : data::map_record(record, spec, tokenizer);
    nlohmann::ordered_json entry = {{number_key, line}};
    if (name_file) entry = {{"file", path}, {number_key, line}};
    if (outcome.kind == data::OutcomeKind::kBadRecord) {
      if (config.data.on_bad_record == BadRecordPolicy::kError || outcome.fatal) {
        flush();
        throw DataError(where(line) + ": " + outcome.problem,
                        !outcome.hint.empty() ? outcome.hint
                                              : "fix or remove the record, or set data.on_bad_record = \"skip\"");
      }
      entry["skipped"] = outcome.problem;
      buffer += entry.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else if (outcome.kind == data::OutcomeKind::kOverlengthSkipped) {
      entry["skipped"] = outcome.problem;
      buffer += entry.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else {
      // Written directly, the bytes entry.dump() would write: the ids are most of the output.
      char digits[24];
      buffer += '{';
      if (name_file) {
        buffer += "\"file\":";
        append_json_string(buffer, path);
        buffer += ',';
      }
      buffer += reader.table() ? "\"row\":" : "\"line\":";
      buffer.append(digits, std::to_chars(digits, digits + sizeof digits, line).ptr);
      buffer += ",\"input_ids\":";
      const std::size_t ids_at = buffer.size();
      append_ids(buffer, outcome.example.input_ids);
      const std::size_t ids_end = buffer.size();
      buffer += ",\"labels\":";
      // Every token trained (train_on=all): the labels' list is the ids' list just written.
      if (outcome.example.labels == outcome.example.input_ids) buffer.append(buffer, ids_at, ids_end - ids_at);
      else append_ids(buffer, outcome.example.labels);
      if (!outcome.example.rejected_ids.empty()) {  // a preference pair: input_ids/labels are its chosen sequence
        buffer += ",\"rejected_ids\":";
        append_ids(buffer, outcome.example.rejected_ids);
        buffer += ",\"rejected_labels\":";
        append_ids(buffer, outcome.example.rejected_labels);
      }
      if (outcome.truncated) buffer += ",\"truncated\":true";
      if (!outcome.chat_text.empty()) {
        buffer += ",\"text\":";
        append_json_string(buffer, outcome.chat_text);
      }
      if (!outcome.chat_mask.empty()) buffer += ",\"mask\":\"" + outcome.chat_mask + "\"";
      buffer += '}';
      ++written;
    }
    buffer += '\n';
    if (buffer.size() >= (1u << 20)) flush();
  }
  flush();
}


// `trainer data --dump`: the first `count` examples of `files` (one file, or the shards of a datasets folder), in
// file order, one JSON object per line; with several files each line names its file.
void dump_examples(const Config& config, const Tokenizer& tokenizer, DataFamily family,
                   const DataCommandOptions& options, const std::vector<std::string>& files, const RecordMapper& map,
                   std::ostream& out) {
  data::MappingSpec spec = data::mapping_spec(config, family);
  spec.keep_chat_text = true;
  int64_t written = 0;
  for (const auto& file : files) {
    if (written >= options.dump) break;
    dump_file_examples(config, tokenizer, spec, options, file, files.size() > 1, map, written, out);
  }
}

// The first chat record among the first lines of the first train file, with its trained tokens marked.
void preview_chat(const Config& config, const Tokenizer& tokenizer, std::ostream& out) {
  constexpr std::uint64_t kLinesLooked = 1000;
  const auto files = data::expand_globs(config.data.train_files, "data.train_files");
  if (files.empty()) return;
  data::OrderedRecordReader reader(files.front());
  std::string record;
  std::uint64_t line = 0;
  while (reader.next(record, line) && line <= kLinesLooked) {
    if (record.find(std::string("\"") + data::kMessagesField + "\"") == std::string::npos) continue;
    const data::Outcome outcome = data::map_record(record, data::mapping_spec(config, DataFamily::kCausal), tokenizer);
    if (outcome.kind != data::OutcomeKind::kExample) continue;
    out << fmt::format("first chat record ({}{}{}), trained tokens between [[ and ]] (data.train_on):\n{}\n",
                       files.front(), reader.table() ? ": row " : ":", line, mark_trained(tokenizer, outcome.example));
    return;
  }
}

}  // namespace

// `trainer data` on an image classifier's config: the training images (augmented when data.augment is on) and the
// validation images, each once, through data.num_workers decoding threads.
int run_image_data(const Config& config, std::ostream& out) {
  Config one_pass = config;
  one_pass.training.max_steps = 0;
  one_pass.training.epochs = 1;
  const auto dataset = open_training_images(one_pass, {});
  const auto spec = image_processor_for(config.model.path);
  out << fmt::format("data: image classifier ({} classes), {} worker(s), batch_size {}{}\n", dataset->classes.size(),
                     config.data.num_workers, config.training.batch_size, config.data.augment ? ", augmented" : "");
  auto train = make_image_train_loader(one_pass, dataset, spec);
  out << fmt::format("train: {} records per epoch\n", train->examples_per_epoch());
  stream_images("train", *train, out);
  if (auto validation = make_image_validation_loader(one_pass, dataset->classes, spec, config.training.batch_size))
    stream_images("validation", *validation, out);
  out << fmt::format("peak RSS {:.1f} MiB\n", static_cast<double>(peak_rss_bytes()) / (1024.0 * 1024.0));
  return kExitOk;
}

int run_data(const Config& config, std::ostream& out, const DataCommandOptions& options) {
  const ModelDirInfo model = inspect_model_dir(config.model.path, false);
  const auto tokenizer = load_run_tokenizer(config, /*samples=*/false);
  const DataFamily family = model.family == "seq2seq" ? DataFamily::kSeq2Seq : DataFamily::kCausal;
  const int32_t pad_id = tokenizer->pad_id().value_or(tokenizer->eos_id().value_or(0));
  const RecordMapper map = options.mapper ? options.mapper(config, *tokenizer) : RecordMapper{};
  if (options.dump >= 0) {
    std::vector<std::string> files;
    if (options.dump_file.empty()) {
      // The training files in order (several: a glob, a datasets folder's shards, a Hub dataset's Parquet files).
      files = data::expand_globs(config.data.train_files, "data.train_files");
      if (files.empty()) throw UsageError("trainer data --dump needs a FILE or data.train_files", "name the data file");
    } else {
      files = data::expand_globs({options.dump_file}, "FILE");  // a file, a glob, or a datasets folder (DIR:split)
    }
    dump_examples(config, *tokenizer, family, options, files, map, out);
    return kExitOk;
  }

  // One pass, whatever the run length says.
  Config one_pass = config;
  one_pass.training.max_steps = 0;
  one_pass.training.epochs = 1;
  out << fmt::format("data: {} model ({}), tokenizer {}, {} worker(s), batch_size {}\n", model.family,
                     model.model_type, tokenizer->source(), config.data.num_workers, config.training.batch_size);
  auto train = make_train_loader(one_pass, *tokenizer, family, {}, map);
  out << fmt::format("train: {} records per epoch\n", train->examples_per_epoch());
  const PackCapacity capacity = pack_capacity(config.data, family);
  print_pass("train", stream_all(*train, pad_id, family, capacity), out);
  if (auto validation = make_validation_loader(one_pass, *tokenizer, family, config.training.batch_size, {}, map))
    print_pass("validation", stream_all(*validation, pad_id, family, capacity), out);
  if (family == DataFamily::kCausal && !is_ids_only(*tokenizer) && !map) preview_chat(config, *tokenizer, out);
  out << fmt::format("peak RSS {:.1f} MiB\n", static_cast<double>(peak_rss_bytes()) / (1024.0 * 1024.0));
  return kExitOk;
}

}  // namespace trainer
