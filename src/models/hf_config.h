// Typed reads of a transformers config.json, with errors that name the key.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "trainer/errors.h"

namespace trainer::hf {

inline const nlohmann::json* find(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  return (it == config.end() || it->is_null()) ? nullptr : &*it;
}

inline int64_t get_int(const nlohmann::json& config, const char* key, std::optional<int64_t> fallback = {}) {
  if (const auto* v = find(config, key)) {
    if (!v->is_number_integer()) throw DataError(std::string("config.json: \"") + key + "\" must be an integer");
    return v->get<int64_t>();
  }
  if (fallback) return *fallback;
  throw DataError(std::string("config.json: \"") + key + "\" is missing", "is this the config.json of the model?");
}

inline std::optional<int64_t> get_optional_int(const nlohmann::json& config, const char* key) {
  if (!find(config, key)) return std::nullopt;
  return get_int(config, key);
}

inline double get_double(const nlohmann::json& config, const char* key, std::optional<double> fallback = {}) {
  if (const auto* v = find(config, key)) {
    if (!v->is_number()) throw DataError(std::string("config.json: \"") + key + "\" must be a number");
    return v->get<double>();
  }
  if (fallback) return *fallback;
  throw DataError(std::string("config.json: \"") + key + "\" is missing", "is this the config.json of the model?");
}

inline bool get_bool(const nlohmann::json& config, const char* key, bool fallback) {
  if (const auto* v = find(config, key)) {
    if (!v->is_boolean()) throw DataError(std::string("config.json: \"") + key + "\" must be true or false");
    return v->get<bool>();
  }
  return fallback;
}

inline std::string get_string(const nlohmann::json& config, const char* key, const std::string& fallback) {
  if (const auto* v = find(config, key)) {
    if (!v->is_string()) throw DataError(std::string("config.json: \"") + key + "\" must be a string");
    return v->get<std::string>();
  }
  return fallback;
}

// eos_token_id may be an integer or a list (the first is used to stop).
inline std::optional<int64_t> get_eos(const nlohmann::json& config) {
  const auto* v = find(config, "eos_token_id");
  if (!v) return std::nullopt;
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_array() && !v->empty() && (*v)[0].is_number_integer()) return (*v)[0].get<int64_t>();
  return std::nullopt;
}

}  // namespace trainer::hf
