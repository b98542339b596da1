// The work board: work stealing inside a minibatch (issue #45). Queue r holds rank r's
// microbatches of the minibatch's plan; a rank takes the front of its own queue while it has
// one, then the tail of the open queue with the most predicted cost left (ties: lowest rank).
// Invariant: every microbatch of a minibatch is claimed at most once whatever the timing, and
// exactly once when every rank takes until "done": each queue's state is one 64-bit claim word at
// its owner, [tag: 24][fingerprint: 8][head: 16][tail: 16], changed only by compare-and-swap
// (Transport::compare_swap); thieves claim on a word only while its tag is the minibatch they
// are in, which only the owner sets, when it opens that minibatch's board (docs/protocol.md).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "core/transport.h"

namespace odc {

// What take() claimed: microbatch `index` of rank `queue`'s queue; queue == index == -1 when no
// open queue has an unclaimed microbatch left.
struct WorkClaim {
  int32_t queue = -1;
  int32_t index = -1;
  bool done() const { return queue < 0; }
};

// Microbatches this rank took from its own queue and from other ranks' queues, in the minibatch
// whose board it opened last and since the communicator was made.
struct WorkBoardStats {
  int64_t own_this = 0;
  int64_t stolen_this = 0;
  int64_t own_total = 0;
  int64_t stolen_total = 0;
};

// The claim word's fields.
struct ClaimWord {
  static constexpr int kTagBits = 24;
  static constexpr uint64_t kTagMask = (uint64_t{1} << kTagBits) - 1;
  static constexpr uint32_t kMaxCount = 0xFFFF;  // head and tail are 16 bits

  uint32_t tag = 0;  // 0: never opened
  uint8_t fingerprint = 0;
  uint32_t head = 0;  // claimed from the front (by the owner)
  uint32_t tail = 0;  // claimed from the back (by thieves)

  static ClaimWord unpack(uint64_t word);
  uint64_t pack() const;
};

// The tag of the communicator's minibatch `serial` (1-based count of its minibatch_begin calls):
// 1 .. 2^24 - 1, cycling, never 0 (the tag of a word no owner opened yet).
uint32_t claim_tag(uint64_t serial);

// Validates a plan and keeps it: world_size queues, counts[r] microbatches (<= 65535) each, costs
// (NULL: all 1.0) queue by queue, finite and >= 0. A plan's fingerprint is 8 bits of a hash of
// all of it (counts and cost bits).
class WorkPlan {
 public:
  static Result<WorkPlan> make(int world_size, int num_queues, const int32_t* counts,
                               const double* costs);
  int32_t count(int queue) const { return counts_[static_cast<size_t>(queue)]; }
  // The predicted cost of items [first, last) of `queue`, summed in index order.
  double cost(int queue, uint32_t first, uint32_t last) const;
  uint8_t fingerprint() const { return fingerprint_; }

 private:
  std::vector<int32_t> counts_;
  std::vector<size_t> offsets_;  // where each queue's costs start in costs_
  std::vector<double> costs_;
  uint8_t fingerprint_ = 0;
};

// One per communicator, made at its first open with the claim words (8 bytes per rank, allocated
// collectively by the communicator), which it owns; the transport outlives it.
class WorkBoard {
 public:
  WorkBoard(Transport& transport, std::unique_ptr<SymmetricRegion> words);

  size_t bytes() const { return words_->bytes(); }
  // Whether open() succeeded for minibatch `tag` (take() is allowed).
  bool is_open(uint32_t tag) const { return open_tag_ == tag; }
  // Sets this rank's word to (tag, the plan's fingerprint, 0, 0) by compare-and-swap (thieves of
  // the previous minibatch may still touch it on stream-ordered transports), and resets the
  // counters of this minibatch.
  Status open(uint32_t tag, WorkPlan plan);
  // One claim by the rule above. A word of an open queue with another fingerprint: InvalidUsage
  // naming the queue. A failed or dead peer: the transport's error naming it.
  Result<WorkClaim> take();
  const WorkBoardStats& stats() const { return stats_; }

 private:
  Transport& transport_;
  std::unique_ptr<SymmetricRegion> words_;
  uint32_t open_tag_ = 0;  // 0: not open in any minibatch yet
  WorkPlan plan_;
  uint64_t own_word_ = 0;             // the last value this rank saw of its own word
  std::vector<CompareSwapOp> reads_;  // one read of every rank's word
  std::vector<uint64_t> seen_;
  WorkBoardStats stats_;
};

}  // namespace odc
