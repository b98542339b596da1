// Policies and bubble predictions, against docs/design.md's definitions ("Load balancing: exact
// definitions") and hand-computed cases.
#include "planner/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "planner/plan_format.h"
#include "test_util.h"

namespace odc::planner {
namespace {

using testing::expect_valid_plan;
using testing::random_lengths;

PlanOptions options_for(Policy policy, int64_t ranks, int64_t max_tokens) {
  PlanOptions options;
  options.policy = policy;
  options.num_ranks = ranks;
  options.max_tokens = max_tokens;
  return options;
}

Plan plan_or_die(const std::vector<int64_t>& lengths, const PlanOptions& options) {
  auto plan = make_plan(lengths, options);
  EXPECT_TRUE(plan.ok()) << plan.status().message();
  return plan.ok() ? plan.value() : Plan{};
}

std::string error_of(const std::vector<int64_t>& lengths, const PlanOptions& options) {
  auto plan = make_plan(lengths, options);
  EXPECT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  return plan.status().message();
}

TEST(LocalSort, TakesStridedSamplesShortestFirst) {
  const std::vector<int64_t> lengths = {5, 1, 4, 2, 3, 6, 7};
  const Plan plan = plan_or_die(lengths, options_for(Policy::kLocalSort, 3, 10));
  const auto& ranks = plan.minibatches.at(0).ranks;
  using MB = std::vector<Microbatch>;
  EXPECT_EQ(ranks[0].microbatches, (MB{{3}, {0}, {6}}));  // lengths 2, 5, 7
  EXPECT_EQ(ranks[1].microbatches, (MB{{1}, {4}}));       // lengths 1, 3
  EXPECT_EQ(ranks[2].microbatches, (MB{{2}, {5}}));       // lengths 4, 6
}

TEST(Bubble, HandComputedLocalSort) {
  // Microbatch costs: rank0 [2,5,7], rank1 [1,3], rank2 [4,6]; busy 28.
  // T_coll = 4 + 6 + 7 = 17, T_odc = max(14, 4, 10) = 14.
  const std::vector<int64_t> lengths = {5, 1, 4, 2, 3, 6, 7};
  const Plan plan = plan_or_die(lengths, options_for(Policy::kLocalSort, 3, 10));
  const auto& times = plan.minibatches[0].times;
  EXPECT_DOUBLE_EQ(times.busy, 28);
  EXPECT_DOUBLE_EQ(times.collective, 17);
  EXPECT_DOUBLE_EQ(times.odc, 14);
  EXPECT_DOUBLE_EQ(plan.bubble.collective, 1.0 - 28.0 / 51.0);
  EXPECT_DOUBLE_EQ(plan.bubble.odc, 1.0 - 28.0 / 42.0);
}

TEST(Bubble, HandComputedWithSpeedAndMicrobatchConstant) {
  // Same plan; rank 1 twice as fast; c = 1 per microbatch.
  // Times: rank0 [3,6,8] = 17, rank1 [1,2] = 3, rank2 [5,7] = 12; busy 32.
  // T_coll = 5 + 7 + 8 = 20, T_odc = 17.
  const std::vector<int64_t> lengths = {5, 1, 4, 2, 3, 6, 7};
  PlanOptions options = options_for(Policy::kLocalSort, 3, 10);
  options.cost = {1.0, 0.0, 1.0};
  options.rank_speed = {1.0, 2.0, 1.0};
  const Plan plan = plan_or_die(lengths, options);
  EXPECT_DOUBLE_EQ(plan.minibatches[0].times.busy, 32);
  EXPECT_DOUBLE_EQ(plan.bubble.collective, 1.0 - 32.0 / 60.0);
  EXPECT_DOUBLE_EQ(plan.bubble.odc, 1.0 - 32.0 / 51.0);
}

TEST(Bubble, QuadraticCost) {
  // cost = L^2: rank0 takes {3} -> 9, rank1 {4} -> 16. busy 25, T = 16 either way.
  PlanOptions options = options_for(Policy::kLocalSort, 2, 10);
  options.cost = {0.0, 1.0, 0.0};
  const Plan plan = plan_or_die({3, 4}, options);
  EXPECT_DOUBLE_EQ(plan.bubble.odc, 1.0 - 25.0 / 32.0);
  EXPECT_DOUBLE_EQ(plan.bubble.collective, 1.0 - 25.0 / 32.0);
}

TEST(Bubble, AggregatesOverMinibatches) {
  // M = 2: minibatch 0 {1 | 2}: busy 3, T 2; minibatch 1 {3 | 4}: busy 7, T 4.
  PlanOptions options = options_for(Policy::kLocalSort, 2, 10);
  options.minibatch_size = 2;
  const Plan plan = plan_or_die({1, 2, 3, 4}, options);
  ASSERT_EQ(plan.minibatches.size(), 2u);
  EXPECT_DOUBLE_EQ(plan.minibatches[0].bubble.odc, 0.25);
  EXPECT_DOUBLE_EQ(plan.minibatches[1].bubble.odc, 0.125);
  EXPECT_DOUBLE_EQ(plan.bubble.odc, 1.0 - 10.0 / 12.0);
  EXPECT_DOUBLE_EQ(plan.bubble.collective, 1.0 - 10.0 / 12.0);
}

TEST(Bubble, ZeroCostIsZeroBubble) {
  PlanOptions options = options_for(Policy::kLbMini, 2, 10);
  options.cost = {0.0, 0.0, 0.0};
  const Plan plan = plan_or_die({1, 2, 3}, options);
  EXPECT_EQ(plan.bubble.odc, 0.0);
  EXPECT_EQ(plan.bubble.collective, 0.0);
}

TEST(Minibatches, ConsecutiveGroupsLastSmaller) {
  PlanOptions options = options_for(Policy::kLbMini, 2, 100);
  options.minibatch_size = 4;
  const std::vector<int64_t> lengths = random_lengths(10, 100, 1);
  const Plan plan = plan_or_die(lengths, options);
  ASSERT_EQ(plan.minibatches.size(), 3u);
  EXPECT_EQ(plan.minibatches[0].samples, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(plan.minibatches[2].samples, (std::vector<int64_t>{8, 9}));
  expect_valid_plan(plan, lengths);
}

class PolicyInvariants : public ::testing::TestWithParam<std::tuple<Policy, int, int>> {};

TEST_P(PolicyInvariants, EverySampleOnceUnderTheCap) {
  const auto [policy, ranks, minibatch_size] = GetParam();
  for (uint32_t seed = 0; seed < 5; ++seed) {
    const int64_t max_tokens = 8192;
    const auto lengths = random_lengths(300, max_tokens, seed);
    PlanOptions options = options_for(policy, ranks, max_tokens);
    options.minibatch_size = minibatch_size;
    options.cost = {1.0, 1e-4, 5.0};
    const Plan plan = plan_or_die(lengths, options);
    expect_valid_plan(plan, lengths);
    for (const auto& minibatch : plan.minibatches) {
      const size_t samples = minibatch.samples.size();
      size_t fewest = SIZE_MAX;
      size_t most = 0;
      size_t common = minibatch.ranks[0].microbatches.size();
      for (const auto& rank : minibatch.ranks) {
        size_t count = 0;
        for (const auto& mb : rank.microbatches) count += mb.size();
        fewest = std::min(fewest, count);
        most = std::max(most, count);
        const size_t empty = std::count_if(rank.microbatches.begin(), rank.microbatches.end(),
                                           [](const auto& mb) { return mb.empty(); });
        if (policy == Policy::kLbMicro) {
          EXPECT_EQ(rank.microbatches.size(), common);
          // Padding only when the rank has fewer samples than the common count.
          EXPECT_EQ(empty, count < common ? common - count : 0);
          // Heaviest microbatch first.
          for (size_t k = 1; k < rank.microbatches.size(); ++k) {
            double prev = 0, cur = 0;
            for (auto s : rank.microbatches[k - 1]) prev += options.cost.sample_cost(lengths[s]);
            for (auto s : rank.microbatches[k]) cur += options.cost.sample_cost(lengths[s]);
            EXPECT_GE(prev, cur);
          }
        } else {
          EXPECT_EQ(empty, 0u);
        }
        if (policy == Policy::kLocalSort) {
          for (const auto& mb : rank.microbatches) EXPECT_EQ(mb.size(), 1u);
        }
      }
      if (policy != Policy::kLbMini) {
        EXPECT_LE(most - fewest, 1u) << samples;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllPolicies, PolicyInvariants,
    ::testing::Combine(::testing::Values(Policy::kLocalSort, Policy::kLbMicro, Policy::kLbMini),
                       ::testing::Values(1, 3, 8), ::testing::Values(7, 32, 300)),
    [](const auto& info) {
      std::string name(policy_name(std::get<0>(info.param)));
      std::replace(name.begin(), name.end(), '-', '_');
      return name + "_ranks" + std::to_string(std::get<1>(info.param)) + "_mb" +
             std::to_string(std::get<2>(info.param));
    });

TEST(LbMini, BeatsLbMicroOnSkewedData) {
  // A long-tailed minibatch: LB-Mini under ODC idles far less than LB-Micro under collectives.
  const auto lengths = random_lengths(512, 65536, 11);
  PlanOptions options = options_for(Policy::kLbMicro, 8, 65536);
  options.minibatch_size = 64;
  options.cost = {2.7401178e-4, 4.2464424e-9, 0.0};
  const Plan micro = plan_or_die(lengths, options);
  options.policy = Policy::kLbMini;
  const Plan mini = plan_or_die(lengths, options);
  EXPECT_LT(mini.bubble.odc, micro.bubble.collective);
  EXPECT_LE(mini.bubble.odc, micro.bubble.odc + 1e-9);
}

int64_t largest_microbatch(const RankPlan& rank, const std::vector<int64_t>& lengths) {
  int64_t largest = 0;
  for (const auto& mb : rank.microbatches) {
    int64_t tokens = 0;
    for (auto s : mb) tokens += lengths[s];
    largest = std::max(largest, tokens);
  }
  return largest;
}

TEST(LbMini, PacksTheFewestCountByTokens) {
  // One rank, cap 14: at least 2 microbatches for 26 tokens. The costs are quadratic, so the
  // cost-balanced split is {8, 4} + {5, 5, 4} (80 + 66, largest 14 tokens); by tokens the same
  // count packs {8, 5} + {5, 4, 4}: 13 + 13. A microbatch's cost is c plus its samples' costs,
  // so the rank's predicted time is the same either way.
  const std::vector<int64_t> lengths = {8, 5, 5, 4, 4};
  PlanOptions options = options_for(Policy::kLbMini, 1, 14);
  options.cost = {0.0, 1.0, 1.0};
  const Plan plan = plan_or_die(lengths, options);
  const auto& rank = plan.minibatches.at(0).ranks.at(0);
  EXPECT_EQ(rank.microbatches.size(), 2u);
  EXPECT_EQ(largest_microbatch(rank, lengths), 13);
  EXPECT_DOUBLE_EQ(plan.minibatches[0].times.odc, 2.0 + 64 + 25 + 25 + 16 + 16);
}

TEST(LbMini, SplitsAboveTheLongestSampleOnlyWithinTheSlowestRanksTime) {
  // Linear cost, c = 1. Cost-balanced ranks {10, 3} (13) and {9, 3} (12); each fits one
  // microbatch (cap 100), so the minibatch takes 14. Rank {9, 3} has 14 - 12 = 2 to spare: it
  // runs [9] and [3] (no microbatch above the longest sample, 10) and still ends by 14. Rank
  // {10, 3} has 1 to spare, less than a microbatch: it keeps its 13 tokens in one.
  const std::vector<int64_t> lengths = {10, 9, 3, 3};
  PlanOptions options = options_for(Policy::kLbMini, 2, 100);
  options.cost = {1.0, 0.0, 1.0};
  const Plan plan = plan_or_die(lengths, options);
  expect_valid_plan(plan, lengths);
  const auto& minibatch = plan.minibatches.at(0);
  for (const auto& rank : minibatch.ranks) {
    int64_t tokens = 0;
    for (const auto& mb : rank.microbatches)
      for (auto s : mb) tokens += lengths[s];
    if (tokens == 13) {
      EXPECT_EQ(rank.microbatches.size(), 1u);
    } else {
      EXPECT_EQ(tokens, 12);
      EXPECT_EQ(rank.microbatches.size(), 2u);
      EXPECT_EQ(largest_microbatch(rank, lengths), 9);
    }
  }
  EXPECT_DOUBLE_EQ(minibatch.times.odc, 14.0);
  EXPECT_DOUBLE_EQ(minibatch.times.busy, 14.0 + 14.0);
}

TEST(LbMini, NeverSlowerAndNoLargerMicrobatchesThanFewestPacking) {
  // Against the plain rule (each rank in its fewest cost-balanced microbatches, which is what
  // LB-Micro's packer yields with one rank): predicted time equal, largest microbatch no larger.
  const auto lengths = random_lengths(256, 32768, 3);
  for (const CostModel cost : {CostModel{1.0, 0.0, 0.0}, CostModel{3.1e-5, 1.2e-9, 0.07}}) {
    PlanOptions options = options_for(Policy::kLbMini, 4, 32768);
    options.minibatch_size = 32;
    options.cost = cost;
    options.microbatch_memory = MicrobatchMemory::kCap;  // the bound below is kLbMicro's test
    const Plan plan = plan_or_die(lengths, options);
    expect_valid_plan(plan, lengths);
    for (const auto& minibatch : plan.minibatches) {
      int64_t longest = 0;
      for (auto s : minibatch.samples) longest = std::max(longest, lengths[s]);
      double slowest_fewest = 0.0;
      for (const auto& rank : minibatch.ranks) {
        std::vector<int64_t> mine;
        for (const auto& mb : rank.microbatches)
          for (auto s : mb) mine.push_back(lengths[s]);
        PlanOptions alone = options_for(Policy::kLbMicro, 1, 32768);
        alone.cost = cost;
        const Plan fewest = plan_or_die(mine, alone);
        slowest_fewest = std::max(slowest_fewest, fewest.minibatches[0].times.odc);
        EXPECT_LE(largest_microbatch(rank, lengths),
                  std::max(longest, largest_microbatch(fewest.minibatches[0].ranks[0], mine)));
      }
      EXPECT_NEAR(minibatch.times.odc, slowest_fewest, 1e-9 * slowest_fewest);
    }
  }
}

// The largest microbatch of each minibatch of `plan`, split chunks excluded.
std::vector<int64_t> largest_per_minibatch(const Plan& plan, const std::vector<int64_t>& lengths) {
  std::vector<int64_t> largest;
  for (const auto& minibatch : plan.minibatches) {
    int64_t most = 0;
    for (const auto& rank : minibatch.ranks)
      most = std::max(most, largest_microbatch(rank, lengths));
    largest.push_back(most);
  }
  return largest;
}

TEST(LbMini, MicrobatchesNoLargerThanLbMicrosByDefault) {
  // Default kLbMicro: in every minibatch LB-Mini's largest microbatch is at most LB-Micro's (so
  // ODC + LB-Mini needs no more activation memory), and where the bound changed the plan it is
  // predicted no slower than LB-Micro's; kCap may exceed the bound.
  // Heavy-tailed lengths and a long cap make LB-Mini's fewest packing fill microbatches.
  std::vector<int64_t> lengths = random_lengths(512, 4096, 11);
  for (size_t i = 0; i < lengths.size(); i += 37) lengths[i] = 60000 + static_cast<int64_t>(i);
  bool cap_exceeded_somewhere = false;
  for (const CostModel cost : {CostModel{1.0, 0.0, 0.0}, CostModel{3.1e-5, 1.2e-9, 0.07},
                               CostModel{1.1e-4, 2.7e-9, 0.1}}) {
    for (const SplitMode split : {SplitMode::kOff, SplitMode::kAuto}) {
      PlanOptions micro = options_for(Policy::kLbMicro, 4, 200000);
      micro.minibatch_size = 16;
      micro.cost = cost;
      PlanOptions mini = micro;
      mini.policy = Policy::kLbMini;
      mini.split = split;
      PlanOptions cap = mini;
      cap.microbatch_memory = MicrobatchMemory::kCap;
      const Plan micro_plan = plan_or_die(lengths, micro);
      const Plan mini_plan = plan_or_die(lengths, mini);
      const Plan cap_plan = plan_or_die(lengths, cap);
      if (split == SplitMode::kOff) {  // (split samples are in no rank's microbatches)
        expect_valid_plan(mini_plan, lengths);
        expect_valid_plan(cap_plan, lengths);
      }
      const auto micro_largest = largest_per_minibatch(micro_plan, lengths);
      const auto mini_largest = largest_per_minibatch(mini_plan, lengths);
      const auto cap_largest = largest_per_minibatch(cap_plan, lengths);
      ASSERT_EQ(micro_largest.size(), mini_largest.size());
      for (size_t m = 0; m < micro_largest.size(); ++m) {
        EXPECT_LE(mini_largest[m], micro_largest[m]) << "minibatch " << m;
        if (cap_largest[m] > micro_largest[m]) cap_exceeded_somewhere = true;
        if (split == SplitMode::kOff) {
          // Bounded, LB-Mini keeps its own plan or (where the bound made it slower) LB-Micro's.
          const double mini_time = mini_plan.minibatches[m].times.odc;
          if (mini_largest[m] != cap_largest[m]) {
            EXPECT_LE(mini_time, micro_plan.minibatches[m].times.odc * (1 + 1e-12))
                << "minibatch " << m;
          } else {
            EXPECT_DOUBLE_EQ(mini_time, cap_plan.minibatches[m].times.odc) << "minibatch " << m;
          }
        }
      }
    }
  }
  EXPECT_TRUE(cap_exceeded_somewhere) << "the data never made the bound bind: test is vacuous";
}

TEST(LbMini, MicrobatchMemoryNames) {
  EXPECT_EQ(parse_microbatch_memory("lb-micro").value(), MicrobatchMemory::kLbMicro);
  EXPECT_EQ(parse_microbatch_memory("cap").value(), MicrobatchMemory::kCap);
  const auto bad = parse_microbatch_memory("tight");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected lb-micro or cap"), std::string::npos);
  PlanOptions options = options_for(Policy::kLbMini, 2, 100);
  options.microbatch_memory = static_cast<MicrobatchMemory>(7);
  EXPECT_FALSE(validate_plan_options(options).ok());
}

TEST(LbMini, UsesRankSpeed) {
  const auto lengths = random_lengths(400, 4096, 5);
  PlanOptions options = options_for(Policy::kLbMini, 4, 4096);
  const std::vector<double> speeds = {1.0, 1.0, 2.0, 2.0};
  options.rank_speed = speeds;
  const Plan aware = plan_or_die(lengths, options);
  // The fast ranks get about twice the tokens.
  const auto tokens_of = [&](const RankPlan& rank) {
    int64_t total = 0;
    for (const auto& mb : rank.microbatches)
      for (auto s : mb) total += lengths[s];
    return total;
  };
  const auto& ranks = aware.minibatches[0].ranks;
  EXPECT_GT(tokens_of(ranks[2]), 1.8 * tokens_of(ranks[0]));
  EXPECT_LT(aware.bubble.odc, 0.01);
}

TEST(Plans, Deterministic) {
  const auto lengths = random_lengths(2000, 32768, 9);
  for (Policy policy : {Policy::kLocalSort, Policy::kLbMicro, Policy::kLbMini}) {
    PlanOptions options = options_for(policy, 8, 32768);
    options.minibatch_size = 256;
    EXPECT_EQ(plan_to_json(plan_or_die(lengths, options)),
              plan_to_json(plan_or_die(lengths, options)));
  }
}

TEST(Plans, JsonFollowsTheContract) {
  PlanOptions options = options_for(Policy::kLbMicro, 2, 100);
  options.cost = {1.0, 0.5, 2.0};
  const auto json = nlohmann::json::parse(plan_to_json(plan_or_die({10, 20, 30}, options)));
  EXPECT_EQ(json["policy"], "lb-micro");
  EXPECT_EQ(json["ranks"], 2);
  EXPECT_EQ(json["max_tokens"], 100);
  EXPECT_EQ(json["cost"]["b"], 0.5);
  ASSERT_EQ(json["minibatches"].size(), 1u);
  EXPECT_EQ(json["minibatches"][0]["samples"], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(json["minibatches"][0]["ranks"].size(), 2u);
  EXPECT_TRUE(json["minibatches"][0]["ranks"][0]["microbatches"].is_array());
  EXPECT_TRUE(json["bubble"]["collective"].is_number());
  EXPECT_TRUE(json["minibatches"][0]["bubble"]["odc"].is_number());
}

TEST(Validation, TokenTotalsMustFitInt64) {
  // Three samples of INT64_MAX tokens "fitted" one microbatch once the sum wrapped.
  const int64_t most = INT64_MAX;
  EXPECT_EQ(error_of({most, most, most}, options_for(Policy::kLbMini, 1, most)),
            "the sample lengths add up to more than 9223372036854775807 tokens (at sample 1)");
  for (Policy policy : {Policy::kLocalSort, Policy::kLbMicro, Policy::kLbMini}) {
    EXPECT_FALSE(
        make_plan(std::vector<int64_t>{most / 2, most / 2, 2}, options_for(policy, 2, most)).ok());
    // Right at the limit is fine, and nothing wraps while packing.
    const Plan plan = plan_or_die({most / 2, most / 2, 1}, options_for(policy, 2, most));
    expect_valid_plan(plan, {most / 2, most / 2, 1});
  }
}

TEST(Validation, CostsThatOverflowAreRejectedNotNaN) {
  PlanOptions options = options_for(Policy::kLbMini, 2, 1000);
  options.cost = {1e308, 1e308, 0.0};
  EXPECT_EQ(error_of({5, 6}, options),
            "costs overflow: the cost model 1e+308,1e+308,0 gives an infinite total by sample 0 "
            "(length 5); scale the coefficients down");
  options.cost = {1e300, 0.0, 0.0};  // finite costs, but divided by a tiny speed
  options.rank_speed = {1e-300, 1.0};
  options.policy = Policy::kLocalSort;  // gives rank 0 samples: its time is infinite
  EXPECT_EQ(error_of({5, 6, 7, 8}, options),
            "predicted times overflow (cost model 1e+300,0,0 with the given rank speeds): scale "
            "the coefficients or speeds");
  for (Policy policy : {Policy::kLbMicro, Policy::kLbMini}) {
    options.policy = policy;
    auto plan = make_plan(std::vector<int64_t>{5, 6, 7, 8}, options);
    if (plan.ok()) {  // a balancer may leave the slow rank idle: then every number is finite
      EXPECT_TRUE(std::isfinite(plan.value().bubble.collective)) << policy_name(policy);
      EXPECT_TRUE(std::isfinite(plan.value().bubble.odc)) << policy_name(policy);
    } else {
      EXPECT_EQ(plan.status().message(),
                "predicted times overflow (cost model 1e+300,0,0 with the given rank speeds): "
                "scale the coefficients or speeds");
    }
  }
}

// The documented JSON as nlohmann renders it: the hand-written writer must give the same bytes.
std::string reference_json(const Plan& plan) {
  using nlohmann::ordered_json;
  const PlanOptions& options = plan.options;
  ordered_json root;
  root["policy"] = std::string(policy_name(options.policy));
  root["ranks"] = options.num_ranks;
  root["max_tokens"] = options.max_tokens;
  root["cost"] = {{"a", options.cost.a}, {"b", options.cost.b}, {"c", options.cost.c}};
  ordered_json minibatches = ordered_json::array();
  for (const auto& minibatch : plan.minibatches) {
    ordered_json ranks = ordered_json::array();
    for (const auto& rank : minibatch.ranks) ranks.push_back({{"microbatches", rank.microbatches}});
    minibatches.push_back(
        {{"samples", minibatch.samples},
         {"ranks", std::move(ranks)},
         {"bubble", {{"collective", minibatch.bubble.collective}, {"odc", minibatch.bubble.odc}}}});
  }
  root["minibatches"] = std::move(minibatches);
  root["bubble"] = {{"collective", plan.bubble.collective}, {"odc", plan.bubble.odc}};
  return root.dump();
}

TEST(Plans, JsonWriterMatchesNlohmann) {
  const std::vector<int64_t> lengths = random_lengths(300, 4096, 11);
  for (Policy policy : {Policy::kLocalSort, Policy::kLbMicro, Policy::kLbMini}) {
    for (const CostModel cost : {CostModel{1, 0, 0}, CostModel{1.69e-5, 9.75e-10, 0.069},
                                 CostModel{0.1, 1e-300, 1e20}, CostModel{0, 0, 0}}) {
      PlanOptions options = options_for(policy, 3, 8192);
      options.cost = cost;
      options.minibatch_size = 64;
      const Plan plan = plan_or_die(lengths, options);
      EXPECT_EQ(plan_to_json(plan), reference_json(plan)) << policy_name(policy);
    }
  }
}

TEST(Validation, NamesTheProblem) {
  const PlanOptions good = options_for(Policy::kLbMini, 2, 100);
  auto with = [&](auto change) {
    PlanOptions options = good;
    change(options);
    return options;
  };
  EXPECT_EQ(error_of({10}, with([](auto& o) { o.num_ranks = 0; })),
            "ranks must be at least 1, got 0");
  EXPECT_EQ(error_of({10}, with([](auto& o) { o.max_tokens = 0; })),
            "max_tokens must be at least 1, got 0");
  EXPECT_EQ(error_of({10}, with([](auto& o) { o.minibatch_size = 0; })),
            "minibatch_size must be at least 1, got 0");
  EXPECT_EQ(error_of({10}, with([](auto& o) {
                       o.cost = {1, -1, 0};
                     })),
            "malformed cost 1,-1,0: expected three comma-separated non-negative numbers A,B,C");
  EXPECT_EQ(error_of({10}, with([](auto& o) { o.rank_speed = {1}; })),
            "rank_speed must have one entry per rank: got 1 for 2 ranks");
  EXPECT_EQ(error_of({10}, with([](auto& o) {
                       o.rank_speed = {1, 0};
                     })),
            "rank_speed entries must be positive: got 0 for rank 1");
  EXPECT_EQ(error_of({}, good), "empty input: no sample lengths given");
  EXPECT_EQ(error_of({10, 0}, good), "sample 1 has non-positive length 0");
  EXPECT_EQ(error_of({10, 20, 101}, good), "sample 2 has length 101, above max_tokens 100");
  EXPECT_EQ(parse_policy("fsdp").status().message(),
            "unknown policy 'fsdp': expected local-sort, lb-micro or lb-mini");
}

}  // namespace
}  // namespace odc::planner
