// The external bootstrap (odcBootstrap_t): ranks are threads of this process and the callbacks an
// in-process rendezvous (mutex + condition variable, bounded waits, a failure flag), as a caller's
// store or MPI would provide them. Communicators built on it sum exactly; a failing callback ends
// every rank's init with a clear error, and nothing hangs.
#include <gtest/gtest.h>

#include <unistd.h>
#include <chrono>
#include <condition_variable>

#include <cstddef>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "odc/odc.h"

namespace {

// One job's rendezvous. Collectives are rounds: a rank waits until every rank has entered the
// round it entered (or a rank failed, or its wait timed out: then the callback returns nonzero).
class Rendezvous {
 public:
  explicit Rendezvous(int world_size) : world_size_(world_size), data_(world_size) {}

  int allgather(int rank, const void* send, void* recv, size_t bytes) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t round = entered_[rank]++;
    data_[rank].resize(round + 1);
    data_[rank][round].assign(static_cast<const char*>(send),
                              static_cast<const char*>(send) + bytes);
    changed_.notify_all();
    const bool ready = changed_.wait_for(lock, std::chrono::seconds(20), [&] {
      if (failed_) return true;
      for (int r = 0; r < world_size_; ++r) {
        if (entered_[r] <= round) return false;
      }
      return true;
    });
    if (!ready || failed_) return failed_ ? 2 : 3;
    for (int r = 0; r < world_size_; ++r) {
      if (data_[r][round].size() != bytes) return 4;  // not a collective: sizes differ
      std::memcpy(static_cast<char*>(recv) + r * bytes, data_[r][round].data(), bytes);
    }
    return 0;
  }

  void mark_failed(int rank, const char* reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    failed_ = true;
    reasons_.push_back("rank " + std::to_string(rank) + ": " + reason);
    changed_.notify_all();
  }

  std::vector<std::string> reasons() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reasons_;
  }

 private:
  int world_size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<uint64_t> entered_ = std::vector<uint64_t>(256, 0);
  std::vector<std::vector<std::vector<char>>> data_;  // [rank][round]
  bool failed_ = false;
  std::vector<std::string> reasons_;
};

// The callbacks' ctx: one rank's view of the rendezvous; `fail_allgather` makes its allgather
// callback fail as a broken store would.
struct RankContext {
  Rendezvous* rendezvous;
  int rank;
  int fail_allgather = 0;
};

int allgather_cb(void* ctx, const void* send, void* recv, size_t bytes) {
  auto* self = static_cast<RankContext*>(ctx);
  if (self->fail_allgather != 0) return self->fail_allgather;
  return self->rendezvous->allgather(self->rank, send, recv, bytes);
}

int barrier_cb(void* ctx) {
  auto* self = static_cast<RankContext*>(ctx);
  char token = 1;
  std::vector<char> all(256);
  return self->rendezvous->allgather(self->rank, &token, all.data(), 1);
}

void mark_failed_cb(void* ctx, const char* reason) {
  auto* self = static_cast<RankContext*>(ctx);
  self->rendezvous->mark_failed(self->rank, reason);
}

odcBootstrap_t bootstrap_of(RankContext* context) {
  return odcBootstrap_t{ODC_BOOTSTRAP_VERSION, context, &allgather_cb, &barrier_cb,
                        &mark_failed_cb};
}

// One rank: init over the bootstrap, 3 minibatches of uneven pushes, checks the exact sums.
std::string run_rank(Rendezvous& rendezvous, int rank, int world, int fail_allgather = 0) {
  RankContext context{&rendezvous, rank, fail_allgather};
  const odcBootstrap_t bootstrap = bootstrap_of(&context);
  odcCommConfig_t config = ODC_COMM_CONFIG_INIT;
  if (odcCommConfigInit(&config) != odcSuccess) return "config init failed";
  config.bootstrap = &bootstrap;
  config.timeout_seconds = 20.0;
  odcComm_t comm = nullptr;
  if (odcCommInitConfig(&comm, rank, world, &config) != odcSuccess) {
    return std::string("init: ") + odcGetLastError();
  }
  const size_t count = 8;
  odcBuffer_t accumulator;
  void* local = nullptr;
  std::string error;
  if (odcBufferAlloc(comm, count, odcFloat32, 1, &accumulator, &local) != odcSuccess) {
    error = odcCommGetLastError(comm);
  }
  std::vector<float> src(world * count, 1.0f);
  for (int minibatch = 0; minibatch < 3 && error.empty(); ++minibatch) {
    bool ok = odcMinibatchBegin(comm, nullptr) == odcSuccess;
    for (int push = 0; ok && push < rank + 1; ++push) {
      ok = odcScatterAccumulate(comm, src.data(), src.size(), odcFloat32, accumulator, nullptr) ==
           odcSuccess;
    }
    ok = ok && odcMinibatchEnd(comm, nullptr) == odcSuccess;
    if (!ok) {
      error = odcCommGetLastError(comm);
      break;
    }
    const float expected = static_cast<float>(world * (world + 1) / 2);  // sum of rank + 1
    for (size_t i = 0; i < count; ++i) {
      if (static_cast<float>(static_cast<float*>(local)[i]) != expected) {
        error = "wrong sum " + std::to_string(static_cast<float*>(local)[i]);
      }
    }
  }
  odcCommDestroy(comm);
  return error;
}

template <typename Body>
std::vector<std::string> run_threads(int world, Body body) {
  std::vector<std::string> outcome(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] { outcome[rank] = body(rank); });
  }
  for (auto& thread : threads) thread.join();
  return outcome;
}

TEST(ExternalBootstrap, CommunicatorsSumExactly) {
  const int world = 4;
  Rendezvous rendezvous(world);
  const auto outcome =
      run_threads(world, [&](int rank) { return run_rank(rendezvous, rank, world); });
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(outcome[rank], "") << "rank " << rank;
  EXPECT_TRUE(rendezvous.reasons().empty());
}

TEST(ExternalBootstrap, TwoJobsWithTheirOwnBootstrapsNeverMeet) {
  // Same ranks, same (absent) key, at the same time: each job gets its own random key.
  const int world = 2;
  Rendezvous first(world), second(world);
  const auto outcome = run_threads(2 * world, [&](int thread) {
    return run_rank(thread < world ? first : second, thread % world, world);
  });
  for (int thread = 0; thread < 2 * world; ++thread) EXPECT_EQ(outcome[thread], "");
}

TEST(ExternalBootstrap, FailingCallbackFailsEveryRankClearly) {
  const int world = 3;
  Rendezvous rendezvous(world);
  const auto outcome = run_threads(world, [&](int rank) {
    return run_rank(rendezvous, rank, world, /*fail_allgather=*/rank == 1 ? 7 : 0);
  });
  EXPECT_EQ(outcome[1],
            "init: rank 1: init: bootstrap allgather (agree on key) failed: the caller's callback "
            "returned 7");
  for (int rank : {0, 2}) {
    // Released by rank 1's failure flag (the callback's 2), not by its own timeout (3).
    EXPECT_EQ(outcome[rank], "init: rank " + std::to_string(rank) +
                                 ": init: bootstrap allgather (agree on key) failed: the caller's "
                                 "callback returned 2");
  }
  const auto reasons = rendezvous.reasons();
  ASSERT_FALSE(reasons.empty());
  EXPECT_EQ(reasons[0].rfind("rank 1: rank 1: init: bootstrap allgather", 0), 0u) << reasons[0];
}

TEST(ExternalBootstrap, BadConfigsAreRefusedByName) {
  Rendezvous rendezvous(1);
  RankContext context{&rendezvous, 0};
  odcBootstrap_t bootstrap = bootstrap_of(&context);
  odcCommConfig_t config = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigInit(&config), odcSuccess);
  EXPECT_EQ(config.bootstrap, nullptr);
  config.bootstrap = &bootstrap;
  config.key = "both";
  odcComm_t comm = nullptr;
  EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &config), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "rank 0: init: give a key or a bootstrap, not both");
  config.key = nullptr;
  bootstrap.allgather = nullptr;
  EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &config), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "rank 0: init: bootstrap: the allgather callback is NULL");
  bootstrap = bootstrap_of(&context);
  bootstrap.version = 99;
  EXPECT_EQ(odcCommInitConfig(&comm, 0, 1, &config), odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("bootstrap has version 99"), std::string::npos);
  // A version-1 config (no bootstrap field) still works with a key.
  odcCommConfig_t version1 = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigInit(&version1), odcSuccess);
  version1.version = 1;
  version1.size = offsetof(odcCommConfig_t, bootstrap);
  version1.bootstrap = &bootstrap;  // beyond its size: must be ignored
  const std::string key = "bootstrap-v1-" + std::to_string(::getpid());
  version1.key = key.c_str();
  ASSERT_EQ(odcCommInitConfig(&comm, 0, 1, &version1), odcSuccess) << odcGetLastError();
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
  // A version-2 config (no staging_bytes) too: what lies beyond its size is never read.
  odcCommConfig_t version2 = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigInit(&version2), odcSuccess);
  // The one "unset" of the byte fields (0, the default before version 5, still means it).
  EXPECT_EQ(version2.staging_bytes, ODC_BYTES_FROM_ENVIRONMENT);
  version2.version = 2;
  version2.size = offsetof(odcCommConfig_t, staging_bytes);
  version2.staging_bytes = 1;  // beyond its size: a budget this small would be refused
  const std::string key2 = "bootstrap-v2-" + std::to_string(::getpid());
  version2.key = key2.c_str();
  ASSERT_EQ(odcCommInitConfig(&comm, 0, 1, &version2), odcSuccess) << odcGetLastError();
  odcBuffer_t accumulator = nullptr;
  void* local = nullptr;
  EXPECT_EQ(odcBufferAlloc(comm, 8, odcFloat32, 1, &accumulator, &local), odcSuccess)
      << odcGetLastError();
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
  // Version 3: the budget is the caller's; too small for the world is refused at the first
  // accumulator, naming what it needs.
  odcCommConfig_t version3 = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigInit(&version3), odcSuccess);
  version3.staging_bytes = 64;
  const std::string key3 = "bootstrap-v3-" + std::to_string(::getpid());
  version3.key = key3.c_str();
  ASSERT_EQ(odcCommInitConfig(&comm, 0, 1, &version3), odcSuccess) << odcGetLastError();
  EXPECT_EQ(odcBufferAlloc(comm, 8, odcFloat32, 1, &accumulator, &local), odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("staging budget of 64 bytes is too small"),
            std::string::npos)
      << odcGetLastError();
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
  // A version-3 config (no node budgets) is accepted; version 4's defaults take them from the
  // environment.
  odcCommConfig_t version3_layout = ODC_COMM_CONFIG_INIT;
  ASSERT_EQ(odcCommConfigInit(&version3_layout), odcSuccess);
  EXPECT_EQ(version3_layout.node_cache_bytes, ODC_BYTES_FROM_ENVIRONMENT);
  EXPECT_EQ(version3_layout.node_aggregation_bytes, ODC_BYTES_FROM_ENVIRONMENT);
  version3_layout.version = 3;
  version3_layout.size = offsetof(odcCommConfig_t, node_cache_bytes);
  const std::string key4 = "bootstrap-v3-layout-" + std::to_string(::getpid());
  version3_layout.key = key4.c_str();
  ASSERT_EQ(odcCommInitConfig(&comm, 0, 1, &version3_layout), odcSuccess) << odcGetLastError();
  EXPECT_EQ(odcCommDestroy(comm), odcSuccess);
}

}  // namespace
