// The device barrier's word on the CPU: what every device transport (CUDA IPC, NVSHMEM) announces
// in a device barrier carries the epoch and the collective (kernels/wait_record.h), one rule
// decides how a peer's word stands, and the record a failed wait leaves reads the same on every
// device transport (transport/device/wait_status.h). So ranks that meet in different collectives
// fail naming both on NVSHMEM as on CUDA; tests/gpu runs the same on GPUs.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/transport.h"
#include "kernels/wait_record.h"
#include "transport/device/wait_status.h"

namespace odc {
namespace {

using kernels::barrier_epoch;
using kernels::barrier_op;
using kernels::barrier_word;
using kernels::barrier_word_state;
using kernels::BarrierWordState;

const std::vector<CollectiveOp> kEveryOp = {
    CollectiveOp::kInit,    CollectiveOp::kExchange,       CollectiveOp::kAllocate,
    CollectiveOp::kRelease, CollectiveOp::kMinibatchBegin, CollectiveOp::kMinibatchEnd,
    CollectiveOp::kBarrier, CollectiveOp::kDestroy};

uint64_t word(uint64_t epoch, CollectiveOp op) {
  return barrier_word(epoch, static_cast<uint32_t>(op));
}

TEST(DeviceBarrierWord, CarriesEpochAndCollective) {
  for (const uint64_t epoch :
       {uint64_t{1}, uint64_t{2}, uint64_t{255}, uint64_t{1} << 24, (uint64_t{1} << 56) - 1}) {
    for (const CollectiveOp op : kEveryOp) {
      const uint64_t w = word(epoch, op);
      EXPECT_EQ(barrier_epoch(w), epoch);
      EXPECT_EQ(barrier_op(w), static_cast<uint32_t>(op));
      EXPECT_NE(w, kernels::kBarrierPeerFailed);
    }
  }
}

TEST(DeviceBarrierWord, GrowsWithTheEpochWhateverTheCollective) {
  // A peer that has moved on to a later barrier compares as arrived, whatever it is in now.
  for (const CollectiveOp earlier : kEveryOp) {
    for (const CollectiveOp later : kEveryOp) {
      EXPECT_LT(word(7, earlier), word(8, later));
    }
  }
}

TEST(DeviceBarrierWord, SameEpochInAnotherCollectiveIsAMismatch) {
  const uint64_t mine = word(5, CollectiveOp::kBarrier);
  EXPECT_EQ(barrier_word_state(0, mine), BarrierWordState::kNotYet);  // nothing announced yet
  EXPECT_EQ(barrier_word_state(word(4, CollectiveOp::kBarrier), mine), BarrierWordState::kNotYet);
  EXPECT_EQ(barrier_word_state(word(4, CollectiveOp::kMinibatchBegin), mine),
            BarrierWordState::kNotYet);
  EXPECT_EQ(barrier_word_state(mine, mine), BarrierWordState::kArrived);
  EXPECT_EQ(barrier_word_state(word(6, CollectiveOp::kMinibatchEnd), mine),
            BarrierWordState::kArrived);
  for (const CollectiveOp other : kEveryOp) {
    if (other == CollectiveOp::kBarrier) continue;
    EXPECT_EQ(barrier_word_state(word(5, other), mine), BarrierWordState::kMismatch)
        << collective_op_name(other);
  }
}

// What a device wait of `rank` records when it sees `peer`'s word (kernels/device_sync.cuh's
// wait_barrier_word, by the same rule), or kWaitNone where the peer arrived.
kernels::WaitError wait_once(int rank, int peer, uint64_t mine, uint64_t theirs) {
  kernels::WaitError record{};
  if (barrier_word_state(theirs, mine) == BarrierWordState::kMismatch) {
    record = {kernels::kWaitMismatch, rank, peer, 0, mine, theirs, nullptr};
  }
  return record;
}

TEST(DeviceBarrierWord, MismatchIsNamedOnBothRanks) {
  // Both ranks passed barrier #1 together; then rank 0 calls barrier() and rank 1
  // minibatch_begin(): the second device barrier of each.
  const uint64_t rank0 = word(2, CollectiveOp::kBarrier);
  const uint64_t rank1 = word(2, CollectiveOp::kMinibatchBegin);
  const Status seen_by_0 =
      device::wait_record_status(wait_once(0, 1, rank0, rank1), 10'000'000'000, nullptr);
  ASSERT_EQ(seen_by_0.code(), StatusCode::kRemoteError);
  EXPECT_EQ(seen_by_0.message(),
            "collective mismatch: rank 1 called minibatch_begin where this rank called barrier "
            "(device barrier #2)");
  const Status seen_by_1 =
      device::wait_record_status(wait_once(1, 0, rank1, rank0), 10'000'000'000, nullptr);
  ASSERT_EQ(seen_by_1.code(), StatusCode::kRemoteError);
  EXPECT_EQ(seen_by_1.message(),
            "collective mismatch: rank 0 called barrier where this rank called minibatch_begin "
            "(device barrier #2)");
  // The same collective pairs up and records nothing.
  EXPECT_TRUE(device::wait_record_status(wait_once(0, 1, rank0, rank0), 1, nullptr).ok());
}

TEST(DeviceBarrierWord, TimeoutNamesTheCollectiveOfBothSides) {
  const kernels::WaitError record{kernels::kWaitBarrier,
                                  0,
                                  3,
                                  0,
                                  word(3, CollectiveOp::kMinibatchEnd),
                                  word(2, CollectiveOp::kMinibatchBegin),
                                  nullptr};
  const Status status = device::wait_record_status(record, 2'500'000'000, nullptr);
  ASSERT_EQ(status.code(), StatusCode::kTimeout);
  EXPECT_EQ(status.message(),
            "device barrier timed out after 2.5 s: rank 0 waited for rank 3 in minibatch_end #3 "
            "(the last it saw of rank 3: minibatch_begin #2)");
}

TEST(DeviceBarrierWord, FailedPeerIsNamedWithWhatTheBootstrapKnows) {
  const kernels::WaitError record{
      kernels::kWaitPeerFailed,    1,      2, 0, word(4, CollectiveOp::kMinibatchEnd),
      kernels::kBarrierPeerFailed, nullptr};
  const Status status = device::wait_record_status(
      record, 1'000'000'000, [](int peer) { return " (rank " + std::to_string(peer) + ": oom)"; });
  ASSERT_EQ(status.code(), StatusCode::kRemoteError);
  EXPECT_EQ(status.message(),
            "rank 2 failed (it ended its part of the device barrier in minibatch_end #4; its own "
            "error says why) (rank 2: oom)");
}

TEST(DeviceBarrierWord, ARefusedChunkFromAFailedSenderNamesItsFailure) {
  // Seen on 2 x H200 (2026-11-28): rank 0's credit wait expired, its later puts carried a stale
  // outbox, and rank 1 reported an internal error instead of rank 0's failure.
  const kernels::WaitError record{kernels::kWaitBadChunk, 1, 0, 0, 1, 34, nullptr};
  const Status unknown = device::wait_record_status(record, 1'000'000'000, nullptr);
  ASSERT_EQ(unknown.code(), StatusCode::kInternalError);
  EXPECT_NE(unknown.message().find("refused chunk 1 from rank 0: saw 34"), std::string::npos);
  const Status named = device::wait_record_status(record, 1'000'000'000, [](int peer) {
    return ": rank " + std::to_string(peer) + " timed out";
  });
  ASSERT_EQ(named.code(), StatusCode::kRemoteError);
  EXPECT_EQ(named.message(),
            "streamed fold: rank 1 refused chunk 1 from rank 0 (saw 34 instead; nothing of it was "
            "added), and rank 0 has failed: rank 0 timed out");
}

TEST(DeviceBarrierWord, OtherWaitsNameTheirSite) {
  const kernels::WaitError none{};
  EXPECT_TRUE(device::wait_record_status(none, 1, nullptr).ok());
  const kernels::WaitError credit{kernels::kWaitCredit, 0, 1, 0, 9, 7, nullptr};
  const Status status = device::wait_record_status(credit, 1'000'000'000, nullptr);
  ASSERT_EQ(status.code(), StatusCode::kTimeout);
  EXPECT_EQ(status.message(),
            "credit wait (scatter_accumulate) timed out after 1 s: rank 0 waited for rank 1 "
            "(expected 9, saw 7)");
}

}  // namespace
}  // namespace odc
