// `odc simulate`: for each rank count, every requested policy (and, with --split auto, its split
// variant) x mode is planned on the same lengths and simulated; speedup is against collective +
// lb-micro at the same rank count. Without --split auto a split check names where it would pay.
#include "simulate/simulate_cli.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <functional>
#include <new>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "planner/plan_io.h"
#include "simulate/simulate.h"

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

Result<std::vector<int64_t>> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      const long long value = std::stoll(item, &used);
      if (used != item.size() || value < 1) throw std::invalid_argument(item);
      values.push_back(value);
    } catch (const std::exception&) {
      return Status::InvalidArgument(what + ": '" + item + "' is not a positive integer");
    }
  }
  if (values.empty()) return Status::InvalidArgument(what + " is empty");
  return values;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) items.push_back(item);
  return items;
}

struct Row {
  int64_t ranks = 0;
  std::string policy, mode;
  SimulateResult result;  // --task grpo: per RL step (GrpoResult::rl_step)
  // --task grpo: one forward-only phase and the update minibatches (GrpoResult).
  SimulateResult forward_phase, update;
  double speedup = 0.0;  // baseline step time / this step time; 0 when there is no baseline
  // The same from the planner's times alone (compute only: odc compare's basis).
  double planner_speedup = 0.0;
  std::string label() const { return mode + " + " + policy; }
};

// The verdict's label for a rank count where no simulated arm fits the GPU's memory.
constexpr const char* kNothingFits = "nothing that fits";

// Whether a row's layout keeps its state within the GPU's memory (the memory table's "fits?"):
// verdicts name only arms that fit, however fast the others are.
using FitsMemory = std::function<bool(const Row&)>;

// At one rank count, the strongest baseline arm (the fastest FSDP2 arm that fits: collective,
// fsdp2-deferred, fsdp2-unsharded, any policy) and ODC's fastest arm that fits (odc,
// odc-hybrid); indices into the rows, kNone where no such arm was simulated or none fits.
constexpr size_t kNone = static_cast<size_t>(-1);
struct Strongest {
  int64_t ranks = 0;
  size_t baseline = kNone, odc = kNone;
  double odc_speedup(const std::vector<Row>& rows) const {
    return rows[baseline].result.seconds / rows[odc].result.seconds;
  }
};

std::vector<Strongest> strongest_arms(const std::vector<Row>& rows, const FitsMemory& fits) {
  std::vector<Strongest> found;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (found.empty() || found.back().ranks != rows[i].ranks) found.push_back({rows[i].ranks});
    if (!fits(rows[i])) continue;
    const bool odc = is_odc(parse_mode(rows[i].mode).value());
    size_t& best = odc ? found.back().odc : found.back().baseline;
    if (best == kNone || rows[i].result.seconds < rows[best].result.seconds) best = i;
  }
  return found;
}

// "a at 8-16 GPUs, b at 64 GPUs": labels per rank count (ascending), runs of one label merged.
std::string labels_by_ranks(const std::vector<std::pair<int64_t, std::string>>& labels) {
  std::string text;
  for (size_t i = 0; i < labels.size();) {
    size_t j = i;
    while (j + 1 < labels.size() && labels[j + 1].second == labels[i].second) ++j;
    text += (i ? ", " : "") + labels[i].second + " at " + std::to_string(labels[i].first) +
            (j != i ? "-" + std::to_string(labels[j].first) : std::string()) + " GPUs";
    i = j + 1;
  }
  return text;
}

// "8" or "8-64": the rank counts of per-rank-count entries (ascending).
std::string rank_span(const std::vector<std::pair<int64_t, std::string>>& entries) {
  std::string span = std::to_string(entries.front().first);
  if (entries.back().first != entries.front().first) {
    span += "-" + std::to_string(entries.back().first);
  }
  return span;
}

// The split check of a sweep run without --split auto: at each rank count the fastest ODC arm
// with lb-mini is simulated again on lb-mini+split; the rank count where that gains most is kept.
// The hint and the verdict name it where it is at least kSplitHintGain faster (odc compare's
// threshold for its own hint).
constexpr double kSplitHintGain = 1.05;
// The check plans lb-mini+split, whose search tries every group size for every outlier: on the
// development VM 2 s at 64 ranks x 20 minibatches of longalign_like.txt, 150 s at 256. So it runs
// at rank counts up to this one only (--split auto simulates any count, at that cost).
constexpr int64_t kSplitCheckMaxRanks = 64;

struct SplitCheck {
  int64_t ranks = 0;
  std::string mode;
  double without_seconds = 0.0, with_seconds = 0.0;  // per sweep (sums over minibatches)
  double baseline_seconds = 0.0;                     // 0: the baseline was not simulated
  double gain() const { return with_seconds > 0 ? without_seconds / with_seconds : 0.0; }
};

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

struct MemoryRow {
  int64_t ranks = 0;
  Mode mode = Mode::kCollective;
  MemoryPerGpu memory;
};

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

// The one verdict line of `odc simulate`: the fastest arm at each rank count, its speedup over
// the baseline, the compute-only speedup of the same arms (odc compare's basis, so the two tools'
// figures are told apart), and what else is in the simulated time with its assumptions.
std::string verdict_line(const std::vector<Row>& rows, const SimulateOptions& base,
                         const CliArgs& args, const SplitCheck& split_check,
                         const FitsMemory& fits) {
  // Per rank count, in rank order: the fastest arm that fits, and a faster one that does not.
  std::vector<std::pair<int64_t, std::string>> fastest, faster_unfit;
  double low = 0, high = 0, compute_low = 0, compute_high = 0;
  bool any_speedup = false;
  for (size_t i = 0; i < rows.size();) {
    size_t j = i, best = kNone, best_any = i;
    for (; j < rows.size() && rows[j].ranks == rows[i].ranks; ++j) {
      if (rows[j].result.seconds < rows[best_any].result.seconds) best_any = j;
      if (fits(rows[j]) && (best == kNone || rows[j].result.seconds < rows[best].result.seconds)) {
        best = j;
      }
    }
    if (best != best_any) faster_unfit.emplace_back(rows[best_any].ranks, rows[best_any].label());
    if (best == kNone) {
      fastest.emplace_back(rows[i].ranks, kNothingFits);
      i = j;
      continue;
    }
    const Row& row = rows[best];
    fastest.emplace_back(row.ranks, row.label());
    if (row.speedup > 0) {
      low = any_speedup ? std::min(low, row.speedup) : row.speedup;
      high = any_speedup ? std::max(high, row.speedup) : row.speedup;
      compute_low = any_speedup ? std::min(compute_low, row.planner_speedup) : row.planner_speedup;
      compute_high =
          any_speedup ? std::max(compute_high, row.planner_speedup) : row.planner_speedup;
      any_speedup = true;
    }
    i = j;
  }
  std::string line = "verdict: ";
  if (std::all_of(fastest.begin(), fastest.end(),
                  [](const auto& entry) { return entry.second == kNothingFits; })) {
    return line + "no arm's state fits a " + fixed("%.0f GB GPU", args.gpu_memory_gbytes) + " at " +
           rank_span(fastest) +
           " GPUs (memory table: more GPUs, a larger GPU or a smaller model); the fastest "
           "regardless: " +
           labels_by_ranks(faster_unfit);
  }
  const bool one_label = std::all_of(fastest.begin(), fastest.end(), [&](const auto& entry) {
    return entry.second == fastest.front().second;
  });
  if (one_label) {
    line += fastest.front().second + " is fastest at " + rank_span(fastest) + " GPUs";
  } else {
    line += "fastest: " + labels_by_ranks(fastest);
  }
  // The compute-only figure is the planner's on the minibatches simulated here, not on the whole
  // file as odc compare plans it: said so, so that the two are not read as one number.
  const bool grpo = args.task == "grpo";
  const std::string sample = std::to_string(args.minibatches) +
                             (grpo ? (args.minibatches == 1 ? " RL step" : " RL steps")
                                   : (args.minibatches == 1 ? " minibatch" : " minibatches"));
  if (any_speedup) {
    line += ", simulated speedup " + range(low, high, "%.2fx") +
            " over the baseline collective + lb-micro (compute only on the same " + sample +
            ", odc compare's basis: " + range(compute_low, compute_high, "%.2fx") +
            "; compare plans the whole file)";
  } else {
    line += " (no speedup: the baseline, collective + lb-micro, was not simulated)";
  }
  if (!faster_unfit.empty()) {
    line += fixed("; faster but its state does not fit a %.0f GB GPU: ", args.gpu_memory_gbytes) +
            labels_by_ranks(faster_unfit) + " (memory table)";
  }
  // Against the strongest arm a user could pick instead of ODC (docs/design.md, "Baselines").
  std::vector<std::pair<int64_t, std::string>> baselines, odc_arms;
  double odc_low = 0, odc_high = 0;
  for (const Strongest& s : strongest_arms(rows, fits)) {
    if (s.baseline == kNone || s.odc == kNone) continue;
    const double speedup = s.odc_speedup(rows);
    odc_low = baselines.empty() ? speedup : std::min(odc_low, speedup);
    odc_high = baselines.empty() ? speedup : std::max(odc_high, speedup);
    baselines.emplace_back(s.ranks, rows[s.baseline].label());
    odc_arms.emplace_back(s.ranks, rows[s.odc].label());
  }
  if (!baselines.empty()) {
    line += "; strongest baseline arm (the fastest FSDP2 arm that fits): " +
            labels_by_ranks(baselines) + ", ODC's speedup over it " +
            range(odc_low, odc_high, "%.2fx") + " (" + labels_by_ranks(odc_arms) + ")";
  }
  if (grpo) {
    line += "; per RL step: 2 forward-only phases and " +
            std::to_string(args.minibatches_per_step) + " update minibatches";
  }
  if (split_check.gain() >= kSplitHintGain) {
    line += split_check.baseline_seconds > 0
                ? fixed("; --split auto would give %.2fx",
                        split_check.baseline_seconds / split_check.with_seconds)
                : fixed("; --split auto would be %.2fx faster", split_check.gain());
    line += " (" + split_check.mode + " + lb-mini+split at " + std::to_string(split_check.ranks) +
            " GPUs: see the hint)";
  }
  const Topology& t = base.topology;
  line += "; includes modelled communication (";
  line += args.transport_path.empty()
              ? fixed("NVLink %.0f GB/s", t.nvlink.bytes_per_second / 1e9) +
                    fixed(" ODC / %.0f GB/s NCCL", t.nvlink_collective.bytes_per_second / 1e9)
              : "NVLink from " + args.transport_path;
  line += ", " + std::to_string(t.gpus_per_node) + " GPUs per node" +
          fixed(", network %.0f Gb/s per GPU", t.network.bytes_per_second * 8 / 1e9) +
          "; validated against runs on one node only) and the optimizer";
  return line;
}

// --split, --split-exchange and --rank-speed, checked before the lengths are read. Rank speeds
// name each rank, so they fit exactly one rank count.
Status build_split_and_speed(const CliArgs& args, const std::vector<int64_t>& ranks,
                             SimulateOptions& base) {
  auto split = planner::parse_split_mode(args.split);
  if (!split.ok()) return split.status();
  base.plan.split = split.value();
  if (!(args.split_exchange >= 0) || !std::isfinite(args.split_exchange)) {
    return Status::InvalidArgument("--split-exchange must be a finite number >= 0");
  }
  base.plan.split_exchange = args.split_exchange;
  if (args.rank_speed.empty()) return Status::Ok();
  auto speeds = planner::parse_rank_speed(args.rank_speed);
  if (!speeds.ok()) return speeds.status();
  const auto count = static_cast<int64_t>(speeds.value().size());
  if (ranks.size() != 1 || ranks.front() != count) {
    return Status::InvalidArgument("--rank-speed gives " + std::to_string(count) +
                                   " speeds, one per rank: simulate one rank count with --ranks " +
                                   std::to_string(count));
  }
  base.plan.rank_speed = std::move(speeds).value();
  return Status::Ok();
}

Status build(const CliArgs& args, SimulateOptions& base, std::vector<int64_t>& source,
             std::vector<int64_t>& ranks, std::vector<PolicyChoice>& policies,
             std::vector<Mode>& modes) {
  if (args.format != "table" && args.format != "json") {
    return Status::InvalidArgument("unknown format '" + args.format + "': expected table or json");
  }
  if (args.task != "sft" && args.task != "grpo") {
    return Status::InvalidArgument("unknown task '" + args.task + "': expected sft or grpo");
  }
  if (args.task == "grpo") {
    // As odc.train --task grpo refuses them.
    if (args.split != "off") {
      return Status::InvalidArgument("--task grpo does not split samples yet: drop --split");
    }
    if (args.minibatches_per_step < 1) {
      return Status::InvalidArgument("--minibatches-per-step must be >= 1, got " +
                                     std::to_string(args.minibatches_per_step));
    }
  }
  const bool custom = args.layers || args.layer_params || args.other_params;
  if (custom) {
    if (!args.layers || !args.layer_params || !args.other_params) {
      return Status::InvalidArgument(
          "a custom model needs all of --layers, --layer-params and --other-params");
    }
    base.model = ModelShape{*args.layers, *args.layer_params, *args.other_params};
  } else {
    auto preset = model_preset(args.model);
    if (!preset.ok()) return preset.status();
    base.model = preset.value();
  }
  std::string cost_text = args.cost;
  if (cost_text.empty()) {
    const char* fitted = custom ? nullptr : default_cost(args.model);
    if (!fitted) return Status::InvalidArgument("a custom model needs --cost A,B,C (seconds)");
    cost_text = fitted;
  }
  // The presets' costs were fitted by odc.train under FSDP2 on 4 GPUs of one node.
  base.cost_calibration_ranks =
      args.cost_calibrated_on ? *args.cost_calibrated_on : (args.cost.empty() ? 4 : 0);
  auto cost = planner::parse_cost(cost_text);
  if (!cost.ok()) return cost.status();
  base.plan.cost = cost.value();
  auto rank_list = parse_int_list(args.ranks, "--ranks");
  if (!rank_list.ok()) return rank_list.status();
  ranks = rank_list.value();
  for (const auto& name : split(args.policies)) {
    auto policy = parse_policy_choice(name);
    if (!policy.ok()) return policy.status();
    policies.push_back(policy.value());
  }
  for (const auto& name : split(args.modes)) {
    auto mode = parse_mode(name);
    if (!mode.ok()) return mode.status();
    modes.push_back(mode.value());
  }
  if (policies.empty() || modes.empty()) {
    return Status::InvalidArgument("--policies and --modes need at least one entry each");
  }
  ODC_RETURN_IF_ERROR(build_split_and_speed(args, ranks, base));
  if (args.samples.samples_per_rank < 1 || args.minibatches < 1) {
    return Status::InvalidArgument("--samples-per-rank and --minibatches must be >= 1");
  }
  if (args.task == "grpo") {
    for (int64_t num_ranks : ranks) {
      // Checked for overflow below; an RL step of N x K rollouts splits into equal updates.
      int64_t step = 0;
      if (!__builtin_mul_overflow(num_ranks, args.samples.samples_per_rank, &step) &&
          step % args.minibatches_per_step != 0) {
        return Status::InvalidArgument(
            "--task grpo: an RL step of --ranks " + std::to_string(num_ranks) +
            " x --samples-per-rank " + std::to_string(args.samples.samples_per_rank) + " = " +
            std::to_string(step) + " rollouts does not split into --minibatches-per-step " +
            std::to_string(args.minibatches_per_step) + " equal update minibatches");
      }
    }
  }
  // Checked before any allocation: N x samples per rank x minibatches samples are drawn and
  // planned per rank count, and an overflowed product would turn into a negative minibatch.
  for (int64_t num_ranks : ranks) {
    if (num_ranks > planner::kMaxRanks) {
      return Status::InvalidArgument("--ranks: " + std::to_string(num_ranks) + " is above " +
                                     std::to_string(planner::kMaxRanks));
    }
    int64_t per_minibatch = 0, total = 0;
    if (__builtin_mul_overflow(num_ranks, args.samples.samples_per_rank, &per_minibatch) ||
        __builtin_mul_overflow(per_minibatch, args.minibatches, &total) ||
        total > kMaxSimulatedSamples) {
      return Status::InvalidArgument(
          "--ranks " + std::to_string(num_ranks) + " x --samples-per-rank " +
          std::to_string(args.samples.samples_per_rank) + " x --minibatches " +
          std::to_string(args.minibatches) + " is more than " +
          std::to_string(kMaxSimulatedSamples) + " samples, the most simulated per rank count");
    }
  }
  if (custom && (*args.layers < 1 || *args.layers > kMaxLayers)) {
    return Status::InvalidArgument("--layers must be 1 to " + std::to_string(kMaxLayers) +
                                   ", got " + std::to_string(*args.layers));
  }
  if (args.cost_calibrated_on &&
      (*args.cost_calibrated_on < 0 || *args.cost_calibrated_on > kMaxCalibrationRanks)) {
    return Status::InvalidArgument("--cost-calibrated-on must be 0 to " +
                                   std::to_string(kMaxCalibrationRanks) +
                                   " (the GPUs of one node the cost was fitted on), got " +
                                   std::to_string(*args.cost_calibrated_on));
  }
  if (args.gpus_per_node < 1) return Status::InvalidArgument("--gpus-per-node must be >= 1");
  if (!(args.gpu_memory_gbytes > 0) || !std::isfinite(args.gpu_memory_gbytes)) {
    return Status::InvalidArgument("--gpu-memory-gbytes must be a number > 0");
  }
  Topology& t = base.topology;
  t.gpus_per_node = args.gpus_per_node;
  t.nvlink = Link{args.nvlink_gbytes * 1e9, args.nvlink_latency_us * 1e-6};
  t.nvlink_collective = Link{args.nvlink_collective_gbytes * 1e9, args.nvlink_latency_us * 1e-6};
  t.network = Link{args.network_gbits * 1e9 / 8, args.network_latency_us * 1e-6};
  base.forward_fraction = args.forward_fraction;
  if (!args.transport_path.empty()) {
    auto curves = read_transport_curves(args.transport_path);
    if (!curves.ok()) return curves.status();
    t.curves = std::move(curves).value();
  }
  auto read = read_samples(args.samples);
  if (!read.ok()) return read.status();
  base.plan.max_tokens = read.value().max_tokens;
  source = std::move(read).value().lengths;
  base.plan.minibatch_size = args.samples.samples_per_rank;  // times ranks, set per rank count
  auto memory = planner::parse_microbatch_memory(args.microbatch_memory);
  if (!memory.ok()) return memory.status();
  base.plan.microbatch_memory = memory.value();
  return Status::Ok();
}

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * fraction);
  return text;
}

}  // namespace

CLI::Validator int64_range() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const char* begin = text.data();
        const char* end = begin + text.size();
        if (begin != end && *begin == '+') ++begin;
        int64_t value = 0;
        if (std::from_chars(begin, end, value).ec == std::errc::result_out_of_range) {
          return "'" + text + "' is out of range: integers here lie within +-" +
                 std::to_string(INT64_MAX);
        }
        return "";  // anything else is CLI11's to convert or refuse
      },
      "");
}

void add_sample_options(CLI::App& command, SampleArgs& args, bool deprecated_minibatch_size) {
  command
      .add_option("--lengths", args.lengths_path,
                  "file with one sample length (tokens) per line; '-' reads stdin")
      ->required();
  CLI::Option* per_rank =
      command
          .add_option("--samples-per-rank", args.samples_per_rank,
                      "samples per rank per minibatch: a minibatch is ranks x this many "
                      "consecutive samples")
          ->capture_default_str()
          ->check(int64_range());
  if (deprecated_minibatch_size) {
    command
        .add_option("--minibatch-size", args.minibatch_size,
                    "deprecated: samples per minibatch (use --samples-per-rank)")
        ->excludes(per_rank)
        ->check(int64_range());
  }
  command
      .add_option("--max-tokens", args.max_tokens,
                  "token cap per microbatch (default: the longest sample)")
      ->check(int64_range());
  command.add_option("--max-length", args.max_length, "drop samples longer than this")
      ->check(int64_range());
}

Result<Samples> read_samples(const SampleArgs& args) {
  if (args.samples_per_rank < 1) {
    return Status::InvalidArgument("--samples-per-rank must be >= 1, got " +
                                   std::to_string(args.samples_per_rank));
  }
  if (args.max_length && *args.max_length < 1) {
    return Status::InvalidArgument("--max-length must be >= 1, got " +
                                   std::to_string(*args.max_length));
  }
  std::vector<int64_t> all;
  if (args.given_lengths) {
    all = *args.given_lengths;
  } else {
    auto read = planner::read_lengths_file(args.lengths_path);
    if (!read.ok()) return read.status();
    all = std::move(read).value();
  }
  Samples samples;
  for (size_t i = 0; i < all.size(); ++i) {
    if (args.max_length && all[i] > *args.max_length) continue;
    samples.lengths.push_back(all[i]);
    samples.file_index.push_back(static_cast<int64_t>(i));
  }
  if (samples.lengths.empty()) {
    return Status::InvalidArgument(all.empty() ? "empty input: no sample lengths given"
                                               : "no sample is within --max-length");
  }
  samples.max_tokens = args.max_tokens
                           ? *args.max_tokens
                           : *std::max_element(samples.lengths.begin(), samples.lengths.end());
  return samples;
}

void add_cli_options(CLI::App& command, CliArgs& args) {
  add_sample_options(command, args.samples, /*deprecated_minibatch_size=*/false);
  command.add_option("--model", args.model, "model preset: 1.5b or 7b")->capture_default_str();
  command.add_option("--layers", args.layers, "custom model: transformer layers");
  command.add_option("--layer-params", args.layer_params, "custom model: parameters per layer");
  command.add_option("--other-params", args.other_params,
                     "custom model: parameters outside the layers (embeddings, head)");
  command.add_option("--cost", args.cost,
                     "microbatch cost in seconds, C + sum(A*L + B*L^2), as A,B,C, or A,B,C,F with "
                     "a floor F per microbatch (default: the preset's fit on H200, from "
                     "odc.train)");
  command.add_option("--cost-calibrated-on", args.cost_calibrated_on,
                     "GPUs of one node the cost was fitted on under FSDP2 (odc.train's fit): its "
                     "exposed collective time is removed from the cost (default: 4 with the "
                     "preset's cost, else 0 = the cost is compute alone)");
  command.add_option("--ranks", args.ranks, "rank counts, comma-separated")->capture_default_str();
  command
      .add_option("--minibatches", args.minibatches,
                  "minibatches per configuration (the file is repeated, reshuffled, when it "
                  "has too few samples)")
      ->capture_default_str();
  command
      .add_option("--policies", args.policies,
                  "local-sort, lb-micro, lb-mini, lb-mini-padded (LB-Mini padded to equal "
                  "microbatch counts with empty microbatches), comma-separated")
      ->capture_default_str();
  command
      .add_option("--microbatch-memory", args.microbatch_memory,
                  "lb-mini's microbatch bound: lb-micro (no larger than lb-micro's) or cap")
      ->capture_default_str();
  command
      .add_option("--modes", args.modes,
                  "collective, fsdp2-deferred, fsdp2-unsharded, odc, odc-hybrid, comma-separated")
      ->capture_default_str();
  command
      .add_option("--task", args.task,
                  "sft, or grpo: GRPO's training phase, per RL step of ranks x samples-per-rank "
                  "rollouts two forward-only minibatches (old and reference log-probs) and "
                  "--minibatches-per-step updates; --minibatches then counts RL steps")
      ->capture_default_str();
  command
      .add_option("--minibatches-per-step", args.minibatches_per_step,
                  "--task grpo: update minibatches per RL step")
      ->capture_default_str();
  command
      .add_option("--split", args.split,
                  "auto: also simulate lb-micro+split and lb-mini+split (a sample above the "
                  "minibatch's per-rank share runs on a group of ranks); off")
      ->capture_default_str();
  command
      .add_option("--split-exchange", args.split_exchange,
                  "K/V exchange cost of a split chunk per token received, as a fraction of A")
      ->capture_default_str();
  command.add_option("--rank-speed", args.rank_speed,
                     "relative speed of each rank, S0,S1,... (default: all equal; one rank count "
                     "in --ranks, with as many ranks)");
  command.add_option("--gpus-per-node", args.gpus_per_node)->capture_default_str();
  command
      .add_option("--nvlink-gbytes", args.nvlink_gbytes,
                  "ODC pull/push bandwidth per GPU within a node, GB/s")
      ->capture_default_str();
  command
      .add_option("--nvlink-collective-gbytes", args.nvlink_collective_gbytes,
                  "NCCL all-gather / reduce-scatter bus bandwidth within a node, GB/s")
      ->capture_default_str();
  command.add_option("--network-gbits", args.network_gbits, "NIC bandwidth per GPU, Gb/s")
      ->capture_default_str();
  command.add_option("--nvlink-latency-us", args.nvlink_latency_us)->capture_default_str();
  command.add_option("--network-latency-us", args.network_latency_us)->capture_default_str();
  command
      .add_option("--forward-fraction", args.forward_fraction,
                  "share of a microbatch's cost in the forward pass, and what a forward-only "
                  "microbatch costs (--task grpo): 1/4 with activation checkpointing (odc.train "
                  "on GPUs), 1/3 without")
      ->capture_default_str();
  command.add_option("--transport", args.transport_path,
                     "measured curves within a node (JSON; python -m odc.simulate --curves "
                     "converts odc_bench output): they replace the NVLink constants");
  command
      .add_option("--gpu-memory-gbytes", args.gpu_memory_gbytes,
                  "GPU memory, GB: the memory table says whether each layout's state fits")
      ->capture_default_str();
  command.add_option("--format", args.format, "table or json")->capture_default_str();
  for (const char* name : {"--layers", "--cost-calibrated-on", "--minibatches", "--gpus-per-node",
                           "--minibatches-per-step"}) {
    command.get_option(name)->check(int64_range());
  }
}

namespace {

int run_sweep(const CliArgs& args, std::ostream& out, std::string& error, std::string* document) {
  SimulateOptions base;
  std::vector<int64_t> source, ranks;
  std::vector<PolicyChoice> policies;
  std::vector<Mode> modes;
  if (Status status = build(args, base, source, ranks, policies, modes); !status.ok()) {
    error = status.message();
    return 2;
  }
  const bool grpo = args.task == "grpo";
  // The arms: every policy unsplit, then, with --split auto, the policies that can split
  // (lb-micro, lb-mini) split, in odc compare's order.
  const bool split_auto = base.plan.split == planner::SplitMode::kAuto;
  std::vector<std::pair<PolicyChoice, planner::SplitMode>> arms;
  for (auto policy : policies) arms.emplace_back(policy, planner::SplitMode::kOff);
  if (split_auto) {
    for (auto policy : policies) {
      if (policy.policy != planner::Policy::kLocalSort && !policy.padded) {
        arms.emplace_back(policy, base.plan.split);
      }
    }
  }
  std::vector<Row> rows;
  SplitCheck split_check;
  for (int64_t num_ranks : ranks) {
    // SFT: a minibatch of N x K samples; GRPO: an RL step of N x K rollouts.
    const int64_t per_minibatch = num_ranks * args.samples.samples_per_rank;
    const auto lengths = resample_lengths(source, per_minibatch * args.minibatches, 0);
    double baseline = 0.0;
    size_t baseline_row = 0;
    const size_t first = rows.size();
    SimulateOptions options = base;
    options.plan.num_ranks = num_ranks;
    options.plan.minibatch_size = per_minibatch;
    // Plans by (planner policy, split): lb-mini-padded pads LB-Mini's plan (simulate_plan does,
    // per mode), so the two share one plan (LB-Mini's partition dominates the time at 1,024).
    std::vector<std::pair<std::pair<planner::Policy, planner::SplitMode>, GrpoPlans>> made;
    for (const auto& [choice, split_mode] : arms) {
      options.plan.policy = choice.policy;
      options.plan.split = split_mode;
      options.pad_to_equal_counts = choice.padded;
      const std::pair<planner::Policy, planner::SplitMode> key{choice.policy, split_mode};
      auto cached = std::find_if(made.begin(), made.end(),
                                 [&](const auto& entry) { return entry.first == key; });
      if (cached == made.end()) {
        GrpoPlans plans;
        if (grpo) {
          options.mode = Mode::kOdcFlat;  // any mode that can run the policy, for validation
          auto made_plans = make_grpo_plans(lengths, options, args.minibatches_per_step);
          if (!made_plans.ok()) {
            error = made_plans.status().message();
            return 2;
          }
          plans = std::move(made_plans).value();
        } else {
          auto plan = planner::make_plan(lengths, options.plan);
          if (!plan.ok()) {
            error = plan.status().message();
            return 2;
          }
          plans.update = std::move(plan).value();
        }
        made.emplace_back(key, std::move(plans));
        cached = made.end() - 1;
      }
      const GrpoPlans& plans = cached->second;
      const std::string label =
          policy_label(choice) + (split_mode == planner::SplitMode::kAuto ? "+split" : "");
      for (auto mode : modes) {
        // Lockstep modes cannot run lb-mini's unequal counts; padding buys the others nothing
        // (they run unequal counts), so lb-mini-padded is simulated where it is needed only.
        if (lockstep(mode) ? choice.policy == planner::Policy::kLbMini && !choice.padded
                           : choice.padded) {
          continue;
        }
        options.mode = mode;
        Row row;
        row.ranks = num_ranks;
        row.policy = label;
        row.mode = std::string(mode_name(mode));
        if (grpo) {
          auto result = simulate_grpo_plans(plans, lengths, options, args.minibatches_per_step);
          if (!result.ok()) {
            error = result.status().message();
            return 2;
          }
          row.result = result.value().rl_step;
          row.forward_phase = result.value().forward_phase;
          row.update = result.value().update;
        } else {
          auto result = simulate_plan(plans.update, lengths, options);
          if (!result.ok()) {
            error = result.status().message();
            return 2;
          }
          row.result = std::move(result).value();
        }
        rows.push_back(std::move(row));
        if (mode == Mode::kCollective && choice.policy == planner::Policy::kLbMicro &&
            split_mode == planner::SplitMode::kOff) {
          baseline = rows.back().result.seconds;
          baseline_row = rows.size() - 1;
        }
      }
    }
    options.pad_to_equal_counts = false;
    // The split check (odc compare's hint, simulated): the fastest ODC + lb-mini row again on
    // lb-mini+split, where some minibatch splits at all. SFT only: GRPO does not split yet.
    const Row* lb_mini = nullptr;
    for (size_t i = first; i < rows.size(); ++i) {
      if (rows[i].policy == "lb-mini" && is_odc(parse_mode(rows[i].mode).value()) &&
          (!lb_mini || rows[i].result.seconds < lb_mini->result.seconds)) {
        lb_mini = &rows[i];
      }
    }
    if (!split_auto && !grpo && lb_mini != nullptr && num_ranks <= kSplitCheckMaxRanks) {
      options.plan.policy = planner::Policy::kLbMini;
      options.plan.split = planner::SplitMode::kAuto;
      auto plan = planner::make_plan(lengths, options.plan);
      const bool splits =
          plan.ok() && std::any_of(plan.value().minibatches.begin(), plan.value().minibatches.end(),
                                   [](const auto& minibatch) { return !minibatch.splits.empty(); });
      if (splits) {
        options.mode = parse_mode(lb_mini->mode).value();
        auto result = simulate_plan(plan.value(), lengths, options);
        if (result.ok()) {
          SplitCheck check{num_ranks, lb_mini->mode, lb_mini->result.seconds,
                           result.value().seconds, baseline};
          if (check.gain() > split_check.gain()) split_check = check;
        }
      }
    }
    const double baseline_planner = baseline > 0 ? rows[baseline_row].result.planner_seconds : 0;
    for (size_t i = first; i < rows.size(); ++i) {
      if (baseline > 0) rows[i].speedup = baseline / rows[i].result.seconds;
      if (baseline_planner > 0 && rows[i].result.planner_seconds > 0) {
        rows[i].planner_speedup = baseline_planner / rows[i].result.planner_seconds;
      }
    }
  }

  if (rows.empty()) {
    error =
        "no arm to simulate: lockstep modes (collective, fsdp2-deferred) cannot run lb-mini "
        "(use lb-mini-padded), and lb-mini-padded is simulated under those modes only; "
        "--modes " +
        args.modes + " with --policies " + args.policies + " leave nothing";
    return 2;
  }
  std::vector<MemoryRow> memory;
  for (int64_t num_ranks : ranks) {
    for (Mode mode : modes) {
      memory.push_back(
          MemoryRow{num_ranks, mode,
                    memory_per_gpu(base.model, mode, num_ranks, base.topology.gpus_per_node,
                                   /*reference_model=*/args.task == "grpo")});
    }
  }
  const double capacity = args.gpu_memory_gbytes * 1e9;
  const FitsMemory fits = [&](const Row& row) {
    const Mode mode = parse_mode(row.mode).value();
    for (const MemoryRow& m : memory) {
      if (m.ranks == row.ranks && m.mode == mode) return m.memory.total_bytes() <= capacity;
    }
    return true;  // not in the table: nothing says it does not fit
  };
  const std::string verdict = verdict_line(rows, base, args, split_check, fits);
  const std::string hint = split_hint(split_check);

  if (args.format == "json" || document != nullptr) {
    nlohmann::ordered_json root;
    root["model"] = {{"layers", base.model.num_layers},
                     {"layer_params", base.model.layer_params},
                     {"other_params", base.model.other_params}};
    root["cost"] = {{"a", base.plan.cost.a}, {"b", base.plan.cost.b}, {"c", base.plan.cost.c}};
    if (base.plan.cost.floor > 0.0) root["cost"]["floor"] = base.plan.cost.floor;
    root["cost_calibrated_on"] = base.cost_calibration_ranks;
    root["task"] = args.task;
    if (grpo) {
      // --minibatches counts RL steps; each holds N x samples_per_rank rollouts.
      root["minibatches_per_step"] = args.minibatches_per_step;
    }
    root["forward_fraction"] = base.forward_fraction;
    root["samples_per_rank"] = args.samples.samples_per_rank;
    root["minibatches"] = args.minibatches;
    root["max_tokens"] = base.plan.max_tokens;
    root["microbatch_memory"] =
        std::string(planner::microbatch_memory_name(base.plan.microbatch_memory));
    root["topology"] = {
        {"gpus_per_node", base.topology.gpus_per_node},
        {"nvlink_bytes_per_second", base.topology.nvlink.bytes_per_second},
        {"nvlink_collective_bytes_per_second", base.topology.nvlink_collective.bytes_per_second},
        {"network_bytes_per_second", base.topology.network.bytes_per_second}};
    root["topology"]["transport_curves"] = args.transport_path;
    root["split"] = std::string(planner::split_mode_name(base.plan.split));
    root["split_exchange"] = base.plan.split_exchange;
    if (!base.plan.rank_speed.empty()) root["rank_speed"] = base.plan.rank_speed;
    root["baseline"] = "collective + lb-micro at the same rank count";
    root["verdict"] = verdict;
    root["split_hint"] =
        hint.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(hint);
    nlohmann::ordered_json strongest = nlohmann::ordered_json::array();
    for (const Strongest& s : strongest_arms(rows, fits)) {
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
    // Per rank count: the fastest FSDP2 arm and ODC's fastest arm that fit, ODC's speedup over it.
    root["strongest_baseline"] = std::move(strongest);
    nlohmann::ordered_json results = nlohmann::ordered_json::array();
    for (const Row& row : rows) {
      const double m = static_cast<double>(row.result.num_minibatches);
      nlohmann::ordered_json phases = nullptr;
      if (grpo) {
        // Per RL step: one forward-only phase (the step holds two) and the K updates.
        phases = {
            {"forward_phase_seconds", row.forward_phase.seconds / m},
            {"update_seconds", row.update.seconds / m},
            {"planner_forward_phase_seconds", row.forward_phase.planner_seconds / m},
            {"planner_update_seconds", row.update.planner_seconds / m},
            {"forward_phase_exposed_comm_seconds", row.forward_phase.exposed_comm_seconds / m},
            {"update_exposed_comm_seconds", row.update.exposed_comm_seconds / m}};
      }
      results.push_back({{"ranks", row.ranks},
                         {"policy", row.policy},
                         {"mode", row.mode},
                         {"step_seconds", row.result.seconds / m},
                         {"bubble", row.result.bubble},
                         {"speedup", row.speedup > 0 ? nlohmann::ordered_json(row.speedup)
                                                     : nlohmann::ordered_json(nullptr)},
                         {"compute_seconds", row.result.compute_seconds / m},
                         {"exposed_comm_seconds", row.result.exposed_comm_seconds / m},
                         {"idle_seconds", row.result.idle_seconds / m},
                         {"optimizer_seconds", row.result.optimizer_seconds / m},
                         {"planner_step_seconds", row.result.planner_seconds / m},
                         {"minibatch_seconds", row.result.minibatch_seconds},
                         {"phases", phases}});
    }
    root["results"] = std::move(results);
    root["gpu_memory_bytes"] = capacity;
    nlohmann::ordered_json memory_rows = nlohmann::ordered_json::array();
    for (const MemoryRow& row : memory) {
      memory_rows.push_back({{"ranks", row.ranks},
                             {"mode", std::string(mode_name(row.mode))},
                             {"state_bytes", row.memory.state_bytes},
                             {"gathered_bytes", row.memory.gathered_bytes},
                             {"unsharded_bytes", row.memory.unsharded_bytes},
                             {"odc_bytes", row.memory.odc_bytes},
                             {"total_bytes", row.memory.total_bytes()},
                             {"fits", row.memory.total_bytes() <= capacity}});
    }
    root["memory_per_gpu"] = std::move(memory_rows);
    if (document != nullptr) *document = root.dump();
    if (args.format == "json") {
      out << root.dump() << "\n";
      return 0;
    }
  }
  // The policy column fits "lb-mini+split" where --split auto adds such rows.
  int policy_width = 10;
  for (const Row& row : rows)
    policy_width = std::max(policy_width, static_cast<int>(row.policy.size()));
  char line[240];
  // GRPO adds the RL step's two parts: one forward-only phase (the step runs two) and the K
  // update minibatches together.
  std::snprintf(line, sizeof(line), "%6s %-*s %-15s %8s%s %7s %8s %9s %9s %9s %9s\n", "ranks",
                policy_width, "policy", "mode", "step s", grpo ? " fwd-only   update" : "",
                "bubble", "speedup", "compute", "exp.comm", "idle", "optim");
  out << line;
  for (const Row& row : rows) {
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
    out << line;
  }
  if (grpo) {
    out << "seconds per RL step (step: 2 forward-only phases, old and reference log-probs, then "
        << args.minibatches_per_step
        << " update minibatches; fwd-only: one of the two phases; update: the updates together) "
           "and the step's parts per rank: compute, exposed communication, idle (waiting for "
           "other ranks), optimizer; speedup against collective + lb-micro at the same rank "
           "count\n\n";
  } else {
    out << "seconds per minibatch (step) and its parts per rank: compute, exposed communication, "
           "idle (waiting for other ranks), optimizer; speedup against collective + lb-micro at "
           "the same rank count\n\n";
  }
  std::snprintf(line, sizeof(line), "%6s %-15s %9s %9s %9s %9s %9s %12s\n", "ranks", "mode",
                "state", "gathered", "unsharded", "odc bufs", "total", "fits?");
  out << "memory per GPU, GB (state sharded as the runtime does; activations not included)\n"
      << line;
  for (const MemoryRow& row : memory) {
    const double total = row.memory.total_bytes();
    char fits[32];
    if (total <= capacity) {
      std::snprintf(fits, sizeof(fits), "yes, %.0f left", (capacity - total) / 1e9);
    } else {
      std::snprintf(fits, sizeof(fits), "no");
    }
    std::snprintf(line, sizeof(line), "%6lld %-15s %9.2f %9.2f %9.2f %9.2f %9.2f %12s\n",
                  static_cast<long long>(row.ranks), std::string(mode_name(row.mode)).c_str(),
                  row.memory.state_bytes / 1e9, row.memory.gathered_bytes / 1e9,
                  row.memory.unsharded_bytes / 1e9, row.memory.odc_bytes / 1e9, total / 1e9, fits);
    out << line;
  }
  out << fixed("on a %.0f GB GPU", args.gpu_memory_gbytes)
      << " (--gpu-memory-gbytes); \"left\" is what activations may use. state: 16 B per parameter "
         "(fp32 weights, AdamW, gradient or odc's accumulator; odc publishes the fp32 shards in "
         "place) / N, odc-hybrid / GPUs per node"
      << (args.task == "grpo" ? ", plus the frozen reference's fp32 parameters (4 B) likewise" : "")
      << "; unsharded: held whole on every GPU, fsdp2-deferred's fp32 gradients (4 B per "
         "parameter), fsdp2-unsharded's bf16 parameters and fp32 gradients (6 B)\n";
  out << verdict << "\n";
  if (!hint.empty()) out << hint << "\n";
  return 0;
}

}  // namespace

int run_cli(const CliArgs& args, std::ostream& out, std::string& error, std::string* document) {
  // The sizes are bounded above; memory can still run out on a small machine: one line, not an
  // abort.
  try {
    return run_sweep(args, out, error, document);
  } catch (const std::bad_alloc&) {
    error = "out of memory (fewer --ranks, --samples-per-rank or --minibatches need less)";
  } catch (const std::length_error&) {
    error = "out of memory (fewer --ranks, --samples-per-rank or --minibatches need less)";
  }
  return 2;
}

}  // namespace odc::simulate
