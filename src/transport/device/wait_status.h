// How a device-side wait's record (kernels/wait_record.h) reads as a Status, for every device
// transport: a collective mismatch names both collectives, a timed-out barrier names the epoch and
// collective of both sides, other waits name their site, rank, peer and values. Pure functions of
// the record (no CUDA call), header-only so that libodc and the NVSHMEM plugin word them alike and
// CPU tests check them without a GPU (tests/cpp/device_barrier_word_test.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <sstream>
#include <string>

#include "common/status.h"
#include "core/transport.h"
#include "kernels/wait_record.h"

namespace odc::device {

// The collective a barrier word carries, by name ("minibatch_begin").
inline const char* barrier_word_op_name(uint64_t word) {
  return collective_op_name(static_cast<CollectiveOp>(kernels::barrier_op(word)));
}

// "minibatch_end #3" for a device barrier word, "none" before the first, "failed" for the word a
// failed rank leaves (kernels::kBarrierPeerFailed).
inline std::string describe_barrier_word(uint64_t word) {
  if (word == 0) return "none";
  if (word == kernels::kBarrierPeerFailed) return "failed";
  return std::string(barrier_word_op_name(word)) + " #" +
         std::to_string(kernels::barrier_epoch(word));
}

inline const char* wait_site_name(int32_t site) {
  switch (site) {
    case kernels::kWaitBarrier:
      return "device barrier";
    case kernels::kWaitSlotFree:
      return "staging slot release";
    case kernels::kWaitSlotReady:
      return "staging slot arrival";
    case kernels::kWaitFetch:
      return "gather of a published buffer: the node's fetch of remote shards";
    case kernels::kWaitPeerFailed:
      return "device barrier (the peer failed)";
    case kernels::kWaitCredit:
      return "credit wait (scatter_accumulate)";
    case kernels::kWaitStreamEnd:
      return "push wait (minibatch_end)";
    case kernels::kWaitFetchPeerFailed:
      return "gather of a published buffer (the fetching rank failed)";
    case kernels::kWaitMeeting:
      return "meeting of every rank before a collective inside a minibatch";
    default:
      return "device wait";
  }
}

// What `record` says (Ok where no wait failed). `timeout_ns` bounded the waits; `failure_of(peer)`
// is what the bootstrap knows of a failed peer (appended to the messages that name one; may be
// empty).
inline Status wait_record_status(const kernels::WaitError& record, int64_t timeout_ns,
                                 const std::function<std::string(int)>& failure_of) {
  const auto peer_failure = [&] { return failure_of ? failure_of(record.peer) : std::string(); };
  const double timeout_s = static_cast<double>(timeout_ns) / 1e9;
  switch (record.site) {
    case kernels::kWaitNone:
      return Status::Ok();
    case kernels::kWaitMismatch:
      // expected: this rank's word; seen: the peer's, at the same epoch.
      return Status::RemoteError("collective mismatch: rank " + std::to_string(record.peer) +
                                 " called " + barrier_word_op_name(record.seen) +
                                 " where this rank called " +
                                 barrier_word_op_name(record.expected) + " (device barrier #" +
                                 std::to_string(kernels::barrier_epoch(record.expected)) + ")");
    case kernels::kWaitPeerFailed:
      return Status::RemoteError("rank " + std::to_string(record.peer) +
                                 " failed (it ended its part of the device barrier in " +
                                 describe_barrier_word(record.expected) +
                                 "; its own error says why)" + peer_failure());
    case kernels::kWaitFetchPeerFailed:
      return Status::RemoteError("rank " + std::to_string(record.peer) +
                                 " failed (seen by a gather waiting for its node fetch; its own "
                                 "error says why)" +
                                 peer_failure());
    case kernels::kWaitBarrier: {
      std::ostringstream message;
      message << "device barrier timed out after " << timeout_s << " s: rank " << record.rank
              << " waited for rank " << record.peer << " in "
              << describe_barrier_word(record.expected) << " (the last it saw of rank "
              << record.peer << ": " << describe_barrier_word(record.seen) << ")";
      return Status::Timeout(message.str());
    }
    case kernels::kWaitBadChunk:
      // A sender that failed (its credit wait expired, say) still puts whatever its outbox holds,
      // so the refusal may be its failure's echo: that failure is named beside the facts (which
      // came first is not known here; each rank's own error says what it saw).
      if (const std::string failure = peer_failure(); !failure.empty()) {
        return Status::RemoteError("streamed fold: rank " + std::to_string(record.rank) +
                                   " refused chunk " + std::to_string(record.expected) +
                                   " from rank " + std::to_string(record.peer) + " (saw " +
                                   std::to_string(record.seen) +
                                   " instead; nothing of it was added), and rank " +
                                   std::to_string(record.peer) + " has failed" + failure);
      }
      return Status::InternalError(
          "streamed fold: rank " + std::to_string(record.rank) + " refused chunk " +
          std::to_string(record.expected) + " from rank " + std::to_string(record.peer) + ": saw " +
          std::to_string(record.seen) +
          " instead (a slot holding another chunk, a signal or end beyond what the ring holds, or "
          "a chunk for no live accumulator: a lost put, a stray or doubled signal or credit); "
          "nothing of it was added");
    default: {
      std::ostringstream message;
      message << wait_site_name(record.site) << " timed out after " << timeout_s << " s: rank "
              << record.rank << " waited for rank " << record.peer << " (expected "
              << record.expected << ", saw " << record.seen << ")";
      return Status::Timeout(message.str());
    }
  }
}

}  // namespace odc::device
