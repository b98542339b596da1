// Renderings of a sweep (sweep_format.h). Verdicts name only arms whose state fits the GPU's memory
// (SweepResult::fits), however fast the others are; all figures are per step (a minibatch, or an
// RL step with --task grpo), the rows' sums divided by their step count.
#include "simulate/sweep_format.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace odc::simulate {
namespace {

using RankLabels = std::vector<std::pair<int64_t, std::string>>;

// The verdict's label for a rank count where no simulated arm fits the GPU's memory.
constexpr const char* kNothingFits = "nothing that fits";

// At one rank count, the strongest baseline arm (the fastest FSDP2 arm that fits: collective,
// fsdp2-deferred, fsdp2-unsharded, any policy) and ODC's fastest arm that fits (odc,
// odc-hybrid); indices into the rows, kNone where no such arm was simulated or none fits.
constexpr size_t kNone = static_cast<size_t>(-1);
struct Strongest {
  int64_t ranks = 0;
  size_t baseline = kNone, odc = kNone;
  double odc_speedup(const std::vector<SweepRow>& rows) const {
    return rows[baseline].result.seconds / rows[odc].result.seconds;
  }
};

std::vector<Strongest> strongest_arms(const SweepResult& sweep) {
  const std::vector<SweepRow>& rows = sweep.rows;
  std::vector<Strongest> found;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (found.empty() || found.back().ranks != rows[i].ranks) found.push_back({rows[i].ranks});
    if (!sweep.fits(rows[i])) continue;
    const bool odc = is_odc(parse_mode(rows[i].mode).value());
    size_t& best = odc ? found.back().odc : found.back().baseline;
    if (best == kNone || rows[i].result.seconds < rows[best].result.seconds) best = i;
  }
  return found;
}

// "a at 8-16 GPUs, b at 64 GPUs": labels per rank count (ascending), runs of one label merged.
std::string labels_by_ranks(const RankLabels& labels) {
  std::string text;
  for (size_t i = 0; i < labels.size();) {
    size_t j = i;
    while (j + 1 < labels.size() && labels[j + 1].second == labels[i].second) ++j;
    if (i != 0) text += ", ";
    text += labels[i].second + " at " + std::to_string(labels[i].first);
    if (j != i) text += '-' + std::to_string(labels[j].first);
    text += " GPUs";
    i = j + 1;
  }
  return text;
}

// "8" or "8-64": the rank counts of per-rank-count entries (ascending).
std::string rank_span(const RankLabels& entries) {
  std::string span = std::to_string(entries.front().first);
  if (entries.back().first != entries.front().first) {
    span += '-' + std::to_string(entries.back().first);
  }
  return span;
}

// The hint and the verdict name the split check where splitting is at least this much faster (odc
// compare's threshold for its own hint).
constexpr double kSplitHintGain = 1.05;

// "hint: --split auto predicts 2.01x instead of 1.05x here (...)", as odc compare words it, or ""
// when splitting does not pay by kSplitHintGain.
std::string split_hint(const SplitCheck& check) {
  if (!(check.gain() >= kSplitHintGain)) return "";
  char line[400];
  if (check.baseline_seconds > 0) {
    std::snprintf(line, sizeof(line), "hint: --split auto predicts %.2fx instead of %.2fx",
                  check.baseline_seconds / check.with_seconds,
                  check.baseline_seconds / check.without_seconds);
  } else {
    std::snprintf(line, sizeof(line), "hint: --split auto predicts a %.2fx faster step",
                  check.gain());
  }
  return std::string(line) + " here (simulated, " + check.mode + " + lb-mini at " +
         std::to_string(check.ranks) +
         " GPUs; samples above a rank's share run as context-parallel chunks on a few ranks; "
         "docs/planner.md)";
}

std::string fixed(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

// "a" or "a-b" (GPUs) / "1.30x" or "1.30x to 1.35x".
std::string range(double low, double high, const char* format) {
  const std::string a = fixed(format, low), b = fixed(format, high);
  return a == b ? a : a + " to " + b;
}

// Per rank count, in rank order: the fastest arm that fits (kNothingFits where none does), a
// faster one that does not fit, and the range of the fitting arms' speedups.
struct Fastest {
  RankLabels fitting, faster_unfit;
  double low = 0, high = 0, compute_low = 0, compute_high = 0;
  bool any_speedup = false;
  void add_speedups(const SweepRow& row) {
    if (!(row.speedup > 0)) return;
    low = any_speedup ? std::min(low, row.speedup) : row.speedup;
    high = any_speedup ? std::max(high, row.speedup) : row.speedup;
    compute_low = any_speedup ? std::min(compute_low, row.planner_speedup) : row.planner_speedup;
    compute_high = any_speedup ? std::max(compute_high, row.planner_speedup) : row.planner_speedup;
    any_speedup = true;
  }
};

Fastest fastest_arms(const SweepResult& sweep) {
  const std::vector<SweepRow>& rows = sweep.rows;
  Fastest fastest;
  for (size_t i = 0; i < rows.size();) {
    size_t j = i, best = kNone, best_any = i;
    for (; j < rows.size() && rows[j].ranks == rows[i].ranks; ++j) {
      if (rows[j].result.seconds < rows[best_any].result.seconds) best_any = j;
      if (sweep.fits(rows[j]) &&
          (best == kNone || rows[j].result.seconds < rows[best].result.seconds)) {
        best = j;
      }
    }
    if (best != best_any) {
      fastest.faster_unfit.emplace_back(rows[best_any].ranks, rows[best_any].label());
    }
    if (best == kNone) {
      fastest.fitting.emplace_back(rows[i].ranks, kNothingFits);
    } else {
      fastest.fitting.emplace_back(rows[best].ranks, rows[best].label());
      fastest.add_speedups(rows[best]);
    }
    i = j;
  }
  return fastest;
}

// The verdict's speedup over collective + lb-micro, and beside it the compute-only figure: the
// planner's on the minibatches simulated here, not on the whole file as odc compare plans it
// (said so, so that the two are not read as one number).
std::string speedup_words(const SweepResult& sweep, const Fastest& fastest) {
  if (!fastest.any_speedup) {
    return " (no speedup: the baseline, collective + lb-micro, was not simulated)";
  }
  const Sweep& request = sweep.request;
  const bool grpo = request.task == Task::kGrpo;
  const std::string sample = std::to_string(request.minibatches) +
                             (grpo ? (request.minibatches == 1 ? " RL step" : " RL steps")
                                   : (request.minibatches == 1 ? " minibatch" : " minibatches"));
  return ", simulated speedup " + range(fastest.low, fastest.high, "%.2fx") +
         " over the baseline collective + lb-micro (compute only on the same " + sample +
         ", odc compare's basis: " + range(fastest.compute_low, fastest.compute_high, "%.2fx") +
         "; compare plans the whole file)";
}

// Against the strongest arm a user could pick instead of ODC (docs/design.md, "Baselines").
std::string strongest_words(const SweepResult& sweep) {
  RankLabels baselines, odc_arms;
  double odc_low = 0, odc_high = 0;
  for (const Strongest& s : strongest_arms(sweep)) {
    if (s.baseline == kNone || s.odc == kNone) continue;
    const double speedup = s.odc_speedup(sweep.rows);
    odc_low = baselines.empty() ? speedup : std::min(odc_low, speedup);
    odc_high = baselines.empty() ? speedup : std::max(odc_high, speedup);
    baselines.emplace_back(s.ranks, sweep.rows[s.baseline].label());
    odc_arms.emplace_back(s.ranks, sweep.rows[s.odc].label());
  }
  if (baselines.empty()) return "";
  return "; strongest baseline arm (the fastest FSDP2 arm that fits): " +
         labels_by_ranks(baselines) + ", ODC's speedup over it " +
         range(odc_low, odc_high, "%.2fx") + " (" + labels_by_ranks(odc_arms) + ")";
}

// GRPO's step, the split check where it pays, and what the simulated time includes.
std::string assumption_words(const SweepResult& sweep) {
  const Sweep& request = sweep.request;
  std::string words;
  if (request.task == Task::kGrpo) {
    words += "; per RL step: 2 forward-only phases and " +
             std::to_string(request.minibatches_per_step) + " update minibatches";
  }
  const SplitCheck& check = sweep.split_check;
  if (check.gain() >= kSplitHintGain) {
    words +=
        check.baseline_seconds > 0
            ? fixed("; --split auto would give %.2fx", check.baseline_seconds / check.with_seconds)
            : fixed("; --split auto would be %.2fx faster", check.gain());
    words += " (" + check.mode + " + lb-mini+split at " + std::to_string(check.ranks) +
             " GPUs: see the hint)";
  }
  const Topology& t = sweep.base.topology;
  words += "; includes modelled communication (";
  words += request.transport_path.empty()
               ? fixed("NVLink %.0f GB/s", t.nvlink.bytes_per_second / 1e9) +
                     fixed(" ODC / %.0f GB/s NCCL", t.nvlink_collective.bytes_per_second / 1e9)
               : "NVLink from " + request.transport_path;
  words += ", " + std::to_string(t.gpus_per_node) + " GPUs per node" +
           fixed(", network %.0f Gb/s per GPU", t.network.bytes_per_second * 8 / 1e9) +
           "; validated against runs on one node only) and the optimizer";
  return words;
}

nlohmann::ordered_json optional_number(double value, bool present) {
  return present ? nlohmann::ordered_json(value) : nlohmann::ordered_json(nullptr);
}

// The request and what it resolved to, in the document's key order.
void json_settings(const SweepResult& sweep, nlohmann::ordered_json& root) {
  const Sweep& request = sweep.request;
  const SimulateOptions& base = sweep.base;
  root["model"] = {{"layers", base.model.num_layers},
                   {"layer_params", base.model.layer_params},
                   {"other_params", base.model.other_params}};
  root["cost"] = {{"a", base.plan.cost.a}, {"b", base.plan.cost.b}, {"c", base.plan.cost.c}};
  if (base.plan.cost.floor > 0.0) root["cost"]["floor"] = base.plan.cost.floor;
  root["cost_calibrated_on"] = base.cost_calibration_ranks;
  root["task"] = std::string(task_name(request.task));
  if (request.task == Task::kGrpo) {
    // --minibatches counts RL steps; each holds N x samples_per_rank rollouts.
    root["minibatches_per_step"] = request.minibatches_per_step;
  }
  root["forward_fraction"] = base.forward_fraction;
  root["samples_per_rank"] = request.samples.samples_per_rank;
  root["minibatches"] = request.minibatches;
  root["max_tokens"] = base.plan.max_tokens;
  root["microbatch_memory"] =
      std::string(planner::microbatch_memory_name(base.plan.microbatch_memory));
  root["topology"] = {
      {"gpus_per_node", base.topology.gpus_per_node},
      {"nvlink_bytes_per_second", base.topology.nvlink.bytes_per_second},
      {"nvlink_collective_bytes_per_second", base.topology.nvlink_collective.bytes_per_second},
      {"network_bytes_per_second", base.topology.network.bytes_per_second}};
  root["topology"]["transport_curves"] = request.transport_path;
  root["split"] = std::string(planner::split_mode_name(base.plan.split));
  root["split_exchange"] = base.plan.split_exchange;
  if (!base.plan.rank_speed.empty()) root["rank_speed"] = base.plan.rank_speed;
  // Only when asked for: documents without them keep their keys.
  if (request.steal) root["steal"] = true;
  if (!request.rank_slowdown.empty()) {
    nlohmann::ordered_json slowdowns = nlohmann::ordered_json::array();
    for (const auto& [rank, factor] : request.rank_slowdown) {
      slowdowns.push_back({{"rank", rank}, {"factor", factor}});
    }
    root["rank_slowdown"] = std::move(slowdowns);
  }
}

// Per rank count: the fastest FSDP2 arm and ODC's fastest arm that fit, ODC's speedup over it.
nlohmann::ordered_json json_strongest(const SweepResult& sweep) {
  const std::vector<SweepRow>& rows = sweep.rows;
  nlohmann::ordered_json strongest = nlohmann::ordered_json::array();
  for (const Strongest& s : strongest_arms(sweep)) {
    if (s.baseline == kNone || s.odc == kNone) continue;
    const double baseline_steps = static_cast<double>(rows[s.baseline].result.num_minibatches);
    const double odc_steps = static_cast<double>(rows[s.odc].result.num_minibatches);
    strongest.push_back(
        {{"ranks", s.ranks},
         {"baseline", rows[s.baseline].label()},
         {"baseline_step_seconds", rows[s.baseline].result.seconds / baseline_steps},
         {"odc", rows[s.odc].label()},
         {"odc_step_seconds", rows[s.odc].result.seconds / odc_steps},
         {"odc_speedup", s.odc_speedup(rows)}});
  }
  return strongest;
}

nlohmann::ordered_json json_row(const SweepRow& row, bool grpo) {
  const double m = static_cast<double>(row.result.num_minibatches);
  nlohmann::ordered_json phases = nullptr;
  if (grpo) {
    // Per RL step: one forward-only phase (the step holds two) and the K updates.
    phases = {{"forward_phase_seconds", row.forward_phase.seconds / m},
              {"update_seconds", row.update.seconds / m},
              {"planner_forward_phase_seconds", row.forward_phase.planner_seconds / m},
              {"planner_update_seconds", row.update.planner_seconds / m},
              {"forward_phase_exposed_comm_seconds", row.forward_phase.exposed_comm_seconds / m},
              {"update_exposed_comm_seconds", row.update.exposed_comm_seconds / m}};
  }
  return {{"ranks", row.ranks},
          {"policy", row.policy},
          {"mode", row.mode},
          {"step_seconds", row.result.seconds / m},
          {"bubble", row.result.bubble},
          {"speedup", optional_number(row.speedup, row.speedup > 0)},
          {"compute_seconds", row.result.compute_seconds / m},
          {"exposed_comm_seconds", row.result.exposed_comm_seconds / m},
          {"idle_seconds", row.result.idle_seconds / m},
          {"optimizer_seconds", row.result.optimizer_seconds / m},
          {"planner_step_seconds", row.result.planner_seconds / m},
          {"minibatch_seconds", row.result.minibatch_seconds},
          {"phases", phases}};
}

nlohmann::ordered_json json_memory(const SweepResult& sweep) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const MemoryRow& row : sweep.memory) {
    rows.push_back({{"ranks", row.ranks},
                    {"mode", std::string(mode_name(row.mode))},
                    {"state_bytes", row.memory.state_bytes},
                    {"gathered_bytes", row.memory.gathered_bytes},
                    {"unsharded_bytes", row.memory.unsharded_bytes},
                    {"odc_bytes", row.memory.odc_bytes},
                    {"total_bytes", row.memory.total_bytes()},
                    {"fits", row.fits}});
  }
  return rows;
}

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * fraction);
  return text;
}

// Seconds per step and their parts per rank, one line per arm.
std::string step_table(const SweepResult& sweep) {
  const bool grpo = sweep.request.task == Task::kGrpo;
  // The policy column fits "lb-mini+split" where --split auto adds such rows.
  int policy_width = 10;
  for (const SweepRow& row : sweep.rows) {
    policy_width = std::max(policy_width, static_cast<int>(row.policy.size()));
  }
  std::string out;
  char line[240];
  // GRPO adds the RL step's two parts: one forward-only phase (the step runs two) and the K
  // update minibatches together.
  std::snprintf(line, sizeof(line), "%6s %-*s %-15s %8s%s %7s %8s %9s %9s %9s %9s\n", "ranks",
                policy_width, "policy", "mode", "step s", grpo ? " fwd-only   update" : "",
                "bubble", "speedup", "compute", "exp.comm", "idle", "optim");
  out += line;
  for (const SweepRow& row : sweep.rows) {
    const double m = static_cast<double>(row.result.num_minibatches);
    char speedup[16] = "-";
    if (row.speedup > 0) std::snprintf(speedup, sizeof(speedup), "%.2fx", row.speedup);
    char phases[40] = "";
    if (grpo) {
      std::snprintf(phases, sizeof(phases), " %8.3f %8.3f", row.forward_phase.seconds / m,
                    row.update.seconds / m);
    }
    std::snprintf(line, sizeof(line), "%6lld %-*s %-15s %8.3f%s %7s %8s %9.3f %9.3f %9.3f %9.4f\n",
                  static_cast<long long>(row.ranks), policy_width, row.policy.c_str(),
                  row.mode.c_str(), row.result.seconds / m, phases,
                  percent(row.result.bubble).c_str(), speedup, row.result.compute_seconds / m,
                  row.result.exposed_comm_seconds / m, row.result.idle_seconds / m,
                  row.result.optimizer_seconds / m);
    out += line;
  }
  if (grpo) {
    out += "seconds per RL step (step: 2 forward-only phases, old and reference log-probs, then " +
           std::to_string(sweep.request.minibatches_per_step) +
           " update minibatches; fwd-only: one of the two phases; update: the updates together) "
           "and the step's parts per rank: compute, exposed communication, idle (waiting for "
           "other ranks), optimizer; speedup against collective + lb-micro at the same rank "
           "count\n\n";
  } else {
    out +=
        "seconds per minibatch (step) and its parts per rank: compute, exposed communication, "
        "idle (waiting for other ranks), optimizer; speedup against collective + lb-micro at "
        "the same rank count\n\n";
  }
  // Said where it applies, so that the rows above read right; tables without them are unchanged.
  const Sweep& request = sweep.request;
  if (!request.rank_slowdown.empty()) {
    out.resize(out.size() - 1);  // this line joins the legend
    std::string ranks;
    for (const auto& [rank, factor] : request.rank_slowdown) {
      char text[64];
      std::snprintf(text, sizeof(text), "%s%lld %gx", ranks.empty() ? "" : ", ",
                    static_cast<long long>(rank), factor);
      ranks += text;
    }
    out +=
        "unplanned slowdown (--rank-slowdown, every arm; the plans assume planned speeds): rank " +
        ranks + " slower\n\n";
  }
  if (request.steal) {
    out.resize(out.size() - 1);
    out +=
        "+steal: the same plan under odc with work stealing (a rank out of microbatches takes the "
        "tail of the queue with the most predicted work left; docs/planner.md, \"Work "
        "stealing\")\n\n";
  }
  return out;
}

// State per GPU per layout, and whether it fits.
std::string memory_table(const SweepResult& sweep) {
  const double capacity = sweep.gpu_memory_bytes;
  char line[240];
  std::snprintf(line, sizeof(line), "%6s %-15s %9s %9s %9s %9s %9s %12s\n", "ranks", "mode",
                "state", "gathered", "unsharded", "odc bufs", "total", "fits?");
  std::string out =
      "memory per GPU, GB (state sharded as the runtime does; activations not included)\n";
  out += line;
  for (const MemoryRow& row : sweep.memory) {
    const double total = row.memory.total_bytes();
    char fits[32];
    if (row.fits) {
      std::snprintf(fits, sizeof(fits), "yes, %.0f left", (capacity - total) / 1e9);
    } else {
      std::snprintf(fits, sizeof(fits), "no");
    }
    std::snprintf(line, sizeof(line), "%6lld %-15s %9.2f %9.2f %9.2f %9.2f %9.2f %12s\n",
                  static_cast<long long>(row.ranks), std::string(mode_name(row.mode)).c_str(),
                  row.memory.state_bytes / 1e9, row.memory.gathered_bytes / 1e9,
                  row.memory.unsharded_bytes / 1e9, row.memory.odc_bytes / 1e9, total / 1e9, fits);
    out += line;
  }
  out += fixed("on a %.0f GB GPU", sweep.request.gpu_memory_gbytes) +
         " (--gpu-memory-gbytes); \"left\" is what activations may use. state: 16 B per "
         "parameter (fp32 weights, AdamW, gradient or odc's accumulator; odc publishes the fp32 "
         "shards in place) / N, odc-hybrid / GPUs per node" +
         (sweep.request.task == Task::kGrpo
              ? ", plus the frozen reference's fp32 parameters (4 B) likewise"
              : "") +
         "; unsharded: held whole on every GPU, fsdp2-deferred's fp32 gradients (4 B per "
         "parameter), fsdp2-unsharded's bf16 parameters and fp32 gradients (6 B)\n";
  return out;
}

}  // namespace

std::string sweep_verdict(const SweepResult& sweep) {
  const Fastest fastest = fastest_arms(sweep);
  const std::string line = "verdict: ";
  if (std::all_of(fastest.fitting.begin(), fastest.fitting.end(),
                  [](const auto& entry) { return entry.second == kNothingFits; })) {
    return line + "no arm's state fits a " + fixed("%.0f GB GPU", sweep.request.gpu_memory_gbytes) +
           " at " + rank_span(fastest.fitting) +
           " GPUs (memory table: more GPUs, a larger GPU or a smaller model); the fastest "
           "regardless: " +
           labels_by_ranks(fastest.faster_unfit);
  }
  const RankLabels& fitting = fastest.fitting;
  const bool one_label = std::all_of(fitting.begin(), fitting.end(), [&](const auto& entry) {
    return entry.second == fitting.front().second;
  });
  std::string words =
      line + (one_label ? fitting.front().second + " is fastest at " + rank_span(fitting) + " GPUs"
                        : "fastest: " + labels_by_ranks(fitting));
  words += speedup_words(sweep, fastest);
  if (!fastest.faster_unfit.empty()) {
    words += fixed("; faster but its state does not fit a %.0f GB GPU: ",
                   sweep.request.gpu_memory_gbytes) +
             labels_by_ranks(fastest.faster_unfit) + " (memory table)";
  }
  return words + strongest_words(sweep) + assumption_words(sweep);
}

std::string sweep_to_json(const SweepResult& sweep) {
  nlohmann::ordered_json root;
  json_settings(sweep, root);
  root["baseline"] = "collective + lb-micro at the same rank count";
  root["verdict"] = sweep_verdict(sweep);
  const std::string hint = split_hint(sweep.split_check);
  root["split_hint"] =
      hint.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(hint);
  root["strongest_baseline"] = json_strongest(sweep);
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const SweepRow& row : sweep.rows) {
    results.push_back(json_row(row, sweep.request.task == Task::kGrpo));
  }
  root["results"] = std::move(results);
  root["gpu_memory_bytes"] = sweep.gpu_memory_bytes;
  root["memory_per_gpu"] = json_memory(sweep);
  return root.dump();
}

std::string sweep_to_table(const SweepResult& sweep) {
  std::string out = step_table(sweep) + memory_table(sweep) + sweep_verdict(sweep) + "\n";
  const std::string hint = split_hint(sweep.split_check);
  if (!hint.empty()) out += hint + "\n";
  return out;
}

}  // namespace odc::simulate
