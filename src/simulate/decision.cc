// The decision of `odc compare` and `odc simulate` (decision.h): per rank count the fastest ODC arm
// and the fastest FSDP2 arm that fit, ODC chosen where it gains at least kOdcPaysGain; arms that do
// not fit are only ever named as such. The line groups rank counts that decide alike.
#include "simulate/decision.h"

#include <algorithm>
#include <cstdio>
#include <utility>

namespace odc::simulate {
namespace {

std::string fixed(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

std::string percent(double fraction) {
  return fixed("%.0f%%", 100.0 * fraction);
}

std::string gbytes(double bytes) {
  return fixed("%.2f GB/GPU", bytes / 1e9);
}

// "1.40x"; a gain just under kOdcPaysGain keeps a third decimal ("1.029x", not "1.03x").
std::string gain_words(double gain) {
  const std::string words = fixed("%.2fx", gain);
  return gain < kOdcPaysGain && words == fixed("%.2fx", kOdcPaysGain) ? fixed("%.3fx", gain)
                                                                      : words;
}

// "1.40x" or "1.40x-1.52x".
std::string gain_range(double low, double high) {
  const std::string a = gain_words(low), b = gain_words(high);
  return a == b ? a : a + "-" + b;
}

std::string choice_name(RankDecision::Choice choice) {
  switch (choice) {
    case RankDecision::Choice::kOdc:
      return "odc";
    case RankDecision::Choice::kFsdp2:
      return "fsdp2";
    case RankDecision::Choice::kNothingFits:
      break;
  }
  return "nothing fits";
}

bool faster(const DecisionArm& a, const std::optional<DecisionArm>& b) {
  return !b || a.seconds < b->seconds;
}

RankDecision decide_one(int64_t ranks, const std::vector<const DecisionArm*>& arms) {
  RankDecision d;
  d.ranks = ranks;
  std::optional<DecisionArm> fastest;
  for (const DecisionArm* arm : arms) {
    if (faster(*arm, fastest)) fastest = *arm;
    if (!d.smallest || arm->memory_bytes < d.smallest->memory_bytes) d.smallest = *arm;
    if (!arm->fits) continue;
    std::optional<DecisionArm>& best = arm->odc ? d.odc : d.baseline;
    if (faster(*arm, best)) best = *arm;
  }
  for (const DecisionArm* arm : arms) {
    if (d.odc && d.odc->split && arm->fits && !arm->split) {
      std::optional<DecisionArm>& best = arm->odc ? d.odc_unsplit : d.baseline_unsplit;
      if (faster(*arm, best)) best = *arm;
    }
    if (!arm->odc && !arm->fits && (!d.baseline || arm->seconds < d.baseline->seconds) &&
        faster(*arm, d.baseline_unfit)) {
      d.baseline_unfit = *arm;
    }
  }
  if (!d.odc && !d.baseline) {
    d.choice = RankDecision::Choice::kNothingFits;
  } else if (!d.baseline || (d.odc && d.gain() >= kOdcPaysGain)) {
    d.choice = RankDecision::Choice::kOdc;
  } else {
    d.choice = RankDecision::Choice::kFsdp2;
  }
  const DecisionArm* chosen = d.chosen();
  if (fastest && !fastest->fits && (!chosen || fastest->seconds < chosen->seconds)) {
    d.faster_unfit = fastest;
  }
  return d;
}

// Rank counts in a row that decide alike (the same choice, arm and kind of comparison).
struct Group {
  std::vector<const RankDecision*> members;
  std::string span() const {
    const std::string first = std::to_string(members.front()->ranks);
    const std::string last = std::to_string(members.back()->ranks);
    return "at " + (first == last ? first : first + "-" + last) + " GPUs";
  }
  // ODC's gains over the baselines, where both fit everywhere in the group; false otherwise.
  bool gains(double& low, double& high) const {
    low = high = 0.0;
    for (const RankDecision* d : members) {
      const double g = d->gain();
      if (!(g > 0)) return false;
      low = d == members.front() ? g : std::min(low, g);
      high = d == members.front() ? g : std::max(high, g);
    }
    return true;
  }
  // The baseline's label where every member has the same one, else "".
  std::string baseline() const {
    for (const RankDecision* d : members) {
      if (!d->baseline || d->baseline->label() != members.front()->baseline->label()) return "";
    }
    return members.front()->baseline->label();
  }
};

// How finely the line tells rank counts apart: by the whole arm ("odc-hybrid + lb-mini+split"), by
// the policy and split alone (the mode then varies within a run), or only ODC or FSDP2.
enum class Detail { kArm, kPolicy, kChoice };

std::string group_key(const RankDecision& d, Detail detail) {
  const DecisionArm* chosen = detail == Detail::kChoice ? nullptr : d.chosen();
  std::string key = choice_name(d.choice) + "|" + (d.odc ? "o" : "") + (d.baseline ? "b" : "");
  if (chosen)
    key += "|" + (detail == Detail::kArm ? chosen->mode : "") + "|" + chosen->policy +
           (chosen->split ? "+split" : "");
  return key;
}

std::vector<Group> groups(const std::vector<RankDecision>& decisions, Detail detail) {
  std::vector<Group> out;
  for (const RankDecision& d : decisions) {
    if (out.empty() || group_key(*out.back().members.front(), detail) != group_key(d, detail)) {
      out.push_back({});
    }
    out.back().members.push_back(&d);
  }
  return out;
}

// The chosen arm's words at a detail: "odc-hybrid + lb-mini+split", "odc/odc-hybrid + lb-mini", or
// "odc" (the modes of a run, in order, where they differ).
std::string arm_words(const Group& group, Detail detail) {
  const DecisionArm& first = *group.members.front()->chosen();
  if (detail == Detail::kChoice) return first.odc ? "odc" : "FSDP2";
  std::vector<std::string> modes;
  for (const RankDecision* d : group.members) {
    if (std::find(modes.begin(), modes.end(), d->chosen()->mode) == modes.end()) {
      modes.push_back(d->chosen()->mode);
    }
  }
  std::string words;
  for (const std::string& mode : modes) words += (words.empty() ? "" : "/") + mode;
  return words + " + " + first.policy + (first.split ? "+split" : "");
}

// "use odc + lb-mini+split at 8-64 GPUs: 1.40x-1.52x over collective + lb-micro+split".
std::string phrase(const Group& group, Detail detail) {
  const RankDecision& first = *group.members.front();
  double low = 0, high = 0;
  group.gains(low, high);
  switch (first.choice) {
    case RankDecision::Choice::kOdc: {
      const std::string head = "use " + arm_words(group, detail) + " " + group.span();
      if (!first.baseline) return head + ": no FSDP2 arm fits";
      if (detail == Detail::kChoice) return head + " (" + gain_range(low, high) + ")";
      const std::string baseline = group.baseline();
      return head + ": " + gain_range(low, high) + " over " +
             (baseline.empty() ? "the strongest FSDP2 arm" : baseline);
    }
    case RankDecision::Choice::kFsdp2: {
      const std::string head = detail == Detail::kChoice
                                   ? "use FSDP2 " + group.span()
                                   : "use FSDP2 (" + arm_words(group, detail) + ") " + group.span();
      if (!first.odc) return head + ": no ODC arm fits";
      return head + (detail == Detail::kChoice ? " (odc " + gain_range(low, high) + ")"
                                               : ": odc gains only " + gain_range(low, high));
    }
    case RankDecision::Choice::kNothingFits:
      break;
  }
  return "nothing fits " + group.span();
}

std::string line_of(const std::vector<RankDecision>& decisions, const DecisionContext& context,
                    Detail detail) {
  std::string words;
  for (const Group& group : groups(decisions, detail)) {
    words += (words.empty() ? "" : "; ") + phrase(group, detail);
  }
  return "decision: " + words + " (" + context.memory + ", " + context.memory_source + ")";
}

// The one line of why, for one rank count: what decided it, what did not fit, what would pay.
std::string reason_for(const RankDecision& d, const DecisionContext& context) {
  std::vector<std::string> facts;
  switch (d.choice) {
    case RankDecision::Choice::kOdc:
      if (!d.baseline) {
        facts.push_back("no FSDP2 arm fits " + context.memory);
      } else if (d.odc->split && d.odc_unsplit && d.baseline_unsplit) {
        facts.push_back("splitting outliers is the win: without split ODC gains " +
                        gain_words(d.baseline_unsplit->seconds / d.odc_unsplit->seconds) +
                        " over " + d.baseline_unsplit->label());
      } else {
        facts.push_back(d.baseline->label() + " idles " + percent(d.baseline->bubble) + ", " +
                        d.odc->mode + " " + percent(d.odc->bubble) +
                        ": ODC's ranks meet once per minibatch");
      }
      break;
    case RankDecision::Choice::kFsdp2:
      if (!d.odc) {
        facts.push_back("no ODC arm fits " + context.memory);
      } else {
        facts.push_back("ODC gains " + gain_words(d.gain()) + fixed(" < %.2fx: ", kOdcPaysGain) +
                        d.baseline->label() + " idles " + percent(d.baseline->bubble) + ", " +
                        d.odc->label() + " " + percent(d.odc->bubble));
      }
      break;
    case RankDecision::Choice::kNothingFits:
      if (d.smallest && d.smallest->memory_bytes > 0) {
        facts.push_back("the smallest state, " + d.smallest->mode + "'s, needs " +
                        gbytes(d.smallest->memory_bytes) + " > " + context.memory);
      }
      if (!context.nothing_fits_remedy.empty()) facts.push_back(context.nothing_fits_remedy);
      break;
  }
  if (d.faster_unfit && d.choice != RankDecision::Choice::kNothingFits) {
    facts.push_back(d.faster_unfit->label() + " is faster but needs " +
                    gbytes(d.faster_unfit->memory_bytes));
  } else if (d.baseline_unfit && d.baseline) {
    facts.push_back(d.baseline_unfit->label() + " would beat " + d.baseline->label() +
                    " but needs " + gbytes(d.baseline_unfit->memory_bytes));
  }
  if (!context.split_words.empty()) facts.push_back(context.split_words);
  if (!context.basis.empty()) facts.push_back(context.basis);
  std::string words;
  for (const std::string& fact : facts) words += (words.empty() ? "" : "; ") + fact;
  return words;
}

nlohmann::ordered_json arm_json(const std::optional<DecisionArm>& arm) {
  return arm ? nlohmann::ordered_json(arm->label()) : nlohmann::ordered_json(nullptr);
}

nlohmann::ordered_json number_or_null(double value) {
  return value > 0 ? nlohmann::ordered_json(value) : nlohmann::ordered_json(nullptr);
}

// use_odc, arm, policy, split, gain, baseline of one decision (null where it has none).
void choice_json(const RankDecision& d, nlohmann::ordered_json& out) {
  const DecisionArm* chosen = d.chosen();
  out["choice"] = choice_name(d.choice);
  out["use_odc"] = d.choice == RankDecision::Choice::kNothingFits
                       ? nlohmann::ordered_json(nullptr)
                       : nlohmann::ordered_json(d.choice == RankDecision::Choice::kOdc);
  out["arm"] = chosen ? nlohmann::ordered_json(chosen->label()) : nlohmann::ordered_json(nullptr);
  out["policy"] = chosen ? nlohmann::ordered_json(chosen->policy) : nlohmann::ordered_json(nullptr);
  out["split"] = chosen ? nlohmann::ordered_json(chosen->split) : nlohmann::ordered_json(nullptr);
}

}  // namespace

const DecisionArm* RankDecision::chosen() const {
  switch (choice) {
    case Choice::kOdc:
      return &*odc;
    case Choice::kFsdp2:
      return &*baseline;
    case Choice::kNothingFits:
      break;
  }
  return nullptr;
}

std::vector<RankDecision> decide(const std::vector<DecisionArm>& arms) {
  std::vector<int64_t> order;
  for (const DecisionArm& arm : arms) {
    if (std::find(order.begin(), order.end(), arm.ranks) == order.end()) order.push_back(arm.ranks);
  }
  std::vector<RankDecision> decisions;
  for (int64_t ranks : order) {
    std::vector<const DecisionArm*> at;
    for (const DecisionArm& arm : arms) {
      if (arm.ranks == ranks) at.push_back(&arm);
    }
    decisions.push_back(decide_one(ranks, at));
  }
  return decisions;
}

DecisionText decision_text(const std::vector<RankDecision>& decisions,
                           const DecisionContext& context) {
  DecisionText text;
  if (decisions.empty()) return text;
  // Each run of rank counts with its arm; where that is too long, with its policy, then only ODC
  // or FSDP2 per run; where even that is, the range of ODC's gains and where to read the rest.
  for (Detail detail : {Detail::kArm, Detail::kPolicy, Detail::kChoice}) {
    text.line = line_of(decisions, context, detail);
    if (text.line.size() <= kDecisionLineMaxChars) break;
  }
  if (text.line.size() > kDecisionLineMaxChars) {
    double low = 0, high = 0;
    bool any = false;
    for (const RankDecision& d : decisions) {
      if (!(d.gain() > 0)) continue;
      low = any ? std::min(low, d.gain()) : d.gain();
      high = any ? std::max(high, d.gain()) : d.gain();
      any = true;
    }
    text.line = "decision: varies with GPUs (" +
                (any ? "odc gains " + gain_range(low, high) : std::string("see the tables")) +
                "; per rank count: --format json's decision) (" + context.memory + ", " +
                context.memory_source + ")";
  }
  const RankDecision& first = decisions.front();
  text.reason = "why" +
                (decisions.size() > 1 ? " (at " + std::to_string(first.ranks) + " GPUs)" : "") +
                ": " + reason_for(first, context);
  return text;
}

nlohmann::ordered_json decision_json(const std::vector<RankDecision>& decisions,
                                     const DecisionContext& context) {
  const DecisionText text = decision_text(decisions, context);
  nlohmann::ordered_json out;
  out["text"] = text.line;
  out["reason"] = text.reason;
  out["memory_assumed"] = context.memory;
  out["memory_source"] = context.memory_source;
  out["gpu_memory_bytes"] = number_or_null(context.gpu_memory_bytes);
  // One choice at every rank count: it, with the smallest and largest gain, at the top.
  const std::vector<Group> runs = groups(decisions, Detail::kArm);
  out["uniform"] = runs.size() == 1;
  // Present either way (a stable schema): null where the rank counts decide differently.
  for (const char* key :
       {"choice", "use_odc", "arm", "policy", "split", "gain", "gain_max", "baseline"}) {
    out[key] = nullptr;
  }
  if (runs.size() == 1) {
    choice_json(decisions.front(), out);
    double low = 0, high = 0;
    const bool gains = runs.front().gains(low, high);
    out["gain"] = gains ? nlohmann::ordered_json(low) : nlohmann::ordered_json(nullptr);
    out["gain_max"] = gains ? nlohmann::ordered_json(high) : nlohmann::ordered_json(nullptr);
    const std::string baseline = runs.front().baseline();
    out["baseline"] =
        baseline.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(baseline);
  }
  nlohmann::ordered_json by_ranks = nlohmann::ordered_json::array();
  for (const RankDecision& d : decisions) {
    nlohmann::ordered_json entry;
    entry["ranks"] = d.ranks;
    choice_json(d, entry);
    entry["gain"] = number_or_null(d.gain());
    entry["odc_arm"] = arm_json(d.odc);
    entry["baseline"] = arm_json(d.baseline);
    entry["faster_unfit"] = arm_json(d.faster_unfit);
    entry["faster_unfit_bytes"] = number_or_null(d.faster_unfit ? d.faster_unfit->memory_bytes : 0);
    by_ranks.push_back(std::move(entry));
  }
  out["by_ranks"] = std::move(by_ranks);
  return out;
}

}  // namespace odc::simulate
