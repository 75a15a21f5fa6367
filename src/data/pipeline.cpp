// Reader -> workers -> in-order consumer, with a bounded number of chunks in flight (see pipeline.h).
#include "data/pipeline.h"

#include <cstring>
#include <string_view>

#include "trainer/errors.h"

namespace trainer::data {
namespace {
// Records per chunk: large enough that locking is rare, small enough that the first batch comes quickly.
constexpr std::size_t kChunkRecords = 64;

// ---- what ranks exchange per chunk: 'O' and each of the sender's records' outcomes, or 'E' and its error ----

void put_u32(std::string& out, std::uint32_t value) { out.append(reinterpret_cast<const char*>(&value), sizeof value); }

void put_bytes(std::string& out, std::string_view bytes) {
  put_u32(out, static_cast<std::uint32_t>(bytes.size()));
  out.append(bytes);
}

void put_ids(std::string& out, const std::vector<std::int32_t>& ids) {
  put_u32(out, static_cast<std::uint32_t>(ids.size()));
  out.append(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(std::int32_t));
}

class Unpacker {
 public:
  Unpacker(std::string_view data, int rank) : data_(data), rank_(rank) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(take(1)[0]); }
  std::uint32_t u32() {
    std::uint32_t value = 0;
    std::memcpy(&value, take(sizeof value).data(), sizeof value);
    return value;
  }
  std::string bytes() { return std::string(take(u32())); }
  std::vector<std::int32_t> ids() {
    const std::uint32_t count = u32();
    const std::string_view raw = take(static_cast<std::size_t>(count) * sizeof(std::int32_t));
    std::vector<std::int32_t> out(count);
    std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }
  bool done() const { return pos_ == data_.size(); }

 private:
  std::string_view take(std::size_t n) {
    if (data_.size() - pos_ < n)  // a bug, not bad data: every rank runs this code on the same records
      throw Error("data parallelism: rank " + std::to_string(rank_) + "'s tokenized records arrived incomplete (" +
                  std::to_string(data_.size()) + " bytes)");
    const std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::string_view data_;
  std::size_t pos_ = 0;
  int rank_;
};

// Another rank's error, rethrown here with its exit code (every rank stops the same way).
class RankError : public Error {
 public:
  RankError(std::string message, std::string hint, ExitCode code)
      : Error(std::move(message), std::move(hint)), code_(code) {}
  ExitCode exit_code() const override { return code_; }

 private:
  ExitCode code_;
};

std::string error_payload(std::exception_ptr error) {
  std::string out = "E";
  ExitCode code = kExitFailure;
  std::string message = "an unknown exception", hint;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    code = e.exit_code();
    message = e.what();
    hint = e.hint();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {  // not a std::exception: still sent (as "an unknown exception"), so no rank waits for this one
  }
  put_u32(out, static_cast<std::uint32_t>(code));
  put_bytes(out, message);
  put_bytes(out, hint);
  return out;
}

}  // namespace

Pipeline::Pipeline(std::unique_ptr<RecordStream> stream, MapFunction map, int workers, RecordShare share,
                   MapRowFunction map_row)
    : stream_(std::move(stream)),
      map_(std::move(map)),
      map_row_(std::move(map_row)),
      workers_(workers),
      share_(std::move(share)),
      capacity_(static_cast<std::size_t>(4 * std::max(workers, 1))) {
  if (share_.world < 1 || share_.rank < 0 || share_.rank >= share_.world)
    throw Error("data parallelism: record share rank " + std::to_string(share_.rank) + " of " +
                std::to_string(share_.world));
  if (share_.world > 1 && !share_.exchange) throw Error("data parallelism: a record share without an exchange");
  if (workers_ == 0) return;
  threads_.emplace_back([this] { read_loop(); });
  for (int i = 0; i < workers_; ++i) threads_.emplace_back([this] { work_loop(); });
}

Pipeline::~Pipeline() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  room_ready_.notify_all();
  done_ready_.notify_all();
  for (auto& thread : threads_) thread.join();
}

int Pipeline::owner(std::uint64_t position) const {
  return static_cast<int>(position % static_cast<std::uint64_t>(share_.world));
}

void Pipeline::map_chunk(Chunk& chunk) const {
  chunk.mapped.resize(chunk.raw.size());
  for (std::size_t i = 0; i < chunk.raw.size(); ++i) {  // where every record is, mapped here or not
    const RawRecord& raw = chunk.raw[i];
    MappedRecord& mapped = chunk.mapped[i];
    mapped.slot = raw.slot;
    mapped.file = raw.file;
    mapped.offset = raw.offset;
    mapped.line = raw.line;
    mapped.mapped_here = owner(chunk.first + i) == share_.rank;
  }
  try {
    std::string scratch;  // a Parquet/Arrow row rendered here, on the worker
    for (std::size_t i = 0; i < chunk.raw.size(); ++i)
      if (chunk.mapped[i].mapped_here) {
        const RawRecord& raw = chunk.raw[i];
        chunk.mapped[i].outcome =
            raw.group && map_row_ ? map_row_(*raw.group, raw.group_row, scratch) : map_(raw.json(scratch));
      }
  } catch (...) {
    // Not swallowed: handed to the consumer, which rethrows it when it reaches this chunk.
    chunk.error = std::current_exception();
  }
  chunk.raw.clear();
  chunk.raw.shrink_to_fit();
}

void Pipeline::read_loop() {
  std::uint64_t read = 0;
  try {
    for (;;) {
      Chunk chunk;
      chunk.first = read;
      chunk.raw.reserve(kChunkRecords);
      RawRecord record;
      while (chunk.raw.size() < kChunkRecords && stream_->next(record)) chunk.raw.push_back(std::move(record));
      const bool last = chunk.raw.size() < kChunkRecords;
      read += chunk.raw.size();
      std::unique_lock lock(mutex_);
      room_ready_.wait(lock, [&] { return stopping_ || produced_ - consumed_ < capacity_; });
      if (stopping_) return;
      if (!chunk.raw.empty()) waiting_.emplace(produced_++, std::move(chunk));
      if (last) reader_finished_ = true;
      lock.unlock();
      work_ready_.notify_one();
      if (last) break;
    }
  } catch (...) {
    // Not swallowed: the consumer rethrows it after the chunks read before it.
    std::lock_guard lock(mutex_);
    reader_error_ = std::current_exception();
    reader_finished_ = true;
  }
  work_ready_.notify_all();
  done_ready_.notify_all();
}

void Pipeline::work_loop() {
  for (;;) {
    std::unique_lock lock(mutex_);
    work_ready_.wait(lock, [&] { return stopping_ || !waiting_.empty() || reader_finished_; });
    if (stopping_) return;
    if (waiting_.empty()) {
      if (reader_finished_) return;
      continue;
    }
    auto node = waiting_.extract(waiting_.begin());
    lock.unlock();
    map_chunk(node.mapped());
    lock.lock();
    done_.insert(std::move(node));
    lock.unlock();
    done_ready_.notify_all();
  }
}

std::optional<Pipeline::Chunk> Pipeline::take_chunk() {
  std::exception_ptr error;
  if (workers_ == 0) {
    Chunk chunk;
    chunk.first = inline_read_;
    RawRecord record;
    try {
      while (chunk.raw.size() < kChunkRecords && stream_->next(record)) chunk.raw.push_back(std::move(record));
    } catch (...) {  // whatever the read threw, carried as the reader thread's is (read_loop)
      error = std::current_exception();
    }
    if (!error) {
      inline_read_ += chunk.raw.size();
      if (chunk.raw.empty()) return std::nullopt;
      map_chunk(chunk);
      return chunk;
    }
  } else {
    std::unique_lock lock(mutex_);
    done_ready_.wait(lock, [&] { return done_.count(consumed_) > 0 || (reader_finished_ && consumed_ == produced_); });
    if (done_.count(consumed_) > 0) {
      auto node = done_.extract(consumed_++);
      lock.unlock();
      room_ready_.notify_one();
      return std::move(node.mapped());
    }
    error = reader_error_;
    if (!error) return std::nullopt;
  }
  if (share_.world > 1) exchange_error(error);  // throws the first failing rank's error, on every rank
  std::rethrow_exception(error);
}

bool Pipeline::next(MappedRecord& out) {
  while (current_pos_ >= current_.mapped.size()) {
    if (ended_) return false;
    current_ = Chunk{};
    current_pos_ = 0;
    ended_ = true;  // until a whole chunk is here: the end of the records, or any error below, ends them
    std::optional<Chunk> chunk = take_chunk();
    if (!chunk) return false;
    if (share_.world > 1) exchange(*chunk);
    if (chunk->error) std::rethrow_exception(chunk->error);
    ended_ = false;
    current_ = std::move(*chunk);
  }
  out = std::move(current_.mapped[current_pos_++]);
  return true;
}

void Pipeline::exchange(Chunk& chunk) {
  std::string mine_bytes;
  if (chunk.error) {
    mine_bytes = error_payload(chunk.error);
  } else {
    mine_bytes = "O";
    for (const auto& mapped : chunk.mapped) {
      if (!mapped.mapped_here) continue;
      const Outcome& o = mapped.outcome;
      mine_bytes.push_back(static_cast<char>(o.kind));
      mine_bytes.push_back(o.truncated ? 1 : 0);
      mine_bytes.push_back(o.fatal ? 1 : 0);
      put_bytes(mine_bytes, o.problem);
      put_bytes(mine_bytes, o.hint);
      put_ids(mine_bytes, o.example.input_ids);
      put_ids(mine_bytes, o.example.labels);
      put_ids(mine_bytes, o.example.rejected_ids);
      put_ids(mine_bytes, o.example.rejected_labels);
    }
  }
  const std::vector<std::string> all = share_.exchange(mine_bytes);
  if (all.size() != static_cast<std::size_t>(share_.world))
    throw Error("data parallelism: the record exchange returned " + std::to_string(all.size()) + " parts for " +
                std::to_string(share_.world) + " ranks");
  for (int r = 0; r < share_.world; ++r) {  // the first rank's error, the same on every rank
    const std::string& part = all[static_cast<std::size_t>(r)];
    if (part.empty() || part[0] != 'E') continue;
    Unpacker in(std::string_view(part).substr(1), r);
    const auto code = static_cast<ExitCode>(in.u32());
    std::string message = in.bytes();
    std::string hint = in.bytes();
    message = "rank " + std::to_string(r) + " (reading and tokenizing its share of the records): " + message;
    if (code == kExitData) throw DataError(std::move(message), std::move(hint));
    if (code == kExitUsage) throw UsageError(std::move(message), std::move(hint));
    throw RankError(std::move(message), std::move(hint), code);
  }
  for (int r = 0; r < share_.world; ++r) {
    if (r == share_.rank) continue;
    const std::string& part = all[static_cast<std::size_t>(r)];
    Unpacker in(std::string_view(part).substr(part.empty() ? 0 : 1), r);
    for (std::size_t i = 0; i < chunk.mapped.size(); ++i) {
      if (owner(chunk.first + i) != r) continue;
      Outcome& o = chunk.mapped[i].outcome;
      o.kind = static_cast<OutcomeKind>(in.u8());
      o.truncated = in.u8() != 0;
      o.fatal = in.u8() != 0;
      o.problem = in.bytes();
      o.hint = in.bytes();
      o.example.input_ids = in.ids();
      o.example.labels = in.ids();
      o.example.rejected_ids = in.ids();
      o.example.rejected_labels = in.ids();
    }
    if (!in.done())
      throw Error("data parallelism: rank " + std::to_string(r) + " sent more tokenized records than its share");
  }
}

void Pipeline::exchange_error(std::exception_ptr error) {
  Chunk failed;
  failed.error = std::move(error);
  exchange(failed);  // throws the first rank's error
  std::rethrow_exception(failed.error);
}

}  // namespace trainer::data
