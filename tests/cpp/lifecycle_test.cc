// Destroy order of a communicator, on the in-memory transport dressed up as a
// stream-ordered one: before any buffer is freed, this rank's queued work must be complete (drain)
// and, unless the communicator failed, every peer must have met it in a final barrier, so that no
// peer's queued gather or push still uses the memory. The wrapper logs the order of those events.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "transport/mem/mem_transport.h"
#include "transport/transport_wrapper.h"

namespace odc {
namespace {

// Events of one rank, in order: "barrier:<op>", "host_barrier:<op>", "drain", "free", "put",
// "open:<bytes of each region>" and "close" (gather windows).
struct EventLog {
  std::mutex mutex;
  std::vector<std::string> events;
  void add(std::string event) {
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back(std::move(event));
  }
  std::vector<std::string> snapshot() {
    std::lock_guard<std::mutex> lock(mutex);
    return events;
  }
};

// A region that logs "free" when it goes.
class LoggedRegion final : public SymmetricRegion {
 public:
  LoggedRegion(std::unique_ptr<SymmetricRegion> inner, int rank, int world_size,
               std::shared_ptr<EventLog> log)
      : SymmetricRegion(peers_of(*inner, world_size), rank, inner->bytes()),
        inner_(std::move(inner)),
        log_(std::move(log)) {}
  ~LoggedRegion() override { log_->add("free"); }

 private:
  static std::vector<void*> peers_of(const SymmetricRegion& region, int world_size) {
    std::vector<void*> peers;
    for (int r = 0; r < world_size; ++r) peers.push_back(region.peer(r));
    return peers;
  }
  std::unique_ptr<SymmetricRegion> inner_;
  std::shared_ptr<EventLog> log_;
};

// The in-memory transport, reporting itself stream-ordered (as CUDA is) and logging collectives,
// drains, frees, gets, puts, signals and the background stream; every other call reaches the
// in-memory transport's own.
class LoggedTransport final : public TransportWrapper {
 public:
  static std::unique_ptr<LoggedTransport> wrap(std::unique_ptr<Transport> inner,
                                               std::shared_ptr<EventLog> log) {
    TransportTraits traits = inner->traits();
    traits.caps.stream_ordered = true;
    return std::unique_ptr<LoggedTransport>(
        new LoggedTransport(std::move(inner), traits, std::move(log)));
  }
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override {
    auto region = inner().allocate(bytes);
    if (!region.ok()) return region.status();
    return std::unique_ptr<SymmetricRegion>(
        new LoggedRegion(std::move(region).value(), rank(), world_size(), log_));
  }
  Status barrier(CollectiveOp op, StreamHandle stream) override {
    log_->add(std::string("barrier:") + collective_op_name(op));
    return inner().barrier(op, stream);
  }
  Status host_barrier(CollectiveOp op) override {
    log_->add(std::string("host_barrier:") + collective_op_name(op));
    return inner().host_barrier(op);
  }
  Status drain() override {
    log_->add("drain");
    return inner().drain();
  }
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override {
    log_->add("get:" + std::to_string(bytes));
    return inner().get(dst, region, peer, offset, bytes, stream);
  }
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override {
    log_->add("put");
    return inner().put(src, region, peer, offset, bytes, stream);
  }
  Result<StreamHandle> fork_background(StreamHandle stream) override {
    log_->add("fork");
    return inner().fork_background(stream);
  }
  Status join_background(StreamHandle stream) override {
    log_->add("join");
    return inner().join_background(stream);
  }
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override {
    log_->add("signal");
    return inner().signal(signals, peer, value, stream);
  }
  // A streamed push's put and signal in one call: logged as both, as they were when the table's
  // default split it into put() and signal().
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override {
    log_->add("put");
    log_->add("signal");
    return inner().put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }

 private:
  LoggedTransport(std::unique_ptr<Transport> inner, const TransportTraits& traits,
                  std::shared_ptr<EventLog> log)
      : TransportWrapper(std::move(inner), traits), log_(std::move(log)) {}

  std::shared_ptr<EventLog> log_;
};

// Position of the first `event` in `events`, or events.size().
size_t first(const std::vector<std::string>& events, const std::string& event) {
  return static_cast<size_t>(std::find(events.begin(), events.end(), event) - events.begin());
}

std::string joined(const std::vector<std::string>& events) {
  std::string text;
  for (const auto& event : events) text += event + " ";
  return text;
}

// One logged transport per rank of an in-memory world, each with its own event log.
struct LoggedWorld {
  std::vector<std::shared_ptr<EventLog>> logs;
  std::vector<std::unique_ptr<Transport>> transports;
};

// An in-memory world that runs the device's steps of the streamed scheme (its fold emulated).
mem::MemOptions device_steps() {
  mem::MemOptions options;
  options.stream_ordered = true;
  return options;
}

LoggedWorld logged_world(int world, mem::MemOptions options) {
  auto mem = mem::MemWorld::create(world, options);
  LoggedWorld logged;
  for (int rank = 0; rank < world; ++rank) {
    logged.logs.push_back(std::make_shared<EventLog>());
    logged.transports.push_back(LoggedTransport::wrap(mem->join(rank), logged.logs.back()));
  }
  return logged;
}

TEST(Lifecycle, DestroyMeetsPeersAndDrainsBeforeFreeing) {
  const int world = 3;
  auto [logs, transports] = logged_world(world, mem::MemOptions{/*remote_fp32_add=*/true});
  std::vector<std::string> failures(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      auto comm = std::make_unique<Communicator>(std::move(transports[rank]));
      auto params = comm->allocate(16, DataType::kFloat32, false);
      auto acc = comm->allocate(16, DataType::kFloat32, true);
      if (!params.ok() || !acc.ok()) {
        failures[rank] = "alloc failed";
        return;
      }
      Status status = comm->minibatch_begin(nullptr);
      if (status.ok()) status = comm->minibatch_end(nullptr);
      if (!status.ok()) failures[rank] = status.message();
      comm.reset();  // destroy with both buffers alive
    });
  }
  for (auto& thread : threads) thread.join();
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(failures[rank], "") << "rank " << rank;
    const auto events = logs[rank]->snapshot();
    const size_t destroy_barrier = first(events, "host_barrier:destroy");
    const size_t drain = first(events, "drain");
    const size_t freed = first(events, "free");
    ASSERT_LT(freed, events.size()) << joined(events);
    EXPECT_LT(destroy_barrier, freed) << "rank " << rank << ": " << joined(events);
    EXPECT_LT(drain, freed) << "rank " << rank << ": " << joined(events);
  }
}

TEST(Lifecycle, FailedCommunicatorDrainsBeforeFreeing) {
  // Rank 1 dies; rank 0's minibatch_begin fails, so its communicator is failed: free and destroy
  // meet nobody, but must still complete this rank's own queued work before the memory goes.
  auto mem = mem::MemWorld::create(2, mem::MemOptions{/*remote_fp32_add=*/true});
  auto log = std::make_shared<EventLog>();
  auto comm = std::make_unique<Communicator>(LoggedTransport::wrap(mem->join(0), log));
  auto peer = std::make_unique<Communicator>(mem->join(1));
  Result<Buffer*> buffers[2] = {Status::InternalError("unset"), Status::InternalError("unset")};
  std::thread peer_thread([&] {
    auto a = peer->allocate(16, DataType::kFloat32, true);
    auto b = peer->allocate(16, DataType::kFloat32, false);
    mem->kill(1);
  });
  buffers[0] = comm->allocate(16, DataType::kFloat32, true);
  buffers[1] = comm->allocate(16, DataType::kFloat32, false);
  peer_thread.join();
  ASSERT_TRUE(buffers[0].ok() && buffers[1].ok());
  Status begun = comm->minibatch_begin(nullptr);
  ASSERT_FALSE(begun.ok());
  ASSERT_EQ(comm->state(), CommState::kFailed) << begun.message();

  const size_t before = log->snapshot().size();
  ASSERT_TRUE(comm->release(buffers[1].value()).ok());
  auto events = log->snapshot();
  events.erase(events.begin(), events.begin() + static_cast<std::ptrdiff_t>(before));
  ASSERT_LT(first(events, "free"), events.size()) << joined(events);
  EXPECT_LT(first(events, "drain"), first(events, "free")) << joined(events);

  const size_t released = log->snapshot().size();
  comm.reset();
  events = log->snapshot();
  events.erase(events.begin(), events.begin() + static_cast<std::ptrdiff_t>(released));
  EXPECT_EQ(first(events, "host_barrier:destroy"), events.size())
      << "a failed communicator meets nobody: " << joined(events);
  ASSERT_LT(first(events, "free"), events.size()) << joined(events);
  EXPECT_LT(first(events, "drain"), first(events, "free")) << joined(events);
}

// Runs body(communicator, rank) for every rank of `transports` on its own thread; returns what
// each rank's body returned ("" = fine).
std::vector<std::string> on_each_rank(std::vector<std::unique_ptr<Transport>>& transports,
                                      const std::function<std::string(Communicator&, int)>& body) {
  std::vector<std::string> outcome(transports.size());
  std::vector<std::thread> threads;
  for (size_t rank = 0; rank < transports.size(); ++rank) {
    threads.emplace_back([&, rank] {
      Communicator comm(std::move(transports[rank]));
      outcome[rank] = body(comm, static_cast<int>(rank));
    });
  }
  for (auto& thread : threads) thread.join();
  return outcome;
}

TEST(Lifecycle, NodeFetchSpansExactlyTheMinibatch) {
  // The node cache (2 pretend nodes of 2) fetches after the barrier that ends owners' rewrites, on
  // the background stream, every published buffer in allocation order (not plain shards, which may
  // change inside a minibatch, nor accumulators), each followed by its ready words to the node's
  // two ranks; the background stream is joined before this rank meets the barrier after which
  // owners rewrite again. A buffer allocated later joins the next minibatch's fetch.
  const int world = 4;
  mem::MemOptions options = device_steps();
  options.ranks_per_node = 2;
  auto [logs, transports] = logged_world(world, options);
  const auto failures = on_each_rank(transports, [](Communicator& comm, int) {
    auto params = comm.allocate(3, DataType::kFloat32, false, "", /*published=*/true);
    auto acc = comm.allocate(2, DataType::kFloat32, true);
    auto scratch = comm.allocate(11, DataType::kFloat32, false);
    auto halves = comm.allocate(5, DataType::kBfloat16, false, "", /*published=*/true);
    Status status = params.ok() && acc.ok() && scratch.ok() && halves.ok()
                        ? Status::Ok()
                        : Status::InternalError("alloc");
    if (status.ok()) status = comm.minibatch_begin(nullptr);
    if (status.ok()) status = comm.minibatch_end(nullptr);
    auto later = comm.allocate(7, DataType::kFloat32, false, "", /*published=*/true);
    if (status.ok()) status = later.ok() ? comm.minibatch_begin(nullptr) : later.status();
    if (status.ok()) status = comm.minibatch_end(nullptr);
    return status.ok() ? std::string() : status.message();
  });
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(failures[rank], "") << "rank " << rank;
    std::vector<std::string> events = logs[rank]->snapshot();
    // The minibatch barriers, the background stream's fork and join, and between them the gets
    // (with their sizes) and signals.
    std::vector<std::string> seen;
    bool forked = false;
    for (const std::string& event : events) {
      if (event == "fork") forked = true;
      if (event == "join") forked = false;
      const bool fetch_event = event.rfind("get:", 0) == 0 || event == "signal";
      if (event == "fork" || event == "join" || event == "barrier:minibatch_begin" ||
          event == "barrier:minibatch_end" || (forked && fetch_event)) {
        seen.push_back(event);
      }
    }
    // Each minibatch_begin also joins the progress thread's passes of the minibatch before (the
    // first join) and forks the background stream for this one's (the first fork), then the node
    // cache forks it for its fetch.
    const std::vector<std::string> want = {"join",
                                           "barrier:minibatch_begin",
                                           "fork",
                                           "fork",
                                           "get:12",
                                           "signal",
                                           "signal",
                                           "get:10",
                                           "signal",
                                           "signal",
                                           "join",
                                           "barrier:minibatch_end",
                                           "join",
                                           "barrier:minibatch_begin",
                                           "fork",
                                           "fork",
                                           "get:12",
                                           "signal",
                                           "signal",
                                           "get:10",
                                           "signal",
                                           "signal",
                                           "get:28",
                                           "signal",
                                           "signal",
                                           "join",
                                           "barrier:minibatch_end"};
    EXPECT_EQ(seen, want) << "rank " << rank << ": " << joined(events);
  }
}

TEST(Lifecycle, PublishedIsPartOfTheBufferKind) {
  // Every rank must agree that a buffer is published (its gathers may be served from a copy of
  // minibatch_begin): a rank that allocates plain shards where the others publish fails them all.
  auto [logs, transports] = logged_world(2, device_steps());
  const auto outcome = on_each_rank(transports, [](Communicator& comm, int rank) {
    auto both = comm.allocate(4, DataType::kFloat32, true, "", /*published=*/true);
    auto mixed = comm.allocate(4, DataType::kFloat32, false, "", /*published=*/rank == 0);
    return (both.ok() ? std::string("accumulator and published accepted")
                      : both.status().message()) +
           " | " + (mixed.ok() ? std::string("mixed kinds accepted") : mixed.status().message());
  });
  for (const std::string& text : outcome) {
    EXPECT_NE(text.find("either an accumulator or published"), std::string::npos) << text;
    EXPECT_NE(text.find("4 float32 (published) elements"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace odc
