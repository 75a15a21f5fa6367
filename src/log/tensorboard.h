// TensorBoard event files without TensorFlow or protobuf: TFRecord framing (length, masked CRC-32C of the length,
// payload, masked CRC-32C of the payload) around hand-encoded `tensorboard.Event` messages (event.proto,
// summary.proto, tensor.proto). Scalars and text; what `tensorboard --logdir` and `wandb sync` read.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainer {

// CRC-32C (Castagnoli), as TFRecord uses it: crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view data);
// TFRecord stores CRCs rotated right by 15 bits plus a constant, so a CRC of data containing CRCs stays useful.
uint32_t masked_crc32c(std::string_view data);

// One TFRecord: uint64 length (little-endian), masked CRC of those 8 bytes, the payload, masked CRC of the payload.
std::string tfrecord(std::string_view payload);

// Serialised Event messages.
std::string file_version_event(double wall_time);  // the first record of every file: "brain.Event:2"
// SessionLog START at `step`: TensorBoard drops what an earlier, interrupted run wrote at `step` and later, so a
// resumed run's curves continue without a tangle.
std::string session_start_event(double wall_time, int64_t step);
std::string scalars_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);
// A string scalar for the text plugin (rendered as Markdown).
std::string text_event(double wall_time, int64_t step, std::string_view tag, std::string_view text);

// An events.out.tfevents.* file in `dir`; every write is flushed, so a running TensorBoard sees it at once.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::filesystem::path& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  void session_start(int64_t step);
  void scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values);
  void text(int64_t step, std::string_view tag, std::string_view text);
  const std::filesystem::path& path() const { return path_; }

 private:
  void write(const std::string& event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  bool warned_ = false;
};

}  // namespace trainer
