// Number partitioning: split items with weights into bins of nearly equal total weight.
// Karmarkar-Karp largest differencing (with and without an equal-count constraint), a greedy for
// bins of different speeds, and a refinement pass. Every function is deterministic: ties are broken
// by item and bin index, never by addresses or hash order.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace odc::planner {

// bins[b] lists the indices (into the weight array) of the items in bin b, in ascending order.
using Bins = std::vector<std::vector<int>>;

// Karmarkar-Karp without the equal-size constraint keeps items x bins subsets (16 bytes each) and
// sorts a tuple of `bins` subsets per step; callers use it while items x bins stays under this
// budget (about 64 MB, a fraction of a second) and a greedy beyond. Every shipped data file stays
// under it, so their plans are unchanged.
inline constexpr int64_t kKarmarkarKarpBudget = int64_t{1} << 22;

// k-way largest differencing method. With `equal_size`, bin item counts differ by at most one
// (balanced LDM: items are grouped k at a time in descending weight order). Bins come out sorted by
// total weight, heaviest first.
Bins karmarkar_karp(std::span<const double> weights, int num_bins, bool equal_size);

// Longest-processing-time greedy for bins with relative speeds: each item, heaviest first, goes to
// the bin that would finish it earliest (time = load / speed). With equal speeds that is the
// least-loaded bin (lowest index among equals), found in O(log bins).
Bins greedy_by_speed(std::span<const double> weights, std::span<const double> bin_speeds);

// Limits on what refine() may do.
struct RefineLimits {
  // Keep bin item counts within one of each other (moves only from a fuller bin to an emptier one).
  bool keep_counts_balanced = false;
  // When non-empty: tokens of each item, and no bin may exceed token_cap after a move or swap.
  std::span<const int64_t> item_tokens;
  int64_t token_cap = 0;
  // When non-empty: relative speed of each bin; the objective is load / speed.
  std::span<const double> bin_speeds;
};

// Moves or swaps items between the slowest (heaviest) and fastest (lightest) bins while that lowers
// the larger of the two bins' times. Never empties a bin that holds one item. Returns the number of
// moves and swaps applied.
int refine(Bins& bins, std::span<const double> weights, const RefineLimits& limits);

// Sum of weights per bin.
std::vector<double> bin_loads(const Bins& bins, std::span<const double> weights);

}  // namespace odc::planner
