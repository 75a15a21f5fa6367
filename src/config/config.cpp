// Reading and writing the configuration: JSON <-> structs by walking each struct's visit(), --set overrides,
// and the start-up table. Semantic checks live in validate.cpp.
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "trainer/config.h"
#include "util/strings.h"

namespace trainer {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// ---- per-type JSON conversion ---------------------------------------------------------------------------------

std::string describe(const json& j) {
  std::string text = j.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  switch (j.type()) {
    case json::value_t::string: return "string " + text;
    case json::value_t::boolean: return "boolean " + text;
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer " + text;
    case json::value_t::number_float: return "number " + text;
    case json::value_t::array: return "list " + text;
    case json::value_t::object: return "object " + text;
    case json::value_t::null: return "null";
    default: return text;
  }
}

// A quoted number or boolean is a common slip; say how to write it.
std::string unquote_hint(const json& j, const char* wanted) {
  if (!j.is_string()) return {};
  const json inner = json::parse(j.get<std::string>(), nullptr, false);
  if (inner.is_discarded() || inner.is_string() || inner.is_object() || inner.is_array()) return {};
  return std::string("; write ") + wanted + " without quotes: " + inner.dump();
}

// Each read_value returns an empty string on success, else what is wrong.
std::string read_value(const json& j, bool& out) {
  if (!j.is_boolean()) return "expected true or false, got " + describe(j) + unquote_hint(j, "the boolean");
  out = j.get<bool>();
  return {};
}

std::string read_value(const json& j, std::int64_t& out) {
  if (j.is_number_integer()) {
    if (j.is_number_unsigned() && j.get<std::uint64_t>() > std::numeric_limits<std::int64_t>::max())
      return "integer " + j.dump() + " is too large";
    out = j.get<std::int64_t>();
    return {};
  }
  if (j.is_number_float()) {
    const double d = j.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) {
      out = static_cast<std::int64_t>(d);
      return {};
    }
  }
  return "expected an integer, got " + describe(j) + unquote_hint(j, "the number");
}

std::string read_value(const json& j, double& out) {
  if (!j.is_number()) return "expected a number, got " + describe(j) + unquote_hint(j, "the number");
  out = j.get<double>();
  return {};
}

std::string read_value(const json& j, std::string& out) {
  if (!j.is_string()) return "expected a string, got " + describe(j);
  out = j.get<std::string>();
  return {};
}

std::string read_value(const json& j, std::vector<std::string>& out) {
  if (j.is_string()) {  // one item may be written without the list
    out = {j.get<std::string>()};
    return {};
  }
  if (!j.is_array()) return "expected a list of strings, got " + describe(j);
  std::vector<std::string> items;
  for (std::size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_string()) return "item " + std::to_string(i) + ": expected a string, got " + describe(j[i]);
    items.push_back(j[i].get<std::string>());
  }
  out = std::move(items);
  return {};
}

std::string read_value(const json& j, std::vector<double>& out) {
  if (j.is_number()) {  // one item may be written without the list
    out = {j.get<double>()};
    return {};
  }
  if (!j.is_array()) return "expected a list of numbers, got " + describe(j);
  std::vector<double> items;
  for (std::size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_number()) return "item " + std::to_string(i) + ": expected a number, got " + describe(j[i]);
    items.push_back(j[i].get<double>());
  }
  out = std::move(items);
  return {};
}

std::string read_value(const json& j, ByteSize& out) {
  if (j.is_number_integer() && !(j.is_number_integer() && !j.is_number_unsigned() && j.get<std::int64_t>() < 0)) {
    out = ByteSize{j.get<std::uint64_t>()};
    return {};
  }
  if (j.is_string()) {
    try {
      out = parse_byte_size(j.get<std::string>());
      return {};
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
  }
  return "expected a size such as \"24GiB\" or a number of bytes, got " + describe(j);
}

std::string read_value(const json& j, MicroBatchSize& out) {
  if (j.is_string() && j.get<std::string>() == "auto") {
    out = MicroBatchSize::automatic();
    return {};
  }
  std::int64_t n = 0;
  if (!j.is_string() && read_value(j, n).empty()) {
    out = MicroBatchSize::fixed(n);
    return {};
  }
  return "expected \"auto\" or an integer, got " + describe(j) + unquote_hint(j, "the number");
}

// Values that users bring from other tools but that trainer refuses on purpose, with the reason.
template <class E>
std::string refused_value(E, const std::string&) {
  return {};
}
std::string refused_value(PrecisionMode, const std::string& text) {
  if (text == "16-mixed" || text == "fp16_mixed" || text == "mixed-fp16")
    return "'" + text + "' is spelled 'fp16-mixed' here (fp32 master weights, fp16 autocast, dynamic loss scaling)";
  if (text != "fp16" && text != "float16" && text != "half") return {};
  return "'" + text + "' is refused: fp16 weights lose small updates and need loss scaling. On GPUs without bf16 "
         "(T4, V100, RTX 20xx) use 'fp16-mixed' (fp32 master weights, fp16 autocast, dynamic loss scaling; not for "
         "T5 / FLAN-T5, whose activations overflow fp16); elsewhere 'bf16-mixed' or 'bf16'";
}

template <class E>
  requires std::is_enum_v<E>
std::string read_value(const json& j, E& out) {
  if (j.is_string())
    if (auto reason = refused_value(E{}, j.get<std::string>()); !reason.empty()) return reason;
  std::vector<std::string> names;
  for (const auto& entry : enum_names(E{})) names.emplace_back(entry.name);
  if (j.is_string()) {
    const auto text = j.get<std::string>();
    for (const auto& entry : enum_names(E{})) {
      if (text == entry.name) {
        out = entry.value;
        return {};
      }
    }
    std::string message = "'" + text + "' is not one of " + join_alternatives(names);
    if (auto guess = closest_match(text, names); !guess.empty()) message += "; did you mean '" + guess + "'?";
    return message;
  }
  return "expected one of " + join_alternatives(names) + ", got " + describe(j);
}

std::string read_value(const json& j, GenerateEarlyStopping& out) {
  if (j.is_boolean()) {
    out = j.get<bool>() ? GenerateEarlyStopping::kTrue : GenerateEarlyStopping::kFalse;
    return {};
  }
  if (j.is_string() && j.get<std::string>() == "never") {
    out = GenerateEarlyStopping::kNever;
    return {};
  }
  if (j.is_string() && (j.get<std::string>() == "true" || j.get<std::string>() == "false"))
    return "expected true, false or \"never\", got " + describe(j) + "; write the boolean without quotes";
  return "expected true, false or \"never\", got " + describe(j);
}

// An optional setting: null (the default) leaves it unset.
template <class T>
std::string read_value(const json& j, std::optional<T>& out) {
  if (j.is_null()) {
    out.reset();
    return {};
  }
  T value{};
  if (auto error = read_value(j, value); !error.empty()) return error;
  out = value;
  return {};
}

ordered_json write_value(bool v) { return v; }
ordered_json write_value(std::int64_t v) { return v; }
ordered_json write_value(double v) { return v; }
ordered_json write_value(const std::string& v) { return v; }
ordered_json write_value(const std::vector<std::string>& v) { return v; }
ordered_json write_value(const std::vector<double>& v) { return v; }
ordered_json write_value(ByteSize v) {
  if (v.bytes == 0) return 0;
  return format_byte_size(v);
}
ordered_json write_value(MicroBatchSize v) {
  if (v.is_auto) return "auto";
  return v.value;
}
template <class E>
  requires std::is_enum_v<E>
ordered_json write_value(E v) {
  return enum_name(v);
}
ordered_json write_value(GenerateEarlyStopping v) {
  if (v == GenerateEarlyStopping::kNever) return "never";
  return v == GenerateEarlyStopping::kTrue;
}
template <class T>
ordered_json write_value(const std::optional<T>& v) {
  return v ? write_value(*v) : ordered_json(nullptr);
}

std::string type_name(bool) { return "boolean"; }
std::string type_name(std::int64_t) { return "integer"; }
std::string type_name(double) { return "number"; }
std::string type_name(const std::string&) { return "string"; }
std::string type_name(const std::vector<std::string>&) { return "list of strings"; }
std::string type_name(const std::vector<double>&) { return "list of numbers"; }
std::string type_name(ByteSize) { return "size"; }
std::string type_name(MicroBatchSize) { return "\"auto\" or integer"; }
template <class E>
  requires std::is_enum_v<E>
std::string type_name(E) {
  std::string names;
  for (const auto& entry : enum_names(E{})) names += (names.empty() ? "" : "|") + std::string(entry.name);
  return names;
}
std::string type_name(GenerateEarlyStopping) { return "true|false|never"; }
template <class T>
std::string type_name(const std::optional<T>&) {
  return type_name(T{}) + " or null";
}

// Whether a --set value for this type is taken as literal text when it is not a JSON string
// (so that `--set model.path=123` or `--set logging.level=info` need no quotes).
template <class T>
constexpr bool kTextValued = std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<std::string>> ||
                             std::is_enum_v<T>;
template <class T>
constexpr bool kTextValued<std::optional<T>> = kTextValued<T>;

// ---- visitors over the config -------------------------------------------------------------------------------

// Collects every key with its type, default and description.
struct KeyCollector {
  std::string prefix;
  std::vector<ConfigKey>* keys;
  std::map<std::string, bool>* text_valued;

  template <class T>
  void operator()(const char* key, T& field, const char* doc) {
    keys->push_back({prefix + key, type_name(field), write_value(field).dump(), doc});
    (*text_valued)[prefix + key] = kTextValued<T>;
  }
  template <class S>
  void section(const char* key, S& s, const char* /*doc*/) {
    KeyCollector inner{std::string(key) + ".", keys, text_valued};
    s.visit(inner);
  }
};

struct Schema {
  std::vector<ConfigKey> keys;
  std::map<std::string, bool> text_valued;
  std::vector<std::string> sections;
  std::vector<std::string> paths;
};

const Schema& schema() {
  static const Schema instance = [] {
    Schema s;
    Config defaults;
    KeyCollector collector{"", &s.keys, &s.text_valued};
    defaults.visit(collector);
    for (const auto& key : s.keys) {
      s.paths.push_back(key.path);
      const auto section = key.path.substr(0, key.path.find('.'));
      if (s.sections.empty() || s.sections.back() != section) s.sections.push_back(section);
    }
    return s;
  }();
  return instance;
}

// "did you mean ..." for an unknown key at `prefix` (a section name with a dot, or empty at the top level).
std::string suggest_key(const std::string& prefix, const std::string& key) {
  const Schema& s = schema();
  std::vector<std::string> local;  // keys of the same section (or the sections at the top level)
  if (prefix.empty()) {
    local = s.sections;
  } else {
    for (const auto& path : s.paths)
      if (path.starts_with(prefix)) local.push_back(path.substr(prefix.size()));
  }
  if (auto guess = closest_match(key, local); !guess.empty()) return "; did you mean " + prefix + guess + "?";
  // The same key in another section ("training.lr" -> "optimizer.lr").
  for (const auto& path : s.paths)
    if (path.substr(path.find('.') + 1) == key) return "; did you mean " + path + "?";
  if (!prefix.empty()) {
    std::vector<std::string> elsewhere;
    for (const auto& path : s.paths) elsewhere.push_back(path.substr(path.find('.') + 1));
    if (auto guess = closest_match(key, elsewhere); !guess.empty())
      for (const auto& path : s.paths)
        if (path.substr(path.find('.') + 1) == guess) return "; did you mean " + path + "?";
  }
  // Secrets never live in the config.
  for (const char* word : {"token", "secret", "password", "webhook", "api_key", "apikey"})
    if (key.find(word) != std::string::npos)
      return "; secrets are never read from config files: set them in the environment (e.g. TRAINER_WEBHOOK_URL)";
  return prefix.empty() ? "; the sections are " + join_alternatives(s.sections)
                        : "; run `trainer --help-config` for the keys of " + prefix.substr(0, prefix.size() - 1);
}

// Reads a JSON object into a struct, collecting problems instead of stopping at the first.
struct Reader {
  const json& node;
  std::string prefix;
  std::vector<ConfigProblem>& problems;
  std::set<std::string> known;

  template <class T>
  void operator()(const char* key, T& field, const char* /*doc*/) {
    known.insert(key);
    auto it = node.find(key);
    if (it == node.end()) return;
    if (auto error = read_value(*it, field); !error.empty()) problems.push_back({prefix + key, error});
  }

  template <class S>
  void section(const char* key, S& s, const char* /*doc*/) {
    known.insert(key);
    auto it = node.find(key);
    if (it == node.end()) return;
    if (!it->is_object()) {
      problems.push_back({key, "expected an object {...} of " + std::string(key) + " keys, got " + describe(*it)});
      return;
    }
    Reader inner{*it, std::string(key) + ".", problems, {}};
    s.visit(inner);
    inner.report_unknown_keys();
  }

  void report_unknown_keys() {
    for (const auto& [key, value] : node.items()) {
      if (known.count(key)) continue;
      problems.push_back({prefix + key, "unknown key" + suggest_key(prefix, key)});
    }
  }
};

struct Writer {
  ordered_json& node;

  template <class T>
  void operator()(const char* key, T& field, const char* /*doc*/) {
    node[key] = write_value(field);
  }
  template <class S>
  void section(const char* key, S& s, const char* /*doc*/) {
    ordered_json inner = ordered_json::object();
    Writer w{inner};
    s.visit(w);
    node[key] = std::move(inner);
  }
};

// (line, column) of a byte offset, for syntax errors.
std::pair<std::size_t, std::size_t> line_and_column(const std::string& text, std::size_t offset) {
  std::size_t line = 1, column = 1;
  for (std::size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

// Applies one `section.key=value` override to the JSON tree. Returns the key path, or records a problem.
void apply_override(json& root, const std::string& assignment, std::vector<ConfigProblem>& problems,
                    std::map<std::string, std::string>& origin) {
  const auto equals = assignment.find('=');
  const std::string where = "--set " + assignment;
  if (equals == std::string::npos || equals == 0) {
    problems.push_back({where, "expected section.key=value, e.g. --set training.batch_size=64"});
    return;
  }
  const std::string path = assignment.substr(0, equals);
  const std::string text = assignment.substr(equals + 1);
  const auto dot = path.find('.');
  if (dot == std::string::npos || path.find('.', dot + 1) != std::string::npos) {
    problems.push_back({where, "the key must be section.key, e.g. training.batch_size" +
                                   (dot == std::string::npos ? suggest_key("", path) : std::string())});
    return;
  }
  const std::string section = path.substr(0, dot);
  const std::string key = path.substr(dot + 1);

  json value = json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/false);
  const auto& kinds = schema().text_valued;
  const auto kind = kinds.find(path);
  const bool text_valued = kind != kinds.end() && kind->second;
  if (value.is_discarded() || (text_valued && !value.is_string() && !value.is_array())) value = text;

  if (!root.contains(section)) root[section] = json::object();
  if (!root[section].is_object()) {
    problems.push_back({where, "section '" + section + "' in the file is not an object"});
    return;
  }
  root[section][key] = std::move(value);
  origin[path] = where;
}

}  // namespace

ConfigError::ConfigError(std::string source, std::vector<ConfigProblem> problems)
    : Error([&] {
        std::string message = source + ": " + std::to_string(problems.size()) +
                              (problems.size() == 1 ? " problem" : " problems") + " in the configuration";
        for (const auto& p : problems) message += "\n  " + p.where + ": " + p.what;
        return message;
      }(),
            "fix the keys above; `trainer --help-config` lists every key with its type and default"),
      problems_(std::move(problems)) {}

std::vector<ConfigKey> config_keys() { return schema().keys; }

Config parse_config(const std::string& json_text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  std::vector<ConfigProblem> problems;
  json root;
  try {
    root = json::parse(json_text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    const auto [line, column] = line_and_column(json_text, e.byte == 0 ? 0 : e.byte - 1);
    std::string what = e.what();
    // nlohmann's text starts with "[json.exception.parse_error.101] parse error at line 3, column 5: ".
    if (auto colon = what.find(": ", what.find("parse error")); colon != std::string::npos)
      what = what.substr(colon + 2);
    throw ConfigError(source, {{source + ":" + std::to_string(line) + ":" + std::to_string(column),
                                "invalid JSON: " + what}});
  }
  if (!root.is_object()) throw ConfigError(source, {{source, "expected a JSON object {...}, got " + describe(root)}});

  std::map<std::string, std::string> origin;
  for (const auto& assignment : overrides) apply_override(root, assignment, problems, origin);

  Config config;
  Reader reader{root, "", problems, {}};
  config.visit(reader);
  reader.report_unknown_keys();
  // Hand-tuned setups give micro_batch_size x gradient_accumulation_steps; without batch_size, that is the batch.
  const auto& training = root.contains("training") && root["training"].is_object() ? root["training"] : json::object();
  if (!training.contains("batch_size") && !config.training.micro_batch_size.is_auto &&
      config.training.gradient_accumulation_steps > 0)
    config.training.batch_size = config.training.micro_batch_size.value * config.training.gradient_accumulation_steps;
  for (auto& p : validate(config)) problems.push_back(std::move(p));

  // Name the --set that introduced a value, so the user knows which of file and command line to fix.
  for (auto& p : problems)
    if (auto it = origin.find(p.where); it != origin.end()) p.where = it->second + " (" + p.where + ")";
  if (!problems.empty()) throw ConfigError(source, std::move(problems));
  return config;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream file(path, std::ios::binary);
  if (!file)
    throw UsageError("cannot open the config file " + path, "check the path; the shipped configs are in configs/");
  std::stringstream text;
  text << file.rdbuf();
  return parse_config(text.str(), path, overrides);
}

std::string config_to_json(const Config& config, int indent) {
  ordered_json root = ordered_json::object();
  Writer writer{root};
  const_cast<Config&>(config).visit(writer);  // Writer only reads the fields
  return root.dump(indent);
}

std::string format_config_table(const Config& config, const std::string& source,
                                const std::vector<std::string>& overrides) {
  const ordered_json current = ordered_json::parse(config_to_json(config));
  const ordered_json defaults = ordered_json::parse(config_to_json(Config{}));
  // Long values (prompt lists) are shortened in the table; the JSON saved with checkpoints has them whole.
  auto show = [](const ordered_json& v) {
    std::string text = v.is_string() ? v.get<std::string>() : v.dump();
    if (text.size() > 60) text = text.substr(0, 57) + "...";
    return text;
  };
  // Where a changed value came from: the last --set of its key, else the file (which may also derive it).
  auto origin = [&](const std::string& path) {
    for (auto it = overrides.rbegin(); it != overrides.rend(); ++it)
      if (it->starts_with(path + "=")) return std::string("--set");
    return source.empty() ? std::string("the file") : source;
  };
  struct Row {
    std::string key, value, default_value, from;
  };
  std::vector<Row> rows;
  for (const auto& key : schema().keys) {
    const auto dot = key.path.find('.');
    const auto section = key.path.substr(0, dot), name = key.path.substr(dot + 1);
    const auto& v = current[section][name];
    const auto& d = defaults[section][name];
    if (v != d) rows.push_back({key.path, show(v), show(d), origin(key.path)});
  }
  if (rows.empty()) return "(every key at its default)\n";
  Row widths{"key", "value", "default", "from"};
  std::size_t w[3] = {widths.key.size(), widths.value.size(), widths.default_value.size()};
  for (const auto& r : rows) {
    w[0] = std::max(w[0], r.key.size());
    w[1] = std::max(w[1], r.value.size());
    w[2] = std::max(w[2], r.default_value.size());
  }
  auto pad = [](std::string s, std::size_t width) {
    if (s.size() < width) s.append(width - s.size(), ' ');
    return s;
  };
  std::ostringstream out;
  auto line = [&](const Row& r) {
    out << pad(r.key, w[0]) << "  " << pad(r.value, w[1]) << "  " << pad(r.default_value, w[2]) << "  " << r.from
        << "\n";
  };
  line(widths);
  line({std::string(w[0], '-'), std::string(w[1], '-'), std::string(w[2], '-'), "----"});
  for (const auto& r : rows) line(r);
  return out.str();
}

}  // namespace trainer
