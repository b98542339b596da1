// Renderings of a sweep (sweep_format.h). The decision (decision.h) and the strongest baseline
// name only arms whose state fits the GPU's memory (SweepResult::fits), however fast the others
// are; all figures are per step (a minibatch, or an RL step with --task grpo), the rows' sums
// divided by their step count.
#include "simulate/sweep_format.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace odc::simulate {
namespace {

// The suffix of a split arm's policy label (sweep.cc: "lb-mini+split").
constexpr std::string_view kSplitSuffix = "+split";

// The split check is named where splitting is at least this much faster (odc compare's threshold
// for its own).
constexpr double kSplitHintGain = 1.05;

std::string fixed(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

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

// The split check's words where splitting pays by kSplitHintGain and split is off: the split arms
// (ODC's and FSDP2's) are then not in the decision, so the user is told to run them.
std::string split_words(const SplitCheck& check) {
  if (!(check.gain() >= kSplitHintGain)) return "";
  return "rerun with --split auto: splitting outliers made " + check.mode + " + lb-mini " +
         fixed("%.2fx faster at ", check.gain()) + std::to_string(check.ranks) + " GPUs";
}

// The rank count from which some requested layout's state fits, doubling from the largest
// requested (the memory table's own formulas), or "" where none does up to kMaxRanksTried.
std::string nothing_fits_remedy(const SweepResult& sweep) {
  constexpr int64_t kMaxRanksTried = int64_t{1} << 20;
  const Sweep& request = sweep.request;
  const int64_t largest = *std::max_element(request.ranks.begin(), request.ranks.end());
  for (int64_t ranks = largest * 2; ranks <= kMaxRanksTried; ranks *= 2) {
    for (Mode mode : request.modes) {
      const MemoryPerGpu memory =
          memory_per_gpu(sweep.base.model, mode, ranks, sweep.base.topology.gpus_per_node,
                         /*reference_model=*/request.task == Task::kGrpo);
      if (memory.total_bytes() <= sweep.gpu_memory_bytes) {
        return std::string(mode_name(mode)) + "'s state fits from " + std::to_string(ranks) +
               " GPUs";
      }
    }
  }
  return "no rank count fits: a larger GPU (--gpu-memory-gbytes) or a smaller model";
}

// Every simulated arm as the decision sees it, with the memory table's verdict and total.
std::vector<DecisionArm> decision_arms(const SweepResult& sweep) {
  std::vector<DecisionArm> arms;
  for (const SweepRow& row : sweep.rows) {
    DecisionArm arm;
    arm.ranks = row.ranks;
    arm.mode = row.mode;
    arm.split = row.policy.ends_with(kSplitSuffix);
    arm.policy =
        arm.split ? row.policy.substr(0, row.policy.size() - kSplitSuffix.size()) : row.policy;
    const Mode mode = parse_mode(row.mode).value();
    arm.odc = is_odc(mode);
    arm.seconds = row.result.seconds;
    arm.bubble = row.result.bubble;
    arm.fits = sweep.fits(row);
    for (const MemoryRow& m : sweep.memory) {
      if (m.ranks == row.ranks && m.mode == mode) arm.memory_bytes = m.memory.total_bytes();
    }
    arms.push_back(std::move(arm));
  }
  return arms;
}

DecisionContext decision_context(const SweepResult& sweep) {
  DecisionContext context;
  const double gbytes = sweep.request.gpu_memory_gbytes;
  context.memory = fixed("%g GB/GPU", gbytes);
  context.memory_source =
      gbytes == kDefaultGpuMemoryGbytes ? "default --gpu-memory-gbytes" : "--gpu-memory-gbytes";
  context.gpu_memory_bytes = sweep.gpu_memory_bytes;
  context.nothing_fits_remedy = nothing_fits_remedy(sweep);
  context.split_words = split_words(sweep.split_check);
  return context;
}

// What the simulated time includes, under the step table.
std::string assumption_words(const SweepResult& sweep) {
  const Sweep& request = sweep.request;
  const Topology& t = sweep.base.topology;
  std::string words = "simulated time includes modelled communication (";
  words += request.transport_path.empty()
               ? fixed("NVLink %.0f GB/s", t.nvlink.bytes_per_second / 1e9) +
                     fixed(" ODC / %.0f GB/s NCCL", t.nvlink_collective.bytes_per_second / 1e9)
               : "NVLink from " + request.transport_path;
  words += ", " + std::to_string(t.gpus_per_node) + " GPUs per node" +
           fixed(", network %.0f Gb/s per GPU", t.network.bytes_per_second * 8 / 1e9) +
           "; validated against runs on one node only) and the optimizer\n";
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
           "count\n";
  } else {
    out +=
        "seconds per minibatch (step) and its parts per rank: compute, exposed communication, "
        "idle (waiting for other ranks), optimizer; speedup against collective + lb-micro at "
        "the same rank count\n";
  }
  // Said where it applies, so that the rows above read right; tables without them are unchanged.
  const Sweep& request = sweep.request;
  if (!request.rank_slowdown.empty()) {
    std::string ranks;
    for (const auto& [rank, factor] : request.rank_slowdown) {
      char text[64];
      std::snprintf(text, sizeof(text), "%s%lld %gx", ranks.empty() ? "" : ", ",
                    static_cast<long long>(rank), factor);
      ranks += text;
    }
    out +=
        "unplanned slowdown (--rank-slowdown, every arm; the plans assume planned speeds): rank " +
        ranks + " slower\n";
  }
  if (request.steal) {
    out +=
        "+steal: the same plan under odc with work stealing (a rank out of microbatches takes the "
        "tail of the queue with the most predicted work left; docs/planner.md, \"Work "
        "stealing\")\n";
  }
  return out + assumption_words(sweep) + "\n";
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

DecisionText sweep_decision(const SweepResult& sweep) {
  return decision_text(decide(decision_arms(sweep)), decision_context(sweep));
}

std::string sweep_to_json(const SweepResult& sweep) {
  nlohmann::ordered_json root;
  json_settings(sweep, root);
  root["baseline"] = "collective + lb-micro at the same rank count";
  root["decision"] = decision_json(decide(decision_arms(sweep)), decision_context(sweep));
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
  const DecisionText decision = sweep_decision(sweep);
  return step_table(sweep) + memory_table(sweep) + decision.line + "\n" + decision.reason + "\n";
}

}  // namespace odc::simulate
