// What a bounded device-side wait leaves behind, as plain data (no CUDA types): the error record
// (WaitError, where it waited) and the word a rank announces in a device barrier (epoch and
// collective). Shared by the kernels that write them and by the host code that reads them back
// into messages, which CPU tests check without a GPU (tests/cpp/device_barrier_word_test.cc).
// Invariant: a barrier word always carries the caller's collective, on every device transport.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ODC_HOST_DEVICE __host__ __device__
#else
#define ODC_HOST_DEVICE
#endif

namespace odc::kernels {

enum WaitSite : int32_t {
  kWaitNone = 0,
  kWaitBarrier = 1,    // device_barrier: peer has not reached the epoch
  kWaitSlotFree = 2,   // staged push: owner has not released our slot from the previous push
  kWaitSlotReady = 3,  // staged accumulate: sender's slot has not landed
  // 4 was the staged scheme's signal wait (retired): not reused, so old records stay readable.
  kWaitMismatch = 5,    // device_barrier: a peer announced the same epoch in another collective
  kWaitFetch = 6,       // node-cached gather: a rank of the node has not fetched its rows yet
  kWaitPeerFailed = 7,  // device_barrier: the peer marked itself failed (kBarrierPeerFailed)
  kWaitSelfFailed = 8,  // this rank failed on the host (set by the host: stay silent)
  kWaitCredit = 9,      // streamed push: the owner has not freed a slot of this rank's ring
  kWaitStreamEnd = 10,  // streamed minibatch_end: a sender has not ended its pushes here
  kWaitMeeting = 11,    // streamed collective inside a minibatch: a rank has not reached it
  kWaitBadChunk = 12,   // streamed fold: a slot holds another chunk than its signal covers
  kWaitFetchPeerFailed = 13,  // wait_slots: the rank waited for marked itself failed
};

// Written by the first wait that expires (first writer wins); `site` == kWaitNone means no error.
// Every wait reads it first (fail fast), so keep it in device memory and copy it out once the
// stream is synchronized; host-mapped memory also works but costs a PCIe read per wait.
struct WaitError {
  int32_t site;
  int32_t rank;  // the rank that waited
  int32_t peer;  // the rank it waited for
  int32_t reserved;
  uint64_t expected;  // the value it waited for (at least)
  uint64_t seen;      // the last value it read
  // Optional: a WaitError in host-mapped pinned memory (its device address) that receives a copy
  // of the record, site written last, so the host can poll for errors without a CUDA call.
  WaitError* host_mirror;
};

// What a rank that failed writes into its slot of every peer's barrier words (host side, on a
// stream of its own), so that a peer waiting for it in a device barrier ends at once naming it
// (kWaitPeerFailed) instead of at its timeout. No real word reaches it (epochs are counters).
inline constexpr uint64_t kBarrierPeerFailed = ~uint64_t{0};

// What a rank announces in a device barrier: the epoch in the high bits, the caller's collective
// (an opaque tag below 256, e.g. odc::CollectiveOp) in the low byte, as the host transport does.
// Words grow with the epoch, so a peer that has moved on to a later barrier still compares as
// "arrived"; at the same epoch a different tag is a collective mismatch.
inline constexpr int kBarrierOpBits = 8;
ODC_HOST_DEVICE inline constexpr uint64_t barrier_word(uint64_t epoch, uint32_t op) {
  return (epoch << kBarrierOpBits) | (op & ((1u << kBarrierOpBits) - 1));
}
ODC_HOST_DEVICE inline constexpr uint64_t barrier_epoch(uint64_t word) {
  return word >> kBarrierOpBits;
}
ODC_HOST_DEVICE inline constexpr uint32_t barrier_op(uint64_t word) {
  return static_cast<uint32_t>(word & ((1u << kBarrierOpBits) - 1));
}

// How a wait for one peer's barrier word stands: arrived (the same word, or a later epoch), not
// yet (an earlier epoch), or a mismatch (this epoch announced in another collective). One rule
// for the device barriers of every transport (kernels/device_sync.cuh) and the CPU tests.
enum class BarrierWordState : int { kNotYet = 0, kArrived = 1, kMismatch = -1 };
ODC_HOST_DEVICE inline constexpr BarrierWordState barrier_word_state(uint64_t seen, uint64_t mine) {
  return barrier_epoch(seen) > barrier_epoch(mine)   ? BarrierWordState::kArrived
         : barrier_epoch(seen) < barrier_epoch(mine) ? BarrierWordState::kNotYet
         : seen == mine                              ? BarrierWordState::kArrived
                                                     : BarrierWordState::kMismatch;
}

}  // namespace odc::kernels
