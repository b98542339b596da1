// Helpers shared by the planner tests: seeded random lengths and plan invariant checks.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "planner/plan.h"

namespace odc::planner::testing {

// Log-normal-ish lengths in [1, max_length], reproducible from `seed`.
inline std::vector<int64_t> random_lengths(size_t count, int64_t max_length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<double> dist(7.0, 1.2);
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < count; ++i) {
    const auto value = static_cast<int64_t>(dist(rng));
    lengths.push_back(std::clamp<int64_t>(value, 1, max_length));
  }
  return lengths;
}

// Every sample of each minibatch appears exactly once, on some rank, and no microbatch exceeds the
// token cap.
inline void expect_valid_plan(const Plan& plan, const std::vector<int64_t>& lengths) {
  std::set<int64_t> seen;
  for (const auto& minibatch : plan.minibatches) {
    ASSERT_EQ(static_cast<int64_t>(minibatch.ranks.size()), plan.options.num_ranks);
    std::multiset<int64_t> in_minibatch;
    for (const auto& rank : minibatch.ranks) {
      for (const auto& microbatch : rank.microbatches) {
        int64_t tokens = 0;
        for (int64_t sample : microbatch) {
          in_minibatch.insert(sample);
          tokens += lengths[sample];
        }
        EXPECT_LE(tokens, plan.options.max_tokens);
      }
    }
    const std::multiset<int64_t> expected(minibatch.samples.begin(), minibatch.samples.end());
    EXPECT_EQ(in_minibatch, expected);
    seen.insert(minibatch.samples.begin(), minibatch.samples.end());
  }
  EXPECT_EQ(seen.size(), lengths.size());
}

}  // namespace odc::planner::testing
