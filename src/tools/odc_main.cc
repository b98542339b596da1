// The `odc` command-line tool. Subcommands:
//   odc plan     one policy's plan as JSON (the documented contract) or a table
//   odc compare  the three policies side by side on the same lengths (the main job's table), as a
//                table, JSON or CSV, and optionally as a figure (--plot, drawn by the Python
//                module odc.compare_plot in a child process: this tool links no Python)
//   odc simulate step time, bubble and speedup of collective / ODC at many rank counts
// Every user error exits with status 2 and one line naming the problem.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "planner/plan_format.h"
#include "planner/plan_io.h"
#include "simulate/simulate_cli.h"

namespace {

using odc::Status;
using odc::planner::Plan;
using odc::planner::PlanOptions;

constexpr int kUsageError = 2;

// Options shared by `plan` and `compare`, as the user typed them.
struct CommonArgs {
  std::string lengths_path;
  int64_t num_ranks = 0;
  int64_t max_tokens = 0;
  std::optional<int64_t> minibatch_size;
  std::string cost = "1,0,0";
  std::string rank_speed;
  std::string split = "off";
  double split_exchange = odc::planner::kDefaultSplitExchange;
  std::string microbatch_memory = "lb-micro";
};

void add_common_options(CLI::App& command, CommonArgs& args) {
  command
      .add_option("--lengths", args.lengths_path,
                  "file with one sample length (tokens) per line; '-' reads stdin")
      ->required();
  command.add_option("--ranks", args.num_ranks, "number of data-parallel ranks (N)")->required();
  command.add_option("--max-tokens", args.max_tokens, "token cap per microbatch (T)")->required();
  command.add_option("--minibatch-size", args.minibatch_size,
                     "samples per minibatch, consecutive in file order (default: all)");
  command
      .add_option("--cost", args.cost,
                  "microbatch cost C + sum(A*L + B*L^2), as A,B,C; A,B,C,F: at least F per "
                  "microbatch (the host-bound floor)")
      ->capture_default_str();
  command.add_option("--rank-speed", args.rank_speed,
                     "relative speed of each rank, S0,S1,... (default: all equal)");
  command
      .add_option("--split", args.split,
                  "auto: run a sample above the minibatch's per-rank share on a group of ranks "
                  "(lb-mini, lb-micro); off")
      ->capture_default_str();
  command
      .add_option("--split-exchange", args.split_exchange,
                  "K/V exchange cost of a split chunk per token received, as a fraction of A")
      ->capture_default_str();
  command
      .add_option("--microbatch-memory", args.microbatch_memory,
                  "lb-micro: no lb-mini microbatch above the largest lb-micro builds for the "
                  "same minibatch (no more activation memory); cap: up to --max-tokens (fastest)")
      ->capture_default_str();
  for (const char* name : {"--ranks", "--max-tokens", "--minibatch-size"}) {
    command.get_option(name)->check(odc::simulate::int64_range());
  }
}

// Turns the typed arguments into plan inputs; the first problem found is returned.
Status build_inputs(const CommonArgs& args, std::vector<int64_t>& lengths, PlanOptions& options) {
  options.num_ranks = args.num_ranks;
  options.max_tokens = args.max_tokens;
  if (args.minibatch_size) options.minibatch_size = *args.minibatch_size;
  auto cost = odc::planner::parse_cost(args.cost);
  if (!cost.ok()) return cost.status();
  options.cost = cost.value();
  if (!args.rank_speed.empty()) {
    auto speeds = odc::planner::parse_rank_speed(args.rank_speed);
    if (!speeds.ok()) return speeds.status();
    options.rank_speed = speeds.value();
  }
  auto split = odc::planner::parse_split_mode(args.split);
  if (!split.ok()) return split.status();
  options.split = split.value();
  options.split_exchange = args.split_exchange;
  auto memory = odc::planner::parse_microbatch_memory(args.microbatch_memory);
  if (!memory.ok()) return memory.status();
  options.microbatch_memory = memory.value();
  // Option errors come before reading a possibly large file.
  ODC_RETURN_IF_ERROR(odc::planner::validate_plan_options(options));
  auto read = odc::planner::read_lengths_file(args.lengths_path);
  if (!read.ok()) return read.status();
  lengths = std::move(read).value();
  return Status::Ok();
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

nlohmann::ordered_json compare_json(const std::vector<Plan>& plans) {
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

// The line under the comparison table: what ODC + LB-Mini buys over collective + LB-Micro.
std::string speedup_line(const std::vector<Plan>& plans) {
  const auto rows = compare_rows(plans);
  const double baseline = baseline_time(rows);
  // The last row: lb-mini, or lb-mini+split when splitting is on.
  char line[200];
  std::snprintf(line, sizeof(line),
                "predicted speedup of odc + %s over collective + lb-micro: %.2fx\n",
                rows.back().policy.c_str(), speedup(baseline, rows.back().time_odc));
  return line;
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

// Runs `python -m odc.compare_plot PATH` with the comparison JSON on its stdin. Returns "" or why
// it failed; the child's own message (e.g. matplotlib missing) goes to stderr.
std::string write_plot(const nlohmann::ordered_json& comparison, const std::string& path,
                       const std::string& title) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return "cannot create a pipe for the plotter";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[0], STDIN_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[1]);
  const std::string python = plot_python();
  std::vector<std::string> words = {python, "-m", "odc.compare_plot", path, title};
  std::vector<char*> argv;
  for (auto& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[0]);
  if (spawned != 0) {
    close(pipe_fds[1]);
    return "cannot start '" + python + "' to draw the plot (set ODC_PYTHON)";
  }
  const std::string text = comparison.dump();
  std::signal(SIGPIPE, SIG_IGN);  // a plotter that dies early must not kill this process
  FILE* to_child = fdopen(pipe_fds[1], "w");
  if (to_child != nullptr) {
    std::fwrite(text.data(), 1, text.size(), to_child);
    std::fclose(to_child);
  } else {
    close(pipe_fds[1]);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return "the plotter (" + python + " -m odc.compare_plot) failed; see its message above";
  }
  return "";
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"odc: On-Demand Communication for variable-length sharded training"};
  app.set_version_flag("--version", "odc " ODC_VERSION_STRING);
  app.require_subcommand(1);

  CommonArgs plan_args;
  std::string policy_text;
  std::string format = "json";
  CLI::App* plan_command =
      app.add_subcommand("plan", "plan one minibatch schedule and predict its bubble");
  add_common_options(*plan_command, plan_args);
  plan_command->add_option("--policy", policy_text, "local-sort, lb-micro or lb-mini")->required();
  plan_command->add_option("--format", format, "json or table")->capture_default_str();

  CommonArgs compare_args;
  CLI::App* compare_command = app.add_subcommand(
      "compare", "predict the bubble of all three policies under collective and ODC execution");
  add_common_options(*compare_command, compare_args);
  std::string compare_format = "table";
  std::string plot_path;
  compare_command->add_option("--format", compare_format, "table, json or csv")
      ->capture_default_str();
  compare_command->add_option("--plot", plot_path,
                              "also draw the bubbles and speedups into this PNG (needs Python "
                              "with matplotlib and the odc package)");

  odc::simulate::CliArgs simulate_args;
  CLI::App* simulate_command = app.add_subcommand(
      "simulate", "simulate collective and ODC training at many rank counts (docs/simulate.md)");
  odc::simulate::add_cli_options(*simulate_command, simulate_args);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForVersion& version) {
    return app.exit(version);
  } catch (const CLI::ParseError& error) {
    const std::string command =
        app.get_subcommands().empty() ? std::string("") : app.get_subcommands().front()->get_name();
    return fail(command, error.what());
  }

  if (simulate_command->parsed()) {
    std::string error;
    const int code = odc::simulate::run_cli(simulate_args, std::cout, error);
    return code == 0 ? 0 : fail("simulate", error);
  }

  if (plan_command->parsed()) {
    if (format != "json" && format != "table") {
      return fail("plan", "unknown format " + odc::planner::quote_text(format) +
                              ": expected json or table");
    }
    auto policy = odc::planner::parse_policy(policy_text);
    if (!policy.ok()) return fail("plan", policy.status().message());
    std::vector<int64_t> lengths;
    PlanOptions options;
    options.policy = policy.value();
    if (Status status = build_inputs(plan_args, lengths, options); !status.ok()) {
      return fail("plan", status.message());
    }
    auto plan = odc::planner::make_plan(lengths, options);
    if (!plan.ok()) return fail("plan", plan.status().message());
    std::string text = format == "json" ? odc::planner::plan_to_json(plan.value()) + "\n"
                                        : odc::planner::plan_to_table(plan.value());
    if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout)) {
      return fail("plan", std::string("cannot write the plan: ") + std::strerror(errno));
    }
    return 0;
  }

  if (compare_format != "table" && compare_format != "json" && compare_format != "csv") {
    return fail("compare", "unknown format '" + compare_format + "': expected table, json or csv");
  }
  std::vector<int64_t> lengths;
  PlanOptions options;
  if (Status status = build_inputs(compare_args, lengths, options); !status.ok()) {
    return fail("compare", status.message());
  }
  std::vector<Plan> plans;
  const odc::planner::SplitMode split = options.split;
  for (auto policy : {odc::planner::Policy::kLocalSort, odc::planner::Policy::kLbMicro,
                      odc::planner::Policy::kLbMini}) {
    options.policy = policy;
    options.split = odc::planner::SplitMode::kOff;
    auto plan = odc::planner::make_plan(lengths, options);
    if (!plan.ok()) return fail("compare", plan.status().message());
    plans.push_back(std::move(plan).value());
  }
  // With --split auto, the two policies that can split, split (issue #14).
  if (split == odc::planner::SplitMode::kAuto) {
    for (auto policy : {odc::planner::Policy::kLbMicro, odc::planner::Policy::kLbMini}) {
      options.policy = policy;
      options.split = split;
      auto plan = odc::planner::make_plan(lengths, options);
      if (!plan.ok()) return fail("compare", plan.status().message());
      plans.push_back(std::move(plan).value());
    }
  }
  if (compare_format == "json") {
    std::cout << compare_json(plans).dump(1) << "\n";
  } else if (compare_format == "csv") {
    std::cout << compare_csv(plans);
  } else {
    std::cout << odc::planner::compare_table(plans) << speedup_line(plans);
  }
  if (!plot_path.empty()) {
    std::cout << std::flush;
    const std::string title = compare_args.lengths_path + ": " + std::to_string(options.num_ranks) +
                              " ranks, max " + std::to_string(options.max_tokens) + " tokens";
    if (std::string error = write_plot(compare_json(plans), plot_path, title); !error.empty()) {
      std::fprintf(stderr, "odc compare: error: %s\n", error.c_str());
      return 1;
    }
    // The table's reader learns where the figure is; JSON and CSV stay machine-readable.
    std::fprintf(compare_format == "table" ? stdout : stderr, "plot: %s\n", plot_path.c_str());
  }
  return 0;
}
