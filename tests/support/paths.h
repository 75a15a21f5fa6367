// Paths of the source tree and the built binary, for tests.
#pragma once

#include <string>

namespace trainer::test {

inline std::string source_path(const std::string& relative) { return std::string(TRAINER_SOURCE_DIR) + "/" + relative; }
inline std::string trainer_binary() { return TRAINER_BINARY; }

}  // namespace trainer::test
