// The sweep of `odc simulate` (sweep.h): the request checked and resolved into SimulateOptions,
// then per rank count one plan per (policy, split) shared by every mode, one simulation per arm,
// the speedups against collective + lb-micro, the split check and the memory table.
#include "simulate/sweep.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "planner/plan_io.h"

namespace odc::simulate {
namespace {

// Samples one rank count draws and plans (ranks x samples per rank x minibatches): a plan costs
// ~100 bytes per sample, so this is ~7 GB of memory.
constexpr int64_t kMaxSimulatedSamples = int64_t{1} << 26;

// Cost models fitted by odc.train on 4 H200s (docs/benchmarks-archive.md), per preset.
const char* default_cost(const std::string& model) {
  if (model == "1.5b") return "3.12326e-05,1.18741e-09,0.0708187";
  if (model == "7b") return "1.09574e-04,2.71302e-09,0.103279";
  return nullptr;
}

std::string join(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "" : ",") + name;
  return text;
}

Status check_task(const Sweep& request) {
  if (request.task != Task::kGrpo) return Status::Ok();
  // As odc.train --task grpo refuses them.
  if (request.split != planner::SplitMode::kOff) {
    return Status::InvalidArgument("--task grpo does not split samples yet: drop --split");
  }
  if (request.minibatches_per_step < 1) {
    return Status::InvalidArgument("--minibatches-per-step must be >= 1, got " +
                                   std::to_string(request.minibatches_per_step));
  }
  return Status::Ok();
}

bool custom_model(const Sweep& request) {
  return request.layers || request.layer_params || request.other_params;
}

// The model and its cost: a preset and its fit, or a custom shape with its --cost.
Status resolve_model(const Sweep& request, SimulateOptions& base) {
  const bool custom = custom_model(request);
  if (custom) {
    if (!request.layers || !request.layer_params || !request.other_params) {
      return Status::InvalidArgument(
          "a custom model needs all of --layers, --layer-params and --other-params");
    }
    base.model = ModelShape{*request.layers, *request.layer_params, *request.other_params};
  } else {
    auto preset = model_preset(request.model);
    if (!preset.ok()) return preset.status();
    base.model = preset.value();
  }
  if (request.cost) {
    base.plan.cost = *request.cost;
  } else {
    const char* fitted = custom ? nullptr : default_cost(request.model);
    if (!fitted) return Status::InvalidArgument("a custom model needs --cost A,B,C (seconds)");
    auto cost = planner::parse_cost(fitted);
    if (!cost.ok()) return cost.status();
    base.plan.cost = cost.value();
  }
  // The presets' costs were fitted by odc.train under FSDP2 on 4 GPUs of one node.
  base.cost_calibration_ranks =
      request.cost_calibrated_on ? *request.cost_calibrated_on : (request.cost ? 0 : 4);
  return Status::Ok();
}

// Split and rank speeds. Rank speeds name each rank, so they fit exactly one rank count.
Status resolve_split_and_speed(const Sweep& request, SimulateOptions& base) {
  base.plan.split = request.split;
  if (!(request.split_exchange >= 0) || !std::isfinite(request.split_exchange)) {
    return Status::InvalidArgument("--split-exchange must be a finite number >= 0");
  }
  base.plan.split_exchange = request.split_exchange;
  if (request.rank_speed.empty()) return Status::Ok();
  const auto count = static_cast<int64_t>(request.rank_speed.size());
  if (request.ranks.size() != 1 || request.ranks.front() != count) {
    return Status::InvalidArgument("--rank-speed gives " + std::to_string(count) +
                                   " speeds, one per rank: simulate one rank count with --ranks " +
                                   std::to_string(count));
  }
  base.plan.rank_speed = request.rank_speed;
  return Status::Ok();
}

std::string slowdown_text(const std::pair<int64_t, double>& slowdown) {
  std::ostringstream text;
  text << slowdown.first << ":" << slowdown.second;
  return text.str();
}

// --rank-slowdown RANK:FACTOR names a rank of every rank count, once, with a factor > 0.
Status check_rank_slowdown(const Sweep& request) {
  const int64_t fewest =
      request.ranks.empty() ? 0 : *std::min_element(request.ranks.begin(), request.ranks.end());
  std::vector<int64_t> seen;
  for (const auto& slowdown : request.rank_slowdown) {
    const auto& [rank, factor] = slowdown;
    if (rank < 0 || rank >= fewest) {
      return Status::InvalidArgument(
          "--rank-slowdown " + slowdown_text(slowdown) + ": rank " + std::to_string(rank) +
          " does not exist with --ranks " + std::to_string(fewest) + " (ranks 0 to " +
          std::to_string(fewest - 1) + "): name a rank below every rank count");
    }
    if (!(factor > 0) || !std::isfinite(factor)) {
      return Status::InvalidArgument("--rank-slowdown " + slowdown_text(slowdown) +
                                     ": the factor must be a finite number > 0 (1.3: 1.3x slower)");
    }
    if (std::find(seen.begin(), seen.end(), rank) != seen.end()) {
      return Status::InvalidArgument("--rank-slowdown names rank " + std::to_string(rank) +
                                     " twice: give one factor per rank");
    }
    seen.push_back(rank);
  }
  return Status::Ok();
}

// Checked before any allocation: N x samples per rank x minibatches samples are drawn and planned
// per rank count, and an overflowed product would turn into a negative minibatch.
Status check_sizes(const Sweep& request) {
  const int64_t per_rank = request.samples.samples_per_rank;
  if (per_rank < 1 || request.minibatches < 1) {
    return Status::InvalidArgument("--samples-per-rank and --minibatches must be >= 1");
  }
  for (int64_t num_ranks : request.ranks) {
    if (num_ranks < 1) {
      return Status::InvalidArgument("--ranks: '" + std::to_string(num_ranks) +
                                     "' is not a positive integer");
    }
    // Checked for overflow below; an RL step of N x K rollouts splits into equal updates.
    int64_t step = 0;
    if (request.task == Task::kGrpo && !__builtin_mul_overflow(num_ranks, per_rank, &step) &&
        step % request.minibatches_per_step != 0) {
      return Status::InvalidArgument(
          "--task grpo: an RL step of --ranks " + std::to_string(num_ranks) +
          " x --samples-per-rank " + std::to_string(per_rank) + " = " + std::to_string(step) +
          " rollouts does not split into --minibatches-per-step " +
          std::to_string(request.minibatches_per_step) + " equal update minibatches");
    }
  }
  for (int64_t num_ranks : request.ranks) {
    if (num_ranks > planner::kMaxRanks) {
      return Status::InvalidArgument("--ranks: " + std::to_string(num_ranks) + " is above " +
                                     std::to_string(planner::kMaxRanks));
    }
    int64_t per_minibatch = 0, total = 0;
    if (__builtin_mul_overflow(num_ranks, per_rank, &per_minibatch) ||
        __builtin_mul_overflow(per_minibatch, request.minibatches, &total) ||
        total > kMaxSimulatedSamples) {
      return Status::InvalidArgument("--ranks " + std::to_string(num_ranks) +
                                     " x --samples-per-rank " + std::to_string(per_rank) +
                                     " x --minibatches " + std::to_string(request.minibatches) +
                                     " is more than " + std::to_string(kMaxSimulatedSamples) +
                                     " samples, the most simulated per rank count");
    }
  }
  return Status::Ok();
}

Status check_ranges(const Sweep& request) {
  if (custom_model(request) && (*request.layers < 1 || *request.layers > kMaxLayers)) {
    return Status::InvalidArgument("--layers must be 1 to " + std::to_string(kMaxLayers) +
                                   ", got " + std::to_string(*request.layers));
  }
  if (request.cost_calibrated_on &&
      (*request.cost_calibrated_on < 0 || *request.cost_calibrated_on > kMaxCalibrationRanks)) {
    return Status::InvalidArgument("--cost-calibrated-on must be 0 to " +
                                   std::to_string(kMaxCalibrationRanks) +
                                   " (the GPUs of one node the cost was fitted on), got " +
                                   std::to_string(*request.cost_calibrated_on));
  }
  if (request.gpus_per_node < 1) return Status::InvalidArgument("--gpus-per-node must be >= 1");
  if (!(request.gpu_memory_gbytes > 0) || !std::isfinite(request.gpu_memory_gbytes)) {
    return Status::InvalidArgument("--gpu-memory-gbytes must be a number > 0");
  }
  return Status::Ok();
}

Status resolve_topology(const Sweep& request, Topology& t) {
  t.gpus_per_node = request.gpus_per_node;
  t.nvlink = Link{request.nvlink_gbytes * 1e9, request.nvlink_latency_us * 1e-6};
  t.nvlink_collective =
      Link{request.nvlink_collective_gbytes * 1e9, request.nvlink_latency_us * 1e-6};
  t.network = Link{request.network_gbits * 1e9 / 8, request.network_latency_us * 1e-6};
  if (!request.transport_path.empty()) {
    auto curves = read_transport_curves(request.transport_path);
    if (!curves.ok()) return curves.status();
    t.curves = std::move(curves).value();
  }
  return Status::Ok();
}

// Checks the request and resolves what every arm shares; `source` gets the selected lengths.
Status resolve(const Sweep& request, SimulateOptions& base, std::vector<int64_t>& source) {
  ODC_RETURN_IF_ERROR(check_task(request));
  ODC_RETURN_IF_ERROR(resolve_model(request, base));
  if (request.ranks.empty()) return Status::InvalidArgument("--ranks is empty");
  if (request.policies.empty() || request.modes.empty()) {
    return Status::InvalidArgument("--policies and --modes need at least one entry each");
  }
  ODC_RETURN_IF_ERROR(resolve_split_and_speed(request, base));
  ODC_RETURN_IF_ERROR(check_sizes(request));
  ODC_RETURN_IF_ERROR(check_rank_slowdown(request));
  ODC_RETURN_IF_ERROR(check_ranges(request));
  ODC_RETURN_IF_ERROR(resolve_topology(request, base.topology));
  base.forward_fraction = request.forward_fraction;
  auto read = read_samples(request.samples);
  if (!read.ok()) return read.status();
  base.plan.max_tokens = read.value().max_tokens;
  source = std::move(read).value().lengths;
  base.plan.minibatch_size = request.samples.samples_per_rank;  // times ranks, per rank count
  base.plan.microbatch_memory = request.microbatch_memory;
  return Status::Ok();
}

struct Arm {
  PolicyChoice policy;
  planner::SplitMode split = planner::SplitMode::kOff;
  bool steal = false;  // ODC modes only
};

// Every policy unsplit, then, with split auto, the policies that can split (lb-micro, lb-mini)
// split, in odc compare's order; with steal, each unpadded one of those again with stealing.
std::vector<Arm> sweep_arms(const Sweep& request) {
  std::vector<Arm> arms;
  for (auto policy : request.policies) arms.push_back({policy, planner::SplitMode::kOff});
  if (request.split == planner::SplitMode::kAuto) {
    for (auto policy : request.policies) {
      if (policy.policy != planner::Policy::kLocalSort && !policy.padded) {
        arms.push_back({policy, request.split});
      }
    }
  }
  if (request.steal) {
    const size_t unstolen = arms.size();
    for (size_t i = 0; i < unstolen; ++i) {
      if (!arms[i].policy.padded) arms.push_back({arms[i].policy, arms[i].split, true});
    }
  }
  return arms;
}

// One rank count's plans and rows.
struct RankCount {
  const Sweep& request;
  SimulateOptions options;  // the base, with this rank count's plan options
  std::vector<int64_t> lengths;
  // Plans by (planner policy, split): lb-mini-padded pads LB-Mini's plan (simulate_plan does, per
  // mode), so the two share one plan (LB-Mini's partition dominates the time at 1,024).
  std::vector<std::pair<std::pair<planner::Policy, planner::SplitMode>, GrpoPlans>> plans;
  double baseline = 0.0;  // collective + lb-micro's seconds; 0 where it was not simulated
  double baseline_planner = 0.0;

  bool grpo() const { return request.task == Task::kGrpo; }
  Result<const GrpoPlans*> plans_for(const Arm& arm);
  Status simulate_arm(const Arm& arm, std::vector<SweepRow>& rows);
  void split_check(const std::vector<SweepRow>& rows, size_t first, SplitCheck& best);
};

Result<const GrpoPlans*> RankCount::plans_for(const Arm& arm) {
  const std::pair<planner::Policy, planner::SplitMode> key{arm.policy.policy, arm.split};
  auto cached = std::find_if(plans.begin(), plans.end(),
                             [&](const auto& entry) { return entry.first == key; });
  if (cached != plans.end()) return &cached->second;
  GrpoPlans made;
  if (grpo()) {
    options.mode = Mode::kOdcFlat;  // any mode that can run the policy, for validation
    auto made_plans = make_grpo_plans(lengths, options, request.minibatches_per_step);
    if (!made_plans.ok()) return made_plans.status();
    made = std::move(made_plans).value();
  } else {
    auto plan = planner::make_plan(lengths, options.plan);
    if (!plan.ok()) return plan.status();
    made.update = std::move(plan).value();
  }
  plans.emplace_back(key, std::move(made));
  return &plans.back().second;
}

Status RankCount::simulate_arm(const Arm& arm, std::vector<SweepRow>& rows) {
  const PolicyChoice& choice = arm.policy;
  const planner::SplitMode split_mode = arm.split;
  options.plan.policy = choice.policy;
  options.plan.split = split_mode;
  options.pad_to_equal_counts = choice.padded;
  options.steal = arm.steal;
  auto found = plans_for(arm);
  if (!found.ok()) return found.status();
  const GrpoPlans& made = *found.value();
  const std::string label = policy_label(choice) +
                            (split_mode == planner::SplitMode::kAuto ? "+split" : "") +
                            (arm.steal ? "+steal" : "");
  for (auto mode : request.modes) {
    if (arm.steal && !is_odc(mode)) continue;  // only ODC's ranks may run any microbatch
    // Lockstep modes cannot run lb-mini's unequal counts; padding buys the others nothing (they
    // run unequal counts), so lb-mini-padded is simulated where it is needed only.
    if (lockstep(mode) ? choice.policy == planner::Policy::kLbMini && !choice.padded
                       : choice.padded) {
      continue;
    }
    options.mode = mode;
    SweepRow row;
    row.ranks = options.plan.num_ranks;
    row.policy = label;
    row.mode = std::string(mode_name(mode));
    if (grpo()) {
      auto result = simulate_grpo_plans(made, lengths, options, request.minibatches_per_step);
      if (!result.ok()) return result.status();
      row.result = result.value().rl_step;
      row.forward_phase = result.value().forward_phase;
      row.update = result.value().update;
    } else {
      auto result = simulate_plan(made.update, lengths, options);
      if (!result.ok()) return result.status();
      row.result = std::move(result).value();
    }
    if (mode == Mode::kCollective && choice.policy == planner::Policy::kLbMicro &&
        split_mode == planner::SplitMode::kOff && !arm.steal) {
      baseline = row.result.seconds;
      baseline_planner = row.result.planner_seconds;
    }
    rows.push_back(std::move(row));
  }
  return Status::Ok();
}

// The split check (odc compare's hint, simulated): the fastest ODC + lb-mini row again on
// lb-mini+split, where some minibatch splits at all. SFT only: GRPO does not split yet.
void RankCount::split_check(const std::vector<SweepRow>& rows, size_t first, SplitCheck& best) {
  const int64_t num_ranks = options.plan.num_ranks;
  if (request.split == planner::SplitMode::kAuto || grpo() || num_ranks > kSplitCheckMaxRanks) {
    return;
  }
  options.steal = false;  // lb-mini against lb-mini+split, both as planned
  const SweepRow* lb_mini = nullptr;
  for (size_t i = first; i < rows.size(); ++i) {
    if (rows[i].policy == "lb-mini" && is_odc(parse_mode(rows[i].mode).value()) &&
        (!lb_mini || rows[i].result.seconds < lb_mini->result.seconds)) {
      lb_mini = &rows[i];
    }
  }
  if (lb_mini == nullptr) return;
  options.pad_to_equal_counts = false;
  options.plan.policy = planner::Policy::kLbMini;
  options.plan.split = planner::SplitMode::kAuto;
  auto plan = planner::make_plan(lengths, options.plan);
  const bool splits =
      plan.ok() && std::any_of(plan.value().minibatches.begin(), plan.value().minibatches.end(),
                               [](const auto& minibatch) { return !minibatch.splits.empty(); });
  if (!splits) return;
  options.mode = parse_mode(lb_mini->mode).value();
  auto result = simulate_plan(plan.value(), lengths, options);
  if (!result.ok()) return;
  SplitCheck check{num_ranks, lb_mini->mode, lb_mini->result.seconds, result.value().seconds,
                   baseline};
  if (check.gain() > best.gain()) best = check;
}

// Every arm at one rank count, appended to `sweep.rows` with its speedups.
Status simulate_rank_count(const std::vector<int64_t>& source, int64_t num_ranks,
                           SweepResult& sweep) {
  const Sweep& request = sweep.request;
  // SFT: a minibatch of N x K samples; GRPO: an RL step of N x K rollouts.
  const int64_t per_minibatch = num_ranks * request.samples.samples_per_rank;
  RankCount count{
      request, sweep.base, resample_lengths(source, per_minibatch * request.minibatches, 0), {}};
  count.options.plan.num_ranks = num_ranks;
  count.options.plan.minibatch_size = per_minibatch;
  if (!request.rank_slowdown.empty()) {
    count.options.rank_slowdown.assign(static_cast<size_t>(num_ranks), 1.0);
    for (const auto& [rank, factor] : request.rank_slowdown) {
      count.options.rank_slowdown[static_cast<size_t>(rank)] = factor;
    }
  }
  std::vector<SweepRow>& rows = sweep.rows;
  const size_t first = rows.size();
  for (const Arm& arm : sweep_arms(request)) ODC_RETURN_IF_ERROR(count.simulate_arm(arm, rows));
  count.split_check(rows, first, sweep.split_check);
  for (size_t i = first; i < rows.size(); ++i) {
    if (count.baseline > 0) rows[i].speedup = count.baseline / rows[i].result.seconds;
    if (count.baseline_planner > 0 && rows[i].result.planner_seconds > 0) {
      rows[i].planner_speedup = count.baseline_planner / rows[i].result.planner_seconds;
    }
  }
  return Status::Ok();
}

std::string no_arm_message(const Sweep& request) {
  std::vector<std::string> modes, policies;
  for (Mode mode : request.modes) modes.emplace_back(mode_name(mode));
  for (const PolicyChoice& policy : request.policies) policies.push_back(policy_label(policy));
  return "no arm to simulate: lockstep modes (collective, fsdp2-deferred) cannot run lb-mini "
         "(use lb-mini-padded), and lb-mini-padded is simulated under those modes only; "
         "--modes " +
         join(modes) + " with --policies " + join(policies) + " leave nothing";
}

Result<SweepResult> sweep_or_error(const Sweep& request) {
  SweepResult sweep;
  sweep.request = request;
  std::vector<int64_t> source;
  ODC_RETURN_IF_ERROR(resolve(request, sweep.base, source));
  for (int64_t num_ranks : request.ranks) {
    ODC_RETURN_IF_ERROR(simulate_rank_count(source, num_ranks, sweep));
  }
  if (sweep.rows.empty()) return Status::InvalidArgument(no_arm_message(request));
  sweep.gpu_memory_bytes = request.gpu_memory_gbytes * 1e9;
  for (int64_t num_ranks : request.ranks) {
    for (Mode mode : request.modes) {
      MemoryRow row{
          num_ranks, mode,
          memory_per_gpu(sweep.base.model, mode, num_ranks, sweep.base.topology.gpus_per_node,
                         /*reference_model=*/request.task == Task::kGrpo)};
      row.fits = row.memory.total_bytes() <= sweep.gpu_memory_bytes;
      sweep.memory.push_back(row);
    }
  }
  return sweep;
}

}  // namespace

std::string_view task_name(Task task) {
  return task == Task::kGrpo ? "grpo" : "sft";
}

Result<Task> parse_task(std::string_view name) {
  if (name == "sft") return Task::kSft;
  if (name == "grpo") return Task::kGrpo;
  return Status::InvalidArgument("unknown task '" + std::string(name) + "': expected sft or grpo");
}

Result<Samples> read_samples(const SampleSelection& selection) {
  if (selection.samples_per_rank < 1) {
    return Status::InvalidArgument("--samples-per-rank must be >= 1, got " +
                                   std::to_string(selection.samples_per_rank));
  }
  if (selection.max_length && *selection.max_length < 1) {
    return Status::InvalidArgument("--max-length must be >= 1, got " +
                                   std::to_string(*selection.max_length));
  }
  std::vector<int64_t> all;
  if (selection.given_lengths) {
    all = *selection.given_lengths;
  } else {
    auto read = planner::read_lengths_file(selection.lengths_path);
    if (!read.ok()) return read.status();
    all = std::move(read).value();
  }
  Samples samples;
  for (size_t i = 0; i < all.size(); ++i) {
    if (selection.max_length && all[i] > *selection.max_length) continue;
    samples.lengths.push_back(all[i]);
    samples.file_index.push_back(static_cast<int64_t>(i));
  }
  if (samples.lengths.empty()) {
    return Status::InvalidArgument(all.empty() ? "empty input: no sample lengths given"
                                               : "no sample is within --max-length");
  }
  samples.max_tokens = selection.max_tokens
                           ? *selection.max_tokens
                           : *std::max_element(samples.lengths.begin(), samples.lengths.end());
  return samples;
}

namespace {

// "a,b": {"a", "b"}; "": {}; "a,,b": {"a", "", "b"} (an empty name is refused by its parser).
std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) items.push_back(item);
  return items;
}

}  // namespace

Result<std::vector<PolicyChoice>> parse_policy_list(const std::string& text) {
  std::vector<PolicyChoice> policies;
  for (const auto& name : split_names(text)) {
    auto policy = parse_policy_choice(name);
    if (!policy.ok()) return policy.status();
    policies.push_back(policy.value());
  }
  return policies;
}

Result<std::vector<Mode>> parse_mode_list(const std::string& text) {
  std::vector<Mode> modes;
  for (const auto& name : split_names(text)) {
    auto mode = parse_mode(name);
    if (!mode.ok()) return mode.status();
    modes.push_back(mode.value());
  }
  return modes;
}

bool SweepResult::fits(const SweepRow& row) const {
  const Mode mode = parse_mode(row.mode).value();
  for (const MemoryRow& m : memory) {
    if (m.ranks == row.ranks && m.mode == mode) return m.fits;
  }
  return true;  // not in the table: nothing says it does not fit
}

Result<SweepResult> run_sweep(const Sweep& request) {
  // The sizes are bounded above; memory can still run out on a small machine: one line, not an
  // abort.
  const char* const kOutOfMemory =
      "out of memory (fewer --ranks, --samples-per-rank or --minibatches need less)";
  try {
    return sweep_or_error(request);
  } catch (const std::bad_alloc&) {
    return Status::InvalidArgument(kOutOfMemory);
  } catch (const std::length_error&) {
    return Status::InvalidArgument(kOutOfMemory);
  }
}

}  // namespace odc::simulate
