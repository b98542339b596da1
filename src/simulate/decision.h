// The one decision `odc compare` and `odc simulate` end with: use ODC or FSDP2, with which policy,
// whether to split, and the gain over the strongest baseline arm that fits the memory assumed.
// Invariant: an arm that does not fit is never chosen and never named as the baseline.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace odc::simulate {

// One arm as both tools see it: a mode (collective, fsdp2-*, odc, odc-hybrid) running a policy.
struct DecisionArm {
  int64_t ranks = 0;
  std::string mode;    // "odc-hybrid", "collective", ...
  std::string policy;  // "lb-mini", without "+split"
  bool split = false;
  bool odc = false;      // an ODC mode (else an FSDP2 baseline)
  double seconds = 0.0;  // one unit across the arms of one decision (per step, or the sum)
  double bubble = 0.0;
  bool fits = true;
  double memory_bytes = 0.0;  // per GPU, as the memory table prints it; 0: not modelled
  std::string label() const { return mode + " + " + policy + (split ? "+split" : ""); }
};

// Below this gain over the strongest baseline that fits, ODC is not worth switching to.
inline constexpr double kOdcPaysGain = 1.03;

// The decision at one rank count.
struct RankDecision {
  enum class Choice { kOdc, kFsdp2, kNothingFits };
  int64_t ranks = 0;
  Choice choice = Choice::kNothingFits;
  std::optional<DecisionArm> odc;       // the fastest ODC arm that fits
  std::optional<DecisionArm> baseline;  // the fastest FSDP2 arm that fits
  // Where `odc` splits: the fastest unsplit ODC and FSDP2 arms that fit (what split adds).
  std::optional<DecisionArm> odc_unsplit, baseline_unsplit;
  std::optional<DecisionArm> faster_unfit;  // the fastest arm, where it is faster and does not fit
  // The fastest FSDP2 arm, where it is faster than `baseline` and does not fit (the case:
  // fsdp2-unsharded, fastest but 110 GB on an 80 GB GPU, is not the baseline).
  std::optional<DecisionArm> baseline_unfit;
  std::optional<DecisionArm> smallest;  // the arm needing least memory (nothing fits)
  // ODC's speedup over the baseline (baseline seconds / odc seconds); 0 without either.
  double gain() const { return odc && baseline ? baseline->seconds / odc->seconds : 0.0; }
  const DecisionArm* chosen() const;
};

// One decision per rank count, in the order the rank counts first appear in `arms`.
std::vector<RankDecision> decide(const std::vector<DecisionArm>& arms);

// What the tool adds to the words: the memory it assumed and facts only it knows.
struct DecisionContext {
  std::string memory;           // short, in the line: "80 GB/GPU" or "<= 65536 tokens/microbatch"
  std::string memory_source;    // the flag it came from: "--gpu-memory-gbytes", "default ..."
  double gpu_memory_bytes = 0;  // 0: GPU memory not modelled (compare)
  std::string basis;            // what the gains rest on, where the why should say so
  std::string nothing_fits_remedy;  // what would fit, e.g. "fits from 32 GPUs"
  std::string split_words;          // the split check where it pays, e.g. "--split auto: 1.40x"
};

// The decision's words: `line` (under kDecisionLineMaxChars) and one line of why.
struct DecisionText {
  std::string line, reason;
};
inline constexpr size_t kDecisionLineMaxChars = 160;
DecisionText decision_text(const std::vector<RankDecision>& decisions,
                           const DecisionContext& context);

// The JSON `decision` object (docs/simulate.md, docs/planner.md).
nlohmann::ordered_json decision_json(const std::vector<RankDecision>& decisions,
                                     const DecisionContext& context);

}  // namespace odc::simulate
