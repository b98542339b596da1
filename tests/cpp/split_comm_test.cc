// Sub-communicators (Communicator::split) on the in-memory transport, threads as ranks, every
// accumulation scheme: groups of several sizes gather exactly their members' shards (bytes counted
// by the fault transport) and meet only among themselves, inside a minibatch of the parent too;
// two splits alive at once, destroyed in different orders; a member's death fails its group
// naming it, and a parent's failure fails the sub-communicators split from it.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/device_streamed_staging.h"
#include "protocol_harness.h"
#include "transport/fault/fault_transport.h"
#include "transport/mem/mem_transport.h"

namespace odc {
namespace {

using testing::comm_options_for;
using testing::describe;
using testing::kAllSchemes;
using testing::mem_options_for;
using testing::run_threads;
using testing::Scheme;
using testing::scheme_label;

std::shared_ptr<mem::MemWorld> make_world(int world, Scheme scheme, double timeout_s = 20) {
  return mem::MemWorld::create(world, mem_options_for(scheme, timeout_s));
}

// A parent communicator of `rank` over a fault transport (delays, no fault) that counts bytes.
// Its staging rings of a few slots (comm_options_for), kept by the sub-communicators too, make
// pushes wait for credit.
std::unique_ptr<Communicator> make_comm(const std::shared_ptr<mem::MemWorld>& world, int rank,
                                        Scheme scheme) {
  fault::FaultPlan plan;
  plan.max_delay_us = 50;
  plan.seed = 11 + static_cast<uint32_t>(rank);
  return std::make_unique<Communicator>(
      std::make_unique<fault::FaultTransport>(world->join(rank), plan,
                                              [world, rank] { world->kill(rank); }),
      comm_options_for(scheme, world->world_size()));
}

fault::FaultTransport& counted(Communicator& comm) {
  return dynamic_cast<fault::FaultTransport&>(comm.transport());
}

size_t bytes_read(Communicator& comm) {
  size_t total = 0;
  for (int p = 0; p < comm.world_size(); ++p) total += counted(comm).bytes_read_from(p);
  return total;
}

constexpr size_t kCount = 300;  // shard elements

// Element j of the shard the member at parent rank `owner` writes in round `round`.
float shard_value(int round, int owner, size_t j) {
  return static_cast<float>((round * 7 + owner * 3 + static_cast<int>(j)) % 61);
}

// The K/V exchange's pattern in `group` (members[i] = parent rank of its rank i): each member
// writes its shard, all meet, every member gathers the group's k shards and checks them, meet
// again before the next round rewrites them. Then a minibatch of pushes into a group accumulator,
// checked exactly. Every byte a gather reads is counted: exactly k shards per gather.
std::string exchange_in_group(Communicator& group, const std::vector<int>& members, int rounds) {
  const int k = group.world_size();
  if (static_cast<size_t>(k) != members.size()) return "group has the wrong size";
  auto shards = group.allocate(kCount, DataType::kFloat32, false, "kv");
  if (!shards.ok()) return shards.status().message();
  std::vector<float> gathered(static_cast<size_t>(k) * kCount);
  const int me = members[static_cast<size_t>(group.rank())];
  for (int round = 0; round < rounds; ++round) {
    auto* mine = static_cast<float*>(shards.value()->local());
    for (size_t j = 0; j < kCount; ++j) mine[j] = shard_value(round, me, j);
    if (Status s = group.barrier(nullptr); !s.ok()) return s.message();
    const size_t before = bytes_read(group);
    if (Status s = group.gather(gathered.data(), gathered.size(), shards.value(), nullptr);
        !s.ok()) {
      return s.message();
    }
    if (bytes_read(group) - before != static_cast<size_t>(k) * kCount * sizeof(float)) {
      return "a gather of " + std::to_string(k) + " members read " +
             std::to_string(bytes_read(group) - before) + " bytes";
    }
    for (size_t j = 0; j < gathered.size(); ++j) {
      const int owner = members[j / kCount];
      if (gathered[j] != shard_value(round, owner, j % kCount)) {
        return "wrong shard of parent rank " + std::to_string(owner) + " in round " +
               std::to_string(round);
      }
    }
    if (Status s = group.barrier(nullptr); !s.ok()) return s.message();
  }
  if (Status s = group.release(shards.value()); !s.ok()) return s.message();
  auto acc = group.allocate(kCount, DataType::kFloat32, true, "grads");
  if (!acc.ok()) return acc.status().message();
  std::vector<float> src(static_cast<size_t>(k) * kCount);
  if (Status s = group.minibatch_begin(nullptr); !s.ok()) return s.message();
  for (int push = 0; push < 3; ++push) {
    for (size_t j = 0; j < src.size(); ++j) src[j] = static_cast<float>((me + push + j) % 5);
    if (Status s = group.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, acc.value(),
                                            nullptr);
        !s.ok()) {
      return s.message();
    }
  }
  if (Status s = group.minibatch_end(nullptr); !s.ok()) return s.message();
  if (Status s = group.gather(gathered.data(), gathered.size(), acc.value(), nullptr); !s.ok()) {
    return s.message();
  }
  for (size_t j = 0; j < gathered.size(); ++j) {
    float want = 0;
    for (int member : members) {
      for (int push = 0; push < 3; ++push) want += static_cast<float>((member + push + j) % 5);
    }
    if (gathered[j] != want) return "wrong group sum at element " + std::to_string(j);
  }
  return group.release(acc.value()).message();
}

// 8 ranks split into groups of 1, 3 and 4 (the last ranked by a descending key) and, at the same
// time, into pairs: each group gathers exactly its members' shards, its buffers take memory on
// its members only (the parent's counts stay as they were), and it meets only its members: the
// ranks outside a group wait in a parent barrier that the group's members join only after all
// their own barriers and minibatches. The two splits are destroyed in different orders.
TEST(SplitComm, GroupsOfSeveralSizesGatherTheirShardsAndMeetAlone) {
  constexpr int kWorld = 8;
  for (Scheme scheme : kAllSchemes) {
    SCOPED_TRACE(scheme_label(scheme));
    auto world = make_world(kWorld, scheme);
    const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
      auto parent = make_comm(world, rank, scheme);
      const int color = rank == 0 ? 0 : (rank < 4 ? 1 : 2);
      auto sized = parent->split(color, color == 2 ? -rank : 0);
      if (!sized.ok()) return sized.status().message();
      auto pairs = parent->split(rank / 2, 0);
      if (!pairs.ok()) return pairs.status().message();
      std::unique_ptr<Communicator> a = std::move(sized).value();
      std::unique_ptr<Communicator> b = std::move(pairs).value();
      if (a == nullptr || b == nullptr) return "a member got no sub-communicator";
      const std::vector<std::vector<int>> groups = {{0}, {1, 2, 3}, {7, 6, 5, 4}};
      const std::vector<int>& members = groups[static_cast<size_t>(color)];
      const int expected_rank =
          static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
      if (a->rank() != expected_rank || b->rank() != rank % 2 || b->world_size() != 2) {
        return "wrong place: rank " + std::to_string(a->rank()) + " of " +
               std::to_string(a->world_size()) + ", pair rank " + std::to_string(b->rank());
      }
      if (scheme_name(a->scheme()) != std::string(scheme_name(parent->scheme()))) {
        return "the sub-communicator has another scheme";
      }
      const size_t parent_allocated = counted(*parent).allocated_bytes();
      const size_t parent_read = bytes_read(*parent);
      // Groups 1 and 2 by turns while the others sit in the parent barrier: both are complete
      // before anyone outside them could take part.
      for (int turn = 1; turn <= 2; ++turn) {
        if (color == turn) {
          if (std::string bad = exchange_in_group(*a, members, 3); !bad.empty()) return bad;
        }
        if (Status s = parent->barrier(nullptr); !s.ok()) return s.message();
      }
      if (color == 0) {  // a group of one
        if (std::string bad = exchange_in_group(*a, members, 1); !bad.empty()) return bad;
      }
      if (std::string bad = exchange_in_group(*b, {rank - rank % 2, rank - rank % 2 + 1}, 2);
          !bad.empty()) {
        return bad;
      }
      if (counted(*parent).allocated_bytes() != parent_allocated ||
          bytes_read(*parent) != parent_read || parent->memory().buffer_bytes != 0) {
        return "the sub-communicators' buffers or gathers went through the parent";
      }
      // Different orders of destruction, where destroy is local (stream-ordered transports meet
      // their group's members in it: the same order on every member there).
      if (scheme != Scheme::kStreamedDevice && rank % 2 == 0) a.reset();
      b.reset();
      a.reset();
      return parent->barrier(nullptr).message();
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// Inside a minibatch of the parent: every rank pushes into the parent's accumulator, then splits
// into pairs, each pair exchanges shards and runs a minibatch of its own, frees its group, and
// the parent's minibatch goes on and ends with exact sums.
TEST(SplitComm, UsableInsideAParentMinibatch) {
  constexpr int kWorld = 6;
  for (Scheme scheme : kAllSchemes) {
    SCOPED_TRACE(scheme_label(scheme));
    auto world = make_world(kWorld, scheme);
    const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
      auto parent = make_comm(world, rank, scheme);
      auto acc = parent->allocate(kCount, DataType::kFloat32, true, "parent grads");
      if (!acc.ok()) return acc.status().message();
      std::vector<float> src(static_cast<size_t>(kWorld) * kCount, 1.0f);
      for (int m = 0; m < 2; ++m) {
        if (Status s = parent->minibatch_begin(nullptr); !s.ok()) return s.message();
        for (int push = 0; push < 2; ++push) {
          if (Status s = parent->scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                                    acc.value(), nullptr);
              !s.ok()) {
            return s.message();
          }
          if (push == 0) {
            auto pair = parent->split(rank / 2, rank);
            if (!pair.ok()) return pair.status().message();
            const int first = rank - rank % 2;
            if (std::string bad = exchange_in_group(*pair.value(), {first, first + 1}, 2);
                !bad.empty()) {
              return bad;
            }
          }
        }
        if (Status s = parent->minibatch_end(nullptr); !s.ok()) return s.message();
        std::vector<float> sums(src.size());
        if (Status s = parent->gather(sums.data(), sums.size(), acc.value(), nullptr); !s.ok()) {
          return s.message();
        }
        for (float sum : sums) {
          if (sum != 2.0f * kWorld) return "wrong parent sum " + std::to_string(sum);
        }
      }
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// A member dies while its group is in a minibatch: its peers in the group fail naming it (its
// rank in the group, read through the label's parent ranks), the other group finishes untouched,
// and the parent then fails naming it too.
TEST(SplitComm, MemberDeathFailsItsGroupNamingIt) {
  constexpr int kWorld = 8;
  constexpr int kDying = 5;  // rank 1 of the group of parent ranks 4, 5, 6, 7
  for (Scheme scheme : kAllSchemes) {
    SCOPED_TRACE(scheme_label(scheme));
    auto world = make_world(kWorld, scheme, 5);
    const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
      auto parent = make_comm(world, rank, scheme);
      auto made = parent->split(rank / 4, rank);
      if (!made.ok()) return made.status().message();
      std::unique_ptr<Communicator> group = std::move(made).value();
      auto acc = group->allocate(kCount, DataType::kFloat32, true, "grads");
      if (!acc.ok()) return acc.status().message();
      std::vector<float> src(4 * kCount, 1.0f);
      if (rank == kDying) {
        if (Status s = group->minibatch_begin(nullptr); !s.ok()) return s.message();
        world->kill(rank);
        // Gone: nothing of this rank takes part any more (its destructors meet nobody).
        parent->abort("dead");
        return "";
      }
      Status failure;
      for (int m = 0; m < 50 && failure.ok(); ++m) {
        failure = group->minibatch_begin(nullptr);
        if (failure.ok()) {
          failure = group->scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                              acc.value(), nullptr);
        }
        if (failure.ok()) failure = group->minibatch_end(nullptr);
      }
      const bool in_dying_group = rank / 4 == kDying / 4;
      if (!in_dying_group) {
        if (!failure.ok()) return "the other group failed: " + failure.message();
      } else if (failure.ok()) {
        return "the dying rank's group did not fail";
      } else if (failure.message().find("rank 1 died") == std::string::npos ||
                 failure.message().find("parent ranks 4, 5, 6, 7") == std::string::npos) {
        return "the group's failure does not name its member: " + failure.message();
      }
      Status parent_failure = parent->barrier(nullptr);
      if (parent_failure.message().find("rank 5 died") == std::string::npos) {
        return "the parent's failure does not name rank 5: " + parent_failure.message();
      }
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// The parent fails on one rank (an abort: an exception inside its minibatch): that rank's
// sub-communicators fail with the parent's reason, and their peers, waiting in a group barrier,
// fail naming that rank and the reason; a sub-communicator's failure leaves the parent as it is.
TEST(SplitComm, ParentFailureFailsItsSubCommunicators) {
  constexpr int kWorld = 4;
  for (Scheme scheme : kAllSchemes) {
    SCOPED_TRACE(scheme_label(scheme));
    auto world = make_world(kWorld, scheme, 5);
    const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
      auto parent = make_comm(world, rank, scheme);
      auto made = parent->split(rank < 2 ? 0 : 1, 0);
      if (!made.ok()) return made.status().message();
      std::unique_ptr<Communicator> group = std::move(made).value();
      if (rank == 2) {  // the other group: its own failure stays its own
        group->abort("group only");
        if (Status s = group->barrier(nullptr);
            s.message().find("group only") == std::string::npos) {
          return "the group did not fail: " + s.message();
        }
      }
      if (rank == 3) {
        Status s = group->barrier(nullptr);
        if (s.message().find("rank 0 failed") == std::string::npos ||
            s.message().find("group only") == std::string::npos) {
          return "the group's peer does not name rank 0 and why: " + s.message();
        }
      }
      if (Status s = parent->barrier(nullptr); !s.ok()) return "parent: " + s.message();
      if (rank == 0) {
        parent->abort("an exception in the step");
        Status s = group->barrier(nullptr);
        if (s.message().find("split from failed") == std::string::npos) {
          return "the sub-communicator did not fail with its parent: " + s.message();
        }
        return "";
      }
      if (rank == 1) {
        Status s = group->barrier(nullptr);
        if (s.message().find("rank 0 failed") == std::string::npos ||
            s.message().find("an exception in the step") == std::string::npos) {
          return "the peer does not name rank 0 and the reason: " + s.message();
        }
      }
      return "";
    });
    EXPECT_EQ(describe(outcome), "");
  }
}

// design.md's progress rule: rank 0 pushes a slice larger than its ring at rank 1, then waits for
// rank 1 elsewhere; rank 1 waits there first and pushes only after. Rank 1 folds nothing inside
// that wait, so rank 0's credit can only come from rank 1's progress thread (host folds; on the
// emulated device, a pass of the fold kernel). Where rank 1 waits: its sub-communicator's barrier,
// a second communicator's barrier, or outside odc (a torch collective's stand-in); at the least
// staging budget and at the default (256 MiB: rings of 16 MiB per sender on the host, 64 on the
// device, so slices of 24 and 96 MiB). Every sum exact; before the progress thread each case
// waited out the timeout.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
// Under the sanitizers (scripts/sanitize.sh) the least budget only: the default's slices are
// hundreds of MiB, folded ~10x slower there.
constexpr bool kDefaultBudgetToo = false;
#else
constexpr bool kDefaultBudgetToo = true;
#endif

TEST(SplitComm, PushesProgressWhileTheirOwnerWaitsElsewhere) {
  constexpr int kWorld = 2;
  enum class WaitsIn { kChildBarrier, kSecondComm, kOutsideOdc };
  for (Scheme scheme : {Scheme::kStreamed, Scheme::kStreamedDevice}) {
    const bool device = scheme == Scheme::kStreamedDevice;
    // One slot of the smallest payload per sender (and on the device the outbox and fold words).
    const RingGeometry one_slot{kChunkHeaderBytes + kMinChunkPayloadBytes, 1};
    const size_t least = device ? DeviceStreamedStaging::bytes_for(one_slot, kWorld)
                                : RingGeometry::least_budget(kWorld);
    std::vector<size_t> budgets{least};
    if (kDefaultBudgetToo) budgets.push_back(kDefaultStagingBytes);
    for (size_t budget : budgets) {
      for (WaitsIn where : {WaitsIn::kChildBarrier, WaitsIn::kSecondComm, WaitsIn::kOutsideOdc}) {
        SCOPED_TRACE(std::string(scheme_label(scheme)) + ", budget " + std::to_string(budget) +
                     ", waits in " + std::to_string(static_cast<int>(where)));
        auto world = make_world(kWorld, scheme, 10);
        auto second_world = make_world(kWorld, scheme, 10);
        std::promise<void> pushed;  // rank 0 -> rank 1, outside odc
        std::shared_future<void> pushed_seen = pushed.get_future().share();
        const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
          Communicator parent(world->join(rank), comm_options_for(scheme, kWorld, budget));
          Communicator second(second_world->join(rank), comm_options_for(scheme, kWorld));
          auto made = parent.split(0, rank);
          if (!made.ok()) return made.status().message();
          std::unique_ptr<Communicator> child = std::move(made).value();
          // The smallest shard whose slice fills the ring at the owner one and a half times over.
          const RingGeometry geometry =
              device ? DeviceStreamedStaging::geometry_for(budget, kWorld).value()
                     : RingGeometry::for_budget(budget, kWorld).value();
          const size_t count = geometry.depth * geometry.payload_bytes() / sizeof(float) * 3 / 2;
          auto acc = parent.allocate(count, DataType::kFloat32, true, "grads");
          if (!acc.ok()) return acc.status().message();
          if (parent.staging()->geometry().ring_bytes() != geometry.ring_bytes()) {
            return "the rings are not the budget's";
          }
          std::vector<float> src(kWorld * count);
          for (size_t j = 0; j < src.size(); ++j) src[j] = static_cast<float>((rank + j) % 7);
          if (Status s = parent.minibatch_begin(nullptr); !s.ok()) return s.message();
          const auto push = [&] {
            return parent.scatter_accumulate(src.data(), src.size(), DataType::kFloat32,
                                             acc.value(), nullptr);
          };
          const auto meet = [&]() -> Status {
            switch (where) {
              case WaitsIn::kChildBarrier:
                return child->barrier(nullptr);
              case WaitsIn::kSecondComm:
                return second.barrier(nullptr);
              case WaitsIn::kOutsideOdc:
                if (rank == 0) {
                  pushed.set_value();
                } else if (pushed_seen.wait_for(std::chrono::seconds(30)) !=
                           std::future_status::ready) {
                  return Status::Timeout("rank 0 never finished its push");
                }
                return Status::Ok();
            }
            return Status::Ok();
          };
          const std::vector<std::function<Status()>> steps =
              rank == 0 ? std::vector<std::function<Status()>>{push, meet}
                        : std::vector<std::function<Status()>>{meet, push};
          for (const auto& step : steps) {
            if (Status s = step(); !s.ok()) return s.message();
          }
          if (Status s = parent.minibatch_end(nullptr); !s.ok()) return s.message();
          const auto* sums = static_cast<const float*>(acc.value()->local());
          for (size_t j = 0; j < count; ++j) {
            float want = 0;
            for (int r = 0; r < kWorld; ++r) {
              want += static_cast<float>((r + static_cast<size_t>(rank) * count + j) % 7);
            }
            if (sums[j] != want) return "wrong sum at element " + std::to_string(j);
          }
          return "";
        });
        EXPECT_EQ(describe(outcome), "");
      }
    }
  }
}

// A fold the progress thread runs can fail too: rank 0's arrival signals to rank 1 are inflated
// (a stray signal), rank 0's ring of one slot fills at once, and rank 1, waiting outside odc, is
// served by its progress thread, whose fold refuses the signal. The failure is kept and returned
// by rank 1's next call, which fails its communicator naming it; nothing is summed.
TEST(SplitComm, AFailureOfTheProgressThreadsFoldIsReturnedByTheNextCall) {
  constexpr int kWorld = 2;
  auto world = make_world(kWorld, Scheme::kStreamed, 2);
  std::promise<void> pushed;  // rank 0 -> rank 1, outside odc: its push returned (or failed)
  std::shared_future<void> pushed_seen = pushed.get_future().share();
  const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
    fault::FaultPlan plan;
    if (rank == 0) {
      plan.kind = fault::FaultKind::kInflateSignal;
      plan.peer = 1;
    }
    Communicator comm(
        std::make_unique<fault::FaultTransport>(world->join(rank), plan),
        comm_options_for(Scheme::kStreamed, kWorld, RingGeometry::least_budget(kWorld)));
    const size_t count = 4 * kMinChunkPayloadBytes / sizeof(float);  // 4 chunks per slice
    auto acc = comm.allocate(count, DataType::kFloat32, true, "grads");
    if (!acc.ok()) return acc.status().message();
    std::vector<float> src(kWorld * count, 1.0f);
    if (Status s = comm.minibatch_begin(nullptr); !s.ok()) return s.message();
    if (rank == 0) {
      Status s =
          comm.scatter_accumulate(src.data(), src.size(), DataType::kFloat32, acc.value(), nullptr);
      pushed.set_value();
      return s.ok() ? "rank 0's push went through a refused fold" : "";
    }
    if (pushed_seen.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
      return "rank 0's push never returned";
    }
    Status s = comm.minibatch_end(nullptr);
    if (s.message().find("progress thread") == std::string::npos ||
        s.message().find("stray signal") == std::string::npos) {
      return "the progress thread's refusal is not what fails: " + s.message();
    }
    return comm.state() == CommState::kFailed ? "" : "the communicator did not fail";
  });
  EXPECT_EQ(describe(outcome), "");
}

// A negative colour joins no group; a rank that splits while the others allocate fails, and so do
// they, naming each other's collective instead of pairing up.
TEST(SplitComm, NoColourGetsNullAndAMismatchIsNamed) {
  constexpr int kWorld = 3;
  auto world = make_world(kWorld, Scheme::kStreamed, 5);
  const auto outcome = run_threads(kWorld, [&](int rank) -> std::string {
    auto parent = make_comm(world, rank, Scheme::kStreamed);
    auto made = parent->split(rank == 1 ? kSplitNoColor : 0, 0);
    if (!made.ok()) return made.status().message();
    if ((made.value() == nullptr) != (rank == 1)) return "wrong membership";
    if (made.value() != nullptr && made.value()->world_size() != 2) return "wrong group size";
    made.value().reset();
    if (rank == 0) {
      auto wrong = parent->split(0, 0);
      if (wrong.ok() || wrong.status().message().find("collective mismatch") == std::string::npos) {
        return "split against alloc was not named: " + wrong.status().message();
      }
      return "";
    }
    auto wrong = parent->allocate(4, DataType::kFloat32, false);
    if (wrong.ok()) return "alloc against split succeeded";
    // The split's record used to be read as a buffer request ("rank 0 asked for 0
    // float32 elements named \"...\"", its random name's bytes as the buffer's name).
    const std::string& message = wrong.status().message();
    if (message.find("collective mismatch: rank 0 called split where this rank called alloc") ==
            std::string::npos ||
        message.find("buffers differ") != std::string::npos ||
        message.find("named") != std::string::npos) {
      return "alloc against split was not named: " + message;
    }
    return "";
  });
  EXPECT_EQ(describe(outcome), "");
}

}  // namespace
}  // namespace odc
