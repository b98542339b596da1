// The decision of `odc compare` and `odc simulate` (simulate/decision.h) on hand-made arms: each
// kind of arm wins where it should, an arm that does not fit is never chosen nor the baseline,
// and the line stays under its bound however many rank counts decide differently.
#include "simulate/decision.h"

#include <gtest/gtest.h>

#include <vector>

namespace odc::simulate {
namespace {

using Choice = RankDecision::Choice;

DecisionArm arm(const char* mode, const char* policy, bool split, double seconds, bool fits = true,
                int64_t ranks = 16) {
  DecisionArm a;
  a.ranks = ranks;
  a.mode = mode;
  a.policy = policy;
  a.split = split;
  a.odc = std::string(mode).starts_with("odc");
  a.seconds = seconds;
  a.bubble = seconds > 9 ? 0.3 : 0.1;
  a.fits = fits;
  a.memory_bytes = fits ? 40e9 : 109.66e9;
  return a;
}

DecisionContext context() {
  DecisionContext c;
  c.memory = "80 GB/GPU";
  c.memory_source = "--gpu-memory-gbytes";
  c.gpu_memory_bytes = 80e9;
  c.nothing_fits_remedy = "collective's state fits from 64 GPUs";
  return c;
}

RankDecision one(const std::vector<DecisionArm>& arms) {
  const std::vector<RankDecision> decisions = decide(arms);
  EXPECT_EQ(decisions.size(), 1u);
  return decisions.front();
}

TEST(Decision, OdcWinsOverTheStrongestBaseline) {
  const RankDecision d =
      one({arm("collective", "lb-micro", false, 10.0),
           arm("fsdp2-unsharded", "lb-micro", false, 9.5), arm("odc", "lb-mini", false, 8.0)});
  EXPECT_EQ(d.choice, Choice::kOdc);
  EXPECT_EQ(d.baseline->label(), "fsdp2-unsharded + lb-micro");
  EXPECT_DOUBLE_EQ(d.gain(), 9.5 / 8.0);
  const DecisionText text = decision_text({d}, context());
  EXPECT_EQ(text.line,
            "decision: use odc + lb-mini at 16 GPUs: 1.19x over fsdp2-unsharded + lb-micro "
            "(80 GB/GPU, --gpu-memory-gbytes)");
  EXPECT_EQ(text.reason.rfind("why: fsdp2-unsharded + lb-micro idles 30%, odc 10%", 0), 0u)
      << text.reason;
}

TEST(Decision, OdcWithSplitAgainstTheBestSplitBaseline) {
  const RankDecision d =
      one({arm("collective", "lb-micro", false, 20.0), arm("collective", "lb-micro", true, 14.0),
           arm("odc", "lb-mini", false, 18.0), arm("odc", "lb-mini", true, 10.0)});
  EXPECT_EQ(d.choice, Choice::kOdc);
  EXPECT_TRUE(d.odc->split);
  EXPECT_EQ(d.baseline->label(), "collective + lb-micro+split");
  EXPECT_DOUBLE_EQ(d.gain(), 1.4);
  const DecisionText text = decision_text({d}, context());
  EXPECT_NE(text.line.find("use odc + lb-mini+split at 16 GPUs: 1.40x over collective + "
                           "lb-micro+split"),
            std::string::npos);
  // Without split ODC would gain 20/18 over the unsplit baseline: the why says so.
  EXPECT_NE(text.reason.find("without split ODC gains 1.11x over collective + lb-micro"),
            std::string::npos)
      << text.reason;
}

TEST(Decision, Fsdp2WhereOdcGainsTooLittle) {
  const RankDecision d =
      one({arm("collective", "lb-micro", false, 10.0),
           arm("fsdp2-deferred", "lb-micro", false, 9.0), arm("odc", "lb-mini", false, 8.9)});
  EXPECT_EQ(d.choice, Choice::kFsdp2);
  EXPECT_EQ(d.chosen()->label(), "fsdp2-deferred + lb-micro");
  const DecisionText text = decision_text({d}, context());
  EXPECT_NE(
      text.line.find("use FSDP2 (fsdp2-deferred + lb-micro) at 16 GPUs: odc gains only 1.01x"),
      std::string::npos)
      << text.line;
}

TEST(Decision, UnshardedWinsWhereItFitsAndIsNeverChosenWhereItDoesNot) {
  std::vector<DecisionArm> arms = {arm("collective", "lb-micro", false, 10.0),
                                   arm("fsdp2-unsharded", "lb-mini", false, 7.0),
                                   arm("odc", "lb-mini", false, 7.1)};
  EXPECT_EQ(one(arms).choice, Choice::kFsdp2);
  EXPECT_EQ(one(arms).chosen()->label(), "fsdp2-unsharded + lb-mini");
  // The case (14B on 16 x 80 GB): the unsharded arm needs 109.66 GB and does not fit.
  arms[1].fits = false;
  arms[1].memory_bytes = 109.66e9;
  const RankDecision d = one(arms);
  EXPECT_EQ(d.choice, Choice::kOdc);
  EXPECT_EQ(d.baseline->label(), "collective + lb-micro");
  EXPECT_EQ(d.faster_unfit->label(), "fsdp2-unsharded + lb-mini");
  const DecisionText text = decision_text({d}, context());
  EXPECT_EQ(text.line.find("fsdp2-unsharded"), std::string::npos) << text.line;
  EXPECT_NE(text.reason.find("fsdp2-unsharded + lb-mini is faster but needs 109.66 GB/GPU"),
            std::string::npos)
      << text.reason;
}

TEST(Decision, OnlyOdcFitsOrNothingFits) {
  RankDecision d = one({arm("fsdp2-unsharded", "lb-micro", false, 9.0, false),
                        arm("odc-hybrid", "lb-mini", false, 9.5)});
  EXPECT_EQ(d.choice, Choice::kOdc);
  EXPECT_EQ(d.gain(), 0.0);
  EXPECT_NE(decision_text({d}, context())
                .line.find("use odc-hybrid + lb-mini at 16 GPUs: no FSDP2 "
                           "arm fits"),
            std::string::npos);
  d = one({arm("collective", "lb-micro", false, 10.0, false),
           arm("odc", "lb-mini", false, 8.0, false)});
  EXPECT_EQ(d.choice, Choice::kNothingFits);
  EXPECT_EQ(d.chosen(), nullptr);
  const DecisionText text = decision_text({d}, context());
  EXPECT_EQ(text.line, "decision: nothing fits at 16 GPUs (80 GB/GPU, --gpu-memory-gbytes)");
  EXPECT_NE(text.reason.find("needs 109.66 GB/GPU > 80 GB/GPU; collective's state fits from 64"),
            std::string::npos)
      << text.reason;
  const nlohmann::ordered_json json = decision_json({d}, context());
  EXPECT_TRUE(json["use_odc"].is_null());
  EXPECT_EQ(json["by_ranks"][0]["choice"], "nothing fits");
}

TEST(Decision, RankCountsThatDecideAlikeShareOnePhraseAndTheLineStaysShort) {
  std::vector<DecisionArm> arms;
  for (int64_t ranks : {8, 16, 32}) {
    arms.push_back(arm("collective", "lb-micro", false, 10.0, true, ranks));
    arms.push_back(arm("odc", "lb-mini", false, ranks == 32 ? 8.0 : 7.0, true, ranks));
  }
  std::vector<RankDecision> decisions = decide(arms);
  ASSERT_EQ(decisions.size(), 3u);
  DecisionText text = decision_text(decisions, context());
  EXPECT_EQ(text.line.rfind("decision: use odc + lb-mini at 8-32 GPUs: 1.25x-1.43x over "
                            "collective + lb-micro",
                            0),
            0u)
      << text.line;
  EXPECT_EQ(text.reason.rfind("why (at 8 GPUs): ", 0), 0u);
  nlohmann::ordered_json json = decision_json(decisions, context());
  EXPECT_EQ(json["use_odc"], true);
  EXPECT_EQ(json["policy"], "lb-mini");
  EXPECT_EQ(json["split"], false);
  EXPECT_DOUBLE_EQ(json["gain"].get<double>(), 1.25);
  EXPECT_EQ(json["text"], text.line);
  // Choices alternating over many rank counts: still one line within the bound.
  arms.clear();
  for (int64_t i = 0; i < 12; ++i) {
    const int64_t ranks = int64_t{2} << i;
    arms.push_back(arm("collective", "lb-micro", false, 10.0, true, ranks));
    arms.push_back(
        arm(i % 3 ? "odc" : "odc-hybrid", "lb-mini", i % 4 == 0, i % 2 ? 7.0 : 9.9, true, ranks));
  }
  decisions = decide(arms);
  text = decision_text(decisions, context());
  EXPECT_LE(text.line.size(), kDecisionLineMaxChars) << text.line;
  EXPECT_EQ(text.line.rfind("decision: ", 0), 0u);
  json = decision_json(decisions, context());
  EXPECT_EQ(json["uniform"], false);
  EXPECT_TRUE(json["use_odc"].is_null() && json["arm"].is_null() && json["gain"].is_null());
  EXPECT_EQ(json["by_ranks"].size(), decisions.size());
}

}  // namespace
}  // namespace odc::simulate
