// STAND-IN (see counter_rng.h).
#include "util/counter_rng.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace trainer {
namespace {
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

uint64_t counter_key(std::initializer_list<uint64_t> parts) {
  uint64_t k = 0x9e3779b97f4a7c15ULL;
  for (uint64_t p : parts) k = mix(k + 0x9e3779b97f4a7c15ULL + p);
  return k;
}

uint32_t counter_bits(uint64_t key, uint64_t counter) { return static_cast<uint32_t>(mix(mix(key ^ counter) + key) >> 32); }

at::Tensor counter_bits(uint64_t key, const at::Tensor& counters) {
  at::Tensor c = counters.to(at::kCPU).to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(c);
  const int64_t* in = c.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i) o[i] = counter_bits(key, static_cast<uint64_t>(in[i]));
  return out.to(counters.device());
}

at::Tensor counter_keep_mask(uint64_t key, const at::Tensor& row_base, at::IntArrayRef sizes, at::IntArrayRef strides,
                             double p) {
  TORCH_CHECK(static_cast<int64_t>(strides.size()) + 1 == static_cast<int64_t>(sizes.size()));
  const at::Tensor base = row_base.to(at::kCPU).to(at::kLong).contiguous();
  at::Tensor mask = at::empty(sizes, at::TensorOptions().dtype(at::kBool));
  bool* m = mask.data_ptr<bool>();
  const int64_t* b = base.data_ptr<int64_t>();
  const int64_t per_row = mask.numel() / std::max<int64_t>(1, sizes[0]);
  const uint64_t threshold = static_cast<uint64_t>(p * 4294967296.0);
  const std::vector<int64_t> sz(sizes.begin() + 1, sizes.end()), st(strides.begin(), strides.end());
  at::parallel_for(0, mask.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / per_row;
      int64_t rest = i % per_row, counter = b[r];
      for (int64_t d = static_cast<int64_t>(sz.size()) - 1; d >= 0; --d) {
        counter += (rest % sz[static_cast<std::size_t>(d)]) * st[static_cast<std::size_t>(d)];
        rest /= sz[static_cast<std::size_t>(d)];
      }
      m[i] = counter_bits(key, static_cast<uint64_t>(counter)) >= threshold;
    }
  });
  return mask.to(row_base.device());
}

}  // namespace trainer
