// TensorBoard event files (see tensorboard.h). Field numbers are those of tensorboard/compat/proto/event.proto,
// summary.proto and tensor.proto; proto3 wire format: varints, fixed 32/64-bit little-endian values and
// length-delimited bytes, each after a key of (field number << 3 | wire type).
#include "log/tensorboard.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <chrono>
#include <cstring>

#include <spdlog/spdlog.h>

#include "trainer/errors.h"

namespace trainer {
namespace {

// ---- CRC-32C --------------------------------------------------------------------------------------------------

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;
constexpr uint32_t kCrcMaskDelta = 0xA282EAD8u;

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) ? (crc >> 1) ^ kCastagnoliReflected : crc >> 1;
    table[i] = crc;
  }
  return table;
}
constexpr auto kCrcTable = make_crc_table();

// ---- protobuf wire format -------------------------------------------------------------------------------------

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (uint64_t{field} << 3) | type); }

void put_little_endian(std::string& out, uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

void put_double(std::string& out, uint32_t field, double value) {
  put_key(out, field, kFixed64);
  put_little_endian(out, std::bit_cast<uint64_t>(value), 8);
}

void put_float(std::string& out, uint32_t field, float value) {
  put_key(out, field, kFixed32);
  put_little_endian(out, std::bit_cast<uint32_t>(value), 4);
}

void put_int(std::string& out, uint32_t field, int64_t value) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(value));  // int64: negative numbers take ten bytes, as protobuf does
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event fields.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5, kEventSessionLog = 7;
// Summary.value, and Summary.Value fields.
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2, kValueTensor = 8, kValueMetadata = 9;
// SummaryMetadata.plugin_data, PluginData.plugin_name; SessionLog.status (START = 1).
constexpr uint32_t kMetadataPluginData = 1, kPluginName = 1, kSessionLogStatus = 1;
constexpr int64_t kSessionStart = 1;
// TensorProto fields and DataType DT_STRING.
constexpr uint32_t kTensorDtype = 1, kTensorShape = 2, kTensorStringVal = 8;
constexpr int64_t kDtString = 7;

std::string event_head(double wall_time, int64_t step) {
  std::string event;
  put_double(event, kEventWallTime, wall_time);
  put_int(event, kEventStep, step);
  return event;
}

std::string summary_event(double wall_time, int64_t step, const std::string& summary) {
  auto event = event_head(wall_time, step);
  put_bytes(event, kEventSummary, summary);
  return event;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : data) crc = kCrcTable[(crc ^ static_cast<uint8_t>(c)) & 0xff] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + kCrcMaskDelta;
}

std::string tfrecord(std::string_view payload) {
  std::string record;
  put_little_endian(record, payload.size(), 8);
  put_little_endian(record, masked_crc32c(record), 4);
  record.append(payload);
  put_little_endian(record, masked_crc32c(payload), 4);
  return record;
}

std::string file_version_event(double wall_time) {
  auto event = event_head(wall_time, 0);
  put_bytes(event, kEventFileVersion, "brain.Event:2");
  return event;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string session_log;
  put_int(session_log, kSessionLogStatus, kSessionStart);
  auto event = event_head(wall_time, step);
  put_bytes(event, kEventSessionLog, session_log);
  return event;
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, kValueTag, tag);
    put_float(v, kValueSimpleValue, value);
    put_bytes(summary, kSummaryValue, v);
  }
  return summary_event(wall_time, step, summary);
}

std::string text_event(double wall_time, int64_t step, std::string_view tag, std::string_view text) {
  std::string plugin_data, metadata, tensor, value, summary;
  put_bytes(plugin_data, kPluginName, "text");  // content left empty: TextPluginData version 0
  put_bytes(metadata, kMetadataPluginData, plugin_data);
  put_int(tensor, kTensorDtype, kDtString);
  put_bytes(tensor, kTensorShape, "");  // rank 0: a scalar string
  put_bytes(tensor, kTensorStringVal, text);
  put_bytes(value, kValueTag, tag);
  put_bytes(value, kValueMetadata, metadata);
  put_bytes(value, kValueTensor, tensor);
  put_bytes(summary, kSummaryValue, value);
  return summary_event(wall_time, step, summary);
}

EventFileWriter::EventFileWriter(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = now_seconds();
  path_ = dir / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host + "." +
                 std::to_string(getpid()));
  file_ = std::fopen(path_.c_str(), "ab");
  if (!file_)
    throw DataError("cannot write the TensorBoard event file " + path_.string() + ": " + std::strerror(errno),
                    "make checkpoint.output_dir writable, or set logging.tensorboard=false");
  write(file_version_event(now));
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::session_start(int64_t step) { write(session_start_event(now_seconds(), step)); }

void EventFileWriter::scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  write(scalars_event(now_seconds(), step, values));
}

void EventFileWriter::text(int64_t step, std::string_view tag, std::string_view text) {
  write(text_event(now_seconds(), step, tag, text));
}

void EventFileWriter::write(const std::string& event) {
  const auto record = tfrecord(event);
  const bool written = std::fwrite(record.data(), 1, record.size(), file_) == record.size();
  if ((std::fflush(file_) != 0 || !written) && !warned_) {  // a full disk must not stop training
    spdlog::warn("TensorBoard: cannot write {} ({}); later events may be missing", path_.string(), std::strerror(errno));
    warned_ = true;
  }
}

}  // namespace trainer
