// The threaded part of the loader: one reader thread cuts the epoch's record stream into numbered chunks,
// worker threads map them (parse + tokenize), and the consumer takes the results back in chunk order. The
// number of chunks in flight is bounded (backpressure), so memory does not depend on the data's size, and the
// output is the same for any number of workers. With data parallelism (RecordShare), each rank maps only its share of
// each chunk and the consumer exchanges the outcomes with the other ranks, so every rank gets every chunk whole.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/record.h"
#include "trainer/data.h"

namespace trainer::data {

struct MappedRecord {
  std::uint64_t slot = 0;
  std::uint32_t file = 0;
  std::uint64_t offset = 0;
  std::uint64_t line = 0;
  Outcome outcome;
  bool mapped_here = true;  // this process parsed and tokenized it (false: another rank did; see RecordShare)
};

using MapFunction = std::function<Outcome(std::string_view)>;
// Maps a Parquet/Arrow row from its values (map_table_row); without one, rows are rendered as JSON for MapFunction.
using MapRowFunction = std::function<Outcome(const TableRows&, std::uint64_t row, std::string& scratch)>;

class Pipeline {
 public:
  // workers = 0 maps on the calling thread (no threads at all). `share` (world > 1): this rank maps only the records
  // at positions p % world == rank (p counted from the stream's start) and next() exchanges each chunk's outcomes.
  Pipeline(std::unique_ptr<RecordStream> stream, MapFunction map, int workers, RecordShare share = {},
           MapRowFunction map_row = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // The next mapped record in slot order; false at the end of the epoch. Rethrows, in order, what a reader or
  // worker thread threw (with a share: what any rank's threw, the same error on every rank).
  bool next(MappedRecord& out);

 private:
  struct Chunk {
    std::uint64_t first = 0;  // the position of its first record in the stream
    std::vector<RawRecord> raw;
    std::vector<MappedRecord> mapped;
    std::exception_ptr error;
  };
  void read_loop();
  void work_loop();
  void map_chunk(Chunk& chunk) const;
  // The next chunk in order, mapped (here, or by the worker threads); none at the end of the records. A read error
  // is thrown, with a share the first failing rank's on every rank.
  std::optional<Chunk> take_chunk();
  int owner(std::uint64_t position) const;  // the rank that maps the record at `position` of the epoch
  // Data parallelism: sends this rank's outcomes of `chunk` (or its error) and fills in the other ranks'; throws
  // the error of the first rank that had one, the same on every rank.
  void exchange(Chunk& chunk);
  [[noreturn]] void exchange_error(std::exception_ptr error);

  std::unique_ptr<RecordStream> stream_;
  MapFunction map_;
  MapRowFunction map_row_;
  int workers_;
  RecordShare share_;
  std::uint64_t inline_read_ = 0;  // workers = 0: records read so far
  std::size_t capacity_;

  std::mutex mutex_;
  std::condition_variable work_ready_, done_ready_, room_ready_;
  std::map<std::uint64_t, Chunk> waiting_;  // read, not yet mapped
  std::map<std::uint64_t, Chunk> done_;     // mapped, not yet consumed
  std::uint64_t produced_ = 0;              // chunks read
  std::uint64_t consumed_ = 0;              // chunks taken by the consumer
  bool reader_finished_ = false;
  bool stopping_ = false;
  std::exception_ptr reader_error_;
  std::vector<std::thread> threads_;

  Chunk current_;
  std::size_t current_pos_ = 0;
  bool ended_ = false;
};

}  // namespace trainer::data
