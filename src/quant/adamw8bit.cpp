// bitsandbytes' AdamW8bit transcribed from 0.50.2: optim/optimizer.py
// (Optimizer2State.init_state/update_step) and backends/cpu/ops.py (_optimizer_update_8bit_blockwise_cpu,
// _optimizer_update_32bit_cpu), op for op in fp32.
#include "quant/adamw8bit.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "quant/blockwise.h"

namespace trainer::quant {

namespace {

const std::vector<float>& signed_map() {
  static const std::vector<float> map = create_dynamic_map(true);
  return map;
}

const std::vector<float>& unsigned_map() {
  static const std::vector<float> map = create_dynamic_map(false);
  return map;
}

// torch's addcmul_ on the CPU computes self + value * t1 * t2; ATen's AVX2 build contracts the last multiply
// and the add into one fused multiply-add (checked against bitsandbytes by the parity test).
float addcmul(float self, float value, float t1, float t2) {
  return std::fma(value * t1, t2, self);
}

// torch's add_(other, alpha) is a fused multiply-add in ATen's vectorized kernel.
float add_scaled(float self, float other, float alpha) {
  return std::fma(other, alpha, self);
}

void check_sizes(const AdamW8bitState& state, std::span<float> param, std::span<const float> grad) {
  if (static_cast<int64_t>(param.size()) != state.numel || static_cast<int64_t>(grad.size()) != state.numel) {
    throw std::invalid_argument("adamw8bit_step: parameter has " + std::to_string(param.size()) +
                                " elements and gradient " + std::to_string(grad.size()) +
                                ", state was made for " + std::to_string(state.numel) +
                                "; hint: one state per parameter, in order");
  }
}

void step_8bit(const AdamW8bitConfig& config, AdamW8bitState& state, std::span<float> param,
               std::span<const float> grad) {
  const auto n = static_cast<size_t>(state.numel);
  std::vector<float> m(n);
  std::vector<float> v(n);
  dequantize_blockwise_8bit(state.state1, state.absmax1, signed_map(), AdamW8bitState::kBlocksize, m);
  dequantize_blockwise_8bit(state.state2, state.absmax2, unsigned_map(), AdamW8bitState::kBlocksize, v);
  const auto beta1 = static_cast<float>(config.beta1);
  const auto beta2 = static_cast<float>(config.beta2);
  const auto one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  const auto one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  // Python computes the corrections in double; each reaches the kernel as an fp32 scalar.
  const double correction1 = 1.0 - std::pow(config.beta1, static_cast<double>(state.step));
  const double correction2 = std::sqrt(1.0 - std::pow(config.beta2, static_cast<double>(state.step)));
  const auto correction2_f = static_cast<float>(correction2);
  const auto eps = static_cast<float>(config.eps);
  const auto decay = static_cast<float>(1.0 - config.lr * config.weight_decay);
  const auto step_value = static_cast<float>(-config.lr / correction1);
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i];
    m[i] = add_scaled(m[i] * beta1, g, one_minus_beta1);
    v[i] = addcmul(v[i] * beta2, one_minus_beta2, g, g);
    const float denom = std::sqrt(v[i]) / correction2_f + eps;
    float p = param[i];
    // Decoupled weight decay multiplies the weight before the Adam update, as the CPU kernel does.
    if (config.weight_decay > 0.0) p *= decay;
    param[i] = p + step_value * m[i] / denom;
  }
  quantize_blockwise_8bit(m, signed_map(), AdamW8bitState::kBlocksize, state.state1, state.absmax1);
  quantize_blockwise_8bit(v, unsigned_map(), AdamW8bitState::kBlocksize, state.state2, state.absmax2);
}

void step_32bit(const AdamW8bitConfig& config, AdamW8bitState& state, std::span<float> param,
                std::span<const float> grad) {
  const auto beta1 = static_cast<float>(config.beta1);
  const auto beta2 = static_cast<float>(config.beta2);
  const auto one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  const auto one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  const double correction1 = 1.0 - std::pow(config.beta1, static_cast<double>(state.step));
  const double correction2 = std::sqrt(1.0 - std::pow(config.beta2, static_cast<double>(state.step)));
  const auto step_size = static_cast<float>(-config.lr * correction2 / correction1);
  // The fp32 path puts eps inside the bias-corrected denominator: eps * correction2, not eps.
  const auto eps_scaled = static_cast<float>(config.eps * correction2);
  const auto decay = static_cast<float>(1.0 - config.lr * config.weight_decay);
  for (size_t i = 0; i < param.size(); ++i) {
    const float g = grad[i];
    float& m = state.state1_fp32[i];
    float& v = state.state2_fp32[i];
    m = add_scaled(m * beta1, g, one_minus_beta1);
    v = addcmul(v * beta2, one_minus_beta2, g, g);
    float p = param[i];
    if (config.weight_decay > 0.0) p *= decay;
    const float update = m / (std::sqrt(v) + eps_scaled);
    param[i] = add_scaled(p, update, step_size);
  }
}

// A small fixed header keeps the format self-describing; the arrays follow in declaration order.
constexpr char kMagic[8] = {'T', 'Q', 'A', 'W', '8', 'B', '0', '1'};

template <typename T>
void append(std::vector<uint8_t>& out, const T* data, size_t count) {
  const size_t offset = out.size();
  out.resize(offset + count * sizeof(T));
  if (count > 0) std::memcpy(out.data() + offset, data, count * sizeof(T));
}

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  template <typename T>
  void read(T* data, size_t count) {
    const size_t size = count * sizeof(T);
    if (offset_ + size > bytes_.size()) {
      throw std::runtime_error("AdamW8bit state is truncated at byte " + std::to_string(offset_) +
                               "; hint: the checkpoint file is incomplete or from another format");
    }
    std::memcpy(data, bytes_.data() + offset_, size);
    offset_ += size;
  }
  bool at_end() const { return offset_ == bytes_.size(); }

 private:
  std::span<const uint8_t> bytes_;
  size_t offset_ = 0;
};

}  // namespace

AdamW8bitState make_adamw8bit_state(int64_t numel, const AdamW8bitConfig& config) {
  if (numel <= 0) throw std::invalid_argument("AdamW8bit state for an empty parameter");
  AdamW8bitState state;
  state.numel = numel;
  state.is_8bit = numel >= config.min_8bit_size;
  const auto n = static_cast<size_t>(numel);
  if (state.is_8bit) {
    const auto blocks =
        static_cast<size_t>((numel + AdamW8bitState::kBlocksize - 1) / AdamW8bitState::kBlocksize);
    // Zero codes with zero absmax dequantize to 0, as bitsandbytes' fresh uint8 buffers do.
    state.state1.assign(n, 0);
    state.state2.assign(n, 0);
    state.absmax1.assign(blocks, 0.0f);
    state.absmax2.assign(blocks, 0.0f);
  } else {
    state.state1_fp32.assign(n, 0.0f);
    state.state2_fp32.assign(n, 0.0f);
  }
  return state;
}

void adamw8bit_step(const AdamW8bitConfig& config, AdamW8bitState& state, std::span<float> param,
                    std::span<const float> grad) {
  check_sizes(state, param, grad);
  state.step += 1;
  if (state.is_8bit) {
    step_8bit(config, state, param, grad);
  } else {
    step_32bit(config, state, param, grad);
  }
}

std::vector<float> adamw8bit_moment(const AdamW8bitState& state, int which) {
  if (!state.is_8bit) return which == 1 ? state.state1_fp32 : state.state2_fp32;
  std::vector<float> out(static_cast<size_t>(state.numel));
  if (which == 1) {
    dequantize_blockwise_8bit(state.state1, state.absmax1, signed_map(), AdamW8bitState::kBlocksize, out);
  } else {
    dequantize_blockwise_8bit(state.state2, state.absmax2, unsigned_map(), AdamW8bitState::kBlocksize, out);
  }
  return out;
}

std::vector<uint8_t> serialize_adamw8bit_state(const AdamW8bitState& state) {
  std::vector<uint8_t> out;
  // Reserved up front: one allocation for the whole state.
  const size_t n = static_cast<size_t>(state.numel);
  const size_t blocks = state.absmax1.size();
  out.reserve(sizeof(kMagic) + 2 * sizeof(int64_t) + 1 +
              (state.is_8bit ? 2 * n + 2 * blocks * sizeof(float) : 2 * n * sizeof(float)));
  append(out, kMagic, sizeof(kMagic));
  append(out, &state.numel, 1);
  append(out, &state.step, 1);
  const uint8_t is_8bit = state.is_8bit ? 1 : 0;
  append(out, &is_8bit, 1);
  if (state.is_8bit) {
    append(out, state.state1.data(), state.state1.size());
    append(out, state.state2.data(), state.state2.size());
    append(out, state.absmax1.data(), state.absmax1.size());
    append(out, state.absmax2.data(), state.absmax2.size());
  } else {
    append(out, state.state1_fp32.data(), state.state1_fp32.size());
    append(out, state.state2_fp32.data(), state.state2_fp32.size());
  }
  return out;
}

AdamW8bitState deserialize_adamw8bit_state(std::span<const uint8_t> bytes) {
  Reader reader(bytes);
  char magic[8];
  reader.read(magic, sizeof(magic));
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    throw std::runtime_error(
        "not an AdamW8bit state (bad magic); hint: the optimizer state was written by "
        "another optimizer or another format version");
  }
  AdamW8bitState state;
  uint8_t is_8bit = 0;
  reader.read(&state.numel, 1);
  reader.read(&state.step, 1);
  reader.read(&is_8bit, 1);
  if (state.numel <= 0 || state.step < 0 || is_8bit > 1) {
    throw std::runtime_error("AdamW8bit state header is invalid (numel " + std::to_string(state.numel) +
                             ", step " + std::to_string(state.step) + ")");
  }
  state.is_8bit = is_8bit == 1;
  const auto n = static_cast<size_t>(state.numel);
  if (state.is_8bit) {
    const auto blocks =
        static_cast<size_t>((state.numel + AdamW8bitState::kBlocksize - 1) / AdamW8bitState::kBlocksize);
    state.state1.resize(n);
    state.state2.resize(n);
    state.absmax1.resize(blocks);
    state.absmax2.resize(blocks);
    reader.read(state.state1.data(), n);
    reader.read(state.state2.data(), n);
    reader.read(state.absmax1.data(), blocks);
    reader.read(state.absmax2.data(), blocks);
  } else {
    state.state1_fp32.resize(n);
    state.state2_fp32.resize(n);
    reader.read(state.state1_fp32.data(), n);
    reader.read(state.state2_fp32.data(), n);
  }
  if (!reader.at_end()) {
    throw std::runtime_error("AdamW8bit state has trailing bytes; hint: the file holds more than one state");
  }
  return state;
}

}  // namespace trainer::quant
