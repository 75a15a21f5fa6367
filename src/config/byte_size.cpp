// Byte sizes as people write them: "24GiB", "512MiB", "5GB", plain integers.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "trainer/config.h"

namespace trainer {
namespace {

struct Unit {
  const char* name;
  double factor;
};
// Longest names first so that "GiB" is not read as "G" + "iB".
constexpr Unit kUnits[] = {
    {"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0},
    {"TB", 1e12},             {"GB", 1e9},           {"MB", 1e6},        {"KB", 1e3},
    {"kB", 1e3},              {"B", 1.0},
};

}  // namespace

ByteSize parse_byte_size(const std::string& text) {
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const std::size_t number_begin = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(number_begin, i - number_begin);
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit = text.substr(i);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();

  if (number.empty() || number.find('.') != number.rfind('.'))
    throw std::invalid_argument("'" + text + "' is not a size; write it like \"24GiB\", \"512MiB\" or \"5GB\"");
  double factor = 0;
  if (unit.empty()) {
    factor = 1.0;
  } else {
    for (const auto& u : kUnits)
      if (unit == u.name) factor = u.factor;
  }
  if (factor == 0)
    throw std::invalid_argument("unknown unit '" + unit + "' in '" + text +
                                "'; use B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)");
  const double bytes = std::stod(number) * factor;
  if (bytes > 1.8e19) throw std::invalid_argument("'" + text + "' is too large");
  return ByteSize{static_cast<std::uint64_t>(std::llround(bytes))};
}

std::string format_byte_size(ByteSize size) {
  if (size.bytes == 0) return "0";
  // The largest unit that divides exactly: 24GiB stays 24GiB and 7TB stays 7TB.
  const Unit* best = nullptr;
  for (const auto& u : kUnits) {
    const auto factor = static_cast<std::uint64_t>(u.factor);
    if (size.bytes % factor == 0 && (!best || u.factor > best->factor)) best = &u;
  }
  if (best->factor == 1.0) return std::to_string(size.bytes) + "B";
  return std::to_string(size.bytes / static_cast<std::uint64_t>(best->factor)) + best->name;
}

std::string human_bytes(double bytes) {
  constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  double value = bytes;
  while (std::fabs(value) >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, unit == 0 ? "%.0f %s" : "%.2f %s", value, kNames[unit]);
  return buffer;
}

}  // namespace trainer
