// Reader -> workers -> in-order consumer, with a bounded number of chunks in flight (see pipeline.h).
#include "data/pipeline.h"

namespace trainer::data {
namespace {
// Records per chunk: large enough that locking is rare, small enough that the first batch comes quickly.
constexpr std::size_t kChunkRecords = 64;
}  // namespace

Pipeline::Pipeline(std::unique_ptr<RecordStream> stream, MapFunction map, int workers)
    : stream_(std::move(stream)),
      map_(std::move(map)),
      workers_(workers),
      capacity_(static_cast<std::size_t>(4 * std::max(workers, 1))) {
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

void Pipeline::map_chunk(Chunk& chunk) const {
  chunk.mapped.resize(chunk.raw.size());
  try {
    for (std::size_t i = 0; i < chunk.raw.size(); ++i) {
      const RawRecord& raw = chunk.raw[i];
      MappedRecord& mapped = chunk.mapped[i];
      mapped.slot = raw.slot;
      mapped.file = raw.file;
      mapped.offset = raw.offset;
      mapped.line = raw.line;
      mapped.outcome = map_(raw.text);
    }
  } catch (...) {
    // Not swallowed: handed to the consumer, which rethrows it when it reaches this chunk.
    chunk.error = std::current_exception();
  }
  chunk.raw.clear();
  chunk.raw.shrink_to_fit();
}

void Pipeline::read_loop() {
  try {
    for (;;) {
      Chunk chunk;
      chunk.raw.reserve(kChunkRecords);
      RawRecord record;
      while (chunk.raw.size() < kChunkRecords && stream_->next(record)) chunk.raw.push_back(std::move(record));
      const bool last = chunk.raw.size() < kChunkRecords;
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

bool Pipeline::next(MappedRecord& out) {
  while (current_pos_ >= current_.mapped.size()) {
    if (ended_) return false;
    current_ = Chunk{};
    current_pos_ = 0;
    if (workers_ == 0) {
      RawRecord record;
      while (current_.raw.size() < kChunkRecords && stream_->next(record)) current_.raw.push_back(std::move(record));
      if (current_.raw.empty()) {
        ended_ = true;
        return false;
      }
      map_chunk(current_);
    } else {
      std::unique_lock lock(mutex_);
      done_ready_.wait(lock, [&] { return done_.count(consumed_) > 0 || (reader_finished_ && consumed_ == produced_); });
      if (done_.count(consumed_) == 0) {
        ended_ = true;
        if (reader_error_) std::rethrow_exception(reader_error_);
        return false;
      }
      auto node = done_.extract(consumed_++);
      lock.unlock();
      room_ready_.notify_one();
      current_ = std::move(node.mapped());
    }
    if (current_.error) {
      ended_ = true;
      std::rethrow_exception(current_.error);
    }
  }
  out = std::move(current_.mapped[current_pos_++]);
  return true;
}

}  // namespace trainer::data
