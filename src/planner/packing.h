// Packing one rank's samples into microbatches under a token cap, balanced by cost.
// Invariant: every returned microbatch holds at most `token_cap` tokens (each sample alone fits:
// callers check that before packing).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "planner/partition.h"

namespace odc::planner {

struct PackingInput {
  std::span<const int64_t> tokens;  // per item
  std::span<const double> costs;    // per item
  int64_t token_cap = 0;
};

// As few microbatches as the cap allows (first-fit-decreasing gives an upper bound; smaller counts
// down to ceil(tokens / cap) are tried with cost-balanced packings), then balanced by refinement.
Bins pack_fewest(const PackingInput& input);

// Exactly `num_microbatches` microbatches, which must be at least the count pack_fewest() finds.
// Microbatches are left empty only when there are fewer items than microbatches.
Bins pack_exact(const PackingInput& input, int num_microbatches);

}  // namespace odc::planner
