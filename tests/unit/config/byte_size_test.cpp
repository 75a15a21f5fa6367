#include <stdexcept>

#include <gtest/gtest.h>

#include "trainer/config.h"

namespace trainer {

TEST(ByteSize, ParsesBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_byte_size("24GiB").bytes, 24ull << 30);
  EXPECT_EQ(parse_byte_size("512MiB").bytes, 512ull << 20);
  EXPECT_EQ(parse_byte_size("5GB").bytes, 5'000'000'000ull);
  EXPECT_EQ(parse_byte_size("1.5GiB").bytes, 3ull << 29);
  EXPECT_EQ(parse_byte_size("100").bytes, 100ull);
  EXPECT_EQ(parse_byte_size(" 2 KiB ").bytes, 2048ull);
}

TEST(ByteSize, RejectsWhatIsNotASize) {
  EXPECT_THROW(parse_byte_size("24 gigs"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("GiB"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("1.2.3GB"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("-1GB"), std::invalid_argument);
  try {
    parse_byte_size("4Gb");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("GiB"), std::string::npos) << "the message lists the units";
  }
}

TEST(ByteSize, FormatsExactlyAndRoundTrips) {
  for (const char* text : {"24GiB", "512MiB", "5GB", "1536B", "3KiB", "7TB"})
    EXPECT_EQ(format_byte_size(parse_byte_size(text)), text);
  EXPECT_EQ(format_byte_size({0}), "0");
  EXPECT_EQ(human_bytes(1536.0 * 1024 * 1024), "1.50 GiB");
  EXPECT_EQ(human_bytes(12), "12 B");
}

}  // namespace trainer
