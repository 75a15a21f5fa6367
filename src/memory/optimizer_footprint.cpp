// What an optimizer's state costs (see optimizer_footprint.h).
#include "memory/optimizer_footprint.h"

#include <algorithm>

namespace trainer {

bool adamw_uses_fused_kernel(const OptimizerConfig& config, bool bf16_trainable_parameters) {
  return config.name == OptimizerName::kAdamW && config.state_dtype == StateDtype::kFp32 && !bf16_trainable_parameters;
}

int64_t optimizer_state_bytes(const OptimizerConfig& config, c10::IntArrayRef sizes, bool bf16_param) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  int64_t bytes = 0;
  if (config.name == OptimizerName::kAdafactor) {
    if (sizes.size() >= 2) {
      const int64_t cols = sizes.back(), rows = sizes[sizes.size() - 2];
      const int64_t matrices = rows * cols == 0 ? 0 : numel / (rows * cols);
      bytes += 4 * matrices * (rows + cols);
    } else {
      bytes += 4 * numel;
    }
    if (config.adafactor_beta1) bytes += 4 * numel;
  } else if (config.state_dtype == StateDtype::kInt8) {
    // bitsandbytes' AdamW8bit: two uint8 codes and, per 256 elements, two fp32 absmax; fp32 moments below 4096
    // elements (min_8bit_size); plus the step count (int64).
    bytes += numel >= kInt8MinSize ? 2 * numel + 8 * ((numel + kInt8Block - 1) / kInt8Block) : 8 * numel;
    bytes += 8;
  } else {
    bytes += 2 * numel * (config.state_dtype == StateDtype::kBf16 ? 2 : 4);
  }
  if (bf16_param && config.bf16_update == Bf16Update::kKahan) bytes += 2 * numel;
  return bytes;
}

std::vector<int> shard_owners(const std::vector<int64_t>& numels, int world) {
  std::vector<int> owners(numels.size(), 0);
  if (world <= 1) return owners;
  std::vector<std::size_t> order(numels.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<std::size_t>(world), 0);
  for (const std::size_t i : order) {
    const auto least = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[i] = static_cast<int>(least);
    load[least] += numels[i];
  }
  return owners;
}

}  // namespace trainer
