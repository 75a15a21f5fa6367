// Reading a run's output_dir/metrics.jsonl in tests.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace trainer::test {

// The values of `key` ("loss", "eval_loss", ...) in the order of the records that have it.
inline std::vector<double> metric_values(const std::filesystem::path& metrics_jsonl, const std::string& key) {
  std::vector<double> values;
  std::ifstream file(metrics_jsonl);
  for (std::string line; std::getline(file, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains(key)) values.push_back(record[key].get<double>());
  }
  return values;
}

}  // namespace trainer::test
