// Precompiled header: the heavy, stable headers most translation units need (STYLE.md 9).
// Only third-party and standard headers belong here; our own headers change too often.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
