// Microbatch packing: the token cap always holds, counts are as small as claimed, exact counts
// leave empty microbatches only when items run out.
#include "planner/packing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace odc::planner {
namespace {

struct Items {
  std::vector<int64_t> tokens;
  std::vector<double> costs;
  PackingInput input(int64_t cap) const { return {tokens, costs, cap}; }
};

Items random_items(size_t count, int64_t max_tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> dist(1, max_tokens);
  Items items;
  for (size_t i = 0; i < count; ++i) {
    items.tokens.push_back(dist(rng));
    const double length = static_cast<double>(items.tokens.back());
    items.costs.push_back(length + 1e-4 * length * length);
  }
  return items;
}

void expect_packed(const Bins& bins, const Items& items, int64_t cap) {
  std::vector<int> seen(items.tokens.size(), 0);
  for (const auto& bin : bins) {
    int64_t tokens = 0;
    for (int item : bin) {
      ++seen[item];
      tokens += items.tokens[item];
    }
    EXPECT_LE(tokens, cap);
  }
  for (int count : seen) EXPECT_EQ(count, 1);
}

TEST(PackFewest, RespectsCapAndLowerBound) {
  for (uint32_t seed = 0; seed < 50; ++seed) {
    const int64_t cap = 1000;
    const Items items = random_items(5 + seed, cap, seed);
    const Bins bins = pack_fewest(items.input(cap));
    expect_packed(bins, items, cap);
    const int64_t total = std::accumulate(items.tokens.begin(), items.tokens.end(), int64_t{0});
    EXPECT_GE(static_cast<int64_t>(bins.size()), (total + cap - 1) / cap);
    for (const auto& bin : bins) EXPECT_FALSE(bin.empty());
  }
}

TEST(PackFewest, ReachesTheLowerBoundWhenItIsEasy) {
  // Eight samples of 250 tokens under a 1000 cap: exactly two full microbatches.
  Items items;
  items.tokens.assign(8, 250);
  items.costs.assign(8, 250.0);
  const Bins bins = pack_fewest(items.input(1000));
  ASSERT_EQ(bins.size(), 2u);
  EXPECT_EQ(bins[0].size(), 4u);
}

TEST(PackFewest, BalancesCostAcrossMicrobatches) {
  // 6 items of cost 1..6 with room for everything in two bins: 21 splits into 10 / 11.
  Items items;
  items.tokens.assign(6, 10);
  for (int i = 1; i <= 6; ++i) items.costs.push_back(i);
  const Bins bins = pack_fewest(items.input(30));
  ASSERT_EQ(bins.size(), 2u);
  const auto loads = bin_loads(bins, items.costs);
  EXPECT_LE(std::abs(loads[0] - loads[1]), 1.0);
}

TEST(PackExact, FillsEveryMicrobatchWhenItemsSuffice) {
  for (uint32_t seed = 0; seed < 30; ++seed) {
    const int64_t cap = 4096;
    const Items items = random_items(20, cap / 4, seed);
    const int fewest = static_cast<int>(pack_fewest(items.input(cap)).size());
    for (int extra : {0, 1, 5}) {
      const Bins bins = pack_exact(items.input(cap), fewest + extra);
      ASSERT_EQ(bins.size(), static_cast<size_t>(fewest + extra));
      expect_packed(bins, items, cap);
      for (const auto& bin : bins) EXPECT_FALSE(bin.empty());
    }
  }
}

TEST(PackExact, PadsWithEmptyMicrobatchesOnlyWhenItemsRunOut) {
  Items items;
  items.tokens = {5, 7};
  items.costs = {5, 7};
  const Bins bins = pack_exact(items.input(100), 4);
  ASSERT_EQ(bins.size(), 4u);
  int empty = 0;
  for (const auto& bin : bins) empty += bin.empty();
  EXPECT_EQ(empty, 2);
}

// The packing before it was made near-linear (first-fit by linear scan, one full attempt per
// count from the lower bound up): the reference the fast search must match where both finish.
namespace reference {

std::vector<int> by_tokens(const PackingInput& input) {
  std::vector<int> order(input.tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return input.tokens[x] > input.tokens[y]; });
  return order;
}

bool greedy(const PackingInput& input, int num_bins, Bins& bins) {
  bins.assign(static_cast<size_t>(num_bins), {});
  std::vector<int64_t> used(bins.size(), 0);
  std::vector<double> cost(bins.size(), 0.0);
  for (int item : by_tokens(input)) {
    int best = -1;
    for (int b = 0; b < num_bins; ++b) {
      if (used[b] + input.tokens[item] > input.token_cap) continue;
      if (best < 0 || cost[b] < cost[best]) best = b;
    }
    if (best < 0) return false;
    bins[best].push_back(item);
    used[best] += input.tokens[item];
    cost[best] += input.costs[item];
  }
  return true;
}

bool balanced(const PackingInput& input, int num_bins, Bins& bins) {
  bins = karmarkar_karp(input.costs, num_bins, false);
  bool within_cap = true;
  for (const auto& bin : bins) {
    int64_t sum = 0;
    for (int item : bin) sum += input.tokens[item];
    within_cap = within_cap && sum <= input.token_cap;
  }
  if (!within_cap && !greedy(input, num_bins, bins)) return false;
  RefineLimits limits;
  limits.item_tokens = input.tokens;
  limits.token_cap = input.token_cap;
  (void)refine(bins, input.costs, limits);
  return true;
}

Bins pack_fewest(const PackingInput& input) {
  Bins packed;
  std::vector<int64_t> used;
  for (int item : by_tokens(input)) {
    size_t b = 0;
    while (b < packed.size() && used[b] + input.tokens[item] > input.token_cap) ++b;
    if (b == packed.size()) {
      packed.emplace_back();
      used.push_back(0);
    }
    packed[b].push_back(item);
    used[b] += input.tokens[item];
  }
  const int64_t total = std::accumulate(input.tokens.begin(), input.tokens.end(), int64_t{0});
  const int lower =
      static_cast<int>(std::max<int64_t>(1, (total + input.token_cap - 1) / input.token_cap));
  Bins bins;
  for (int count = lower; count < static_cast<int>(packed.size()); ++count) {
    if (balanced(input, count, bins)) return bins;
  }
  if (balanced(input, static_cast<int>(packed.size()), bins)) return bins;
  RefineLimits limits;
  limits.item_tokens = input.tokens;
  limits.token_cap = input.token_cap;
  (void)refine(packed, input.costs, limits);
  return packed;
}

}  // namespace reference

TEST(PackFewest, SameAsOneAttemptPerCountOnSmallInputs) {
  // Short items (many per microbatch, where the first feasible count is near the lower bound) and
  // long ones (few per microbatch, where first-fit is often already tight).
  for (uint32_t seed = 0; seed < 60; ++seed) {
    const int64_t cap = 4096;
    const Items items = random_items(40 + 7 * seed, seed % 2 ? cap : cap / 8, seed);
    const Bins fast = pack_fewest(items.input(cap));
    const Bins scan = reference::pack_fewest(items.input(cap));
    EXPECT_EQ(fast.size(), scan.size()) << "seed " << seed;
    EXPECT_EQ(fast, scan) << "seed " << seed;
  }
}

TEST(PackFewest, ManyMicrobatchesStayNearLinear) {
  // 200,000 items of up to 4,096 tokens under a 4,096 cap: ~50,000 microbatches. One attempt per
  // count with Karmarkar-Karp (items x microbatches subsets) needed ~10^10 subsets: minutes and
  // tens of GB. The packing must hold the cap, cover every item once and need no more
  // microbatches than first-fit decreasing.
  const int64_t cap = 4096;
  Items items;
  std::mt19937 rng(7);
  std::lognormal_distribution<double> dist(std::log(900.0), 0.9);
  while (items.tokens.size() < 200000) {
    const auto tokens = static_cast<int64_t>(dist(rng));
    if (tokens < 1 || tokens > cap) continue;
    items.tokens.push_back(tokens);
    items.costs.push_back(static_cast<double>(tokens));
  }
  const Bins bins = pack_fewest(items.input(cap));
  expect_packed(bins, items, cap);
  const int64_t total = std::accumulate(items.tokens.begin(), items.tokens.end(), int64_t{0});
  EXPECT_GE(static_cast<int64_t>(bins.size()), (total + cap - 1) / cap);
  EXPECT_LE(static_cast<double>(bins.size()), 1.01 * static_cast<double>((total + cap - 1) / cap));
}

}  // namespace
}  // namespace odc::planner
