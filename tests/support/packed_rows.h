// Segment and position ids of packed rows, as collate_packed makes them, for attention tests.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace trainer::test {

// Segment ids (B, T) numbering each row's segments from 1 (0: padding) and position ids restarting at 0 per
// segment, for rows holding segments of the given lengths, padded to T; on `device`.
inline std::pair<at::Tensor, at::Tensor> packed_rows(const std::vector<std::vector<int64_t>>& rows, int64_t t,
                                                     c10::Device device = c10::Device(c10::kCPU)) {
  at::Tensor segments = at::zeros({static_cast<int64_t>(rows.size()), t}, at::kLong);
  at::Tensor positions = at::zeros_like(segments);
  for (std::size_t b = 0; b < rows.size(); ++b) {
    int64_t at_position = 0, id = 1;
    for (const int64_t length : rows[b]) {
      for (int64_t j = 0; j < length; ++j, ++at_position) {
        segments[static_cast<int64_t>(b)][at_position] = id;
        positions[static_cast<int64_t>(b)][at_position] = j;
      }
      ++id;
    }
  }
  return {segments.to(device), positions.to(device)};
}

}  // namespace trainer::test
