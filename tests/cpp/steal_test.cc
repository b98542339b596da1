// Work stealing simulated (planner/steal.h): hand-computed schedules (a 1.3x slow rank, ties, empty
// queues, one rank holding everything), the errors, and invariants on random queues: every item
// runs once, busy adds up, and with runner-independent durations stealing never lengthens the span.
#include "planner/steal.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "planner/plan.h"
#include "planner/plan_format.h"
#include "test_util.h"

namespace odc::planner {
namespace {

StealResult run(const std::vector<int64_t>& counts, const std::vector<double>& predicted,
                const std::vector<double>& actual = {}, const std::vector<double>& speed = {},
                const std::vector<double>& start = {}) {
  auto result = simulate_stealing({counts, predicted, actual, speed, start});
  EXPECT_TRUE(result.ok()) << result.status().message();
  return result.ok() ? std::move(result).value() : StealResult{};
}

TEST(Steal, SlowRankLosesItsTailToTheFirstFreeRank) {
  // Three queues of six unit items; rank 2 runs 1.3x slower. It claims its items 0..4 at 0, 1.3,
  // 2.6, 3.9 and 5.2; ranks 0 and 1 finish their own at 6, when item 5 of queue 2 is the only one
  // unclaimed: rank 0 (first in rank order) takes it and ends at 7, rank 1 stops at 6, rank 2
  // at 6.5. Without stealing rank 2 would end at 7.8.
  const std::vector<double> units(18, 1.0);
  const StealResult r = run({6, 6, 6}, units, {}, {1.0, 1.0, 1.0 / 1.3});
  EXPECT_DOUBLE_EQ(r.span, 7.0);
  EXPECT_DOUBLE_EQ(r.finish[0], 7.0);
  EXPECT_DOUBLE_EQ(r.finish[1], 6.0);
  EXPECT_NEAR(r.finish[2], 6.5, 1e-12);
  EXPECT_EQ(r.num_moved, 1);
  EXPECT_EQ(r.runner[17], 0);
  for (int i = 12; i < 17; ++i) EXPECT_EQ(r.runner[i], 2) << i;
  EXPECT_NEAR(r.total_busy(), 6 + 1 + 6 + 5 * 1.3, 1e-12);
}

TEST(Steal, SimultaneousRanksAreServedInRankOrder) {
  // Rank 2 runs at half speed: items 0 and 1 of its queue end at 2 and 4. At 4 ranks 0, 1 and 2
  // are free together: rank 0 takes queue 2's tail (item 3), rank 1 the next tail (item 2), and
  // rank 2 finds nothing left.
  const std::vector<double> units(12, 1.0);
  const StealResult r = run({4, 4, 4}, units, {}, {1.0, 1.0, 0.5});
  EXPECT_DOUBLE_EQ(r.span, 5.0);
  EXPECT_EQ(r.runner[11], 0);
  EXPECT_EQ(r.runner[10], 1);
  EXPECT_DOUBLE_EQ(r.finish[2], 4.0);
  EXPECT_EQ(r.num_moved, 2);
  EXPECT_EQ(r.run_order, (std::vector<int64_t>{0, 4, 8, 1, 5, 2, 6, 9, 3, 7, 11, 10}));
}

TEST(Steal, TiesGoToTheLowestRankAndSumsArePredicted) {
  // Queues 1 and 2 both hold 4 predicted; rank 0 (empty) takes queue 1's tail. Actual costs make
  // queue 2 the longer one in truth, which the choice never sees.
  const StealResult r = run({0, 2, 2}, {3, 1, 2, 2}, {3, 1, 20, 2});
  EXPECT_EQ(r.runner, (std::vector<int64_t>{1, 0, 2, 0}));
  EXPECT_DOUBLE_EQ(r.finish[0], 3.0);  // queue 1's item 1 (1), then queue 2's item 1 (2)
  EXPECT_DOUBLE_EQ(r.span, 20.0);
  EXPECT_EQ(r.num_moved, 2);
}

TEST(Steal, SumsAreAddedAsTheWorkBoardAddsThem) {
  // Rank 0 starts at 0.5, when queue 1 has 2.5 and 2.3 left (added from the front: exactly 4.8,
  // the double) and queue 2 has 4.8: a tie, so queue 1 (the lower rank) loses its tail. Prefix
  // sums would have made queue 1's 4.799999999999999 and robbed queue 2. (Both owners' first
  // items last 1 in truth, so neither has moved on by 0.5.)
  const std::vector<double> predicted{0.4, 2.5, 2.3, 1.0, 4.8};
  const std::vector<double> actual{1.0, 2.5, 2.3, 1.0, 4.8};
  const StealResult r = run({0, 3, 2}, predicted, actual, {}, {0.5, 0.0, 0.0});
  EXPECT_EQ(r.runner, (std::vector<int64_t>{1, 1, 0, 2, 2}));
  EXPECT_EQ(r.num_moved, 1);
}

TEST(Steal, OneRankHoldingEverythingIsEmptiedFromTheTail) {
  const StealResult r = run({4, 0, 0}, {4, 3, 2, 1});
  EXPECT_EQ(r.runner, (std::vector<int64_t>{0, 1, 2, 1}));
  EXPECT_DOUBLE_EQ(r.span, 4.0);
  EXPECT_DOUBLE_EQ(r.finish[2], 2.0);
  EXPECT_EQ(r.num_moved, 3);
}

TEST(Steal, EmptyQueuesAndStartOffsets) {
  StealResult r = run({0, 0, 0}, {});
  EXPECT_EQ(r.span, 0.0);
  EXPECT_EQ(r.num_moved, 0);
  // Rank 1 is busy with its split chunk until 5: rank 0 runs its own item, then steals rank 1's
  // tail (ends at 4) and its front too (ends at 6); rank 1 starts at 5 and finds nothing left.
  r = run({1, 2}, {1, 2, 3}, {}, {}, {0.0, 5.0});
  EXPECT_EQ(r.runner, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_DOUBLE_EQ(r.finish[0], 6.0);
  EXPECT_DOUBLE_EQ(r.finish[1], 5.0);  // its start: the offset is not busy time
  EXPECT_DOUBLE_EQ(r.span, 6.0);
  EXPECT_EQ(r.busy[1], 0.0);
  EXPECT_EQ(r.num_moved, 2);
}

TEST(Steal, ErrorsNameTheInput) {
  const std::vector<int64_t> counts{1, 1};
  const std::vector<double> two{1, 1};
  const std::vector<double> negative{1, -1};
  const std::vector<double> zero{1, 0};
  const std::vector<double> one{1};
  const std::vector<int64_t> bad_count{-1, 1};
  auto message = [](const StealInput& input) {
    auto result = simulate_stealing(input);
    EXPECT_FALSE(result.ok());
    return result.ok() ? std::string() : result.status().message();
  };
  EXPECT_EQ(message({counts, one, {}, {}, {}}),
            "predicted costs: got 1 values for 2 items (the sum of the counts)");
  EXPECT_NE(message({counts, two, one, {}, {}}).find("actual costs: got 1 values"),
            std::string::npos);
  EXPECT_EQ(message({counts, negative, {}, {}, {}}),
            "predicted cost of queue 1's item 0 is -1: expected a finite number >= 0");
  EXPECT_NE(message({counts, two, {}, zero, {}}).find("speed of rank 1 is 0"), std::string::npos);
  EXPECT_EQ(message({counts, two, {}, one, {}}),
            "rank_speed must have one entry per rank: got 1 for 2 ranks");
  EXPECT_NE(message({counts, two, {}, {}, negative}).find("start of rank 1"), std::string::npos);
  EXPECT_EQ(message({bad_count, one, {}, {}, {}}), "queue 0 has a negative count -1");
}

TEST(Steal, InvariantsOnRandomQueues) {
  std::mt19937_64 rng(45);
  for (int trial = 0; trial < 2000; ++trial) {
    const int num_ranks = 1 + static_cast<int>(rng() % 6);
    std::vector<int64_t> counts(num_ranks);
    for (auto& c : counts) c = static_cast<int64_t>(rng() % 5);
    const size_t num_items = static_cast<size_t>(std::accumulate(counts.begin(), counts.end(), 0));
    std::vector<double> predicted(num_items), actual(num_items), start(num_ranks);
    for (auto& p : predicted) p = static_cast<double>(rng() % 9);  // zero costs too
    for (auto& a : actual) a = static_cast<double>(1 + rng() % 9);
    for (auto& s : start) s = static_cast<double>(rng() % 3);
    // Runner-independent durations (no speeds): every item ends by the time its owner would have
    // finished alone (the owner works from its start on its own items until none is left, so a
    // thief claims item i before that owner could have finished it), hence the span is at most
    // the span without stealing. Not so with speeds: a slow thief may take the tail (below).
    const StealResult r = run(counts, predicted, actual, {}, start);
    std::vector<int> runs(num_items, 0);
    for (int64_t item : r.run_order) ++runs[static_cast<size_t>(item)];
    EXPECT_TRUE(std::all_of(runs.begin(), runs.end(), [](int n) { return n == 1; }));
    double no_steal_span = 0.0, sum_actual = 0.0;
    size_t item = 0;
    int64_t moved = 0;
    for (int q = 0; q < num_ranks; ++q) {
      double own = start[q];
      for (int64_t i = 0; i < counts[q]; ++i, ++item) {
        own += actual[item];
        sum_actual += actual[item];
        moved += r.runner[item] != q;
      }
      no_steal_span = std::max(no_steal_span, own);
    }
    EXPECT_LE(r.span, no_steal_span + 1e-9) << "trial " << trial;
    EXPECT_EQ(r.num_moved, moved);
    EXPECT_NEAR(r.total_busy(), sum_actual, 1e-9);
    EXPECT_EQ(r.span, *std::max_element(r.finish.begin(), r.finish.end()));
  }
}

TEST(Steal, ASlowThiefCanLengthenTheSpan) {
  // Why the invariant above needs equal speeds: rank 1, 4x slower and idle, takes queue 0's tail
  // at once and ends at 4, where rank 0 alone would have finished both items at 2.
  const StealResult r = run({2, 0}, {1, 1}, {}, {1.0, 0.25});
  EXPECT_DOUBLE_EQ(r.span, 4.0);
  EXPECT_EQ(r.runner, (std::vector<int64_t>{0, 1}));
}

TEST(Steal, ScalesTo256RanksAndManyItems) {
  // 256 ranks x 8 items and one rank with 100,000, unit costs (so thefts meet ties and add exact
  // sums): still instant.
  std::vector<int64_t> counts(256, 8);
  counts[3] = 100000;
  const size_t num_items = static_cast<size_t>(std::accumulate(counts.begin(), counts.end(), 0));
  std::vector<double> predicted(num_items, 1.0);
  const StealResult r = run(counts, predicted);
  EXPECT_EQ(r.run_order.size(), num_items);
  // 102,040 unit items on 256 ranks: the span is at most one item above the ideal.
  EXPECT_LE(r.span, std::ceil(static_cast<double>(num_items) / 256.0) + 1.0);
}

TEST(Steal, PlansPredictStealingBesideOdc) {
  // Every minibatch of an lb-mini plan at equal speeds: stealing's span is at most ODC's time and
  // the busy time is the same (durations do not depend on the runner); the total is time-weighted.
  PlanOptions options;
  options.num_ranks = 4;
  options.max_tokens = 64;
  options.minibatch_size = 24;
  options.cost = CostModel{1.0, 0.02, 3.0};
  options.steal = true;
  const auto lengths = testing::random_lengths(240, 64, 3);
  auto plan = make_plan(lengths, options);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  double busy = 0.0, span = 0.0;
  for (const MinibatchPlan& minibatch : plan.value().minibatches) {
    EXPECT_LE(minibatch.steal.span, minibatch.times.odc * (1 + 1e-12));
    EXPECT_NEAR(minibatch.steal.busy, minibatch.times.busy, 1e-9 * minibatch.times.busy);
    EXPECT_DOUBLE_EQ(minibatch.steal.bubble,
                     bubble_rate(minibatch.steal.busy, 4, minibatch.steal.span));
    busy += minibatch.steal.busy;
    span += minibatch.steal.span;
  }
  EXPECT_DOUBLE_EQ(plan.value().steal_bubble, bubble_rate(busy, 4, span));
  EXPECT_LE(plan.value().steal_bubble, plan.value().bubble.odc + 1e-12);
  // Both renderings carry it; without steal neither mentions it.
  EXPECT_NE(plan_to_json(plan.value()).find("\"steal\":{\"time\""), std::string::npos);
  EXPECT_NE(plan_to_table(plan.value()).find("odc + stealing"), std::string::npos);
  options.steal = false;
  auto plain = make_plan(lengths, options);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plan_to_json(plain.value()).find("steal"), std::string::npos);
}

TEST(Steal, PredictStealingByHandWithASlowdown) {
  // local-sort, 2 ranks, 4 samples of 10 tokens: rank 0 runs samples 0 and 2, rank 1 samples 1
  // and 3 (10 each). Rank 1 3x slower: rank 0 steals rank 1's second microbatch at 20.
  PlanOptions options;
  options.num_ranks = 2;
  options.max_tokens = 10;
  options.policy = Policy::kLocalSort;
  const std::vector<int64_t> lengths(4, 10);
  auto plan = make_plan(lengths, options);
  ASSERT_TRUE(plan.ok());
  const std::vector<double> slowdown{1.0, 3.0};
  auto times = predict_stealing(plan.value().minibatches[0], lengths, options, slowdown);
  ASSERT_TRUE(times.ok()) << times.status().message();
  EXPECT_DOUBLE_EQ(times.value().span, 30.0);
  EXPECT_DOUBLE_EQ(times.value().busy, 60.0);
  EXPECT_EQ(times.value().num_moved, 1);
  EXPECT_DOUBLE_EQ(times.value().bubble, 0.0);
}

}  // namespace
}  // namespace odc::planner
