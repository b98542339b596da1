// The `odc` command-line tool. Subcommands:
//   odc plan     one policy's plan as JSON (the documented contract) or a table
//   odc compare  the three policies side by side on the same lengths (the main job's table), as a
//                table, JSON or CSV, and optionally as a figure (--plot, drawn by the Python
//                module odc.compare_plot in a child process: this tool links no Python)
//   odc simulate step time, bubble and speedup of collective / ODC at many rank counts, memory
//                per GPU per layout, and optionally a figure (--plot, drawn by odc.simulate)
// All three share one vocabulary for the samples (--lengths, --samples-per-rank, --max-tokens,
// --max-length: tools/cli_options.h); compare and simulate end with one decision (use odc or
// FSDP2, which policy, whether to split, the gain over the strongest arm that fits: decision.h)
// and one line of why.
// Every user error exits with status 2 and one line naming the problem; `odc` alone lists the
// subcommands.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "planner/plan_format.h"
#include "planner/plan_io.h"
#include "simulate/decision.h"
#include "simulate/simulate.h"
#include "simulate/sweep.h"
#include "simulate/sweep_format.h"
#include "tools/cli_options.h"

namespace {

using odc::Result;
using odc::Status;
using odc::planner::MinibatchPlan;
using odc::planner::Plan;
using odc::planner::PlanOptions;

constexpr int kUsageError = 2;

// Options shared by `plan` and `compare`, as the user typed them (tables: cli_options.h).
struct CommonArgs {
  odc::simulate::SampleSelection samples;  // --lengths, --samples-per-rank, --max-tokens, ...
  int64_t num_ranks = 0;
  odc::tools::PlannerArgs planner;
  CommonArgs() { planner.cost = "1,0,0"; }  // the planner's unit cost: one per token
};

void add_common_options(CLI::App& command, CommonArgs& args) {
  odc::tools::add_sample_options(command, args.samples, /*deprecated_minibatch_size=*/true);
  command.add_option("--ranks", args.num_ranks, "number of data-parallel ranks (N)")
      ->required()
      ->check(odc::tools::int64_range());
  odc::tools::add_cost_option(command, args.planner.cost,
                              "microbatch cost C + sum(A*L + B*L^2), as A,B,C; A,B,C,F: at least "
                              "F per microbatch (the host-bound floor)");
  odc::tools::add_rank_speed_option(command, args.planner.rank_speed,
                                    "relative speed of each rank, S0,S1,... (default: all equal)");
  odc::tools::add_split_options(command, args.planner,
                                "auto: run a sample above the minibatch's per-rank share on a "
                                "group of ranks (lb-mini, lb-micro); off");
  odc::tools::add_microbatch_memory_option(
      command, args.planner.microbatch_memory,
      "lb-micro: no lb-mini microbatch above the largest lb-micro builds for the same minibatch "
      "(no more activation memory); cap: up to --max-tokens (fastest)");
}

// Turns the typed arguments into plan inputs; the first problem found is returned. `samples`
// keeps the selected lengths and their positions in the file.
Status build_inputs(const CommonArgs& args, odc::simulate::Samples& samples, PlanOptions& options) {
  options.num_ranks = args.num_ranks;
  if (args.samples.minibatch_size) {  // deprecated spelling: samples per minibatch
    options.minibatch_size = *args.samples.minibatch_size;
  } else if (args.samples.samples_per_rank < 1) {
    return Status::InvalidArgument("--samples-per-rank must be >= 1, got " +
                                   std::to_string(args.samples.samples_per_rank));
  } else if (args.num_ranks >= 1 &&
             __builtin_mul_overflow(args.num_ranks, args.samples.samples_per_rank,
                                    &options.minibatch_size)) {
    options.minibatch_size = odc::planner::kAllSamples;  // more samples than any file holds
  }
  options.max_tokens = args.samples.max_tokens.value_or(1);  // checked again once read
  auto cost = odc::planner::parse_cost(args.planner.cost);
  if (!cost.ok()) return cost.status();
  options.cost = cost.value();
  if (!args.planner.rank_speed.empty()) {
    auto speeds = odc::planner::parse_rank_speed(args.planner.rank_speed);
    if (!speeds.ok()) return speeds.status();
    options.rank_speed = speeds.value();
  }
  auto split = odc::planner::parse_split_mode(args.planner.split);
  if (!split.ok()) return split.status();
  options.split = split.value();
  options.split_exchange = args.planner.split_exchange;
  auto memory = odc::planner::parse_microbatch_memory(args.planner.microbatch_memory);
  if (!memory.ok()) return memory.status();
  options.microbatch_memory = memory.value();
  // Option errors come before reading a possibly large file.
  ODC_RETURN_IF_ERROR(odc::planner::validate_plan_options(options));
  auto read = odc::simulate::read_samples(args.samples);
  if (!read.ok()) return read.status();
  samples = std::move(read).value();
  options.max_tokens = samples.max_tokens;
  return Status::Ok();
}

// Plans name samples by their position in the file: with --max-length some were dropped, so the
// planner's indices (into the kept lengths) are mapped back.
void to_file_indices(Plan& plan, const std::vector<int64_t>& file_index) {
  for (auto& minibatch : plan.minibatches) {
    for (int64_t& sample : minibatch.samples) sample = file_index[sample];
    for (auto& rank : minibatch.ranks) {
      for (auto& microbatch : rank.microbatches) {
        for (int64_t& sample : microbatch) sample = file_index[sample];
      }
    }
    for (auto& split : minibatch.splits) split.sample = file_index[split.sample];
  }
}

// One policy of `odc compare`: predicted times summed over minibatches (the planner's cost units)
// and bubbles. LB-Mini has no collective figures: its unequal microbatch counts cannot run there.
struct CompareRow {
  std::string policy;
  size_t min_microbatches = 0;
  size_t max_microbatches = 0;
  double mean_microbatches = 0.0;
  bool runs_collective = true;
  double bubble_collective = 0.0;
  double bubble_odc = 0.0;
  double time_collective = 0.0;
  double time_odc = 0.0;
};

std::vector<CompareRow> compare_rows(const std::vector<Plan>& plans) {
  std::vector<CompareRow> rows;
  for (const Plan& plan : plans) {
    CompareRow row;
    row.policy = std::string(odc::planner::policy_name(plan.options.policy)) +
                 (plan.options.split == odc::planner::SplitMode::kAuto ? "+split" : "");
    row.runs_collective = plan.options.policy != odc::planner::Policy::kLbMini;
    row.bubble_collective = plan.bubble.collective;
    row.bubble_odc = plan.bubble.odc;
    size_t total = 0, count = 0;
    bool first = true;
    for (const auto& minibatch : plan.minibatches) {
      row.time_collective += minibatch.times.collective;
      row.time_odc += minibatch.times.odc;
      for (const auto& rank : minibatch.ranks) {
        const size_t n = rank.microbatches.size();
        row.min_microbatches = first ? n : std::min(row.min_microbatches, n);
        row.max_microbatches = first ? n : std::max(row.max_microbatches, n);
        first = false;
        total += n;
        ++count;
      }
    }
    row.mean_microbatches = count ? static_cast<double>(total) / count : 0.0;
    rows.push_back(row);
  }
  return rows;
}

// The baseline every speedup is relative to: collective FSDP with LB-Micro (what FSDP users run
// today with a good balancer). Speedup = baseline time / this time, from the planner's costs.
double baseline_time(const std::vector<CompareRow>& rows) {
  for (const CompareRow& row : rows) {
    if (row.policy == "lb-micro") return row.time_collective;
  }
  return 0.0;
}

double speedup(double baseline, double time) {
  return time > 0 ? baseline / time : 0.0;
}

// Compare's arms for the decision: every policy under ODC, and under collective where it runs.
// The planner models no GPU state, so every arm "fits": all keep to --max-tokens per microbatch
// (lb-mini, with --microbatch-memory lb-micro, to no more than lb-micro's).
std::vector<odc::simulate::DecisionArm> compare_arms(const std::vector<Plan>& plans) {
  std::vector<odc::simulate::DecisionArm> arms;
  for (const Plan& plan : plans) {
    odc::simulate::DecisionArm arm;
    arm.ranks = plan.options.num_ranks;
    arm.policy = std::string(odc::planner::policy_name(plan.options.policy));
    arm.split = plan.options.split == odc::planner::SplitMode::kAuto;
    for (const auto& minibatch : plan.minibatches) arm.seconds += minibatch.times.odc;
    arm.mode = "odc";
    arm.odc = true;
    arm.bubble = plan.bubble.odc;
    arms.push_back(arm);
    if (plan.options.policy == odc::planner::Policy::kLbMini) continue;  // lockstep cannot run it
    arm.seconds = 0.0;
    for (const auto& minibatch : plan.minibatches) arm.seconds += minibatch.times.collective;
    arm.mode = "collective";
    arm.odc = false;
    arm.bubble = plan.bubble.collective;
    arms.push_back(arm);
  }
  return arms;
}

nlohmann::ordered_json compare_json(const std::vector<Plan>& plans,
                                    const odc::simulate::DecisionContext& context) {
  const auto rows = compare_rows(plans);
  const double baseline = baseline_time(rows);
  const PlanOptions& options = plans.front().options;
  nlohmann::ordered_json out;
  out["ranks"] = options.num_ranks;
  out["max_tokens"] = options.max_tokens;
  out["minibatch_size"] = options.minibatch_size == odc::planner::kAllSamples
                              ? nlohmann::ordered_json(nullptr)
                              : nlohmann::ordered_json(options.minibatch_size);
  out["minibatches"] = plans.front().minibatches.size();
  out["cost"] = {{"a", options.cost.a}, {"b", options.cost.b}, {"c", options.cost.c}};
  if (options.cost.floor > 0.0) out["cost"]["floor"] = options.cost.floor;
  out["baseline"] = "collective + lb-micro";
  out["decision"] =
      odc::simulate::decision_json(odc::simulate::decide(compare_arms(plans)), context);
  out["policies"] = nlohmann::ordered_json::array();
  for (const CompareRow& row : rows) {
    nlohmann::ordered_json entry;
    entry["policy"] = row.policy;
    entry["microbatches_per_rank"] = {{"min", row.min_microbatches},
                                      {"max", row.max_microbatches},
                                      {"mean", row.mean_microbatches}};
    const nlohmann::ordered_json none(nullptr);
    entry["bubble"] = {
        {"collective", row.runs_collective ? nlohmann::ordered_json(row.bubble_collective) : none},
        {"odc", row.bubble_odc}};
    entry["speedup"] = {{"collective", row.runs_collective ? nlohmann::ordered_json(speedup(
                                                                 baseline, row.time_collective))
                                                           : none},
                        {"odc", speedup(baseline, row.time_odc)}};
    out["policies"].push_back(entry);
  }
  return out;
}

std::string compare_csv(const std::vector<Plan>& plans) {
  const auto rows = compare_rows(plans);
  const double baseline = baseline_time(rows);
  std::string out =
      "policy,microbatches_min,microbatches_max,microbatches_mean,bubble_collective,bubble_odc,"
      "speedup_collective,speedup_odc\n";
  char line[256];
  for (const CompareRow& row : rows) {
    std::string collective_bubble, collective_speedup;  // empty cells where collective cannot run
    if (row.runs_collective) {
      char cell[64];
      std::snprintf(cell, sizeof(cell), "%.6f", row.bubble_collective);
      collective_bubble = cell;
      std::snprintf(cell, sizeof(cell), "%.6f", speedup(baseline, row.time_collective));
      collective_speedup = cell;
    }
    std::snprintf(line, sizeof(line), "%s,%zu,%zu,%.4f,%s,%.6f,%s,%.6f\n", row.policy.c_str(),
                  row.min_microbatches, row.max_microbatches, row.mean_microbatches,
                  collective_bubble.c_str(), row.bubble_odc, collective_speedup.c_str(),
                  speedup(baseline, row.time_odc));
    out += line;
  }
  return out;
}

std::string cost_words(const odc::planner::CostModel& cost) {
  char text[160];
  std::snprintf(text, sizeof(text), "%g,%g,%g", cost.a, cost.b, cost.c);
  std::string words = text;
  if (cost.floor > 0.0) {
    std::snprintf(text, sizeof(text), ",%g", cost.floor);
    words += text;
  }
  return words;
}

// What compare's decision assumed and rests on: the token cap every arm keeps to (it models no GPU
// state: odc simulate does), the planner's cost model alone (no communication), and where
// splitting would pay with split off (`split_gain` > 0: odc + lb-mini+split over odc + lb-mini).
odc::simulate::DecisionContext compare_context(const PlanOptions& options, bool max_tokens_given,
                                               const std::string& basis, double split_gain) {
  odc::simulate::DecisionContext context;
  context.memory = "<= " + std::to_string(options.max_tokens) + " tokens/microbatch";
  context.memory_source =
      max_tokens_given ? "--max-tokens" : "default --max-tokens: the longest sample";
  context.basis = "compute only (--cost " + cost_words(options.cost) + basis +
                  "): odc simulate adds communication and GPU memory";
  if (split_gain > 0) {
    char words[160];
    std::snprintf(words, sizeof(words),
                  "rerun with --split auto: splitting outliers made odc + lb-mini %.2fx faster",
                  split_gain);
    context.split_words = words;
  }
  return context;
}

// GRPO's training phase as one plan per policy (odc.train --task grpo, docs/planner.md): per RL
// step of options.minibatch_size rollouts, its forward-only minibatch twice (old log-probs on the
// policy, reference log-probs on a frozen model of the same shape; planned once with the forward
// cost, as grpo_run._step_plans plans it) and its K update minibatches (full cost), in that
// order. The plan's bubble is then over all of it, time-weighted as odc.train measures it.
// Lengths beyond the last whole RL step are left out.
Result<Plan> grpo_plan(std::span<const int64_t> lengths, const PlanOptions& options,
                       int64_t minibatches_per_step, double forward_fraction) {
  const int64_t step = options.minibatch_size;
  if (!(forward_fraction > 0.0 && forward_fraction < 1.0)) {
    return Status::InvalidArgument("--forward-fraction must be in (0, 1)");
  }
  if (step < 1 || step == odc::planner::kAllSamples || lengths.size() < static_cast<size_t>(step)) {
    return Status::InvalidArgument("--task grpo: " + std::to_string(lengths.size()) +
                                   " rollouts hold no RL step of --ranks x --samples-per-rank");
  }
  const size_t whole = lengths.size() / static_cast<size_t>(step) * static_cast<size_t>(step);
  auto planned = odc::simulate::plan_grpo(lengths.first(whole), options, forward_fraction,
                                          minibatches_per_step);
  if (!planned.ok()) return planned.status();
  const Plan& forward_plan = planned.value().forward_only;
  const Plan& update_plan = planned.value().update;
  Plan merged;
  merged.options = options;
  double busy = 0.0, collective = 0.0, odc_time = 0.0;
  const size_t steps = forward_plan.minibatches.size();
  for (size_t s = 0; s < steps; ++s) {
    std::vector<const MinibatchPlan*> parts(2, &forward_plan.minibatches[s]);
    for (int64_t k = 0; k < minibatches_per_step; ++k) {
      parts.push_back(&update_plan.minibatches[s * minibatches_per_step + k]);
    }
    for (const MinibatchPlan* part : parts) {
      merged.minibatches.push_back(*part);
      busy += part->times.busy;
      collective += part->times.collective;
      odc_time += part->times.odc;
    }
  }
  merged.bubble = {odc::planner::bubble_rate(busy, options.num_ranks, collective),
                   odc::planner::bubble_rate(busy, options.num_ranks, odc_time)};
  return merged;
}

// Where splitting outliers would pay and it is off, the decision's why says so (a long-tail file
// was predicted 2.65x with split, 1.02x without, and nothing said so): odc + lb-mini+split's gain
// over odc + lb-mini where it is at least 5%, else 0.
constexpr double kSplitHintGain = 1.05;

double split_gain(const std::vector<Plan>& plans, const Plan& split_plan) {
  const auto rows = compare_rows(plans);
  double split_time = 0.0;
  for (const auto& minibatch : split_plan.minibatches) split_time += minibatch.times.odc;
  const double gain = speedup(rows.back().time_odc, split_time);
  return gain >= kSplitHintGain ? gain : 0.0;
}

// The Python interpreter that draws --plot: $ODC_PYTHON, else the python3 beside this executable
// (a virtual environment's bin/), else python3 on PATH.
std::string plot_python() {
  if (const char* chosen = std::getenv("ODC_PYTHON"); chosen && *chosen) return chosen;
  char self[PATH_MAX];
  const ssize_t size = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (size > 0) {
    std::string dir(self, static_cast<size_t>(size));
    dir = dir.substr(0, dir.rfind('/'));
    const std::string beside = dir + "/python3";
    if (access(beside.c_str(), X_OK) == 0) return beside;
  }
  return "python3";
}

// Checked before any planning or simulation: a plot that cannot be written fails at once, in one
// line, instead of after the work and with the plotter's traceback.
std::string check_plot_path(const std::string& path) {
  namespace fs = std::filesystem;
  // Whole paths, quoted (fail() shows control bytes as \xNN): a cut path would not say where.
  const std::string quoted = "'" + path + "'";
  // Given but empty (`--plot ""`, an unset shell variable): refused, not taken as "no plot".
  if (path.empty()) return "--plot needs a file name, got '' (e.g. --plot speedup.png)";
  std::error_code code;
  if (fs::is_directory(path, code)) return "cannot write the plot to " + quoted + ": a directory";
  std::string folder = fs::path(path).parent_path().string();
  if (folder.empty()) folder = ".";
  if (!fs::is_directory(folder, code)) {
    return "cannot write the plot to " + quoted + ": no directory '" + folder + "'";
  }
  if (access(folder.c_str(), W_OK) != 0) {
    return "cannot write the plot to " + quoted + ": directory '" + folder + "' is not writable";
  }
  // matplotlib picks the format from the extension and refuses others only once the figure is
  // drawn: a usage error like the rest, caught here. No extension: matplotlib's default, PNG.
  static const char* const kFormats[] = {"png",  "pdf", "svg",  "svgz", "eps", "ps",  "jpg",
                                         "jpeg", "tif", "tiff", "webp", "pgf", "raw", "rgba"};
  std::string extension = fs::path(path).extension().string();
  if (!extension.empty()) {
    extension = extension.substr(1);
    for (char& c : extension) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    bool known = false;
    for (const char* format : kFormats) known = known || extension == format;
    if (!known) {
      return "cannot write the plot to " + quoted + ": unsupported format '" + extension +
             "' (use .png, .pdf or .svg)";
    }
  }
  return "";
}

// Runs `python -m MODULE ARGS...` with `document` (JSON) on its stdin. Returns "" or why it failed
// in one line: the plotter's own last line of stderr (e.g. matplotlib missing), its prefix
// removed. On success whatever it wrote to stderr is passed on.
std::string write_plot(const nlohmann::ordered_json& document,
                       const std::vector<std::string>& module_args) {
  int to_child_fds[2], from_child_fds[2];
  if (pipe(to_child_fds) != 0) return "cannot create a pipe for the plotter";
  if (pipe(from_child_fds) != 0) {
    close(to_child_fds[0]);
    close(to_child_fds[1]);
    return "cannot create a pipe for the plotter";
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child_fds[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from_child_fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, to_child_fds[1]);
  posix_spawn_file_actions_addclose(&actions, from_child_fds[0]);
  const std::string python = plot_python();
  std::vector<std::string> words = {python, "-m"};
  words.insert(words.end(), module_args.begin(), module_args.end());
  std::vector<char*> argv;
  for (auto& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(to_child_fds[0]);
  close(from_child_fds[1]);
  if (spawned != 0) {
    close(to_child_fds[1]);
    close(from_child_fds[0]);
    return "cannot start '" + python + "' to draw the plot (set ODC_PYTHON)";
  }
  // The plotter reads all of its input before it writes anything (a traceback at import is far
  // below a pipe's capacity), so writing first, then reading, cannot deadlock.
  const std::string text = document.dump();
  std::signal(SIGPIPE, SIG_IGN);  // a plotter that dies early must not kill this process
  FILE* to_child = fdopen(to_child_fds[1], "w");
  if (to_child != nullptr) {
    std::fwrite(text.data(), 1, text.size(), to_child);
    std::fclose(to_child);
  } else {
    close(to_child_fds[1]);
  }
  std::string messages;
  char buffer[4096];
  for (ssize_t got; (got = read(from_child_fds[0], buffer, sizeof(buffer))) != 0;) {
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) break;
    messages.append(buffer, static_cast<size_t>(got));
  }
  close(from_child_fds[0]);
  int status = 0;
  const bool ok = waitpid(pid, &status, 0) >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (ok) {
    std::fputs(messages.c_str(), stderr);
    return "";
  }
  // The last non-empty line: a Python exception's own line, or the plotter's message.
  std::string last;
  size_t end = messages.find_last_not_of(" \n\r\t");
  if (end != std::string::npos) {
    const size_t begin = messages.rfind('\n', end);
    last = messages.substr(begin == std::string::npos ? 0 : begin + 1,
                           end + 1 - (begin == std::string::npos ? 0 : begin + 1));
  }
  const size_t prefix = last.find(": error: ");
  if (prefix != std::string::npos) last = last.substr(prefix + 9);
  if (last.empty()) last = "it exited without a message";
  return "the plotter (" + python + " -m " + module_args.front() + ") failed: " + last;
}

// One line on stderr whatever the message holds: arguments echoed by the parser may carry raw
// control bytes (a newline, an escape sequence), which are shown as \xNN.
int fail(const std::string& command, const std::string& message) {
  const std::string prefix = command.empty() ? "odc" : "odc " + command;
  std::string line;
  for (char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", byte);
      line += escaped;
    } else {
      line += c;
    }
  }
  std::fprintf(stderr, "%s: error: %s\n", prefix.c_str(), line.c_str());
  return kUsageError;
}

// The arguments of each subcommand, as parsed.
struct PlanCommand {
  CommonArgs args;
  std::string policy;
  std::string format = "json";
  bool steal = false;
};

struct CompareCommand {
  CommonArgs args;
  odc::tools::TaskArgs task;
  std::string format = "table";
  std::string plot_path;
};

struct SimulateCommand {
  odc::tools::SimulateArgs args;
  std::string plot_path;
};

void add_compare_options(CLI::App& command, CompareCommand& compare) {
  add_common_options(command, compare.args);
  command.add_option("--format", compare.format, "table, json or csv")->capture_default_str();
  command.add_option("--plot", compare.plot_path,
                     "also draw the bubbles and speedups into this PNG (needs Python with "
                     "matplotlib and the odc package)");
  odc::tools::add_task_option(command, compare.task,
                              "sft, or grpo: GRPO's training phase, per RL step of ranks x "
                              "samples-per-rank rollouts two forward-only minibatches (old and "
                              "reference log-probs) and --minibatches-per-step updates, all in "
                              "the bubble");
  odc::tools::add_minibatches_per_step_option(command, compare.task);
  odc::tools::add_forward_fraction_option(
      command, compare.task,
      "--task grpo: a forward's share of a microbatch's cost (1/4 with activation checkpointing, "
      "as odc.train on GPUs; 1/3 without)");
}

int run_simulate(const CLI::App& command, const SimulateCommand& simulate) {
  if (command.count("--plot") > 0) {
    if (std::string error = check_plot_path(simulate.plot_path); !error.empty()) {
      return fail("simulate", error);
    }
  }
  auto request = odc::tools::to_sweep(simulate.args);
  if (!request.ok()) return fail("simulate", request.status().message());
  auto sweep = odc::simulate::run_sweep(request.value());
  if (!sweep.ok()) return fail("simulate", sweep.status().message());
  const bool table = simulate.args.format == "table";
  std::cout << (table ? odc::simulate::sweep_to_table(sweep.value())
                      : odc::simulate::sweep_to_json(sweep.value()) + "\n");
  if (simulate.plot_path.empty()) return 0;
  std::cout << std::flush;
  const std::string title = simulate.args.samples.lengths_path;
  if (std::string failure =
          write_plot(nlohmann::ordered_json::parse(odc::simulate::sweep_to_json(sweep.value())),
                     {"odc.simulate", "--draw", simulate.plot_path, title});
      !failure.empty()) {
    std::fprintf(stderr, "odc simulate: error: %s\n", failure.c_str());
    return 1;
  }
  std::fprintf(table ? stdout : stderr, "plot: %s\n", simulate.plot_path.c_str());
  return 0;
}

int run_plan(PlanCommand& command) {
  if (command.format != "json" && command.format != "table") {
    return fail("plan", "unknown format " + odc::planner::quote_text(command.format) +
                            ": expected json or table");
  }
  auto policy = odc::planner::parse_policy(command.policy);
  if (!policy.ok()) return fail("plan", policy.status().message());
  odc::simulate::Samples samples;
  PlanOptions options;
  options.policy = policy.value();
  options.steal = command.steal;
  if (Status status = build_inputs(command.args, samples, options); !status.ok()) {
    return fail("plan", status.message());
  }
  auto plan = odc::planner::make_plan(samples.lengths, options);
  if (!plan.ok()) return fail("plan", plan.status().message());
  to_file_indices(plan.value(), samples.file_index);
  std::string text = command.format == "json" ? odc::planner::plan_to_json(plan.value()) + "\n"
                                              : odc::planner::plan_to_table(plan.value());
  if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout)) {
    return fail("plan", std::string("cannot write the plan: ") + std::strerror(errno));
  }
  return 0;
}

// The three policies (and with --split auto the two that can split), planned on the same lengths.
Status compare_plans(const std::vector<int64_t>& lengths, PlanOptions& options,
                     const odc::tools::TaskArgs& task, std::vector<Plan>& plans) {
  const odc::planner::SplitMode split = options.split;
  const bool grpo = task.task == "grpo";
  for (auto policy : {odc::planner::Policy::kLocalSort, odc::planner::Policy::kLbMicro,
                      odc::planner::Policy::kLbMini}) {
    options.policy = policy;
    options.split = odc::planner::SplitMode::kOff;
    auto plan = grpo ? grpo_plan(lengths, options, task.minibatches_per_step, task.forward_fraction)
                     : odc::planner::make_plan(lengths, options);
    if (!plan.ok()) return plan.status();
    plans.push_back(std::move(plan).value());
  }
  // With --split auto, the two policies that can split (LB-Micro and LB-Mini) are planned split.
  if (split == odc::planner::SplitMode::kAuto) {
    for (auto policy : {odc::planner::Policy::kLbMicro, odc::planner::Policy::kLbMini}) {
      options.policy = policy;
      options.split = split;
      auto plan = odc::planner::make_plan(lengths, options);
      if (!plan.ok()) return plan.status();
      plans.push_back(std::move(plan).value());
    }
  }
  options.split = split;
  return Status::Ok();
}

int run_compare(const CLI::App& command, CompareCommand& compare) {
  const std::string& format = compare.format;
  if (format != "table" && format != "json" && format != "csv") {
    return fail("compare", "unknown format '" + format + "': expected table, json or csv");
  }
  if (command.count("--plot") > 0) {
    if (std::string error = check_plot_path(compare.plot_path); !error.empty()) {
      return fail("compare", error);
    }
  }
  odc::simulate::Samples samples;
  PlanOptions options;
  if (Status status = build_inputs(compare.args, samples, options); !status.ok()) {
    return fail("compare", status.message());
  }
  const bool grpo = compare.task.task == "grpo";
  if (compare.task.task != "sft" && !grpo) {
    return fail("compare", "unknown --task '" + compare.task.task + "': expected sft or grpo");
  }
  const odc::planner::SplitMode split = options.split;
  if (grpo && split == odc::planner::SplitMode::kAuto) {
    return fail("compare", "--task grpo does not split samples (odc.train refuses it too)");
  }
  std::vector<Plan> plans;
  if (Status status = compare_plans(samples.lengths, options, compare.task, plans); !status.ok()) {
    return fail("compare", status.message());
  }
  const std::string basis = grpo ? "; GRPO: per RL step 2 forward-only minibatches at " +
                                       cost_words(odc::simulate::forward_cost(
                                           options.cost, compare.task.forward_fraction)) +
                                       " and " + std::to_string(compare.task.minibatches_per_step) +
                                       " updates"
                                 : "";
  double splitting_gain = 0.0;
  if (split == odc::planner::SplitMode::kOff && !grpo && format != "csv") {
    PlanOptions split_options = options;
    split_options.policy = odc::planner::Policy::kLbMini;
    split_options.split = odc::planner::SplitMode::kAuto;
    auto split_plan = odc::planner::make_plan(samples.lengths, split_options);
    if (split_plan.ok()) splitting_gain = split_gain(plans, split_plan.value());
  }
  const odc::simulate::DecisionContext context =
      compare_context(options, compare.args.samples.max_tokens.has_value(), basis, splitting_gain);
  if (format == "json") {
    std::cout << compare_json(plans, context).dump(1) << "\n";
  } else if (format == "csv") {
    std::cout << compare_csv(plans);
  } else {
    const odc::simulate::DecisionText decision =
        odc::simulate::decision_text(odc::simulate::decide(compare_arms(plans)), context);
    std::cout << odc::planner::compare_table(plans) << decision.line << "\n"
              << decision.reason << "\n";
  }
  if (compare.plot_path.empty()) return 0;
  std::cout << std::flush;
  const std::string title = compare.args.samples.lengths_path + ": " +
                            std::to_string(options.num_ranks) + " ranks, max " +
                            std::to_string(options.max_tokens) + " tokens";
  if (std::string error =
          write_plot(compare_json(plans, context), {"odc.compare_plot", compare.plot_path, title});
      !error.empty()) {
    std::fprintf(stderr, "odc compare: error: %s\n", error.c_str());
    return 1;
  }
  // The table's reader learns where the figure is; JSON and CSV stay machine-readable.
  std::fprintf(format == "table" ? stdout : stderr, "plot: %s\n", compare.plot_path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"odc: On-Demand Communication for variable-length sharded training"};
  app.name("odc");
  app.set_version_flag("--version", "odc " ODC_VERSION_STRING);
  app.require_subcommand(1);

  PlanCommand plan;
  CLI::App* plan_command =
      app.add_subcommand("plan", "plan one policy's minibatch schedule and predict its bubble");
  add_common_options(*plan_command, plan.args);
  plan_command->add_option("--policy", plan.policy, "local-sort, lb-micro or lb-mini")->required();
  plan_command->add_option("--format", plan.format, "json or table")->capture_default_str();
  plan_command->add_flag("--steal", plan.steal,
                         "also predict ODC with work stealing (a rank out of microbatches takes "
                         "another's; docs/planner.md, \"Work stealing\")");

  CompareCommand compare;
  CLI::App* compare_command = app.add_subcommand(
      "compare", "predict the bubble of all three policies under collective and ODC execution");
  add_compare_options(*compare_command, compare);

  SimulateCommand simulate;
  CLI::App* simulate_command = app.add_subcommand(
      "simulate", "simulate collective and ODC training at many rank counts (docs/simulate.md)");
  odc::tools::add_simulate_options(*simulate_command, simulate.args);
  simulate_command->add_option("--plot", simulate.plot_path,
                               "also draw speedup against GPUs into this PNG (needs Python with "
                               "matplotlib and the odc package)");

  // `odc` alone: what it can do, not "a subcommand is required".
  if (argc == 1) {
    std::fputs(app.help().c_str(), stderr);
    return kUsageError;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForVersion& version) {
    return app.exit(version);
  } catch (const CLI::ParseError& error) {
    const CLI::App* parsed = app.get_subcommands().empty() ? &app : app.get_subcommands().front();
    const std::string command = parsed == &app ? std::string("") : parsed->get_name();
    return fail(command, odc::tools::parse_error_message(
                             error, *parsed, std::vector<std::string>(argv + 1, argv + argc)));
  }
  if (simulate_command->parsed()) return run_simulate(*simulate_command, simulate);
  if (plan_command->parsed()) return run_plan(plan);
  return run_compare(*compare_command, compare);
}
