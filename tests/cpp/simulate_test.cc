// The simulator against the planner's own accounting (free communication), hand-computed small
// cases with communication, and its invariants (docs/design.md; docs/simulate.md).
#include "simulate/simulate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

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

TEST(Simulate, FreeCommunicationGivesThePlannersTimes) {
  const auto lengths = planner::testing::random_lengths(400, 64, 7);
  for (auto policy : {planner::Policy::kLocalSort, planner::Policy::kLbMicro}) {
    for (Mode mode : {Mode::kCollective, Mode::kOdcFlat, Mode::kOdcHybrid}) {
      auto options = small_options(mode, policy, 5);
      options.free_communication = true;
      const SimulateResult result = run(lengths, options);
      EXPECT_NEAR(result.seconds, result.planner_seconds, 1e-9 * result.seconds) << mode_name(mode);
      EXPECT_EQ(result.exposed_comm_seconds, 0.0);
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
  EXPECT_FALSE(parse_mode("nccl").ok());
  EXPECT_FALSE(model_preset("70b").ok());
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

// Issue 26: sizes that made the simulator abort, overflow or run for hours are refused with a
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

}  // namespace
}  // namespace odc::simulate
