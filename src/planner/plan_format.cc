// JSON via nlohmann::ordered_json so keys keep the documented order.
#include "planner/plan_format.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace odc::planner {
namespace {

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * fraction);
  return text;
}

struct MicrobatchCounts {
  size_t min = 0;
  size_t max = 0;
  double mean = 0.0;
};

// Microbatches per rank per minibatch, padding included.
MicrobatchCounts microbatch_counts(const Plan& plan) {
  MicrobatchCounts counts;
  size_t total = 0;
  size_t observations = 0;
  bool first = true;
  for (const auto& minibatch : plan.minibatches) {
    for (const auto& rank : minibatch.ranks) {
      const size_t n = rank.microbatches.size();
      counts.min = first ? n : std::min(counts.min, n);
      counts.max = first ? n : std::max(counts.max, n);
      first = false;
      total += n;
      ++observations;
    }
  }
  counts.mean = observations ? static_cast<double>(total) / static_cast<double>(observations) : 0;
  return counts;
}

std::string cost_text(const CostModel& cost) {
  std::ostringstream out;
  out << cost.c << " + sum(" << cost.a << "*L + " << cost.b << "*L^2)";
  return out.str();
}

}  // namespace

std::string plan_to_json(const Plan& plan) {
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
    for (const auto& rank : minibatch.ranks) {
      ranks.push_back({{"microbatches", rank.microbatches}});
    }
    minibatches.push_back(
        {{"samples", minibatch.samples},
         {"ranks", std::move(ranks)},
         {"bubble", {{"collective", minibatch.bubble.collective}, {"odc", minibatch.bubble.odc}}}});
  }
  root["minibatches"] = std::move(minibatches);
  root["bubble"] = {{"collective", plan.bubble.collective}, {"odc", plan.bubble.odc}};
  return root.dump();
}

std::string plan_to_table(const Plan& plan) {
  const PlanOptions& options = plan.options;
  const MicrobatchCounts counts = microbatch_counts(plan);
  size_t num_samples = 0;
  for (const auto& minibatch : plan.minibatches) num_samples += minibatch.samples.size();
  std::vector<double> odc_bubbles;
  for (const auto& minibatch : plan.minibatches) odc_bubbles.push_back(minibatch.bubble.odc);
  std::sort(odc_bubbles.begin(), odc_bubbles.end());

  std::ostringstream out;
  out << "policy            " << policy_name(options.policy) << "\n"
      << "ranks             " << options.num_ranks << "\n"
      << "max tokens        " << options.max_tokens << " per microbatch\n"
      << "microbatch cost   " << cost_text(options.cost) << "\n"
      << "samples           " << num_samples << " in " << plan.minibatches.size()
      << " minibatch(es)\n";
  char line[160];
  std::snprintf(line, sizeof(line),
                "microbatches      %zu to %zu per rank per minibatch (mean %.2f)\n", counts.min,
                counts.max, counts.mean);
  out << line << "\npredicted bubble  collective   odc\n";
  std::snprintf(line, sizeof(line), "  all minibatches %10s %7s\n",
                percent(plan.bubble.collective).c_str(), percent(plan.bubble.odc).c_str());
  out << line;
  if (odc_bubbles.size() > 1) {
    std::snprintf(line, sizeof(line), "  odc per minibatch: median %s, worst %s\n",
                  percent(odc_bubbles[odc_bubbles.size() / 2]).c_str(),
                  percent(odc_bubbles.back()).c_str());
    out << line;
  }
  return out.str();
}

std::string compare_table(const std::vector<Plan>& plans) {
  std::ostringstream out;
  char line[200];
  std::snprintf(line, sizeof(line), "%-11s %-24s %19s %13s\n", "policy", "microbatches/rank/mb",
                "bubble collective", "bubble odc");
  out << line;
  for (const Plan& plan : plans) {
    const MicrobatchCounts counts = microbatch_counts(plan);
    char range[48];
    std::snprintf(range, sizeof(range), "%zu-%zu (mean %.2f)", counts.min, counts.max, counts.mean);
    // LB-Mini's unequal microbatch counts cannot run under per-layer collectives.
    const std::string collective =
        plan.options.policy == Policy::kLbMini ? "n/a (odc only)" : percent(plan.bubble.collective);
    std::snprintf(line, sizeof(line), "%-11s %-24s %19s %13s\n",
                  std::string(policy_name(plan.options.policy)).c_str(), range, collective.c_str(),
                  percent(plan.bubble.odc).c_str());
    out << line;
  }
  return out.str();
}

}  // namespace odc::planner
