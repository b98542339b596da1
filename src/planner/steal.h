// Work stealing inside a minibatch, simulated (issue #45): the rule the runtime's work board
// follows (docs/planner.md, "Work stealing"), played out event by event on predicted and actual
// microbatch times. Invariant: every item runs exactly once, and choices use predicted costs only
// while durations use actual ones, exactly as the runtime sees them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace odc::planner {

// One minibatch's queues: queue r is rank r's microbatches in plan order (counts[r] items), their
// costs flat, queue by queue (counts[0] values, then counts[1], ...).
struct StealInput {
  std::span<const int64_t> counts;
  // Predicted cost of every item: what a thief compares (the sum of a queue's unclaimed items).
  std::span<const double> predicted;
  // Actual cost of every item; empty: the predicted one. An item runs actual / speed of its runner.
  std::span<const double> actual;
  // Relative speed of every rank (> 0); empty: all 1.
  std::span<const double> rank_speed;
  // When each rank starts taking items (>= 0; e.g. after its split chunk); empty: all at 0.
  std::span<const double> rank_start;
};

struct StealResult {
  double span = 0.0;               // when the last rank finishes (its start if it ran nothing)
  std::vector<double> finish;      // per rank: the end of its last item, or its start
  std::vector<double> busy;        // per rank: sum of the durations of the items it ran
  std::vector<int64_t> runner;     // per item (flat, as the costs): the rank that ran it
  std::vector<int64_t> run_order;  // items (flat indices) in the order they were claimed
  int64_t num_moved = 0;           // items run by a rank other than their queue's owner
  double total_busy() const;
};

// Plays the rule out. Free ranks are served in order of (time, rank). A free rank takes the front
// (lowest unclaimed) item of its own queue while it has one; then, among queues with unclaimed
// items, the one whose unclaimed items have the largest sum of predicted costs (ties: the lowest
// rank), and its tail (highest unclaimed) item; it stops when nothing is unclaimed. A queue's
// unclaimed items are always a contiguous range [front, back), and their predicted sum is added
// up item by item from `front` in index order, as the runtime's work board adds it, so sums equal
// only up to rounding break ties alike. O((items + ranks) log ranks), plus exact sums where
// ordered ones come within rounding of each other (ties). Errors name the bad input: sizes that
// disagree, negative counts, costs that are negative or not finite, speeds <= 0, starts < 0.
Result<StealResult> simulate_stealing(const StealInput& input);

}  // namespace odc::planner
