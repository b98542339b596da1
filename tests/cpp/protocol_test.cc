// The ODC protocol (core/communicator) at scale on the in-memory transport, threads as ranks:
// 2 to 256 ranks, 1,000 minibatches of random uneven pushes (some ranks push nothing), exact
// integer sums read by every rank from every owner right after minibatch_end with no extra
// barrier; both accumulation schemes; deterministic mode bit for bit under random delays; and
// every injected fault (death, dropped and duplicated signals, reordering, collective mismatch)
// detected and named, with no hang and no partial sum reported as success.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "transport/fault/fault_transport.h"
#include "transport/mem/mem_transport.h"

namespace odc {
namespace {

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ODC_UNDER_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define ODC_UNDER_TSAN 1
#endif
#ifdef ODC_UNDER_TSAN
// ThreadSanitizer runs these ~10x slower and tracks at most a few thousand threads' histories:
// the same tests, scaled down (scripts/sanitize.sh).
constexpr int kScaleDivisor = 10;
#else
constexpr int kScaleDivisor = 1;
#endif

// Pushes of `rank` in minibatch `m`: 0 to 3, a quarter of them zero.
int num_pushes(uint32_t seed, int m, int rank) {
  std::seed_seq seq{seed, static_cast<uint32_t>(m), static_cast<uint32_t>(rank)};
  std::mt19937 rng(seq);
  return static_cast<int>(rng() % 4);
}

// Element j of push `call` of `sender` in minibatch `m`: a small integer, so every partial sum
// is exact in fp32 whatever the order.
float value(int m, int sender, int call, size_t j) {
  return static_cast<float>((m * 7 + sender * 3 + call * 5) % 17) + static_cast<float>(j % 64);
}

struct Expected {  // per minibatch: sum over pushes of the (m, sender, call) term, and #pushes
  std::vector<double> base;
  std::vector<int> pushes;
};

Expected expected_sums(uint32_t seed, int world, int num_minibatches) {
  Expected e;
  for (int m = 0; m < num_minibatches; ++m) {
    double base = 0;
    int pushes = 0;
    for (int s = 0; s < world; ++s) {
      for (int call = 0; call < num_pushes(seed, m, s); ++call) {
        base += value(m, s, call, 0);
        ++pushes;
      }
    }
    e.base.push_back(base);
    e.pushes.push_back(pushes);
  }
  return e;
}

// Runs `body(rank)` on one thread per rank; returns each rank's verdict ("" = ok).
std::vector<std::string> run_threads(int world, const std::function<std::string(int)>& body) {
  std::vector<std::string> outcome(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] { outcome[static_cast<size_t>(rank)] = body(rank); });
  }
  for (auto& thread : threads) thread.join();
  return outcome;
}

struct RunOptions {
  int world = 2;
  int num_minibatches = 10;
  size_t count = 2;  // shard elements per owner
  bool remote_add = false;
  bool deterministic = false;
  uint32_t seed = 7;
  double timeout_s = 60;
};

// The check every rank runs: minibatches of uneven pushes; after each minibatch_end it gathers
// every owner's sums (no barrier in between) and compares them exactly.
std::string run_rank(Communicator& comm, const RunOptions& o, const Expected& expected,
                     int* completed) {
  const int world = comm.world_size();
  auto acc = comm.allocate(o.count, DataType::kFloat32, /*accumulator=*/true);
  if (!acc.ok()) return acc.status().message();
  std::vector<float> src(static_cast<size_t>(world) * o.count);
  std::vector<float> sums(src.size());
  for (int m = 0; m < o.num_minibatches; ++m) {
    if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
    for (int call = 0; call < num_pushes(o.seed, m, comm.rank()); ++call) {
      for (size_t j = 0; j < src.size(); ++j) src[j] = value(m, comm.rank(), call, j);
      if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                             acc.value(), nullptr);
          !s.ok()) {
        return s.message();
      }
    }
    if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
    if (Status s = comm.gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
      return s.message();
    }
    for (size_t j = 0; j < sums.size(); ++j) {
      const double want = expected.base[m] + static_cast<double>(expected.pushes[m]) * (j % 64);
      if (sums[j] != want) {
        return "minibatch " + std::to_string(m) + " element " + std::to_string(j) + " (owner " +
               std::to_string(j / o.count) + "): got " + std::to_string(sums[j]) + ", expected " +
               std::to_string(want);
      }
    }
    if (completed != nullptr) *completed = m + 1;
  }
  return "";
}

std::string describe(const std::vector<std::string>& outcome) {
  std::string text;
  for (size_t r = 0; r < outcome.size(); ++r) {
    if (!outcome[r].empty()) text += "rank " + std::to_string(r) + ": " + outcome[r] + "\n";
  }
  return text;
}

void run_clean(const RunOptions& o) {
  mem::MemOptions mem_options;
  mem_options.remote_fp32_add = o.remote_add;
  mem_options.timeout = std::chrono::duration<double>(o.timeout_s);
  auto world = mem::MemWorld::create(o.world, mem_options);
  const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
  const auto outcome = run_threads(o.world, [&](int rank) {
    Communicator comm(world->join(rank), CommOptions{o.deterministic, nullptr});
    const AccumulationScheme want = o.deterministic ? AccumulationScheme::kPulled
                                    : o.remote_add  ? AccumulationScheme::kRemoteAdd
                                                    : AccumulationScheme::kStaged;
    if (comm.scheme() != want) return std::string("wrong scheme ") + scheme_name(comm.scheme());
    return run_rank(comm, o, expected, nullptr);
  });
  EXPECT_EQ(describe(outcome), "");
}

class Scale : public ::testing::TestWithParam<int> {};

TEST_P(Scale, StagedThousandMinibatchesExact) {
  RunOptions o;
  o.world = GetParam();
  o.num_minibatches = 1000 / kScaleDivisor;
  if (o.world > 64 && kScaleDivisor > 1) o.world = 64;
  run_clean(o);
}

TEST_P(Scale, RemoteAddThousandMinibatchesExact) {
  RunOptions o;
  o.world = GetParam();
  o.num_minibatches = 1000 / kScaleDivisor;
  if (o.world > 64 && kScaleDivisor > 1) o.world = 64;
  o.remote_add = true;
  run_clean(o);
}

TEST_P(Scale, PulledThousandMinibatchesExact) {
  RunOptions o;
  o.world = GetParam();
  o.num_minibatches = 1000 / kScaleDivisor;
  if (o.world > 64 && kScaleDivisor > 1) o.world = 64;
  o.deterministic = true;
  run_clean(o);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Scale, ::testing::Values(2, 64, 128, 256));

// What each scheme adds per rank, from the bytes the core asks the transport for: the shards
// (count fp32), and per scheme: remote add nothing; staged a pending and a staging buffer of
// world x count fp32 each plus world signal words; pulled (deterministic) one pending buffer of
// world x count fp32 (4 bytes per full-gradient element) plus one fixed scratch per communicator.
TEST(Memory, EachSchemeAllocatesItsDocumentedBytes) {
  for (int world : {2, 64}) {
    for (const char* scheme : {"remote-add", "staged", "pulled"}) {
      mem::MemOptions mem_options;
      mem_options.remote_fp32_add = std::string(scheme) == "remote-add";
      auto mem_world = mem::MemWorld::create(world, mem_options);
      const size_t count = 1000;  // elements per shard; two accumulators
      std::vector<size_t> allocated(static_cast<size_t>(world));
      const auto outcome = run_threads(world, [&](int rank) -> std::string {
        auto transport =
            std::make_unique<fault::FaultTransport>(mem_world->join(rank), fault::FaultPlan{});
        fault::FaultTransport* counted = transport.get();
        Communicator comm(std::move(transport),
                          CommOptions{std::string(scheme) == "pulled", nullptr});
        if (std::string(scheme_name(comm.scheme())) != scheme) return "wrong scheme";
        for (int i = 0; i < 2; ++i) {
          if (!comm.allocate(count, DataType::kFloat32, true).ok()) return "alloc failed";
        }
        allocated[static_cast<size_t>(rank)] = counted->allocated_bytes();
        return "";
      });
      ASSERT_EQ(describe(outcome), "");
      const size_t shards = 2 * count * sizeof(float);
      const size_t full = 2 * static_cast<size_t>(world) * count * sizeof(float);
      size_t want = shards;
      if (std::string(scheme) == "staged") {
        want += 2 * full + 2 * static_cast<size_t>(world) * sizeof(uint64_t);
      }
      if (std::string(scheme) == "pulled") want += full + kPullChunkBytes;
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(allocated[static_cast<size_t>(r)], want) << scheme << " at " << world << " ranks";
      }
    }
  }
}

TEST(Scheme, DeterministicIsPulledEvenWithRemoteAdd) {
  RunOptions o;
  o.world = 8;
  o.num_minibatches = 50;
  o.remote_add = true;
  o.deterministic = true;
  run_clean(o);
}

// Deterministic mode: non-integer contributions (sums depend on order), random delays and
// reordered arrivals that differ per run: every run yields the same bits.
std::vector<uint32_t> deterministic_run(int world_size, uint32_t delay_seed, bool remote_add) {
  mem::MemOptions mem_options;
  mem_options.remote_fp32_add = remote_add;
  auto world = mem::MemWorld::create(world_size, mem_options);
  const size_t count = 16;
  std::vector<std::vector<uint32_t>> bits(static_cast<size_t>(world_size));
  const auto outcome = run_threads(world_size, [&](int rank) -> std::string {
    fault::FaultPlan plan;
    plan.max_delay_us = 300;
    plan.reorder = true;
    plan.seed = delay_seed * 1000 + static_cast<uint32_t>(rank);
    Communicator comm(std::make_unique<fault::FaultTransport>(world->join(rank), plan),
                      CommOptions{/*deterministic=*/true, nullptr});
    auto acc = comm.allocate(count, DataType::kFloat32, true);
    if (!acc.ok()) return acc.status().message();
    std::mt19937 values(99 + static_cast<uint32_t>(rank));  // the same data in every run
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> src(static_cast<size_t>(world_size) * count);
    for (int m = 0; m < 5; ++m) {
      if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
      for (int call = 0; call < 1 + (rank + m) % 3; ++call) {
        for (float& x : src) x = uniform(values) * 1e3f;
        if (Status s = comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                               acc.value(), nullptr);
            !s.ok())
          return s.message();
      }
      if (Status s = comm.minibatch_end(nullptr); !s.ok()) return s.message();
    }
    const float* sums = static_cast<const float*>(acc.value()->local());
    for (size_t i = 0; i < count; ++i) {
      uint32_t word;
      std::memcpy(&word, &sums[i], sizeof(word));
      bits[static_cast<size_t>(rank)].push_back(word);
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
  std::vector<uint32_t> all;
  for (const auto& b : bits) all.insert(all.end(), b.begin(), b.end());
  return all;
}

TEST(Deterministic, BitwiseIdenticalUnderRandomDelays) {
  for (bool remote_add : {false, true}) {
    const auto first = deterministic_run(16, 1, remote_add);
    ASSERT_FALSE(first.empty());
    for (uint32_t seed = 2; seed <= 4; ++seed) {
      EXPECT_EQ(deterministic_run(16, seed, remote_add), first) << "delay seed " << seed;
    }
  }
}

// ---- faults ---------------------------------------------------------------------------------

struct FaultResult {
  std::vector<std::string> outcome;
  std::vector<int> completed;  // minibatches each rank finished and verified
};

FaultResult run_with_fault(int world_size, int faulty_rank, fault::FaultPlan plan, bool remote_add,
                           bool kill_on_death = true, bool deterministic = false) {
  mem::MemOptions mem_options;
  mem_options.remote_fp32_add = remote_add;
  mem_options.timeout = std::chrono::duration<double>(1.0);
  auto world = mem::MemWorld::create(world_size, mem_options);
  RunOptions o;
  o.world = world_size;
  o.num_minibatches = 40;
  o.remote_add = remote_add;
  const Expected expected = expected_sums(o.seed, o.world, o.num_minibatches);
  FaultResult result;
  result.completed.assign(static_cast<size_t>(world_size), 0);
  result.outcome = run_threads(world_size, [&](int rank) {
    fault::FaultPlan mine;
    mine.max_delay_us = 200;
    mine.reorder = true;
    mine.seed = 5 + static_cast<uint32_t>(rank);
    if (rank == faulty_rank) {
      plan.seed = mine.seed;
      mine = plan;
    }
    std::function<void()> die;
    if (kill_on_death) die = [&world, rank] { world->kill(rank); };
    Communicator comm(std::make_unique<fault::FaultTransport>(world->join(rank), mine, die),
                      CommOptions{deterministic, nullptr});
    std::string verdict = run_rank(comm, o, expected, &result.completed[static_cast<size_t>(rank)]);
    return verdict;
  });
  return result;
}

// Every rank but the faulty one fails, in the same minibatch, naming the faulty rank, and none
// reports a wrong sum; and every minibatch before it was verified exact.
void expect_named_failure(const FaultResult& r, int faulty, const std::string& what) {
  const std::string faulty_name = "rank " + std::to_string(faulty);
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    const std::string& verdict = r.outcome[rank];
    EXPECT_FALSE(verdict.empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(verdict.find("minibatch "), std::string::npos)
        << "rank " << rank << " saw a wrong sum: " << verdict;
    if (static_cast<int>(rank) == faulty) continue;
    EXPECT_NE(verdict.find(faulty_name), std::string::npos)
        << "rank " << rank << " does not name " << faulty_name << ": " << verdict;
    EXPECT_NE(verdict.find(what), std::string::npos) << "rank " << rank << ": " << verdict;
    EXPECT_GT(r.completed[rank], 0) << "the fault should land mid-run";
  }
}

TEST(Faults, RankDiesMidMinibatch) {
  for (bool remote_add : {false, true}) {
    fault::FaultPlan plan;
    plan.kind = fault::FaultKind::kDieAtCall;
    plan.at_call = 57;
    const FaultResult r = run_with_fault(8, 3, plan, remote_add);
    expect_named_failure(r, 3, "died");
  }
}

TEST(Faults, RankThatFailsWithoutDyingIsNamed) {
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kDieAtCall;
  plan.at_call = 80;
  const FaultResult r = run_with_fault(6, 2, plan, false, /*kill_on_death=*/false);
  expect_named_failure(r, 2, "failed: died");
}

TEST(Faults, DroppedSignalTimesOutNamingTheSender) {
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kDropSignal;
  plan.at_call = 60;
  plan.peer = 4;
  const FaultResult r = run_with_fault(6, 1, plan, false);
  // The owner that lost the signal names the sender, expected and seen values.
  EXPECT_NE(r.outcome[4].find("signal wait (minibatch_end) timed out"), std::string::npos)
      << r.outcome[4];
  EXPECT_NE(r.outcome[4].find("rank 4 waited for rank 1"), std::string::npos) << r.outcome[4];
  EXPECT_NE(r.outcome[4].find("saw"), std::string::npos) << r.outcome[4];
  // Everybody else fails too, naming the owner (it failed, or timed out first); nobody reports
  // success.
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    EXPECT_FALSE(r.outcome[rank].empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(r.outcome[rank].find("minibatch "), std::string::npos) << r.outcome[rank];
    if (rank != 4) {
      EXPECT_NE(r.outcome[rank].find("rank 4"), std::string::npos) << r.outcome[rank];
    }
  }
}

TEST(Faults, DuplicatedSignalsAndPutsCountOnce) {
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kDuplicateSignal;
  plan.at_call = 30;
  plan.peer = 2;
  const FaultResult r = run_with_fault(5, 0, plan, false);
  EXPECT_EQ(describe(r.outcome), "");  // exact sums in all 40 minibatches
  for (int done : r.completed) EXPECT_EQ(done, 40);
}

TEST(Faults, CollectiveMismatchIsNamed) {
  fault::FaultPlan plan;
  plan.kind = fault::FaultKind::kMismatch;
  plan.at_call = 45;
  const FaultResult r = run_with_fault(4, 2, plan, true);
  EXPECT_NE(r.outcome[2].find("collective mismatch"), std::string::npos) << r.outcome[2];
  for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
    EXPECT_FALSE(r.outcome[rank].empty()) << "rank " << rank << " reported success";
    EXPECT_EQ(r.outcome[rank].find("minibatch "), std::string::npos) << r.outcome[rank];
    const bool names = r.outcome[rank].find("collective mismatch") != std::string::npos ||
                       r.outcome[rank].find("rank 2") != std::string::npos;
    EXPECT_TRUE(names) << "rank " << rank << ": " << r.outcome[rank];
  }
}

TEST(Faults, DeathAtEveryEarlyCallNeverHangsOrLies) {
  // Sweep the point of death over the first minibatches of every scheme (staged, remote add,
  // pulled): whatever the call, every survivor fails naming the dead rank and never reports a
  // wrong sum; nothing hangs (each wait is bounded by the 1 s timeout).
  for (int scheme = 0; scheme < 3; ++scheme) {
    const bool remote_add = scheme == 1;
    const bool deterministic = scheme == 2;
    for (int64_t at = 1; at <= 40; at += 3) {
      fault::FaultPlan plan;
      plan.kind = fault::FaultKind::kDieAtCall;
      plan.at_call = at;
      const FaultResult r = run_with_fault(3, 1, plan, remote_add, true, deterministic);
      for (size_t rank = 0; rank < r.outcome.size(); ++rank) {
        EXPECT_EQ(r.outcome[rank].find("minibatch "), std::string::npos)
            << "at call " << at << ", rank " << rank << ": " << r.outcome[rank];
        if (rank != 1) {
          EXPECT_NE(r.outcome[rank].find("rank 1"), std::string::npos)
              << "at call " << at << ", rank " << rank << ": " << r.outcome[rank];
        }
      }
    }
  }
}

}  // namespace
}  // namespace odc
