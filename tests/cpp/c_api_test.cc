// The planner's C API: results, last-error text, NULL handling, and JSON equal to the C++ render.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "odc/odc.h"
#include "planner/plan.h"
#include "planner/plan_format.h"

namespace {

odcPlanOptions_t default_options() {
  odcPlanOptions_t options;
  EXPECT_EQ(odcPlanOptionsInit(&options), odcSuccess);
  options.num_ranks = 2;
  options.max_tokens = 100;
  return options;
}

TEST(CApi, PlanRoundTrip) {
  const std::vector<int64_t> lengths = {10, 50, 30, 90, 20};
  odcPlanOptions_t options = default_options();
  ASSERT_EQ(odcPolicyFromName("lb-micro", &options.policy), odcSuccess);
  odcPlan_t plan = nullptr;
  ASSERT_EQ(odcPlanCreate(lengths.data(), lengths.size(), &options, &plan), odcSuccess)
      << odcGetLastError();
  const char* json = nullptr;
  ASSERT_EQ(odcPlanToJson(plan, &json), odcSuccess);

  odc::planner::PlanOptions cpp_options;
  cpp_options.num_ranks = 2;
  cpp_options.max_tokens = 100;
  cpp_options.policy = odc::planner::Policy::kLbMicro;
  auto cpp_plan = odc::planner::make_plan(lengths, cpp_options);
  ASSERT_TRUE(cpp_plan.ok());
  EXPECT_EQ(std::string(json), odc::planner::plan_to_json(cpp_plan.value()));

  double collective = -1, odc = -1;
  ASSERT_EQ(odcPlanGetBubble(plan, &collective, &odc), odcSuccess);
  EXPECT_DOUBLE_EQ(collective, cpp_plan.value().bubble.collective);
  EXPECT_DOUBLE_EQ(odc, cpp_plan.value().bubble.odc);
  EXPECT_EQ(odcPlanDestroy(plan), odcSuccess);
}

TEST(CApi, ErrorsLeaveOutputsUntouchedAndExplain) {
  const std::vector<int64_t> lengths = {10, 500};
  odcPlanOptions_t options = default_options();
  odcPlan_t plan = nullptr;
  EXPECT_EQ(odcPlanCreate(lengths.data(), lengths.size(), &options, &plan), odcInvalidArgument);
  EXPECT_EQ(plan, nullptr);
  EXPECT_STREQ(odcGetLastError(), "sample 1 has length 500, above max_tokens 100");
  EXPECT_STREQ(odcGetErrorString(odcInvalidArgument), "invalid argument");

  EXPECT_EQ(odcPlanCreate(lengths.data(), lengths.size(), nullptr, &plan), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "odcPlanCreate: options is NULL");
  EXPECT_EQ(odcPlanCreate(nullptr, 3, &options, &plan), odcInvalidArgument);
  EXPECT_EQ(odcPlanCreate(lengths.data(), 0, &options, &plan), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "empty input: no sample lengths given");
  options.policy = static_cast<odcPolicy_t>(7);
  EXPECT_EQ(odcPlanCreate(lengths.data(), 1, &options, &plan), odcInvalidArgument);

  odcPolicy_t policy;
  EXPECT_EQ(odcPolicyFromName("round-robin", &policy), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(),
               "unknown policy 'round-robin': expected local-sort, lb-micro or lb-mini");
  EXPECT_EQ(odcPlanToJson(nullptr, nullptr), odcInvalidArgument);
  EXPECT_EQ(odcPlanDestroy(nullptr), odcSuccess);
  EXPECT_STREQ(odcGetLastError(), "");
}

TEST(CApi, RankSpeedIsCopiedAndChecked) {
  const std::vector<int64_t> lengths = {10, 20, 30, 40};
  odcPlanOptions_t options = default_options();
  std::vector<double> speeds = {1.0, -2.0};
  options.rank_speed = speeds.data();
  options.num_rank_speeds = 1;
  odcPlan_t plan = nullptr;
  EXPECT_EQ(odcPlanCreate(lengths.data(), lengths.size(), &options, &plan), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "rank_speed must have one entry per rank: got 1 for 2 ranks");
  options.num_rank_speeds = 2;
  EXPECT_EQ(odcPlanCreate(lengths.data(), lengths.size(), &options, &plan), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(), "rank_speed entries must be positive: got -2 for rank 1");
  speeds[1] = 2.0;
  ASSERT_EQ(odcPlanCreate(lengths.data(), lengths.size(), &options, &plan), odcSuccess);
  speeds[1] = -5.0;  // the plan copied the speeds; later changes do not matter
  double collective, odc;
  EXPECT_EQ(odcPlanGetBubble(plan, &collective, &odc), odcSuccess);
  EXPECT_GE(odc, 0.0);
  EXPECT_EQ(odcPlanDestroy(plan), odcSuccess);
}

TEST(CApi, Version) {
  EXPECT_EQ(odcGetVersion(), 100);
}

}  // namespace

namespace {

TEST(CApi, LengthsRead) {
  const std::string path = ::testing::TempDir() + "odc_lengths_test.txt";
  {
    FILE* file = std::fopen(path.c_str(), "w");
    ASSERT_NE(file, nullptr);
    std::fputs("# comment\n7\n\n9\n", file);
    std::fclose(file);
  }
  int64_t* lengths = nullptr;
  size_t count = 0;
  ASSERT_EQ(odcLengthsRead(path.c_str(), &lengths, &count), odcSuccess) << odcGetLastError();
  ASSERT_EQ(count, 2u);
  EXPECT_EQ(lengths[0], 7);
  EXPECT_EQ(lengths[1], 9);
  EXPECT_EQ(odcLengthsFree(lengths), odcSuccess);
  EXPECT_EQ(odcLengthsRead("/nonexistent/lengths.txt", &lengths, &count), odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("cannot read lengths file"), std::string::npos);
  EXPECT_EQ(odcLengthsRead(nullptr, &lengths, &count), odcInvalidArgument);
  std::remove(path.c_str());
}

}  // namespace
