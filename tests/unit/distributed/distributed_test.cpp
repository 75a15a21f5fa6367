// The pure parts of data parallelism: the launch environment, each rank's share of an effective batch, and the
// config comparison across ranks; and the overlapped gradient sums' protocol on two ranks that are two threads of
// this process (real Gloo collectives on 127.0.0.1), and the text loader's record share (each rank tokenizes its
// share of the records and exchanges them). (Whole runs: tests/integration/distributed_test.cpp.)
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "distributed/data_parallel.h"
#include "distributed/process_group.h"
#include "unit/data/data_test_support.h"

namespace trainer::distributed {
namespace {

Getenv from(const std::map<std::string, std::string>& values) {
  return [values](const char* name) -> const char* {
    const auto it = values.find(name);
    return it == values.end() ? nullptr : it->second.c_str();
  };
}

std::string usage_error(const std::map<std::string, std::string>& values) {
  try {
    environment_from_variables(from(values));
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DistributedEnvironment, NoVariablesOrOneRankIsASingleProcess) {
  EXPECT_FALSE(environment_from_variables(from({})).has_value());
  EXPECT_FALSE(environment_from_variables(from({{"WORLD_SIZE", "1"}, {"RANK", "0"}})).has_value());
  EXPECT_FALSE(environment_from_variables(from({{"WORLD_SIZE", "1"}})).has_value());
}

TEST(DistributedEnvironment, ReadsTorchrunsVariables) {
  const auto e = environment_from_variables(from({{"WORLD_SIZE", "4"}, {"RANK", "3"}, {"LOCAL_RANK", "1"},
                                                  {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"},
                                                  {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                                  {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world_size, 2);
  EXPECT_EQ(e->master_addr, "node0");
  EXPECT_EQ(e->master_port, 29400);
  EXPECT_TRUE(e->agent_store);
  EXPECT_EQ(e->restart_count, "2");
  // Without LOCAL_*: every rank on this machine.
  const auto plain = environment_from_variables(
      from({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}}));
  ASSERT_TRUE(plain.has_value());
  EXPECT_EQ(plain->local_rank, 1);
  EXPECT_EQ(plain->local_world_size, 2);
  EXPECT_FALSE(plain->agent_store);
}

TEST(DistributedEnvironment, BadValuesNameTheVariable) {
  const std::map<std::string, std::string> ok = {
      {"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto but = [&](const std::string& key, const char* value) {
    auto values = ok;
    if (value) values[key] = value;
    else values.erase(key);
    return usage_error(values);
  };
  EXPECT_NE(but("RANK", nullptr).find("WORLD_SIZE=2 is set but RANK is not"), std::string::npos);
  EXPECT_NE(usage_error({{"RANK", "0"}}).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(but("RANK", "2").find("RANK=2 is not an integer from 0 to 1"), std::string::npos);
  EXPECT_NE(but("RANK", "one").find("RANK=one"), std::string::npos);
  EXPECT_NE(but("WORLD_SIZE", "0").find("WORLD_SIZE=0"), std::string::npos);
  EXPECT_NE(but("MASTER_PORT", "70000").find("MASTER_PORT=70000"), std::string::npos);
  EXPECT_NE(but("MASTER_PORT", nullptr).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(but("MASTER_ADDR", nullptr).find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(but("LOCAL_RANK", "5").find("LOCAL_RANK=5"), std::string::npos);
}

std::vector<Example> examples_of_lengths(const std::vector<int>& lengths) {
  std::vector<Example> out;
  for (int n : lengths) {
    Example e;
    e.input_ids.assign(static_cast<std::size_t>(n), 7);
    e.labels.assign(static_cast<std::size_t>(n), 7);
    out.push_back(e);
  }
  return out;
}

// The shares of every rank, in order: contiguous, disjoint and covering the batch.
void expect_partition(const std::vector<Example>& examples, int world, bool by_tokens) {
  int64_t next = 0;
  for (int r = 0; r < world; ++r) {
    const auto [begin, count] = share_of(examples, r, world, by_tokens);
    EXPECT_EQ(begin, next) << "rank " << r;
    EXPECT_GE(count, 0);
    next = begin + count;
  }
  EXPECT_EQ(next, static_cast<int64_t>(examples.size()));
}

TEST(DistributedShare, ByExamplesGivesEqualCountsAndTheRemainderToTheFirstRanks) {
  const auto eight = examples_of_lengths(std::vector<int>(8, 5));
  EXPECT_EQ(share_of(eight, 0, 3, false), (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(share_of(eight, 1, 3, false), (std::pair<int64_t, int64_t>{3, 3}));
  EXPECT_EQ(share_of(eight, 2, 3, false), (std::pair<int64_t, int64_t>{6, 2}));
  for (int world : {1, 2, 3, 5, 9, 16}) expect_partition(eight, world, false);
  // A last batch smaller than the world: some ranks train nothing this step.
  const auto two = examples_of_lengths({4, 4});
  EXPECT_EQ(share_of(two, 2, 3, false).second, 0);
  expect_partition(two, 3, false);
}

TEST(DistributedShare, ByTokensBalancesTheLengths) {
  // One long example and many short ones: the long one is a rank's share by itself.
  const auto examples = examples_of_lengths({100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10});
  EXPECT_EQ(share_of(examples, 0, 2, true), (std::pair<int64_t, int64_t>{0, 1}));
  EXPECT_EQ(share_of(examples, 1, 2, true), (std::pair<int64_t, int64_t>{1, 10}));
  for (int world : {1, 2, 3, 4, 11, 12}) expect_partition(examples, world, true);
  const auto equal = examples_of_lengths(std::vector<int>(6, 8));
  EXPECT_EQ(share_of(equal, 1, 3, true), (std::pair<int64_t, int64_t>{2, 2}));
}

TEST(DistributedConfig, DifferingKeysNameTheKeyAndSkipPerRankOnes) {
  const std::string a = R"({"training": {"batch_size": 8, "seed": 1}, "memory": {"limit": "1GiB"},
                            "data": {"train_files": ["a.jsonl"]}, "device": {"type": "cpu"}})";
  const std::string b = R"({"training": {"batch_size": 16, "seed": 1}, "memory": {"limit": "2GiB"},
                            "data": {"train_files": ["a.jsonl", "b.jsonl"]}, "device": {"type": "cuda:1"}})";
  EXPECT_EQ(differing_keys(a, a, {}), std::vector<std::string>{});
  EXPECT_EQ(differing_keys(a, b, {"memory.limit", "device.*"}),
            (std::vector<std::string>{"data.train_files", "training.batch_size"}));
  EXPECT_EQ(differing_keys(a, b, {}),
            (std::vector<std::string>{"data.train_files", "device.type", "memory.limit", "training.batch_size"}));
}

// Two ranks as two threads of this process, each with its own Communicator (rank 0 serves the store): runs
// body(rank, communicator) on each and returns what each threw ("" when nothing).
std::vector<std::string> two_ranks(const std::function<void(int, Communicator&)>& body) {
  ::setenv("GLOO_SOCKET_IFNAME", "lo", 1);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  ::close(fd);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        Environment e;
        e.rank = e.local_rank = r;
        e.world_size = e.local_world_size = 2;
        e.master_port = port;
        auto communicator = Communicator::connect(e, c10::Device(c10::kCPU), std::chrono::seconds(60));
        body(r, *communicator);
        communicator->barrier();
      } catch (const std::exception& error) {
        errors[static_cast<std::size_t>(r)] = error.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// Three parameters in 1 KiB buckets, backward's order: the 300-float one alone (summed in place), then the two
// 100-float ones together (flattened, summed, copied back). Rank 1's first attempt "runs out of memory" after its
// backward reached only the last parameter, whose bucket it has started: what TrainStep does then is agree(false),
// which must take part in the rest of rank 0's buckets, so that the agreement itself pairs up and both ranks learn
// the attempt failed. The retry then sums the gradients: (1 + 2) per element.
TEST(DistributedOverlap, ARankThatFailsMidBackwardKeepsTheCollectivesPairedAndTheRetrySums) {
  const auto errors = two_ranks([](int rank, Communicator& communicator) {
    at::manual_seed(1);
    std::vector<at::Tensor> parameters = {at::randn({100}).requires_grad_(true), at::randn({100}).requires_grad_(true),
                                          at::randn({300}).requires_grad_(true)};
    DataParallel parallel(communicator, parameters, 1024);
    parallel.set_overlap(true);
    const double weight = rank + 1.0;
    auto full_backward = [&] {
      at::Tensor loss = at::zeros({});
      for (auto& p : parameters) loss = loss + (p * weight).sum();
      loss.backward();
    };
    parallel.begin_attempt(true);
    parallel.before_last_backward();
    StepSync::Outcome outcome;
    if (rank == 0) {
      full_backward();
      parallel.prepare();
      outcome = parallel.agree(true, 2);
    } else {
      (parameters[2] * weight).sum().backward();  // the last parameter's gradient is final: its bucket starts
      outcome = parallel.agree(false, 2);
    }
    EXPECT_FALSE(outcome.all_fit);
    EXPECT_EQ(outcome.failed_ranks, "1");
    for (auto& p : parameters) p.mutable_grad() = at::Tensor();
    parallel.begin_attempt(true);
    parallel.before_last_backward();
    full_backward();
    parallel.prepare();
    EXPECT_TRUE(parallel.agree(true, 2).all_fit);
    EXPECT_DOUBLE_EQ(parallel.reduce(weight), 3.0);
    for (const auto& p : parameters) EXPECT_TRUE(at::allclose(p.grad(), at::full_like(p, 3.0))) << p.grad();
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
}

// ---- the text loader's record share: each rank tokenizes its share, the exchange gives every rank the rest ----

// Everything a loader hands out, example by example, and its counts (records_mapped apart).
struct LoaderTrace {
  std::vector<std::tuple<int64_t, int64_t, uint64_t, std::vector<int32_t>, std::vector<int32_t>>> examples;
  std::vector<int64_t> batch_tokens;
  int64_t records_read = 0, examples_counted = 0, bad = 0, truncated = 0, overlength = 0;
  std::vector<std::string> problems;
  int64_t records_mapped = 0;
  bool same_as(const LoaderTrace& o) const {
    return examples == o.examples && batch_tokens == o.batch_tokens && records_read == o.records_read &&
           examples_counted == o.examples_counted && bad == o.bad && truncated == o.truncated &&
           overlength == o.overlength && problems == o.problems;
  }
};

// `batches` batches (all when 0) of `loader`, starting from `from` when given (a resume).
LoaderTrace trace_loader(DataLoader& loader, std::size_t batches = 0, std::optional<LoaderCursor> from = {}) {
  if (from) loader.restore(*from);
  LoaderTrace t;
  int64_t index = 0;
  while (batches == 0 || t.batch_tokens.size() < batches) {
    auto batch = loader.next();
    if (!batch) break;
    for (auto& e : batch->examples)
      t.examples.emplace_back(index, batch->epoch, e.source_index, e.input_ids, e.labels);
    t.batch_tokens.push_back(batch->target_tokens);
    ++index;
  }
  const DataStats s = loader.stats();
  t.records_read = s.records_read;
  t.examples_counted = s.examples;
  t.bad = s.bad_records_skipped;
  t.truncated = s.truncated;
  t.overlength = s.overlength_skipped;
  t.problems = s.first_problems;
  t.records_mapped = s.records_mapped;
  return t;
}

// 300 records, shuffled, two epochs, with bad records (skipped), over-length ones (skipped) and length grouping: on
// two ranks, with or without worker threads, every rank gets one process's batches, counts and problems, having
// tokenized about half of the records; a resume from a cursor mid-epoch continues exactly.
TEST(DistributedRecordShare, TwoRanksTokenizeHalfTheRecordsEachAndGetOneProcessesBatches) {
  test::TempDir dir;
  const std::string path = dir.file("train.jsonl");
  std::string text;
  for (int i = 0; i < 300; i += 30)
    text += test::seq2seq_lines(29, i) + (i % 60 ? "not json\n" : "{\"input\": \"x\", \"target\": 5}\n");
  test::write_file(path, text);
  for (const int workers : {0, 2}) {
    for (const bool grouped : {false, true}) {
      SCOPED_TRACE("workers " + std::to_string(workers) + (grouped ? ", grouped by length" : ""));
      Config config = test::seq2seq_config({path}, 6);
      config.data.num_workers = workers;
      config.data.group_by_length = grouped;
      config.data.on_bad_record = BadRecordPolicy::kSkip;
      config.data.on_overlength = OverlengthPolicy::kSkip;
      config.data.max_input_length = 24;  // the longer records (i % 7 of 5 or 6 "Add salt and pepper.") are skipped
      config.training.epochs = 2;
      auto single = make_train_loader(config, test::t5_tokenizer(), DataFamily::kSeq2Seq);
      const LoaderTrace reference = trace_loader(*single);
      ASSERT_EQ(reference.records_read, 2 * 300);
      ASSERT_EQ(reference.records_mapped, reference.records_read);  // one process tokenizes everything
      ASSERT_GT(reference.bad, 0);
      ASSERT_GT(reference.overlength, 0);
      auto first_part = make_train_loader(config, test::t5_tokenizer(), DataFamily::kSeq2Seq);
      for (int k = 0; k < 7; ++k) first_part->next();
      const LoaderCursor middle = first_part->cursor();  // mid-epoch (a mega-batch boundary when grouped)
      std::vector<LoaderTrace> traces(2), resumed(2);
      const auto errors = two_ranks([&](int rank, Communicator& communicator) {
        const RecordShare share = record_share(&communicator);
        auto loader = make_train_loader(config, test::t5_tokenizer(), DataFamily::kSeq2Seq, share);
        traces[static_cast<std::size_t>(rank)] = trace_loader(*loader);
        auto again = make_train_loader(config, test::t5_tokenizer(), DataFamily::kSeq2Seq, share);
        resumed[static_cast<std::size_t>(rank)] = trace_loader(*again, 0, middle);
      });
      ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(traces[static_cast<std::size_t>(r)].same_as(reference)) << "rank " << r;
        // Each pass counts positions from its start (one per epoch, or per mega-batch when grouped): within a few.
        const int64_t mapped = traces[static_cast<std::size_t>(r)].records_mapped;
        EXPECT_NEAR(static_cast<double>(mapped), reference.records_read / 2.0, grouped ? 4.0 : 1.0) << "rank " << r;
      }
      EXPECT_EQ(traces[0].records_mapped + traces[1].records_mapped, reference.records_read);
      auto tail = make_train_loader(config, test::t5_tokenizer(), DataFamily::kSeq2Seq);
      const LoaderTrace expected_tail = trace_loader(*tail, 0, middle);
      ASSERT_FALSE(expected_tail.examples.empty());
      for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(resumed[static_cast<std::size_t>(r)].same_as(expected_tail)) << "rank " << r;
    }
  }
}

// A tokenizer that throws (not bad data: an exception) for one record, otherwise the tiny T5's.
class ThrowingTokenizer final : public Tokenizer {
 public:
  std::vector<std::int32_t> encode(std::string_view text) const override {
    if (text.find("dish 5.") != std::string_view::npos)
      throw DataError("the tokenizer broke on dish 5", "a hint that travels too");
    return base().encode(text);
  }
  std::string decode(std::span<const std::int32_t> ids, bool skip_special) const override {
    return base().decode(ids, skip_special);
  }
  std::int64_t vocab_size() const override { return base().vocab_size(); }
  std::optional<std::int32_t> eos_id() const override { return base().eos_id(); }
  std::optional<std::int32_t> pad_id() const override { return base().pad_id(); }
  std::optional<std::int32_t> bos_id() const override { return base().bos_id(); }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override { return base().token_to_id(token); }
  SpecialTokenTemplate special_token_template() const override { return base().special_token_template(); }
  const std::string& source() const override { return base().source(); }

 private:
  static const Tokenizer& base() { return test::t5_tokenizer(); }
};

// Record 5 (unshuffled: position 5, rank 1's share) makes the tokenizer throw on rank 1 alone: rank 0, which did
// not tokenize it, stops with the same error (and exit code), instead of waiting in the exchange.
TEST(DistributedRecordShare, AnExceptionInOneRanksShareStopsEveryRankWithTheSameError) {
  test::TempDir dir;
  const std::string path = dir.file("train.jsonl");
  test::write_file(path, test::seq2seq_lines(40));
  for (const int workers : {0, 2}) {
    SCOPED_TRACE("workers " + std::to_string(workers));
    Config config = test::seq2seq_config({path}, 4);
    config.data.num_workers = workers;
    config.data.shuffle = false;
    const ThrowingTokenizer tokenizer;
    std::vector<std::string> caught(2);
    const auto errors = two_ranks([&](int rank, Communicator& communicator) {
      auto loader = make_train_loader(config, tokenizer, DataFamily::kSeq2Seq, record_share(&communicator));
      try {
        while (loader->next()) {
        }
      } catch (const DataError& e) {
        caught[static_cast<std::size_t>(rank)] = std::string(e.what()) + " | " + e.hint();
      }
      EXPECT_EQ(loader->stats().records_mapped, 0) << "rank " << rank << ": the error came with the first chunk";
    });
    EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
    EXPECT_EQ(caught[0], "rank 1 (reading and tokenizing its share of the records): the tokenizer broke on dish 5 | a "
                         "hint that travels too");
    EXPECT_EQ(caught[1], caught[0]);
  }
}

// The exchange itself: byte strings of different lengths (one empty) arrive whole, in rank order, on every rank.
TEST(DistributedRecordShare, AllGatherBytesGivesEveryRankEveryRanksBytes) {
  std::vector<std::vector<std::string>> got(2);
  const auto errors = two_ranks([&](int rank, Communicator& communicator) {
    const std::string mine = rank == 0 ? std::string("\0first\xff", 7) : std::string();
    got[static_cast<std::size_t>(rank)] = communicator.all_gather_bytes(mine, "a test");
    got[static_cast<std::size_t>(rank)].push_back(
        communicator.all_gather_bytes(std::string(1000 + rank, static_cast<char>('a' + rank)), "a test")[1]);
  });
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  const std::vector<std::string> expected = {std::string("\0first\xff", 7), "", std::string(1001, 'b')};
  EXPECT_EQ(got[0], expected);
  EXPECT_EQ(got[1], expected);
}

}  // namespace
}  // namespace trainer::distributed
