// AdamW with blockwise 8-bit moments, stepping exactly as bitsandbytes 0.50.2's optim.AdamW8bit does on CPU
// tensors (fp32 parameters), with a byte format for its state so a resumed run continues bit for bit.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace trainer::quant {

// Mirrors AdamW8bit's constructor arguments (Python floats, hence double) and their defaults.
struct AdamW8bitConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t min_8bit_size = 4096;  // tensors with fewer elements keep fp32 moments
};

// One parameter's optimizer state: 8-bit codes with per-256 absmax, or plain fp32 moments for small tensors.
struct AdamW8bitState {
  static constexpr int64_t kBlocksize = 256;  // bitsandbytes' BLOCKSIZE_2STATE on the CPU
  int64_t numel = 0;
  int64_t step = 0;
  bool is_8bit = false;
  std::vector<uint8_t> state1;  // first moment, signed dynamic map
  std::vector<uint8_t> state2;  // second moment, unsigned dynamic map
  std::vector<float> absmax1;
  std::vector<float> absmax2;
  std::vector<float> state1_fp32;  // used when !is_8bit
  std::vector<float> state2_fp32;
};

AdamW8bitState make_adamw8bit_state(int64_t numel, const AdamW8bitConfig& config);

// One optimizer step for one fp32 parameter in place, in bitsandbytes' order (step count first).
void adamw8bit_step(const AdamW8bitConfig& config, AdamW8bitState& state, std::span<float> param,
                    std::span<const float> grad);

// The moments as bitsandbytes would dequantize them (for inspection and tests).
std::vector<float> adamw8bit_moment(const AdamW8bitState& state, int which);

std::vector<uint8_t> serialize_adamw8bit_state(const AdamW8bitState& state);
AdamW8bitState deserialize_adamw8bit_state(std::span<const uint8_t> bytes);

}  // namespace trainer::quant
