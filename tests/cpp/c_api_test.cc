// The planner's C API: results, last-error text, NULL handling, and JSON equal to the C++ render.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "odc/odc.h"
#include "planner/plan.h"
#include "planner/plan_format.h"

namespace {

odcPlanOptions_t default_options() {
  odcPlanOptions_t options = ODC_PLAN_OPTIONS_INIT;
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
  // Speeds given with a count of 0 are not "uniform": the planner would see none and plan equal
  // speeds, so the header's contract (the count equals num_ranks) is enforced.
  options.num_rank_speeds = 0;
  EXPECT_EQ(odcPlanCreate(lengths.data(), lengths.size(), &options, &plan), odcInvalidArgument);
  EXPECT_STREQ(odcGetLastError(),
               "rank_speed must have one entry per rank: got 0 for 2 ranks (rank_speed NULL: "
               "uniform speeds)");
  EXPECT_EQ(plan, nullptr);
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

namespace {

// odcPlanOptions_t as headers declared it before it was versioned (no size, magic or version).
struct UnversionedPlanOptions {
  int64_t num_ranks;
  int64_t max_tokens;
  odcPolicy_t policy;
  int64_t minibatch_size;
  double cost_a, cost_b, cost_c;
  const double* rank_speed;
  size_t num_rank_speeds;
  odcSplit_t split;
  double split_exchange;
  odcMicrobatchMemory_t microbatch_memory;
  double cost_floor;
};

TEST(CApi, PlanOptionsInitKeepsToTheDeclaredHeader) {
  // The initializer and odcPlanOptionsInit give the same defaults, byte for byte.
  odcPlanOptions_t declared = ODC_PLAN_OPTIONS_INIT;
  odcPlanOptions_t reset = ODC_PLAN_OPTIONS_INIT;
  reset.num_ranks = 7;
  reset.split_exchange = 3.0;
  ASSERT_EQ(odcPlanOptionsInit(&reset), odcSuccess) << odcGetLastError();
  EXPECT_EQ(reset.size, declared.size);
  EXPECT_EQ(reset.magic, declared.magic);
  EXPECT_EQ(reset.version, declared.version);
  EXPECT_EQ(reset.num_ranks, 1);
  EXPECT_EQ(reset.max_tokens, 0);
  EXPECT_EQ(reset.policy, declared.policy);
  EXPECT_EQ(reset.minibatch_size, declared.minibatch_size);
  EXPECT_EQ(reset.cost_a, declared.cost_a);
  EXPECT_EQ(reset.cost_b, declared.cost_b);
  EXPECT_EQ(reset.cost_c, declared.cost_c);
  EXPECT_EQ(reset.rank_speed, declared.rank_speed);
  EXPECT_EQ(reset.num_rank_speeds, declared.num_rank_speeds);
  EXPECT_EQ(reset.split, declared.split);
  EXPECT_EQ(reset.split_exchange, 0.05);
  EXPECT_EQ(reset.microbatch_memory, declared.microbatch_memory);
  EXPECT_EQ(reset.cost_floor, declared.cost_floor);
  EXPECT_EQ(reset.steal, 0);

  // A header never set (garbage or zeros) or of another size is refused and nothing is written.
  for (const auto& [size, magic, version] :
       {std::tuple<size_t, unsigned, unsigned>{0, 0, 0},
        {sizeof(odcPlanOptions_t), 0, ODC_PLAN_OPTIONS_VERSION},
        {sizeof(odcPlanOptions_t), ODC_PLAN_OPTIONS_MAGIC, ODC_PLAN_OPTIONS_VERSION + 1},
        {sizeof(odcPlanOptions_t), ODC_PLAN_OPTIONS_MAGIC, 1},  // version 1 is 120 bytes
        {sizeof(odcPlanOptions_t) + 8, ODC_PLAN_OPTIONS_MAGIC, ODC_PLAN_OPTIONS_VERSION},
        {0xa5a5a5a5a5a5a5a5ull, 0xa5a5a5a5u, 0xa5a5a5a5u}}) {
    odcPlanOptions_t options;
    std::memset(&options, 0xa5, sizeof(options));
    options.size = size;
    options.magic = magic;
    options.version = version;
    odcPlanOptions_t before;
    std::memcpy(&before, &options, sizeof(options));
    EXPECT_EQ(odcPlanOptionsInit(&options), odcInvalidArgument) << size << " " << version;
    EXPECT_NE(std::string(odcGetLastError()).find("declare them with ODC_PLAN_OPTIONS_INIT"),
              std::string::npos)
        << odcGetLastError();
    EXPECT_EQ(std::memcmp(&before, &options, sizeof(options)), 0);
    const int64_t lengths[] = {10};
    odcPlan_t plan = nullptr;
    EXPECT_EQ(odcPlanCreate(lengths, 1, &options, &plan), odcInvalidArgument);
    EXPECT_EQ(plan, nullptr);
  }
}

TEST(CApi, Version1OptionsStillPlanWithoutStealing) {
  // A caller built against version 1 (no `steal`, 120 bytes): init writes its 120 bytes only,
  // and the plan is made as before, with no "steal" keys.
  unsigned char bytes[sizeof(odcPlanOptions_t)];
  std::memset(bytes, 0xa5, sizeof(bytes));
  auto* options = reinterpret_cast<odcPlanOptions_t*>(bytes);
  options->size = 120;
  options->magic = ODC_PLAN_OPTIONS_MAGIC;
  options->version = 1;
  ASSERT_EQ(odcPlanOptionsInit(options), odcSuccess) << odcGetLastError();
  for (size_t i = 120; i < sizeof(bytes); ++i) EXPECT_EQ(bytes[i], 0xa5) << i;
  options->num_ranks = 2;
  options->max_tokens = 100;
  const int64_t lengths[] = {10, 50, 30, 90, 20};
  odcPlan_t plan = nullptr;
  ASSERT_EQ(odcPlanCreate(lengths, 5, options, &plan), odcSuccess) << odcGetLastError();
  const char* json = nullptr;
  ASSERT_EQ(odcPlanToJson(plan, &json), odcSuccess);
  EXPECT_EQ(std::string(json).find("steal"), std::string::npos) << json;
  EXPECT_EQ(odcPlanDestroy(plan), odcSuccess);

  // Version 2 with steal set: the C++ render of the same plan with stealing predicted.
  odcPlanOptions_t stealing = default_options();
  stealing.steal = 1;
  ASSERT_EQ(odcPlanCreate(lengths, 5, &stealing, &plan), odcSuccess) << odcGetLastError();
  ASSERT_EQ(odcPlanToJson(plan, &json), odcSuccess);
  odc::planner::PlanOptions cpp_options;
  cpp_options.num_ranks = 2;
  cpp_options.max_tokens = 100;
  cpp_options.steal = true;
  auto cpp_plan = odc::planner::make_plan(lengths, cpp_options);
  ASSERT_TRUE(cpp_plan.ok());
  EXPECT_EQ(std::string(json), odc::planner::plan_to_json(cpp_plan.value()));
  EXPECT_NE(std::string(json).find("\"steal\":{\"time\""), std::string::npos) << json;
  EXPECT_EQ(odcPlanDestroy(plan), odcSuccess);
}

TEST(CApi, StealSimulateRoundTrip) {
  // Queue 0 holds everything (4, 3, 2, 1): ranks 1 and 2 empty it from the tail (steal_test.cc).
  const int64_t counts[] = {4, 0, 0};
  const double predicted[] = {4, 3, 2, 1};
  double span = 0.0, finish[3], busy[3];
  int64_t runner[4], moved = 0;
  ASSERT_EQ(odcStealSimulate(3, counts, predicted, nullptr, nullptr, nullptr, &span, finish, busy,
                             runner, &moved),
            odcSuccess)
      << odcGetLastError();
  EXPECT_EQ(span, 4.0);
  EXPECT_EQ(moved, 3);
  EXPECT_EQ(std::vector<int64_t>(runner, runner + 4), (std::vector<int64_t>{0, 1, 2, 1}));
  EXPECT_EQ(std::vector<double>(busy, busy + 3), (std::vector<double>{4, 4, 2}));
  // Every output may be NULL; bad input names the problem and writes nothing.
  EXPECT_EQ(odcStealSimulate(3, counts, predicted, nullptr, nullptr, nullptr, nullptr, nullptr,
                             nullptr, nullptr, nullptr),
            odcSuccess);
  const double speeds[] = {1.0, 0.0, 1.0};
  span = -1.0;
  EXPECT_EQ(odcStealSimulate(3, counts, predicted, nullptr, speeds, nullptr, &span, nullptr,
                             nullptr, nullptr, nullptr),
            odcInvalidArgument);
  EXPECT_NE(std::string(odcGetLastError()).find("speed of rank 1 is 0"), std::string::npos)
      << odcGetLastError();
  EXPECT_EQ(span, -1.0);
  EXPECT_EQ(odcStealSimulate(3, nullptr, predicted, nullptr, nullptr, nullptr, &span, nullptr,
                             nullptr, nullptr, nullptr),
            odcInvalidArgument);
  EXPECT_EQ(odcStealSimulate(-1, counts, predicted, nullptr, nullptr, nullptr, &span, nullptr,
                             nullptr, nullptr, nullptr),
            odcInvalidArgument);
  EXPECT_EQ(odcStealSimulate(0, nullptr, nullptr, nullptr, nullptr, nullptr, &span, nullptr,
                             nullptr, nullptr, nullptr),
            odcSuccess);
  EXPECT_EQ(span, 0.0);
}

TEST(CApi, PlanCreateRefusesTheUnversionedLayout) {
  // A caller built against the old header: its num_ranks and max_tokens fill the new header's
  // place; the version word is max_tokens' high half (0), never a valid version.
  for (const int64_t num_ranks : {int64_t{1}, int64_t{120}}) {
    UnversionedPlanOptions old{num_ranks,
                               65536,
                               odcPolicyLbMini,
                               ODC_PLAN_ALL_SAMPLES,
                               1.0,
                               0.0,
                               0.0,
                               nullptr,
                               0,
                               odcSplitOff,
                               0.05,
                               odcMicrobatchMemoryLbMicro,
                               0.0};
    const int64_t lengths[] = {10, 20};
    odcPlan_t plan = nullptr;
    EXPECT_EQ(odcPlanCreate(lengths, 2, reinterpret_cast<const odcPlanOptions_t*>(&old), &plan),
              odcInvalidArgument);
    EXPECT_NE(std::string(odcGetLastError()).find("version 0"), std::string::npos)
        << odcGetLastError();
    EXPECT_EQ(plan, nullptr);
  }
}

}  // namespace
