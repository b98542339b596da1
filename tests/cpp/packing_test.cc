// Microbatch packing: the token cap always holds, counts are as small as claimed, exact counts
// leave empty microbatches only when items run out.
#include "planner/packing.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace odc::planner
