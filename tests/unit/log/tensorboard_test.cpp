// TensorBoard event files: CRC-32C, TFRecord framing and the hand-encoded Event bytes, checked against values
// worked out from the specifications (the parity test then reads real files with the tensorboard package).
#include "log/tensorboard.h"

#include <bit>
#include <cstring>

#include <gtest/gtest.h>

#include "support/temp_dir.h"

namespace trainer {
namespace {

uint64_t read_le(const std::string& bytes, std::size_t at, int n) {
  uint64_t value = 0;
  for (int i = 0; i < n; ++i) value |= uint64_t{static_cast<uint8_t>(bytes[at + static_cast<std::size_t>(i)])} << (8 * i);
  return value;
}

std::string le(uint64_t value, int n) {
  std::string bytes;
  for (int i = 0; i < n; ++i) bytes.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return bytes;
}

}  // namespace

TEST(LogTensorboard, Crc32cKnownVectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the CRC catalogue's check value for CRC-32C
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);  // and of 0xff
}

TEST(LogTensorboard, MaskedCrcRotatesAndAddsTheConstant) {
  const uint32_t crc = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xA282EAD8u);
}

TEST(LogTensorboard, TfrecordFraming) {
  const std::string payload = "hello, events";
  const auto record = tfrecord(payload);
  ASSERT_EQ(record.size(), 8 + 4 + payload.size() + 4);
  EXPECT_EQ(read_le(record, 0, 8), payload.size());
  EXPECT_EQ(read_le(record, 8, 4), masked_crc32c(record.substr(0, 8)));
  EXPECT_EQ(record.substr(12, payload.size()), payload);
  EXPECT_EQ(read_le(record, 12 + payload.size(), 4), masked_crc32c(payload));
  // An empty payload is still a record.
  EXPECT_EQ(tfrecord("").size(), 16u);
}

TEST(LogTensorboard, ScalarEventBytes) {
  // Event{wall_time=1.5, step=300, summary{value{tag="a", simple_value=1.0}}}; 300 is the varint AC 02.
  const auto event = scalars_event(1.5, 300, {{"a", 1.0f}});
  const std::string value = std::string("\x0a\x01" "a" "\x15", 4) + le(std::bit_cast<uint32_t>(1.0f), 4);
  const std::string summary = "\x0a" + std::string(1, static_cast<char>(value.size())) + value;
  const std::string expected = "\x09" + le(std::bit_cast<uint64_t>(1.5), 8) + "\x10\xac\x02" + "\x2a" +
                               std::string(1, static_cast<char>(summary.size())) + summary;
  EXPECT_EQ(event, expected);
}

TEST(LogTensorboard, FileVersionAndSessionStartEvents) {
  const auto version = file_version_event(2.0);
  const std::string tail = std::string("\x10\x00\x1a\x0d", 4) + "brain.Event:2";
  EXPECT_EQ(version, "\x09" + le(std::bit_cast<uint64_t>(2.0), 8) + tail);
  const auto start = session_start_event(2.0, 7);  // session_log (7) {status (1) = START (1)}
  EXPECT_EQ(start, "\x09" + le(std::bit_cast<uint64_t>(2.0), 8) + std::string("\x10\x07\x3a\x02\x08\x01", 6));
}

TEST(LogTensorboard, TextEventCarriesTheTextPluginAndAStringTensor) {
  const auto event = text_event(0.0, 1, "samples/0", "hi");
  // Value: tag, metadata{plugin_data{plugin_name "text"}}, tensor{dtype DT_STRING (7), shape {}, string_val "hi"}.
  const std::string metadata = std::string("\x4a\x08\x0a\x06\x0a\x04", 6) + "text";
  const std::string tensor = std::string("\x42\x08\x08\x07\x12\x00\x42\x02", 8) + "hi";
  EXPECT_NE(event.find(metadata), std::string::npos);
  EXPECT_NE(event.find(tensor), std::string::npos);
  EXPECT_NE(event.find("\x0a\x09samples/0"), std::string::npos);
}

TEST(LogTensorboard, WriterFramesEveryEventStartingWithTheFileVersion) {
  test::TempDir dir;
  std::filesystem::path path;
  {
    EventFileWriter writer(dir.path() / "tb");
    path = writer.path();
    EXPECT_TRUE(path.filename().string().starts_with("events.out.tfevents.")) << path;
    writer.scalars(1, {{"train/loss", 2.5f}});
    // Flushed at once: a running TensorBoard sees it before the writer closes.
    const auto bytes = test::read_file(path.string());
    std::size_t at = 0;
    std::vector<std::string> events;
    while (at < bytes.size()) {
      const auto length = read_le(bytes, at, 8);
      ASSERT_EQ(read_le(bytes, at + 8, 4), masked_crc32c(bytes.substr(at, 8)));
      const auto payload = bytes.substr(at + 12, length);
      ASSERT_EQ(read_le(bytes, at + 12 + length, 4), masked_crc32c(payload));
      events.push_back(payload);
      at += 16 + length;
    }
    ASSERT_EQ(events.size(), 2u);
    EXPECT_NE(events[0].find("brain.Event:2"), std::string::npos);
    EXPECT_NE(events[1].find("train/loss"), std::string::npos);
  }
}

}  // namespace trainer
