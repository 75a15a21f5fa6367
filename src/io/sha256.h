// SHA-256 (FIPS 180-4), incremental: checks a downloaded LFS file against its etag without a crypto library.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace trainer::hub {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  // The digest as 64 lowercase hex digits; the object is spent afterwards.
  std::string hex_digest();

 private:
  void compress(const std::uint8_t* block);
  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t length_ = 0;  // bytes seen
};

}  // namespace trainer::hub
