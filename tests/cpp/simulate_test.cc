// The simulator against the planner's own accounting (free communication), hand-computed small
// cases with communication, and its invariants (docs/design.md; docs/simulate.md).
#include "simulate/simulate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "simulate/sweep.h"
#include "simulate/sweep_format.h"
#include "test_util.h"

namespace odc::simulate {
namespace {

SimulateOptions small_options(Mode mode, planner::Policy policy, int64_t ranks) {
  SimulateOptions options;
  options.mode = mode;
  options.plan.num_ranks = ranks;
  options.plan.policy = policy;
  options.plan.max_tokens = 64;
  options.plan.minibatch_size = 4 * ranks;
  options.plan.cost = planner::CostModel{1e-3, 2e-5, 5e-3};
  options.model = ModelShape{4, 1e6, 2e6};
  options.optimizer_bytes_per_param = 0.0;
  return options;
}

SimulateResult run(std::span<const int64_t> lengths, const SimulateOptions& options) {
  auto result = simulate(lengths, options);
  EXPECT_TRUE(result.ok()) << result.status().message();
  return result.ok() ? result.value() : SimulateResult{};
}

constexpr Mode kEveryMode[] = {Mode::kCollective, Mode::kFsdp2Deferred, Mode::kFsdp2Unsharded,
                               Mode::kOdcFlat, Mode::kOdcHybrid};

TEST(Simulate, FreeCommunicationGivesThePlannersTimes) {
  // Every arm: lockstep modes (collective, fsdp2-deferred) take sum_k max_r C[r][k], the others
  // max_r sum_k C[r][k], on the plan as the arm runs it (lb-mini-padded's and fsdp2-unsharded's
  // empty microbatches included), in update and forward-only minibatches alike.
  const auto lengths = planner::testing::random_lengths(400, 64, 7);
  const PolicyChoice policies[] = {{planner::Policy::kLocalSort},
                                   {planner::Policy::kLbMicro},
                                   {planner::Policy::kLbMini},
                                   {planner::Policy::kLbMini, true}};
  for (const PolicyChoice& policy : policies) {
    for (Mode mode : kEveryMode) {
      if (lockstep(mode) && policy.policy == planner::Policy::kLbMini && !policy.padded) continue;
      for (bool forward_only : {false, true}) {
        auto options = small_options(mode, policy.policy, 5);
        options.pad_to_equal_counts = policy.padded;
        options.forward_only = forward_only;
        options.free_communication = true;
        const SimulateResult result = run(lengths, options);
        if (mode == Mode::kFsdp2Unsharded && !forward_only) {
          // Its last backwards meet layer by layer (UnshardedLastBackwardsMeetLayerByLayer),
          // which no communication speed removes: at least the planner's time.
          EXPECT_GE(result.seconds, result.planner_seconds * (1 - 1e-9)) << policy_label(policy);
        } else {
          EXPECT_NEAR(result.seconds, result.planner_seconds, 1e-9 * result.seconds)
              << mode_name(mode) << " " << policy_label(policy) << " forward-only " << forward_only;
        }
        EXPECT_EQ(result.exposed_comm_seconds, 0.0);
      }
    }
  }
}

TEST(Simulate, SplitSamplesRunAsThePlannerStepsThem) {
  // A heavy tail: every minibatch has a sample far above a rank's share, which --split auto runs
  // as chunks on a group. With free communication the simulated time is still exactly the
  // planner's (chunk first on each member, at the group's slowest chunk), under both policies
  // that split and under collective too (lb-micro+split), with unequal rank speeds.
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 200; ++i) lengths.push_back(i % 20 == 0 ? 60 : 1 + i % 8);
  size_t splits = 0;
  for (auto policy : {planner::Policy::kLbMicro, planner::Policy::kLbMini}) {
    for (Mode mode : {Mode::kCollective, Mode::kOdcFlat, Mode::kOdcHybrid}) {
      if (mode == Mode::kCollective && policy == planner::Policy::kLbMini) continue;
      auto options = small_options(mode, policy, 4);
      options.plan.minibatch_size = 20;
      options.plan.split = planner::SplitMode::kAuto;
      options.plan.rank_speed = {1.0, 0.5, 1.0, 2.0};
      options.free_communication = true;
      auto plan = planner::make_plan(lengths, options.plan);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      for (const auto& minibatch : plan.value().minibatches) splits += minibatch.splits.size();
      auto result = simulate_plan(plan.value(), lengths, options);
      ASSERT_TRUE(result.ok()) << result.status().message();
      EXPECT_NEAR(result.value().seconds, result.value().planner_seconds,
                  1e-9 * result.value().seconds)
          << mode_name(mode) << " " << planner::policy_name(policy);
    }
  }
  EXPECT_GT(splits, 0u);  // the case splits, or it tests nothing
}

TEST(Simulate, StealingWithFreeCommunicationGivesThePlannersStealingTimes) {
  // With stealing on and free communication, the simulated minibatch is the planner's stealing
  // span (predict_stealing), never above the plan's ODC time at equal speeds (steal_test.cc's
  // invariant), splits included.
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 200; ++i) lengths.push_back(i % 20 == 0 ? 60 : 1 + i % 8);
  for (auto split : {planner::SplitMode::kOff, planner::SplitMode::kAuto}) {
    for (Mode mode : {Mode::kOdcFlat, Mode::kOdcHybrid}) {
      auto options = small_options(mode, planner::Policy::kLbMini, 4);
      options.plan.minibatch_size = 20;
      options.plan.split = split;
      options.free_communication = true;
      auto plan = planner::make_plan(lengths, options.plan);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      double odc = 0.0;
      for (const auto& minibatch : plan.value().minibatches) odc += minibatch.times.odc;
      options.steal = true;
      auto result = simulate_plan(plan.value(), lengths, options);
      ASSERT_TRUE(result.ok()) << result.status().message();
      EXPECT_NEAR(result.value().seconds, result.value().planner_seconds,
                  1e-9 * result.value().seconds);
      EXPECT_LE(result.value().seconds, odc * (1 + 1e-12));
    }
  }
}

TEST(Simulate, AnUnplannedSlowdownSlowsEveryArmAndStealingMovesWorkOffIt) {
  // local-sort on 2 ranks, 4 samples of 10 tokens per minibatch at 1 s per token, no c: rank 0
  // runs samples 0 and 2, rank 1 samples 1 and 3, 10 s each. Rank 1 runs 3x slower than planned:
  // without stealing it takes 60 s; with stealing rank 0 (free at 20) takes rank 1's second
  // microbatch, and the minibatch ends at 30 when both finish.
  const std::vector<int64_t> lengths(4, 10);
  auto options = small_options(Mode::kOdcFlat, planner::Policy::kLocalSort, 2);
  options.plan.cost = planner::CostModel{1.0, 0.0, 0.0};
  options.free_communication = true;
  options.rank_slowdown = {1.0, 3.0};
  EXPECT_DOUBLE_EQ(run(lengths, options).seconds, 60.0);
  options.steal = true;
  const SimulateResult stolen = run(lengths, options);
  EXPECT_DOUBLE_EQ(stolen.seconds, 30.0);
  EXPECT_DOUBLE_EQ(stolen.planner_seconds, 20.0);  // the planner knows no slowdown
  EXPECT_DOUBLE_EQ(stolen.compute_seconds, (10 + 10 + 10 + 30) / 2.0);
  // Collective arms run slower too, and cannot steal.
  options.steal = false;
  options.mode = Mode::kCollective;
  EXPECT_DOUBLE_EQ(run(lengths, options).seconds, 60.0);
  options.steal = true;
  auto refused = simulate(lengths, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("work stealing is odc's"), std::string::npos);
  options.mode = Mode::kOdcFlat;
  options.rank_slowdown = {1.0};
  refused = simulate(lengths, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "rank slowdown must have one entry per rank: got 1 for 2 ranks");
}

TEST(Simulate, CollectiveIsNeverFasterThanOdcOnTheSamePlanWhenCommunicationIsFree) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    const auto lengths = planner::testing::random_lengths(240, 64, seed);
    for (auto policy : {planner::Policy::kLocalSort, planner::Policy::kLbMicro}) {
      auto collective = small_options(Mode::kCollective, policy, 6);
      collective.free_communication = true;
      auto odc = small_options(Mode::kOdcFlat, policy, 6);
      odc.free_communication = true;
      EXPECT_GE(run(lengths, collective).seconds, run(lengths, odc).seconds * (1 - 1e-12));
    }
  }
}

TEST(Simulate, OneRankHasNoBubbleAndNoCommunication) {
  const auto lengths = planner::testing::random_lengths(40, 64, 3);
  for (Mode mode : {Mode::kCollective, Mode::kOdcFlat, Mode::kOdcHybrid}) {
    const SimulateResult result = run(lengths, small_options(mode, planner::Policy::kLbMicro, 1));
    EXPECT_NEAR(result.bubble, 0.0, 1e-12) << mode_name(mode);
    EXPECT_NEAR(result.seconds, result.compute_seconds, 1e-12 * result.seconds);
  }
}

// Two ranks, one layer of 1e9 parameters, no root unit, no latency, 1 GB/s links, forward half
// of the cost; samples of cost 3 s and 1 s, one per rank.
SimulateOptions hand_options(Mode mode) {
  SimulateOptions options;
  options.mode = mode;
  options.plan.num_ranks = 2;
  options.plan.policy = planner::Policy::kLbMicro;
  options.plan.max_tokens = 3;
  options.plan.cost = planner::CostModel{1.0, 0.0, 0.0};
  options.model = ModelShape{1, 1e9, 0.0};
  options.topology.nvlink = Link{1e9, 0.0};
  options.topology.nvlink_collective = Link{1e9, 0.0};
  options.forward_fraction = 0.5;
  options.optimizer_bytes_per_param = 0.0;
  return options;
}

TEST(Simulate, CollectiveByHand) {
  // All-gather: half of 2e9 bytes at 1 GB/s = 1 s; reduce-scatter of fp32: 2 s.
  // AG 1 + forward of the slowest 1.5 + AG again 1 + backward 1.5 + RS 2 = 7 s.
  const std::vector<int64_t> lengths = {3, 1};
  const SimulateResult result = run(lengths, hand_options(Mode::kCollective));
  EXPECT_NEAR(result.seconds, 7.0, 1e-12);
  EXPECT_NEAR(result.planner_seconds, 3.0, 1e-12);
  EXPECT_NEAR(result.exposed_comm_seconds, 4.0, 1e-12);
  EXPECT_NEAR(result.bubble, 1.0 - 4.0 / (2 * 7.0), 1e-12);
}

TEST(Simulate, OdcByHandWithContention) {
  // ODC pulls the published fp32 shards (4 B per parameter, narrowed to bf16 on arrival), not
  // the bf16 cast FSDP2's all-gather moves: half of 4e9 bytes at 1 GB/s = 2 s per pull, and the
  // fp32 push 2 s. Without contention rank 0 pulls 2 s, computes 1.5 s, pulls 2 s, computes
  // 1.5 s, pushes 2 s: 9 s. Over both ranks the links carry 8 s of pulls and 4 s of pushes in
  // 2 x 9 s: pulls get 1 / (1 + 4/18) = 9/11 of the bandwidth, pushes 1 / (1 + 8/18) = 9/13, so
  // pull 22/9 s, push 26/9 s, and rank 0 ends at 22/9 + 1.5 + 22/9 + 1.5 + 26/9 = 70/9 + 3.
  // (With 2-byte pulls it was 36/7 + 3.)
  const std::vector<int64_t> lengths = {3, 1};
  const SimulateResult result = run(lengths, hand_options(Mode::kOdcFlat));
  EXPECT_NEAR(result.seconds, 70.0 / 9.0 + 3.0, 1e-12);
  // Hybrid on one node is flat ODC.
  EXPECT_NEAR(run(lengths, hand_options(Mode::kOdcHybrid)).seconds, result.seconds, 1e-12);
}

TEST(Simulate, HybridAddsTheCrossNodeReductionAndKeepsPullsOnTheNode) {
  const auto lengths = planner::testing::random_lengths(256, 64, 11);
  auto flat = small_options(Mode::kOdcFlat, planner::Policy::kLbMini, 16);
  flat.topology.gpus_per_node = 4;
  flat.topology.network = Link{1e6, 1e-3};  // a very slow network
  auto hybrid = flat;
  hybrid.mode = Mode::kOdcHybrid;
  const SimulateResult f = run(lengths, flat), h = run(lengths, hybrid);
  // Flat pulls 3/4 of every layer over the slow network; hybrid only reduces once per minibatch.
  EXPECT_GT(f.exposed_comm_seconds, h.exposed_comm_seconds);
  EXPECT_GT(h.exposed_comm_seconds, 0.0);
  EXPECT_NEAR(f.compute_seconds, h.compute_seconds, 1e-12);
}

TEST(Simulate, RejectsWhatCannotRun) {
  const std::vector<int64_t> lengths = {3, 1};
  auto options = hand_options(Mode::kCollective);
  options.plan.policy = planner::Policy::kLbMini;
  auto result = simulate(lengths, options);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("lb-mini"), std::string::npos);
  options = hand_options(Mode::kOdcFlat);
  options.topology.network.bytes_per_second = 0;
  EXPECT_FALSE(simulate(lengths, options).ok());
  // fsdp2-deferred meets at every microbatch as collective does: the error names it.
  options = hand_options(Mode::kFsdp2Deferred);
  options.plan.policy = planner::Policy::kLbMini;
  result = simulate(lengths, options);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("which fsdp2-deferred cannot run"), std::string::npos);
  options.pad_to_equal_counts = true;  // lb-mini-padded runs
  EXPECT_TRUE(simulate(lengths, options).ok());
  options.plan.policy = planner::Policy::kLbMicro;  // padding is lb-mini's only
  EXPECT_FALSE(simulate(lengths, options).ok());
  auto mode = parse_mode("nccl");
  ASSERT_FALSE(mode.ok());
  EXPECT_NE(mode.status().message().find("fsdp2-deferred, fsdp2-unsharded"), std::string::npos);
  auto policy = parse_policy_choice("lb-maxi");
  ASSERT_FALSE(policy.ok());
  EXPECT_NE(policy.status().message().find("lb-mini-padded"), std::string::npos);
  ASSERT_TRUE(parse_policy_choice("lb-mini-padded").ok());
  EXPECT_TRUE(parse_policy_choice("lb-mini-padded").value().padded);
  EXPECT_FALSE(model_preset("70b").ok());
}

// A plan given by hand: ranks[r] lists rank r's microbatches; times as the planner predicts them.
planner::Plan hand_plan(const std::vector<std::vector<planner::Microbatch>>& ranks,
                        std::span<const int64_t> lengths, const planner::PlanOptions& options) {
  planner::Plan plan;
  plan.options = options;
  planner::MinibatchPlan minibatch;
  for (size_t i = 0; i < lengths.size(); ++i) minibatch.samples.push_back(static_cast<int64_t>(i));
  for (const auto& microbatches : ranks) minibatch.ranks.push_back({microbatches});
  minibatch.times = planner::predict_times(minibatch.ranks, lengths, options);
  plan.minibatches.push_back(minibatch);
  return plan;
}

SimulateResult run_plan(const planner::Plan& plan, std::span<const int64_t> lengths,
                        const SimulateOptions& options) {
  auto result = simulate_plan(plan, lengths, options);
  EXPECT_TRUE(result.ok()) << result.status().message();
  return result.ok() ? result.value() : SimulateResult{};
}

TEST(Simulate, PaddingAndEmptyMicrobatchesByHandWithFreeCommunication) {
  // Cost L + 0.5 per microbatch. Rank 0 runs lengths 1 and 1 (1.5 s each), rank 1 one of 4
  // (4.5 s): LB-Mini's unequal counts.
  const std::vector<int64_t> lengths = {1, 1, 4};
  auto options = hand_options(Mode::kCollective);
  options.plan.policy = planner::Policy::kLbMini;
  options.plan.cost = planner::CostModel{1.0, 0.0, 0.5};
  options.free_communication = true;
  const auto plan = hand_plan({{{0}, {1}}, {{2}}}, lengths, options.plan);
  // lb-mini-padded under lockstep modes: rank 1 gets an empty microbatch (0.5 s) after its own,
  // so max(1.5, 4.5) + max(1.5, 0.5) = 6 s, and busy 8 s of 2 x 6: bubble 1/3.
  options.pad_to_equal_counts = true;
  for (Mode mode : {Mode::kCollective, Mode::kFsdp2Deferred}) {
    options.mode = mode;
    const SimulateResult padded = run_plan(plan, lengths, options);
    EXPECT_NEAR(padded.seconds, 6.0, 1e-12) << mode_name(mode);
    EXPECT_NEAR(padded.planner_seconds, 6.0, 1e-12);
    EXPECT_NEAR(padded.compute_seconds, 4.0, 1e-12);
    EXPECT_NEAR(padded.bubble, 1.0 / 3.0, 1e-12);
  }
  // fsdp2-unsharded runs the counts as they are: max(3, 4.5) = 4.5 s, like odc; a third rank
  // without microbatches runs one empty one (0.5 s of busy time, no effect on the span).
  options.pad_to_equal_counts = false;
  options.mode = Mode::kFsdp2Unsharded;
  const SimulateResult unsharded = run_plan(plan, lengths, options);
  EXPECT_NEAR(unsharded.seconds, 4.5, 1e-12);
  options.plan.num_ranks = 3;
  const auto idle_rank = hand_plan({{{0}, {1}}, {{2}}, {}}, lengths, options.plan);
  const SimulateResult three = run_plan(idle_rank, lengths, options);
  EXPECT_NEAR(three.seconds, 4.5, 1e-12);
  EXPECT_NEAR(three.compute_seconds, (3.0 + 4.5 + 0.5) / 3.0, 1e-12);
  options.mode = Mode::kOdcFlat;  // odc leaves the idle rank idle
  EXPECT_NEAR(run_plan(idle_rank, lengths, options).compute_seconds, 7.5 / 3.0, 1e-12);
}

TEST(Simulate, DeferredSyncByHand) {
  // hand_options: one layer, all-gather 1 s, reduce-scatter 2 s, forward half. Both ranks run
  // two microbatches: rank 0 of 3 s and 1 s, rank 1 of 1 s and 1 s.
  // collective: AG 1, forward 1 -> 2.5 | 1.5; AG at 2.5 -> 3.5, backward -> 5 | 4; RS 5 -> 7;
  //   second microbatch: AG waits for the RS, 7 -> 8, forward 8.5, AG 9.5, backward 10, RS 12.
  // fsdp2-deferred: no RS after the first microbatch, so its second AG runs 5 -> 6, forward 6.5,
  //   AG 7.5, backward 8, RS 10: the first reduce-scatter's 2 s are saved.
  const std::vector<int64_t> lengths = {3, 1, 1, 1};
  auto options = hand_options(Mode::kCollective);
  const auto plan = hand_plan({{{0}, {1}}, {{2}, {3}}}, lengths, options.plan);
  EXPECT_NEAR(run_plan(plan, lengths, options).seconds, 12.0, 1e-12);
  options.mode = Mode::kFsdp2Deferred;
  const SimulateResult deferred = run_plan(plan, lengths, options);
  EXPECT_NEAR(deferred.seconds, 10.0, 1e-12);
  EXPECT_NEAR(deferred.planner_seconds, 4.0, 1e-12);  // max(3, 1) + max(1, 1)
}

TEST(Simulate, UnshardedExposesItsStartAllGatherOncePerMinibatch) {
  // hand_options again; rank 0 runs one microbatch of 3 s, rank 1 two of 1 s. The layer's
  // all-gather (1 s) runs once, at the start: rank 0 forward 1 -> 2.5, backward -> 4; rank 1
  // 1 -> 1.5 -> 2, then 2.5 -> 3. The reduce-scatter (2 s) waits for both last backwards: 4 -> 6.
  // Free communication: max(3, 2) = 3 s, so 3 s exposed: the start all-gather and the final
  // reduce-scatter, once per minibatch however many microbatches a rank runs.
  const std::vector<int64_t> lengths = {3, 1, 1};
  auto options = hand_options(Mode::kFsdp2Unsharded);
  options.plan.policy = planner::Policy::kLbMini;
  const auto plan = hand_plan({{{0}}, {{1}, {2}}}, lengths, options.plan);
  const SimulateResult unsharded = run_plan(plan, lengths, options);
  EXPECT_NEAR(unsharded.seconds, 6.0, 1e-12);
  EXPECT_NEAR(unsharded.exposed_comm_seconds, 3.0, 1e-12);
  EXPECT_NEAR(unsharded.idle_seconds, 3.0 - 2.5, 1e-12);  // busy 5 s over 2 ranks in 3 s
}

TEST(Simulate, UnshardedLastBackwardsMeetLayerByLayer) {
  // Three layers, free communication, forward half. Rank 0 runs one microbatch of 6 s (forward
  // 1 s per layer, backward 1 s per layer), rank 1 two, of 4 s and 2 s (its last backward 1/3 s
  // per layer, from 5 s). FSDP2 keeps one reduce-scatter in flight: a unit's post-backward
  // waits for the previous unit's reduce-scatter, which completes when every rank issued it.
  //   layer 0: rank 0 done 4, rank 1 5 1/3: RS0 at 5 1/3.
  //   layer 1: rank 0 done 5, waits RS0 -> 5 1/3; rank 1 5 2/3: RS1 at 5 2/3.
  //   layer 2: rank 0 6 1/3; rank 1 6: RS2 at 6 1/3; the root's waits it: 6 1/3 s,
  // against the planner's max(6, 6) = 6 s (the same plan under odc takes 6 s).
  const std::vector<int64_t> lengths = {6, 4, 2};
  auto options = hand_options(Mode::kFsdp2Unsharded);
  options.plan.policy = planner::Policy::kLbMini;
  options.plan.max_tokens = 8;
  options.model = ModelShape{3, 1e9, 0.0};
  options.free_communication = true;
  const auto plan = hand_plan({{{0}}, {{1}, {2}}}, lengths, options.plan);
  const SimulateResult unsharded = run_plan(plan, lengths, options);
  EXPECT_NEAR(unsharded.seconds, 19.0 / 3.0, 1e-12);
  EXPECT_NEAR(unsharded.planner_seconds, 6.0, 1e-12);
  options.mode = Mode::kOdcFlat;
  EXPECT_NEAR(run_plan(plan, lengths, options).seconds, 6.0, 1e-12);
}

TEST(Simulate, ForwardOnlyMinibatchesGatherTheRootOnce) {
  // Root and layer all-gathers 1 s each (hand_options' links, 1e9 parameters each); two forward
  // microbatches of 1 s per rank. collective: root 0 -> 1, layer 1 -> 2, forward -> 3; the root
  // stays gathered (no backward reshards it), so the second microbatch gathers the layer only,
  // 3 -> 4, forward -> 5. With a backward every microbatch would gather the root again.
  const std::vector<int64_t> lengths = {1, 1, 1, 1};
  auto options = hand_options(Mode::kCollective);
  options.model = ModelShape{1, 1e9, 1e9};
  options.forward_only = true;
  const auto plan = hand_plan({{{0}, {1}}, {{2}, {3}}}, lengths, options.plan);
  EXPECT_NEAR(run_plan(plan, lengths, options).seconds, 5.0, 1e-12);
}

TEST(Simulate, ForwardOnlyMinibatchesGatherAndNeverReduce) {
  // The plan's costs are already the forward's (forward_cost): 3 s and 1 s, one per rank, all of
  // it in the forward. collective and fsdp2-deferred: AG 1 s, then 3 s: 4 s, no reduce-scatter
  // and no optimizer; fsdp2-unsharded the same (its one start gather); odc pulls the fp32 shards
  // (2 s, nothing pushed to contend with): 5 s.
  const std::vector<int64_t> lengths = {3, 1};
  auto options = hand_options(Mode::kCollective);
  options.forward_only = true;
  options.optimizer_bytes_per_param = 32.0;  // would show if a forward-only minibatch stepped
  const auto plan = hand_plan({{{0}}, {{1}}}, lengths, options.plan);
  for (Mode mode : {Mode::kCollective, Mode::kFsdp2Deferred, Mode::kFsdp2Unsharded}) {
    options.mode = mode;
    const SimulateResult result = run_plan(plan, lengths, options);
    EXPECT_NEAR(result.seconds, 4.0, 1e-12) << mode_name(mode);
    EXPECT_EQ(result.optimizer_seconds, 0.0);
  }
  options.mode = Mode::kOdcFlat;
  EXPECT_NEAR(run_plan(plan, lengths, options).seconds, 5.0, 1e-12);
  EXPECT_NEAR(forward_cost(planner::CostModel{4.0, 8.0, 2.0, 1.0}, 0.25).b, 2.0, 1e-15);
  EXPECT_NEAR(forward_cost(planner::CostModel{4.0, 8.0, 2.0, 1.0}, 0.25).floor, 0.25, 1e-15);
}

TEST(Simulate, GrpoStepByHandWithFreeCommunication) {
  // One RL step of 4 rollouts on 2 ranks, local-sort, cost L, forward a quarter, K = 2.
  // Forward-only plan (one minibatch of all 4, costs / 4): rank 0 lengths 1, 4 -> 0.25, 1;
  // rank 1 lengths 3, 3 -> 0.75, 0.75. Lockstep: 0.75 + 1 = 1.75 s; the others max(1.25, 1.5).
  // Updates: {1 | 3} -> 3 s, {4 | 3} -> 4 s. RL step: 2 x forward + 7.
  const std::vector<int64_t> lengths = {1, 3, 4, 3};
  for (Mode mode : kEveryMode) {
    auto options = small_options(mode, planner::Policy::kLocalSort, 2);
    options.plan.cost = planner::CostModel{1.0, 0.0, 0.0};
    options.plan.minibatch_size = 4;  // the RL step's rollouts
    options.forward_fraction = 0.25;
    options.free_communication = true;
    auto result = simulate_grpo(lengths, options, 2);
    ASSERT_TRUE(result.ok()) << result.status().message();
    const GrpoResult& grpo = result.value();
    const double forward = lockstep(mode) ? 1.75 : 1.5;
    EXPECT_EQ(grpo.num_rl_steps, 1);
    EXPECT_NEAR(grpo.forward_phase.seconds, forward, 1e-12) << mode_name(mode);
    EXPECT_NEAR(grpo.update.seconds, 7.0, 1e-12) << mode_name(mode);
    EXPECT_NEAR(grpo.rl_step.seconds, 2 * forward + 7.0, 1e-12) << mode_name(mode);
    EXPECT_NEAR(grpo.rl_step.planner_seconds, grpo.rl_step.seconds, 1e-12);
    ASSERT_EQ(grpo.rl_step.minibatch_seconds.size(), 1u);
    EXPECT_NEAR(grpo.rl_step.minibatch_seconds[0], 2 * forward + 7.0, 1e-12);
    // busy: two forward phases of 2.75 s and 11 s of updates, over 2 ranks.
    EXPECT_NEAR(grpo.rl_step.compute_seconds, (2 * 2.75 + 11.0) / 2, 1e-12);
  }
  auto options = small_options(Mode::kOdcFlat, planner::Policy::kLocalSort, 2);
  options.plan.minibatch_size = 4;
  EXPECT_FALSE(simulate_grpo(lengths, options, 3).ok());  // 4 rollouts into 3 minibatches
  EXPECT_FALSE(simulate_grpo(std::span(lengths).first(3), options, 2).ok());  // no whole step
}

TEST(Simulate, ResampleKeepsFileOrderFirstThenRepeatsDeterministically) {
  const std::vector<int64_t> source = {5, 6, 7};
  const auto out = resample_lengths(source, 8, 0);
  ASSERT_EQ(out.size(), 8u);
  EXPECT_EQ(std::vector<int64_t>(out.begin(), out.begin() + 3), source);
  EXPECT_EQ(out, resample_lengths(source, 8, 0));
  std::vector<int64_t> second(out.begin() + 3, out.begin() + 6);
  std::sort(second.begin(), second.end());
  EXPECT_EQ(second, source);  // every pass is a permutation of the file
}

// Memory per GPU by hand (docs/multinode.md's state formulas, docs/runtime.md's budgets): P =
// 2 x 1000 + 500 = 2,500 parameters, 16 ranks as 2 nodes of 8.
TEST(Simulate, MemoryPerGpuFollowsTheRuntimesFormulas) {
  const ModelShape model{2, 1000, 500};
  const double gathered = 2.0 * (2 * 1000 + 500) + 4.0 * 1000;  // two layers + root, one gradient
  const MemoryPerGpu fsdp = memory_per_gpu(model, Mode::kCollective, 16, 8);
  EXPECT_DOUBLE_EQ(fsdp.state_bytes, 16.0 * 2500 / 16);
  EXPECT_DOUBLE_EQ(fsdp.gathered_bytes, gathered);
  EXPECT_DOUBLE_EQ(fsdp.odc_bytes, 0.0);
  // odc.torch publishes FSDP2's fp32 shards in place: the same 16 B as FSDP2, no bf16 copy.
  const MemoryPerGpu flat = memory_per_gpu(model, Mode::kOdcFlat, 16, 8);
  EXPECT_DOUBLE_EQ(flat.state_bytes, 16.0 * 2500 / 16);
  // Across nodes: the staging budget and one other node's fp32 shards in the node cache.
  EXPECT_DOUBLE_EQ(flat.odc_bytes, kStagingBudgetBytes + 4.0 * 2500 / 16);
  EXPECT_DOUBLE_EQ(flat.total_bytes(), flat.state_bytes + gathered + flat.odc_bytes);
  EXPECT_DOUBLE_EQ(memory_per_gpu(model, Mode::kOdcFlat, 8, 8).odc_bytes, 0.0);  // one node
  const MemoryPerGpu hybrid = memory_per_gpu(model, Mode::kOdcHybrid, 16, 8);
  EXPECT_DOUBLE_EQ(hybrid.state_bytes, 16.0 * 2500 / 8);
  EXPECT_DOUBLE_EQ(hybrid.odc_bytes, 0.0);
  // fsdp2-deferred: FSDP2's, plus every parameter's unsharded fp32 gradient (4 B x 2,500).
  const MemoryPerGpu deferred = memory_per_gpu(model, Mode::kFsdp2Deferred, 16, 8);
  EXPECT_DOUBLE_EQ(deferred.state_bytes, 16.0 * 2500 / 16);
  EXPECT_DOUBLE_EQ(deferred.gathered_bytes, gathered);
  EXPECT_DOUBLE_EQ(deferred.unsharded_bytes, 4.0 * 2500);
  // fsdp2-unsharded: bf16 parameters and fp32 gradients of the whole model, (2 + 4) B x 2,500
  // on top of the sharded state, and the largest unit's fp32 reduce-scatter input (4 B x 1,000)
  // allocated beside its accumulated gradient.
  const MemoryPerGpu unsharded = memory_per_gpu(model, Mode::kFsdp2Unsharded, 16, 8);
  EXPECT_DOUBLE_EQ(unsharded.total_bytes(), 16.0 * 2500 / 16 + 6.0 * 2500 + 4.0 * 1000);
  EXPECT_DOUBLE_EQ(unsharded.gathered_bytes, 4.0 * 1000);
  // GRPO: the frozen reference's fp32 shards on top, over the sharding group.
  EXPECT_DOUBLE_EQ(memory_per_gpu(model, Mode::kCollective, 16, 8, true).state_bytes,
                   (16.0 + 4.0) * 2500 / 16);
  EXPECT_DOUBLE_EQ(memory_per_gpu(model, Mode::kOdcHybrid, 16, 8, true).state_bytes,
                   (16.0 + 4.0) * 2500 / 8);
  // A node cache larger than its budget is held to it.
  const ModelShape large{10, 1e9, 0};
  EXPECT_DOUBLE_EQ(memory_per_gpu(large, Mode::kOdcFlat, 16, 8).odc_bytes,
                   kStagingBudgetBytes + kNodeCacheBudgetBytes);
}

TEST(Simulate, PresetsHaveTheDocumentedSizes) {
  auto small = model_preset("1.5b");
  auto large = model_preset("7b");
  ASSERT_TRUE(small.ok() && large.ok());
  const auto total = [](const ModelShape& m) {
    return m.other_params + static_cast<double>(m.num_layers) * m.layer_params;
  };
  // odc.train's 1.5b ties the LM head to the embeddings (1.54B); its 7b does not (7.62B).
  EXPECT_NEAR(total(small.value()) / 1e9, 1.54, 0.02);
  EXPECT_NEAR(total(large.value()) / 1e9, 7.62, 0.05);
  EXPECT_TRUE(model_preset("tiny").ok() && model_preset("0.5b").ok());
}

TEST(Simulate, CurvesInterpolateInLogSizeAndClampAtTheEnds) {
  Curve curve;
  curve.points = {{1e6, 100e9}, {4e6, 300e9}};
  EXPECT_DOUBLE_EQ(curve.bandwidth(1e3), 100e9);
  EXPECT_DOUBLE_EQ(curve.bandwidth(1e9), 300e9);
  EXPECT_NEAR(curve.bandwidth(2e6), 200e9, 1e-3);  // halfway in log(size)
}

TEST(Simulate, MeasuredCurvesReplaceTheNvlinkConstants) {
  // The hand case again, with a flat 1 GB/s all-gather curve and 0.5 GB/s reduce-scatter curve
  // instead of the constants: AG 1 s, RS 4 s: 1 + 1.5 + 1 + 1.5 + 4 = 9 s.
  const std::vector<int64_t> lengths = {3, 1};
  auto options = hand_options(Mode::kCollective);
  options.topology.nvlink_collective = Link{1e12, 1.0};  // would be visible if still used
  options.topology.curves.all_gather.points = {{1.0, 1e9}};
  options.topology.curves.reduce_scatter.points = {{1.0, 0.5e9}};
  EXPECT_NEAR(run(lengths, options).seconds, 9.0, 1e-12);
}

// Sizes that made the simulator abort, overflow or run for hours are refused with a
// message, and a directory given as the curves file is an error, not an uncaught exception.
TEST(Simulate, RefusesSizesItCannotRunAndReadsNoDirectory) {
  const std::vector<int64_t> lengths = {3, 1};
  auto options = hand_options(Mode::kOdcFlat);
  ASSERT_TRUE(simulate(lengths, options).ok());
  auto too_deep = options;
  too_deep.model.num_layers = kMaxLayers + 1;
  auto result = simulate(lengths, too_deep);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("layers"), std::string::npos);
  auto calibrated = options;
  calibrated.cost_calibration_ranks = 1000000000;
  result = simulate(lengths, calibrated);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("calibration"), std::string::npos);
  auto huge = options;
  huge.model.layer_params = 1e308;
  EXPECT_FALSE(simulate(lengths, huge).ok());
  auto curves = read_transport_curves(::testing::TempDir());
  ASSERT_FALSE(curves.ok());
  EXPECT_NE(curves.status().message().find("directory"), std::string::npos);
}

// The typed sweep: request in, rows out, without a command line. Lockstep modes skip lb-mini and
// every other mode skips lb-mini-padded; speedups are against collective + lb-micro at each
// rank count, and the memory table has one row per rank count and mode.
TEST(Sweep, RowsFollowTheRequest) {
  Sweep request;
  request.samples.given_lengths = std::vector<int64_t>{900, 30, 400, 70, 2000, 10, 600, 50};
  request.samples.samples_per_rank = 2;
  request.ranks = {2, 4};
  request.minibatches = 2;
  request.policies = {{planner::Policy::kLbMicro, false}, {planner::Policy::kLbMini, false}};
  request.modes = {Mode::kCollective, Mode::kOdcFlat};
  request.model = "tiny";
  request.cost = planner::CostModel{1e-3, 2e-7, 5e-3};
  auto sweep = run_sweep(request);
  ASSERT_TRUE(sweep.ok()) << sweep.status().message();
  const std::vector<SweepRow>& rows = sweep.value().rows;
  ASSERT_EQ(rows.size(), 6u);  // per rank count: lb-micro x 2 modes, lb-mini x odc
  for (const SweepRow& row : rows) {
    EXPECT_FALSE(row.policy == "lb-mini" && row.mode == "collective");
    EXPECT_GT(row.speedup, 0.0);
    if (row.policy == "lb-micro" && row.mode == "collective") {
      EXPECT_DOUBLE_EQ(row.speedup, 1.0);
    }
  }
  EXPECT_EQ(rows.front().ranks, 2);
  EXPECT_EQ(rows.back().ranks, 4);
  EXPECT_EQ(sweep.value().memory.size(), 4u);
  const std::string table = sweep_to_table(sweep.value());
  const DecisionText decision = sweep_decision(sweep.value());
  EXPECT_NE(table.find("\n" + decision.line + "\n" + decision.reason + "\n"), std::string::npos);
  EXPECT_EQ(sweep_to_json(sweep.value()).front(), '{');
}

TEST(Sweep, StealAddsOdcArmsThatOvertakeASlowRank) {
  // A rank 1.5x slower than planned: every arm slows; +steal rows (odc modes only) win back time.
  Sweep request;
  request.samples.given_lengths = planner::testing::random_lengths(400, 2000, 11);
  request.samples.samples_per_rank = 8;
  request.ranks = {4};
  request.minibatches = 4;
  request.policies = {{planner::Policy::kLbMicro, false}, {planner::Policy::kLbMini, false}};
  request.modes = {Mode::kCollective, Mode::kOdcFlat};
  request.model = "tiny";
  request.cost = planner::CostModel{1e-3, 2e-7, 5e-3};
  request.steal = true;
  request.rank_slowdown = {{2, 1.5}};
  auto sweep = run_sweep(request);
  ASSERT_TRUE(sweep.ok()) << sweep.status().message();
  std::vector<std::string> labels;
  double lb_mini = 0.0, lb_mini_steal = 0.0;
  for (const SweepRow& row : sweep.value().rows) {
    labels.push_back(row.label());
    if (row.label() == "odc + lb-mini") lb_mini = row.result.seconds;
    if (row.label() == "odc + lb-mini+steal") lb_mini_steal = row.result.seconds;
  }
  EXPECT_EQ(labels,
            (std::vector<std::string>{"collective + lb-micro", "odc + lb-micro", "odc + lb-mini",
                                      "odc + lb-micro+steal", "odc + lb-mini+steal"}));
  EXPECT_LT(lb_mini_steal, lb_mini);
  const std::string json = sweep_to_json(sweep.value());
  EXPECT_NE(json.find("\"rank_slowdown\":[{\"rank\":2,\"factor\":1.5}]"), std::string::npos);
}

// Refusals name the command's option at fault.
TEST(Sweep, RefusalsNameTheOption) {
  Sweep request;
  request.samples.given_lengths = std::vector<int64_t>{100, 200};
  request.ranks = {8};
  request.minibatches = 1;
  request.layers = 4;  // a custom model needs all three
  auto custom = run_sweep(request);
  ASSERT_FALSE(custom.ok());
  EXPECT_NE(custom.status().message().find("--layer-params"), std::string::npos);
  request.layers.reset();
  request.rank_speed = {1.0, 2.0};
  auto speeds = run_sweep(request);
  ASSERT_FALSE(speeds.ok());
  EXPECT_NE(speeds.status().message().find("--rank-speed gives 2 speeds"), std::string::npos);
  request.rank_speed.clear();
  request.ranks = {4, 8};
  request.rank_slowdown = {{9, 1.3}};
  auto slowdown = run_sweep(request);
  ASSERT_FALSE(slowdown.ok());
  EXPECT_EQ(slowdown.status().message(),
            "--rank-slowdown 9:1.3: rank 9 does not exist with --ranks 4 (ranks 0 to 3): name a "
            "rank below every rank count");
  request.rank_slowdown = {{1, 0.0}};
  ASSERT_FALSE(run_sweep(request).ok());
  request.rank_slowdown = {{1, 1.3}, {1, 2.0}};
  auto twice = run_sweep(request);
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("names rank 1 twice"), std::string::npos);
  request.rank_slowdown.clear();
  request.ranks = {8};
  request.modes = {Mode::kCollective};
  request.policies = {{planner::Policy::kLbMini, false}};
  auto nothing = run_sweep(request);
  ASSERT_FALSE(nothing.ok());
  EXPECT_NE(nothing.status().message().find("--modes collective with --policies lb-mini"),
            std::string::npos);
}

}  // namespace
}  // namespace odc::simulate
