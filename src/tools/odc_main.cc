// The `odc` command-line tool. Subcommands:
//   odc plan     one policy's plan as JSON (the documented contract) or a table
//   odc compare  the three policies side by side on the same lengths (the main job's table)
// Every user error exits with status 2 and one line naming the problem.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "planner/plan_format.h"
#include "planner/plan_io.h"

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
  command.add_option("--cost", args.cost, "microbatch cost C + sum(A*L + B*L^2), as A,B,C")
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
  // Option errors come before reading a possibly large file.
  ODC_RETURN_IF_ERROR(odc::planner::validate_plan_options(options));
  auto read = odc::planner::read_lengths_file(args.lengths_path);
  if (!read.ok()) return read.status();
  lengths = std::move(read).value();
  return Status::Ok();
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::ParseError& error) {
    const std::string command =
        app.get_subcommands().empty() ? std::string("") : app.get_subcommands().front()->get_name();
    return fail(command, error.what());
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
  std::cout << odc::planner::compare_table(plans);
  return 0;
}
