// The work board (see work_board.h): the claim rule over Transport::compare_swap.
#include "core/work_board.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

namespace odc {
namespace {

constexpr int kFingerprintShift = 32;
constexpr int kHeadShift = 16;
constexpr uint64_t kField16 = 0xFFFF;

uint64_t fnv1a_bytes(uint64_t hash, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

}  // namespace

ClaimWord ClaimWord::unpack(uint64_t word) {
  ClaimWord w;
  w.tag = static_cast<uint32_t>(word >> (kFingerprintShift + 8));
  w.fingerprint = static_cast<uint8_t>(word >> kFingerprintShift);
  w.head = static_cast<uint32_t>((word >> kHeadShift) & kField16);
  w.tail = static_cast<uint32_t>(word & kField16);
  return w;
}

uint64_t ClaimWord::pack() const {
  return (uint64_t{tag} & kTagMask) << (kFingerprintShift + 8) |
         uint64_t{fingerprint} << kFingerprintShift | (uint64_t{head} & kField16) << kHeadShift |
         (uint64_t{tail} & kField16);
}

uint32_t claim_tag(uint64_t serial) {
  // Serials 1, 2, ... map to tags 1 .. 2^24 - 1 and around again; 0 stays "never opened".
  return static_cast<uint32_t>((serial - 1) % ClaimWord::kTagMask) + 1;
}

Result<WorkPlan> WorkPlan::make(int world_size, int num_queues, const int32_t* counts,
                                const double* costs) {
  if (num_queues != world_size) {
    return Status::InvalidArgument("num_queues is " + std::to_string(num_queues) +
                                   " but the communicator has " + std::to_string(world_size) +
                                   " ranks: pass one queue (a count of microbatches) per rank");
  }
  if (counts == nullptr) return Status::InvalidArgument("counts is NULL");
  WorkPlan plan;
  int64_t total = 0;
  for (int r = 0; r < num_queues; ++r) {
    if (counts[r] < 0 || static_cast<uint32_t>(counts[r]) > ClaimWord::kMaxCount) {
      return Status::InvalidArgument("counts[" + std::to_string(r) +
                                     "] = " + std::to_string(counts[r]) + ": a queue holds 0 to " +
                                     std::to_string(ClaimWord::kMaxCount) +
                                     " microbatches (the claim word counts them in 16 bits)");
    }
    plan.offsets_.push_back(static_cast<size_t>(total));
    total += counts[r];
    plan.counts_.push_back(counts[r]);
  }
  if (total > std::numeric_limits<int32_t>::max()) {
    return Status::InvalidArgument("the plan holds " + std::to_string(total) +
                                   " microbatches, more than 2^31 - 1");
  }
  plan.costs_.assign(static_cast<size_t>(total), 1.0);
  if (costs != nullptr) {
    for (int64_t i = 0; i < total; ++i) {
      if (!std::isfinite(costs[i]) || costs[i] < 0) {
        int queue = 0;
        while (queue + 1 < num_queues &&
               plan.offsets_[static_cast<size_t>(queue) + 1] <= static_cast<size_t>(i)) {
          ++queue;
        }
        return Status::InvalidArgument(
            "cost of microbatch " +
            std::to_string(i - static_cast<int64_t>(plan.offsets_[static_cast<size_t>(queue)])) +
            " of queue " + std::to_string(queue) + " is " + std::to_string(costs[i]) +
            ": predicted costs must be finite and >= 0");
      }
      plan.costs_[static_cast<size_t>(i)] = costs[i];
    }
  }
  uint64_t hash = 14695981039346656037ull;
  hash = fnv1a_bytes(hash, &num_queues, sizeof(num_queues));
  hash = fnv1a_bytes(hash, plan.counts_.data(), plan.counts_.size() * sizeof(int32_t));
  hash = fnv1a_bytes(hash, plan.costs_.data(), plan.costs_.size() * sizeof(double));
  plan.fingerprint_ =
      static_cast<uint8_t>(hash ^ (hash >> 8) ^ (hash >> 16) ^ (hash >> 24) ^ (hash >> 32) ^
                           (hash >> 40) ^ (hash >> 48) ^ (hash >> 56));
  return plan;
}

double WorkPlan::cost(int queue, uint32_t first, uint32_t last) const {
  const size_t base = offsets_[static_cast<size_t>(queue)];
  double sum = 0.0;
  for (uint32_t i = first; i < last; ++i) sum += costs_[base + i];
  return sum;
}

WorkBoard::WorkBoard(Transport& transport, std::unique_ptr<SymmetricRegion> words)
    : transport_(transport), words_(std::move(words)) {
  const int world = transport_.world_size();
  for (int r = 0; r < world; ++r) reads_.push_back({words_.get(), r, 0, 0, 0});
  seen_.assign(static_cast<size_t>(world), 0);
}

Status WorkBoard::open(uint32_t tag, WorkPlan plan) {
  const int me = transport_.rank();
  ClaimWord opened;
  opened.tag = tag;
  opened.fingerprint = plan.fingerprint();
  const uint64_t desired = opened.pack();
  // Thieves of the previous minibatch may still claim on this word (their host runs behind on
  // stream-ordered transports), so the owner swaps from what it read, never stores blindly.
  uint64_t expected = own_word_;
  for (;;) {
    uint64_t old = 0;
    ODC_RETURN_IF_ERROR(transport_.compare_swap({{words_.get(), me, 0, expected, desired}}, &old));
    if (old == expected) break;
    expected = old;
  }
  own_word_ = desired;
  plan_ = std::move(plan);
  open_tag_ = tag;
  stats_.own_this = 0;
  stats_.stolen_this = 0;
  return Status::Ok();
}

Result<WorkClaim> WorkBoard::take() {
  const int me = transport_.rank();
  // The own queue's front, from the last value seen of the word: thieves only take from its
  // tail, so a lost race needs one more swap from the value it returned.
  for (;;) {
    const ClaimWord own = ClaimWord::unpack(own_word_);
    if (own.tag != open_tag_ || own.head + own.tail >= static_cast<uint32_t>(plan_.count(me))) {
      break;
    }
    ClaimWord next = own;
    ++next.head;
    uint64_t old = 0;
    ODC_RETURN_IF_ERROR(
        transport_.compare_swap({{words_.get(), me, 0, own_word_, next.pack()}}, &old));
    if (old == own_word_) {
      own_word_ = next.pack();
      ++stats_.own_this;
      ++stats_.own_total;
      return WorkClaim{me, static_cast<int32_t>(own.head)};
    }
    own_word_ = old;
  }
  // Steal: one read of every word, then the tail of the open queue with the most predicted cost
  // left (ties: lowest rank); a lost race reads again.
  for (;;) {
    ODC_RETURN_IF_ERROR(transport_.compare_swap(reads_, seen_.data()));
    int victim = -1;
    double most = 0.0;
    ClaimWord victim_word;
    for (int r = 0; r < static_cast<int>(seen_.size()); ++r) {
      const ClaimWord w = ClaimWord::unpack(seen_[static_cast<size_t>(r)]);
      if (w.tag != open_tag_) continue;  // not opened for this minibatch by its owner yet
      if (w.fingerprint != plan_.fingerprint()) {
        return Status::InvalidUsage(
            "ranks passed different plans to the work board: queue " + std::to_string(r) +
            " was opened by its owner with a plan whose fingerprint is " +
            std::to_string(w.fingerprint) + ", this rank's is " +
            std::to_string(plan_.fingerprint()) +
            " (every rank must pass the same counts and costs to work_board_open)");
      }
      const uint32_t count = static_cast<uint32_t>(plan_.count(r));
      if (w.head + w.tail > count) {
        return Status::InternalError("the claim word of queue " + std::to_string(r) + " counts " +
                                     std::to_string(w.head + w.tail) + " claims of " +
                                     std::to_string(count) + " microbatches");
      }
      if (w.head + w.tail == count) continue;
      const double left = plan_.cost(r, w.head, count - w.tail);
      if (victim < 0 || left > most) {
        victim = r;
        most = left;
        victim_word = w;
      }
    }
    if (victim == me) {  // cannot happen (thieves only shrink it), but the front is the owner's
      own_word_ = seen_[static_cast<size_t>(me)];
      return take();
    }
    if (victim < 0) return WorkClaim{};
    ClaimWord next = victim_word;
    ++next.tail;
    const uint64_t expected = victim_word.pack();
    uint64_t old = 0;
    ODC_RETURN_IF_ERROR(
        transport_.compare_swap({{words_.get(), victim, 0, expected, next.pack()}}, &old));
    if (old == expected) {
      ++stats_.stolen_this;
      ++stats_.stolen_total;
      return WorkClaim{victim, static_cast<int32_t>(static_cast<uint32_t>(plan_.count(victim)) -
                                                    victim_word.tail - 1)};
    }
  }
}

}  // namespace odc
