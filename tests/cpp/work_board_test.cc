// The work board (core/work_board.h): the claim rule step by step on a few ranks (owner takes its
// front, a thief the tail of the open queue with the most predicted cost left, ties to the lowest
// rank, queues not opened yet left to their owners), its errors, and exactly-once under load:
// 256 ranks (threads on the in-memory transport) for 1,000 minibatches of random plans with random
// delays, a rank dying while it holds a claim (named by every survivor, nothing hangs, no
// minibatch reported complete with a microbatch lost), and processes on the shared-memory
// transport.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/communicator.h"
#include "core/work_board.h"
#include "multiprocess.h"
#include "protocol_harness.h"
#include "transport/fault/fault_transport.h"
#include "transport/mem/mem_transport.h"
#include "transport/shm/shm_transport.h"

namespace odc {
namespace {

using testing::describe;
using testing::run_threads;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string claim_text(const Result<WorkClaim>& claim) {
  if (!claim.ok()) return "error: " + claim.status().message();
  if (claim.value().done()) return "done";
  return "(" + std::to_string(claim.value().queue) + "," + std::to_string(claim.value().index) +
         ")";
}

// Communicators on an in-memory world, ranks as threads; `deterministic` picks the pulled scheme.
std::unique_ptr<Communicator> make_comm(const std::shared_ptr<mem::MemWorld>& world, int rank,
                                        bool deterministic = false) {
  CommOptions options;
  options.deterministic = deterministic;
  return std::make_unique<Communicator>(world->join(rank), options);
}

std::shared_ptr<mem::MemWorld> make_world(int size, double timeout_s = 20.0) {
  mem::MemOptions options;
  options.timeout = std::chrono::duration<double>(timeout_s);
  return mem::MemWorld::create(size, options);
}

TEST(WorkBoard, ClaimWordRoundTripsAndTagsSkipZero) {
  ClaimWord w;
  w.tag = 0xABCDEF;
  w.fingerprint = 0x5A;
  w.head = 65535;
  w.tail = 7;
  const ClaimWord back = ClaimWord::unpack(w.pack());
  EXPECT_EQ(back.tag, w.tag);
  EXPECT_EQ(back.fingerprint, w.fingerprint);
  EXPECT_EQ(back.head, w.head);
  EXPECT_EQ(back.tail, w.tail);
  EXPECT_EQ(claim_tag(1), 1u);
  EXPECT_EQ(claim_tag(ClaimWord::kTagMask), static_cast<uint32_t>(ClaimWord::kTagMask));
  EXPECT_EQ(claim_tag(ClaimWord::kTagMask + 1), 1u);  // 0 means "never opened"
}

// Waits for another rank's step, bounded: a rank that failed before it never takes it.
bool waited(const std::shared_future<void>& step) {
  return step.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
}

// Waits until `count` reaches `value`, bounded.
bool reached(const std::atomic<int>& count, int value) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (count.load() < value) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

// Rank 0 takes everything while ranks 1 and 2 wait, so the order is the rule's alone.
TEST(WorkBoard, OwnerTakesFrontThiefTakesTailOfMostCostLeftTiesToLowestRank) {
  auto world = make_world(3);
  std::promise<void> rank0_done_1, rank0_done_2, rank2_may_open_3, rank0_done_3;
  std::shared_future<void> done_1 = rank0_done_1.get_future().share();
  std::shared_future<void> done_2 = rank0_done_2.get_future().share();
  std::shared_future<void> may_open_3 = rank2_may_open_3.get_future().share();
  std::shared_future<void> done_3 = rank0_done_3.get_future().share();
  std::atomic<int> opened_1{0}, opened_2{0};  // ranks whose queue is open (thieves skip others)
  const auto outcome = run_threads(3, [&](int rank) -> std::string {
    auto comm = make_comm(world, rank);
    // Minibatch 1: queue 1 costs 1,1,1,5 (8 left), queue 2 costs 3,3,3 (9 left).
    const std::vector<int32_t> counts = {1, 4, 3};
    const std::vector<double> costs = {2.0, 1, 1, 1, 5, 3, 3, 3};
    if (!comm->minibatch_begin(nullptr).ok()) return "begin 1 failed";
    Status opened = comm->work_board_open(3, counts.data(), costs.data());
    if (!opened.ok()) return opened.message();
    opened_1.fetch_add(1);
    if (rank == 0) {
      if (!reached(opened_1, 3)) return "a peer never opened";
      // Own front; then queue 2's tail (9 > 8); queue 1's tail (8 > 6); queue 2 (6 > 3); a tie
      // of 3 and 3 goes to queue 1; then queue 2 (3 > 2); queue 1 to its end; done.
      const std::vector<std::string> want = {"(0,0)", "(2,2)", "(1,3)", "(2,1)", "(1,2)",
                                             "(2,0)", "(1,1)", "(1,0)", "done",  "done"};
      for (const std::string& expected : want) {
        const std::string got = claim_text(comm->work_board_take());
        if (got != expected) return "took " + got + ", expected " + expected;
      }
      const WorkBoardStats stats = comm->work_board_stats();
      if (stats.own_this != 1 || stats.stolen_this != 7) {
        return "stats of minibatch 1: own " + std::to_string(stats.own_this) + ", stolen " +
               std::to_string(stats.stolen_this);
      }
      rank0_done_1.set_value();
    } else {
      if (!waited(done_1)) return "rank 0 never reached its step";
      const std::string got = claim_text(comm->work_board_take());
      if (got != "done") return "took " + got + " after rank 0 took everything";
    }
    if (!comm->minibatch_end(nullptr).ok()) return "end 1 failed";

    // Minibatch 2: a thief takes queue 1's tail, its owner the front, no microbatch twice.
    const std::vector<int32_t> counts_2 = {0, 3, 0};
    if (!comm->minibatch_begin(nullptr).ok()) return "begin 2 failed";
    opened = comm->work_board_open(3, counts_2.data(), nullptr);
    if (!opened.ok()) return opened.message();
    opened_2.fetch_add(1);
    if (rank == 0) {
      if (!reached(opened_2, 3)) return "a peer never opened";
      const std::string got = claim_text(comm->work_board_take());
      if (got != "(1,2)") return "thief took " + got + ", expected (1,2)";
      rank0_done_2.set_value();
    }
    if (rank == 1) {
      if (!waited(done_2)) return "rank 0 never reached its step";
      for (const std::string expected : {"(1,0)", "(1,1)", "done"}) {
        const std::string got = claim_text(comm->work_board_take());
        if (got != expected) return "owner took " + got + ", expected " + expected;
      }
    }
    if (rank == 0) {
      const WorkBoardStats stats = comm->work_board_stats();
      if (stats.own_this != 0 || stats.stolen_this != 1 || stats.own_total != 1 ||
          stats.stolen_total != 8) {
        return "stats of minibatch 2 wrong";
      }
    }
    if (!comm->minibatch_end(nullptr).ok()) return "end 2 failed";

    // Minibatch 3: queue 2 is not open until its owner opens it; a thief leaves it alone.
    const std::vector<int32_t> counts_3 = {0, 0, 2};
    if (!comm->minibatch_begin(nullptr).ok()) return "begin 3 failed";
    if (rank == 2 && !waited(may_open_3)) return "rank 0 never reached its step";
    opened = comm->work_board_open(3, counts_3.data(), nullptr);
    if (!opened.ok()) return opened.message();
    if (rank == 0) {
      const std::string got = claim_text(comm->work_board_take());
      if (got != "done") return "took " + got + " from a queue its owner has not opened";
      rank2_may_open_3.set_value();
      rank0_done_3.set_value();
    }
    if (rank == 2) {
      for (const std::string expected : {"(2,0)", "(2,1)", "done"}) {
        const std::string got = claim_text(comm->work_board_take());
        if (got != expected) return "owner took " + got + ", expected " + expected;
      }
    }
    if (rank == 1 && !waited(done_3)) return "rank 0 never reached its step";
    if (!comm->minibatch_end(nullptr).ok()) return "end 3 failed";
    if (comm->memory().work_board_bytes != sizeof(uint64_t)) return "claim words not 8 bytes";
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
}

TEST(WorkBoard, ErrorsNameTheCallAndChangeNothing) {
  auto world = make_world(2);
  const auto outcome = run_threads(2, [&](int rank) -> std::string {
    auto comm = make_comm(world, rank);
    const std::vector<int32_t> counts = {2, 1};
    if (comm->memory().work_board_bytes != 0) return "a board before any open";
    Status s = comm->work_board_open(2, counts.data(), nullptr);
    if (s.code() != StatusCode::kInvalidUsage || !contains(s.message(), "work_board_open") ||
        !contains(s.message(), "no minibatch is open")) {
      return "open outside a minibatch: " + s.message();
    }
    auto taken = comm->work_board_take();
    if (taken.ok() || taken.status().code() != StatusCode::kInvalidUsage ||
        !contains(taken.status().message(), "work_board_take")) {
      return "take outside a minibatch: " + claim_text(taken);
    }
    if (!comm->minibatch_begin(nullptr).ok()) return "begin failed";
    taken = comm->work_board_take();
    if (taken.ok() || !contains(taken.status().message(), "not open")) {
      return "take before open: " + claim_text(taken);
    }
    s = comm->work_board_open(3, counts.data(), nullptr);
    if (s.code() != StatusCode::kInvalidArgument || !contains(s.message(), "num_queues is 3")) {
      return "three queues for two ranks: " + s.message();
    }
    const std::vector<int32_t> too_many = {70000, 1};
    s = comm->work_board_open(2, too_many.data(), nullptr);
    if (s.code() != StatusCode::kInvalidArgument || !contains(s.message(), "counts[0] = 70000")) {
      return "70000 microbatches: " + s.message();
    }
    const std::vector<double> bad_costs = {1.0, std::nan(""), 1.0};
    s = comm->work_board_open(2, counts.data(), bad_costs.data());
    if (s.code() != StatusCode::kInvalidArgument ||
        !contains(s.message(), "microbatch 1 of queue 0")) {
      return "a NaN cost: " + s.message();
    }
    const std::vector<double> negative = {1.0, 1.0, -2.0};
    s = comm->work_board_open(2, counts.data(), negative.data());
    if (s.code() != StatusCode::kInvalidArgument ||
        !contains(s.message(), "microbatch 0 of queue 1")) {
      return "a negative cost: " + s.message();
    }
    if (comm->state() != CommState::kInMinibatch) return "a refused open changed the state";
    if (!(s = comm->work_board_open(2, counts.data(), nullptr)).ok()) return s.message();
    s = comm->work_board_open(2, counts.data(), nullptr);
    if (s.code() != StatusCode::kInvalidUsage || !contains(s.message(), "open already")) {
      return "a second open: " + s.message();
    }
    for (;;) {
      auto claim = comm->work_board_take();
      if (!claim.ok()) return claim.status().message();
      if (claim.value().done()) break;
    }
    if (!comm->minibatch_end(nullptr).ok()) return "end failed";
    taken = comm->work_board_take();
    if (taken.ok() || !contains(taken.status().message(), "no minibatch is open")) {
      return "take after minibatch_end: " + claim_text(taken);
    }
    (void)rank;
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
}

TEST(WorkBoard, DeterministicModeRefusesOpen) {
  auto world = make_world(2);
  const auto outcome = run_threads(2, [&](int rank) -> std::string {
    auto comm = make_comm(world, rank, /*deterministic=*/true);
    if (!comm->minibatch_begin(nullptr).ok()) return "begin failed";
    const std::vector<int32_t> counts = {1, 1};
    const Status s = comm->work_board_open(2, counts.data(), nullptr);
    const std::string want =
        "work stealing changes which rank pushes a microbatch, so the deterministic mode's fixed "
        "summation order cannot hold: turn one of them off";
    if (s.code() != StatusCode::kInvalidUsage || !contains(s.message(), want)) return s.message();
    return comm->minibatch_end(nullptr).ok() ? "" : "end failed after the refusal";
  });
  EXPECT_EQ(describe(outcome), "");
}

// Rank 1 opens with other costs: rank 0, stealing, names queue 1 and fails; rank 1's
// minibatch_end names rank 0.
TEST(WorkBoard, DifferentPlansAreNamed) {
  const std::vector<int32_t> counts = {1, 2};
  std::vector<double> costs_0 = {1.0, 1.0, 1.0};
  std::vector<double> costs_1 = {1.0, 1.0, 2.0};
  // 8 bits of fingerprint: pick costs whose fingerprints differ (as almost all do).
  const uint8_t print_0 = WorkPlan::make(2, 2, counts.data(), costs_0.data()).value().fingerprint();
  while (WorkPlan::make(2, 2, counts.data(), costs_1.data()).value().fingerprint() == print_0) {
    costs_1[2] += 1.0;
  }
  auto world = make_world(2, 5.0);
  std::promise<void> rank1_opened;
  std::shared_future<void> opened_1 = rank1_opened.get_future().share();
  const auto outcome = run_threads(2, [&](int rank) -> std::string {
    auto comm = make_comm(world, rank);
    if (!comm->minibatch_begin(nullptr).ok()) return "begin failed";
    Status s = comm->work_board_open(2, counts.data(), rank == 0 ? costs_0.data() : costs_1.data());
    if (!s.ok()) return s.message();
    if (rank == 1) {
      rank1_opened.set_value();
      s = comm->minibatch_end(nullptr);
      if (s.ok() || !contains(s.message(), "rank 0")) return "end: " + s.message();
      return "";
    }
    if (!waited(opened_1)) return "rank 1 never opened";
    if (claim_text(comm->work_board_take()) != "(0,0)") return "own front not first";
    auto claim = comm->work_board_take();
    if (claim.ok() || claim.status().code() != StatusCode::kInvalidUsage ||
        !contains(claim.status().message(), "different plans") ||
        !contains(claim.status().message(), "queue 1")) {
      return "steal with another plan: " + claim_text(claim);
    }
    if (comm->state() != CommState::kFailed) return "the communicator should fail";
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
}

// A sub-communicator has a board of its own: its queues are its members', its claims never reach
// the parent's board or the other group's.
TEST(WorkBoard, SubCommunicatorsHaveBoardsOfTheirOwn) {
  constexpr int kWorld = 4;
  auto world = make_world(kWorld);
  std::vector<std::atomic<int>> taken(4 * 5);  // per group of 2 and its 2 queues: up to 5 each
  const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
    auto parent = make_comm(world, rank);
    auto made = parent->split(rank % 2, rank);
    if (!made.ok()) return made.status().message();
    std::unique_ptr<Communicator> group = std::move(made).value();
    const int color = rank % 2;
    const std::vector<int32_t> counts = {5, color == 0 ? 2 : 4};
    if (!group->minibatch_begin(nullptr).ok()) return "begin failed";
    Status s = group->work_board_open(2, counts.data(), nullptr);
    if (!s.ok()) return s.message();
    for (;;) {
      auto claim = group->work_board_take();
      if (!claim.ok()) return claim.status().message();
      if (claim.value().done()) break;
      taken[static_cast<size_t>((color * 2 + claim.value().queue) * 5 + claim.value().index)]
          .fetch_add(1);
    }
    if (!group->minibatch_end(nullptr).ok()) return "end failed";
    if (parent->memory().work_board_bytes != 0) return "the parent got a board";
    return "";
  });
  ASSERT_EQ(describe(outcome), "");
  for (int color = 0; color < 2; ++color) {
    const int counts[2] = {5, color == 0 ? 2 : 4};
    for (int queue = 0; queue < 2; ++queue) {
      for (int index = 0; index < 5; ++index) {
        EXPECT_EQ(taken[static_cast<size_t>((color * 2 + queue) * 5 + index)].load(),
                  index < counts[queue] ? 1 : 0)
            << "group " << color << " queue " << queue << " index " << index;
      }
    }
  }
}

// ---- exactly once under load ----------------------------------------------------------------

struct BoardPlan {
  std::vector<int32_t> counts;
  std::vector<double> costs;
  std::vector<size_t> offsets;  // where queue r's microbatches start in the minibatch's records
  size_t total = 0;
};

std::vector<BoardPlan> random_plans(int world, int minibatches, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<BoardPlan> plans(static_cast<size_t>(minibatches));
  for (BoardPlan& plan : plans) {
    for (int r = 0; r < world; ++r) {
      plan.offsets.push_back(plan.total);
      plan.counts.push_back(static_cast<int32_t>(rng() % 9));  // 0..8
      plan.total += static_cast<size_t>(plan.counts.back());
    }
    for (size_t i = 0; i < plan.total; ++i) plan.costs.push_back((rng() % 1000) / 100.0);
  }
  return plans;
}

struct LoadRun {
  std::vector<std::string> outcome;
  // records[m][offset of (queue, index)]: how many ranks computed it.
  std::vector<std::unique_ptr<std::atomic<int>[]>> records;
  std::vector<int> ended;                // per minibatch: survivors whose minibatch_end succeeded
  std::vector<int> held_claim_at_death;  // per minibatch: the dying rank held a claim there
  int64_t stolen = 0;                    // microbatches taken from another rank's queue
};

// Every rank runs `minibatches` of `plans`, taking until done and recording what it took;
// `faulty_rank` dies at call `die_at` (0: nobody dies). Delays: each transport call may sleep up
// to 50 us, and a taken microbatch "computes" for a random moment (a yield or a short sleep).
LoadRun run_load(int world_size, const std::vector<BoardPlan>& plans, int faulty_rank,
                 int64_t die_at, double timeout_s) {
  auto world = make_world(world_size, timeout_s);
  LoadRun run;
  for (const BoardPlan& plan : plans) {
    run.records.emplace_back(new std::atomic<int>[std::max<size_t>(plan.total, 1)]());
  }
  std::vector<std::atomic<int>> ended(plans.size());
  std::vector<std::atomic<int>> held(plans.size());
  std::atomic<int64_t> stolen{0};
  run.outcome = run_threads(world_size, [&](int rank) -> std::string {
    fault::FaultPlan fault_plan;
    fault_plan.max_delay_us = 50;
    fault_plan.seed = 11 + static_cast<uint32_t>(rank);
    if (rank == faulty_rank && die_at > 0) {
      fault_plan.kind = fault::FaultKind::kDieAtCall;
      fault_plan.at_call = die_at;
    }
    auto transport = std::make_unique<fault::FaultTransport>(world->join(rank), fault_plan,
                                                             [&world, rank] { world->kill(rank); });
    const fault::FaultTransport* faults = transport.get();
    Communicator comm(std::move(transport));
    std::mt19937 rng(1000 + static_cast<uint32_t>(rank));
    for (size_t m = 0; m < plans.size(); ++m) {
      const BoardPlan& plan = plans[m];
      Status s = comm.minibatch_begin(nullptr);
      if (!s.ok()) return s.message();
      s = comm.work_board_open(world_size, plan.counts.data(), plan.costs.data());
      if (!s.ok()) return s.message();
      int64_t taken = 0;
      for (;;) {
        auto claim = comm.work_board_take();
        if (!claim.ok()) {
          if (faults->dead() && taken > 0) held[m].fetch_add(1);
          return claim.status().message();
        }
        if (claim.value().done()) break;
        const WorkClaim c = claim.value();
        if (c.index < 0 || c.index >= plan.counts[static_cast<size_t>(c.queue)]) {
          return "claimed (" + std::to_string(c.queue) + "," + std::to_string(c.index) +
                 "), outside the plan";
        }
        run.records[m][plan.offsets[static_cast<size_t>(c.queue)] + static_cast<size_t>(c.index)]
            .fetch_add(1);
        ++taken;
        const uint32_t pause = rng() % 16;
        if (pause == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 100));
        if (pause == 1) std::this_thread::yield();
      }
      const WorkBoardStats stats = comm.work_board_stats();
      if (stats.own_this + stats.stolen_this != taken) return "stats disagree with the takes";
      if (stats.own_this > plan.counts[static_cast<size_t>(rank)]) return "own count too large";
      stolen.fetch_add(stats.stolen_this);
      s = comm.minibatch_end(nullptr);
      if (!s.ok()) {
        if (faults->dead() && taken > 0) held[m].fetch_add(1);
        return s.message();
      }
      ended[m].fetch_add(1);
    }
    return "";
  });
  for (size_t m = 0; m < plans.size(); ++m) {
    run.ended.push_back(ended[m].load());
    run.held_claim_at_death.push_back(held[m].load());
  }
  run.stolen = stolen.load();
  return run;
}

// Where any rank completed minibatch m, every microbatch of m was computed exactly once.
std::string check_exactly_once(const LoadRun& run, const std::vector<BoardPlan>& plans) {
  for (size_t m = 0; m < plans.size(); ++m) {
    if (run.ended[m] == 0) continue;
    for (size_t i = 0; i < plans[m].total; ++i) {
      const int n = run.records[m][i].load();
      if (n != 1) {
        return "minibatch " + std::to_string(m) + " item " + std::to_string(i) + " computed " +
               std::to_string(n) + " times";
      }
    }
  }
  return "";
}

void expect_exactly_once(int world_size, int minibatches) {
  const std::vector<BoardPlan> plans = random_plans(world_size, minibatches, 7);
  const LoadRun run = run_load(world_size, plans, -1, 0, 60.0);
  ASSERT_EQ(describe(run.outcome), "");
  for (int ended : run.ended) ASSERT_EQ(ended, world_size);
  EXPECT_EQ(check_exactly_once(run, plans), "");
  EXPECT_GT(run.stolen, 0) << "no rank stole: the board's races were not exercised";
}

TEST(WorkBoard, ExactlyOnceUnderRandomDelays) {
  expect_exactly_once(64, 100 / testing::kSanitizerDivisor);
}

// The full tier's run (ctest names with _256ranks; scripts/test.sh --full): ~15 s of a busy
// 2-core machine. Scaled down in the sanitizer builds, as protocol_test.cc's scale tests are.
TEST(WorkBoard, ThousandMinibatchesExactlyOnce_256ranks) {
  const int divisor = testing::kSanitizerDivisor;
  expect_exactly_once(divisor == 1 ? 256 : 64, 1000 / divisor);
}

// A rank dies at call k of a sweep (its takes, opens and barriers are calls): every survivor
// fails naming it, nothing hangs, and no minibatch that any rank completed lost a microbatch.
// The sweep lands deaths while the dying rank holds a claim.
TEST(WorkBoard, RankDyingWhileHoldingAClaimIsNamedNothingLost) {
  constexpr int kWorld = 16;
  constexpr int kMinibatches = 20;
  const std::vector<BoardPlan> plans = random_plans(kWorld, kMinibatches, 3);
  int deaths_holding_a_claim = 0;
  for (int64_t die_at = 3; die_at <= 60; die_at += 3) {
    SCOPED_TRACE("death at call " + std::to_string(die_at));
    const int faulty = static_cast<int>(die_at % kWorld);
    const LoadRun run = run_load(kWorld, plans, faulty, die_at, 10.0);
    const std::string name = "rank " + std::to_string(faulty);
    for (int rank = 0; rank < kWorld; ++rank) {
      const std::string& verdict = run.outcome[static_cast<size_t>(rank)];
      ASSERT_FALSE(verdict.empty()) << "rank " << rank << " finished although " << name << " died";
      if (rank == faulty) continue;
      EXPECT_TRUE(contains(verdict, name) && contains(verdict, "died"))
          << "rank " << rank << ": " << verdict;
    }
    EXPECT_EQ(check_exactly_once(run, plans), "");
    for (int held : run.held_claim_at_death) deaths_holding_a_claim += held;
  }
  EXPECT_GT(deaths_holding_a_claim, 0) << "no death landed while the rank held a claim";
}

// Processes on the shared-memory transport: every microbatch of 30 random minibatches taken once.
TEST(WorkBoard, ShmProcessesTakeEachMicrobatchOnce) {
  constexpr int kWorld = 4;
  constexpr int kMinibatches = 30;
  const std::vector<BoardPlan> plans = random_plans(kWorld, kMinibatches, 5);
  size_t slots = 0;
  for (const BoardPlan& plan : plans) slots += plan.total;
  const size_t bytes = std::max<size_t>(slots, 1) * sizeof(int);
  auto* records = static_cast<int*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(records, MAP_FAILED);
  const auto outcome = testing::run_ranks(
      kWorld,
      [&](int rank, int world, const std::string& key) -> std::string {
        auto transport = shm::ShmTransport::create(rank, world, key, std::chrono::seconds(20));
        if (!transport.ok()) return transport.status().message();
        Communicator comm(std::move(transport).value());
        size_t base = 0;
        for (const BoardPlan& plan : plans) {
          Status s = comm.minibatch_begin(nullptr);
          if (!s.ok()) return s.message();
          s = comm.work_board_open(world, plan.counts.data(), plan.costs.data());
          if (!s.ok()) return s.message();
          for (;;) {
            auto claim = comm.work_board_take();
            if (!claim.ok()) return claim.status().message();
            if (claim.value().done()) break;
            const size_t slot = base + plan.offsets[static_cast<size_t>(claim.value().queue)] +
                                static_cast<size_t>(claim.value().index);
            __atomic_fetch_add(&records[slot], 1, __ATOMIC_SEQ_CST);
          }
          s = comm.minibatch_end(nullptr);
          if (!s.ok()) return s.message();
          base += plan.total;
        }
        return "";
      },
      std::chrono::seconds(60), "board");
  EXPECT_EQ(describe(outcome), "");
  for (size_t i = 0; i < slots; ++i) EXPECT_EQ(records[i], 1) << "slot " << i;
  munmap(records, bytes);
}

// A process that dies holding a claim (it exits right after taking its first microbatch of the
// third minibatch): the survivors' takes or minibatch_end fail naming it, none hangs.
TEST(WorkBoard, ShmProcessDyingWithAClaimIsNamed) {
  constexpr int kWorld = 3;
  constexpr int kDying = 2;
  const auto outcome = testing::run_ranks(
      kWorld,
      [&](int rank, int world, const std::string& key) -> std::string {
        auto transport = shm::ShmTransport::create(rank, world, key, std::chrono::seconds(20));
        if (!transport.ok()) return transport.status().message();
        Communicator comm(std::move(transport).value());
        const std::vector<int32_t> counts(static_cast<size_t>(world), 3);
        for (int m = 0; m < 5; ++m) {
          Status s = comm.minibatch_begin(nullptr);
          if (!s.ok()) return s.message();
          s = comm.work_board_open(world, counts.data(), nullptr);
          if (!s.ok()) return s.message();
          for (;;) {
            auto claim = comm.work_board_take();
            if (!claim.ok()) return claim.status().message();
            if (claim.value().done()) break;
            if (rank == kDying && m == 2) _exit(3);  // a crash while computing it
          }
          s = comm.minibatch_end(nullptr);
          if (!s.ok()) return s.message();
        }
        return "finished every minibatch";
      },
      std::chrono::seconds(60), "board-death");
  for (int rank = 0; rank < kWorld; ++rank) {
    if (rank == kDying) continue;
    const std::string& verdict = outcome[static_cast<size_t>(rank)];
    EXPECT_TRUE(contains(verdict, "rank 2") && contains(verdict, "died"))
        << "rank " << rank << ": " << verdict;
  }
}

}  // namespace
}  // namespace odc
