// Splitting outliers (docs/design.md, "Splitting outliers"): a sample that costs more than a rank's
// share of its minibatch runs as context-parallel chunks on a transient group of k ranks, and the
// other samples are balanced around the groups. Invariant: every token of a split sample belongs to
// exactly one chunk, and each group member's chunk is a zigzag pair of pieces (i, 2k-1-i), so every
// member does the same causal-attention work (to within rounding of the piece boundaries).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "planner/cost_model.h"
#include "planner/partition.h"

namespace odc::planner {

struct PlanOptions;

// Token range [begin, end) of one sample.
using TokenRange = std::array<int64_t, 2>;
// The pieces of a sample one group member processes, in ascending token order.
using SplitChunk = std::vector<TokenRange>;

// The zigzag split of a sample of `length` tokens over `group_size` ranks: 2k pieces of
// floor-divided boundaries j*L/(2k); member i gets pieces i and 2k-1-i. Requires L >= 2k.
std::vector<SplitChunk> zigzag_chunks(int64_t length, int group_size);

// Predicted cost (before rank speed) of one member's chunk of a split sample of `length` tokens:
//   c + a*n + b*L^2 * P_chunk / P_sample + x*a*(L - n)
// n the chunk's tokens; P the causal query-key pairs (token t sees t+1 keys, so the chunk's share
// of the sample's attention is exact under the global causal mask); x = `exchange`, the cost of
// receiving one token's K/V for every layer (forward, recomputation and the gradient's return) as
// a fraction of a, the per-token cost.
double split_chunk_cost(const CostModel& cost, double exchange, int64_t length,
                        const SplitChunk& chunk);

// One split sample of a minibatch, in minibatch-local (or, once emitted, global) sample index.
struct SplitSample {
  int64_t sample = 0;
  std::vector<int64_t> ranks;       // the group, ascending
  std::vector<SplitChunk> chunks;   // one per group member, in `ranks` order
  std::vector<double> chunk_costs;  // predicted cost of each member's chunk (split_chunk_cost)
};

// Result of planning one minibatch with splitting: each rank's microbatches of the samples that
// were not split (local indices, heaviest first) and the split samples, in execution order.
struct SplitMinibatch {
  std::vector<Bins> ranks;
  std::vector<SplitSample> splits;
};

// Plans one minibatch (local indices 0..M-1) under LB-Mini or LB-Micro with splitting. A sample is
// a candidate when its cost exceeds the minibatch's ideal per-rank share, sum(cost) / N; candidates
// are tried heaviest first, each with every group size k = 2..N (the k ranks that are free
// earliest), and kept split where that lowers the predicted span (ODC time for LB-Mini, collective
// time for LB-Micro) of the whole minibatch below the best so far, starting from `unsplit_span`,
// the span of the policy's plan without splits. Remaining samples are balanced around the groups
// (a group member carries its chunk first). Returns no splits when no split helps; the caller then
// keeps the unsplit plan. Trials that provably cannot beat the best span so far are skipped
// without building their plan (same result); `stats`, when given, counts the work done.
struct SplitSearchStats {
  bool exhaustive = false;  // in: skip nothing (tests compare the two)
  int64_t candidates = 0;   // outliers considered
  int64_t plans_built = 0;  // trial plans built and timed (candidate x group size)
};
SplitMinibatch plan_minibatch_with_splits(std::span<const int64_t> tokens,
                                          std::span<const double> costs, const PlanOptions& options,
                                          double unsplit_span, SplitSearchStats* stats = nullptr);

}  // namespace odc::planner
