// JSON in the documented key order: written by hand (fast) without splitting, via nlohmann with it.
#include "planner/plan_format.h"

#include <algorithm>
#include <charconv>
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

struct SplitCounts {
  size_t samples = 0;
  size_t smallest_group = 0;
  size_t largest_group = 0;
};

SplitCounts split_counts(const Plan& plan) {
  SplitCounts counts;
  for (const auto& minibatch : plan.minibatches) {
    for (const SplitSample& split : minibatch.splits) {
      const size_t size = split.ranks.size();
      counts.smallest_group = counts.samples ? std::min(counts.smallest_group, size) : size;
      counts.largest_group = std::max(counts.largest_group, size);
      ++counts.samples;
    }
  }
  return counts;
}

// Stealing over all minibatches (options.steal): the span summed, against ODC's time without it.
struct StealTotals {
  double time = 0.0;
  double odc_time = 0.0;
  int64_t moved = 0;
};

StealTotals steal_totals(const Plan& plan) {
  StealTotals totals;
  for (const auto& minibatch : plan.minibatches) {
    totals.time += minibatch.steal.span;
    totals.odc_time += minibatch.times.odc;
    totals.moved += minibatch.steal.num_moved;
  }
  return totals;
}

std::string policy_label(const PlanOptions& options) {
  std::string label(policy_name(options.policy));
  if (options.split == SplitMode::kAuto) label += "+split";
  return label;
}

std::string cost_text(const CostModel& cost) {
  std::ostringstream out;
  if (cost.floor > 0.0) out << "max(" << cost.floor << ", ";
  out << cost.c << " + sum(" << cost.a << "*L + " << cost.b << "*L^2)";
  if (cost.floor > 0.0) out << ")";
  return out.str();
}

}  // namespace

namespace {

// The document through nlohmann: with splitting on (opt-in, the "split" and "splits" keys) or
// stealing predicted (opt-in, the "steal" keys).
std::string plan_to_json_with_extras(const Plan& plan) {
  using nlohmann::ordered_json;
  const PlanOptions& options = plan.options;
  ordered_json root;
  root["policy"] = std::string(policy_name(options.policy));
  root["ranks"] = options.num_ranks;
  root["max_tokens"] = options.max_tokens;
  root["cost"] = {{"a", options.cost.a}, {"b", options.cost.b}, {"c", options.cost.c}};
  if (options.cost.floor > 0.0) root["cost"]["floor"] = options.cost.floor;  // only when set
  // Only with splitting on: plans without it keep the original document byte for byte.
  const bool split = options.split != SplitMode::kOff;
  if (split) {
    root["split"] = {{"mode", std::string(split_mode_name(options.split))},
                     {"exchange", options.split_exchange}};
  }
  ordered_json minibatches = ordered_json::array();
  for (const auto& minibatch : plan.minibatches) {
    ordered_json ranks = ordered_json::array();
    for (const auto& rank : minibatch.ranks) {
      ranks.push_back({{"microbatches", rank.microbatches}});
    }
    ordered_json entry = {{"samples", minibatch.samples}, {"ranks", std::move(ranks)}};
    if (split) {
      ordered_json splits = ordered_json::array();
      for (const SplitSample& sample : minibatch.splits) {
        splits.push_back({{"sample", sample.sample},
                          {"ranks", sample.ranks},
                          {"chunks", sample.chunks},
                          {"chunk_costs", sample.chunk_costs}});
      }
      entry["splits"] = std::move(splits);
    }
    entry["bubble"] = {{"collective", minibatch.bubble.collective}, {"odc", minibatch.bubble.odc}};
    if (options.steal) {
      const StealTimes& steal = minibatch.steal;
      entry["steal"] = {{"time", steal.span},
                        {"odc_time", minibatch.times.odc},
                        {"busy", steal.busy},
                        {"bubble", steal.bubble},
                        {"moved", steal.num_moved}};
    }
    minibatches.push_back(std::move(entry));
  }
  root["minibatches"] = std::move(minibatches);
  root["bubble"] = {{"collective", plan.bubble.collective}, {"odc", plan.bubble.odc}};
  if (options.steal) {
    const StealTotals totals = steal_totals(plan);
    root["steal"] = {{"time", totals.time},
                     {"odc_time", totals.odc_time},
                     {"bubble", plan.steal_bubble},
                     {"moved", totals.moved}};
  }
  return root.dump();
}

}  // namespace

std::string plan_to_json(const Plan& plan) {
  if (plan.options.split != SplitMode::kOff || plan.options.steal) {
    return plan_to_json_with_extras(plan);
  }
  // Written by hand for speed (a plan of 1M samples is a 10 MB document; building an
  // nlohmann::json tree of it costs more than planning). The bytes equal
  // nlohmann::ordered_json::dump() of the documented structure (tests compare the two); numbers
  // that are not integers are formatted by nlohmann itself, so they round-trip the same way.
  const PlanOptions& options = plan.options;
  size_t num_indices = 0;
  for (const auto& minibatch : plan.minibatches) num_indices += 2 * minibatch.samples.size();
  std::string out;
  out.reserve(256 + 12 * num_indices + 64 * plan.minibatches.size());
  auto integer = [&out](int64_t value) {
    char text[24];
    const auto result = std::to_chars(text, text + sizeof(text), value);
    out.append(text, result.ptr);
  };
  auto number = [&out](double value) { out += nlohmann::json(value).dump(); };
  auto bubble = [&](const Bubble& b) {
    out += "{\"collective\":";
    number(b.collective);
    out += ",\"odc\":";
    number(b.odc);
    out += '}';
  };
  auto index_list = [&](const std::vector<int64_t>& indices) {
    out += '[';
    for (size_t i = 0; i < indices.size(); ++i) {
      if (i > 0) out += ',';
      integer(indices[i]);
    }
    out += ']';
  };
  out += "{\"policy\":\"";
  out += policy_name(options.policy);  // fixed names: nothing to escape
  out += "\",\"ranks\":";
  integer(options.num_ranks);
  out += ",\"max_tokens\":";
  integer(options.max_tokens);
  out += ",\"cost\":{\"a\":";
  number(options.cost.a);
  out += ",\"b\":";
  number(options.cost.b);
  out += ",\"c\":";
  number(options.cost.c);
  if (options.cost.floor > 0.0) {  // only when set: documents without one stay byte for byte
    out += ",\"floor\":";
    number(options.cost.floor);
  }
  out += "},\"minibatches\":[";
  for (size_t m = 0; m < plan.minibatches.size(); ++m) {
    const MinibatchPlan& minibatch = plan.minibatches[m];
    if (m > 0) out += ',';
    out += "{\"samples\":";
    index_list(minibatch.samples);
    out += ",\"ranks\":[";
    for (size_t r = 0; r < minibatch.ranks.size(); ++r) {
      if (r > 0) out += ',';
      out += "{\"microbatches\":[";
      const auto& microbatches = minibatch.ranks[r].microbatches;
      for (size_t k = 0; k < microbatches.size(); ++k) {
        if (k > 0) out += ',';
        index_list(microbatches[k]);
      }
      out += "]}";
    }
    out += "],\"bubble\":";
    bubble(minibatch.bubble);
    out += '}';
  }
  out += "],\"bubble\":";
  bubble(plan.bubble);
  out += '}';
  return out;
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
      << "max tokens        " << options.max_tokens << " per microbatch";
  if (options.policy == Policy::kLbMini) {
    out << (options.microbatch_memory == MicrobatchMemory::kLbMicro
                ? " (lb-mini: at most lb-micro's largest in each minibatch)"
                : " (lb-mini: up to the cap)");
  }
  out << "\n"
      << "microbatch cost   " << cost_text(options.cost) << "\n"
      << "samples           " << num_samples << " in " << plan.minibatches.size()
      << " minibatch(es)\n";
  if (options.split != SplitMode::kOff) {
    const SplitCounts splits = split_counts(plan);
    out << "split             " << split_mode_name(options.split) << " (K/V exchange "
        << options.split_exchange << " x a per token received): " << splits.samples
        << " sample(s) split";
    if (splits.samples > 0) {
      out << ", groups of " << splits.smallest_group;
      if (splits.largest_group != splits.smallest_group) out << " to " << splits.largest_group;
      out << " ranks";
    }
    out << "\n";
    constexpr size_t kListed = 8;  // the first few; the JSON lists them all
    size_t listed = 0;
    for (const auto& minibatch : plan.minibatches) {
      for (const SplitSample& split : minibatch.splits) {
        if (listed++ >= kListed) continue;
        out << "  sample " << split.sample << " (" << split.chunks.size() << "-way) on ranks";
        for (int64_t rank : split.ranks) out << " " << rank;
        out << "\n";
      }
    }
    if (splits.samples > kListed) out << "  ... and " << splits.samples - kListed << " more\n";
  }
  char line[160];
  std::snprintf(line, sizeof(line),
                "microbatches      %zu to %zu per rank per minibatch (mean %.2f)\n", counts.min,
                counts.max, counts.mean);
  out << line << "\npredicted bubble  collective   odc\n";
  // LB-Mini's unequal microbatch counts cannot run under per-layer collectives (the JSON still
  // carries the formula's value, as compare's JSON does not).
  const std::string collective =
      options.policy == Policy::kLbMini ? "n/a" : percent(plan.bubble.collective);
  std::snprintf(line, sizeof(line), "  all minibatches %10s %7s\n", collective.c_str(),
                percent(plan.bubble.odc).c_str());
  out << line;
  if (odc_bubbles.size() > 1) {
    std::snprintf(line, sizeof(line), "  odc per minibatch: median %s, worst %s\n",
                  percent(odc_bubbles[odc_bubbles.size() / 2]).c_str(),
                  percent(odc_bubbles.back()).c_str());
    out << line;
  }
  if (options.steal) {
    const StealTotals totals = steal_totals(plan);
    std::snprintf(line, sizeof(line),
                  "  odc + stealing  %18s (time %.4g against %.4g without, %lld microbatches "
                  "moved)\n",
                  percent(plan.steal_bubble).c_str(), totals.time, totals.odc_time,
                  static_cast<long long>(totals.moved));
    out << line;
  }
  return out.str();
}

std::string compare_table(const std::vector<Plan>& plans) {
  std::ostringstream out;
  char line[200];
  bool any_split = false;
  for (const Plan& plan : plans) any_split = any_split || plan.options.split != SplitMode::kOff;
  // Without splitting the table is the original one, byte for byte.
  const int policy_width = any_split ? 17 : 11;
  std::snprintf(line, sizeof(line), "%-*s %-24s %19s %13s%s\n", policy_width, "policy",
                "microbatches/rank/mb", "bubble collective", "bubble odc",
                any_split ? "  split samples" : "");
  out << line;
  for (const Plan& plan : plans) {
    const MicrobatchCounts counts = microbatch_counts(plan);
    char range[48];
    std::snprintf(range, sizeof(range), "%zu-%zu (mean %.2f)", counts.min, counts.max, counts.mean);
    // LB-Mini's unequal microbatch counts cannot run under per-layer collectives.
    const std::string collective =
        plan.options.policy == Policy::kLbMini ? "n/a (odc only)" : percent(plan.bubble.collective);
    std::string split_column;
    if (any_split) {
      split_column = plan.options.split == SplitMode::kOff
                         ? "  -"
                         : "  " + std::to_string(split_counts(plan).samples);
    }
    std::snprintf(line, sizeof(line), "%-*s %-24s %19s %13s%s\n", policy_width,
                  policy_label(plan.options).c_str(), range, collective.c_str(),
                  percent(plan.bubble.odc).c_str(), split_column.c_str());
    out << line;
  }
  return out.str();
}

}  // namespace odc::planner
