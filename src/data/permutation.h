// A seeded permutation of [0, n) computed on demand (a Feistel network with cycle walking), so a shuffled
// epoch over millions of records costs no memory: position k of the epoch is permutation(k), and a resumed
// run computes the same order from the seed alone.
#pragma once

#include <cstdint>

namespace trainer::data {

// splitmix64's finaliser: a well-mixed 64-bit hash, used for seeds and the Feistel rounds.
inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
  return mix64(mix64(mix64(a) ^ b) ^ c);
}

class Permutation {
 public:
  Permutation() = default;
  Permutation(std::uint64_t n, std::uint64_t key) : n_(n), key_(key) {
    // The network permutes [0, 4^half); cycle walking maps it onto [0, n) in fewer than 4 steps on average.
    while ((std::uint64_t{1} << (2 * half_bits_)) < n_) ++half_bits_;
    mask_ = (std::uint64_t{1} << half_bits_) - 1;
  }
  std::uint64_t size() const { return n_; }

  std::uint64_t operator()(std::uint64_t i) const {
    do i = encrypt(i);
    while (i >= n_);
    return i;
  }
  std::uint64_t inverse(std::uint64_t i) const {
    do i = decrypt(i);
    while (i >= n_);
    return i;
  }

 private:
  static constexpr int kRounds = 6;
  std::uint64_t round(std::uint64_t half, int r) const {
    return mix64(half ^ key_ ^ (static_cast<std::uint64_t>(r + 1) * 0xD6E8FEB86659FD93ull)) & mask_;
  }
  std::uint64_t encrypt(std::uint64_t x) const {
    std::uint64_t left = x >> half_bits_, right = x & mask_;
    for (int r = 0; r < kRounds; ++r) {
      const std::uint64_t next = left ^ round(right, r);
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }
  std::uint64_t decrypt(std::uint64_t x) const {
    std::uint64_t left = x >> half_bits_, right = x & mask_;
    for (int r = kRounds - 1; r >= 0; --r) {
      const std::uint64_t previous = right ^ round(left, r);
      right = left;
      left = previous;
    }
    return (left << half_bits_) | right;
  }

  std::uint64_t n_ = 0;
  std::uint64_t key_ = 0;
  int half_bits_ = 1;
  std::uint64_t mask_ = 1;
};

}  // namespace trainer::data
