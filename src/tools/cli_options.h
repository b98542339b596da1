// The option tables of the `odc` command (plan, compare, simulate): every option spelled, described
// and defaulted in one place, and simulate's options turned into a typed simulate::Sweep. All of
// odc's CLI11 parsing lives under src/tools; libodc links this file for the C API's odcSimulate,
// which takes the command's options as strings.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "planner/plan.h"
#include "simulate/sweep.h"

namespace odc::tools {

// A default request: where SimulateArgs takes the defaults it shares with the library.
inline const simulate::Sweep kSweepDefaults{};

// CLI11 2.1 saturates an integer beyond int64_t (99999999999999999999 reads as INT64_MAX, and the
// error, if any, then names a number nobody typed): every integer option of `odc` checks the text.
CLI::Validator int64_range();

// --lengths, --samples-per-rank, --max-tokens, --max-length (one vocabulary for all three
// subcommands); `deprecated_minibatch_size`: also --minibatch-size (plan and compare had it).
void add_sample_options(CLI::App& command, simulate::SampleSelection& samples,
                        bool deprecated_minibatch_size);

// The planner's options as typed; each subcommand says what --cost defaults to and what --split
// does in it.
struct PlannerArgs {
  std::string cost;  // A,B,C[,F]
  std::string rank_speed;
  std::string split = "off";
  double split_exchange = planner::kDefaultSplitExchange;
  std::string microbatch_memory = "lb-micro";
};
void add_cost_option(CLI::App& command, std::string& cost, const std::string& help);
void add_rank_speed_option(CLI::App& command, std::string& rank_speed, const std::string& help);
void add_split_options(CLI::App& command, PlannerArgs& args, const std::string& split_help);
void add_microbatch_memory_option(CLI::App& command, std::string& microbatch_memory,
                                  const std::string& help);

// --task, --minibatches-per-step, --forward-fraction (compare and simulate).
struct TaskArgs {
  std::string task = "sft";
  int64_t minibatches_per_step = 2;
  double forward_fraction = 0.25;
};
void add_task_option(CLI::App& command, TaskArgs& args, const std::string& help);
void add_minibatches_per_step_option(CLI::App& command, TaskArgs& args);
void add_forward_fraction_option(CLI::App& command, TaskArgs& args, const std::string& help);

// `odc simulate`'s options as typed (lists comma-separated); defaults are simulate::Sweep's.
struct SimulateArgs {
  simulate::SampleSelection samples;
  PlannerArgs planner;
  TaskArgs task;
  std::string model = "1.5b";
  std::optional<int64_t> layers;
  std::optional<double> layer_params;
  std::optional<double> other_params;
  std::optional<int64_t> cost_calibrated_on;
  std::string ranks = "8,16,32,64,128,256,512,1024";
  int64_t minibatches = 20;
  std::string policies = "local-sort,lb-micro,lb-mini,lb-mini-padded";
  std::string modes = "collective,fsdp2-deferred,fsdp2-unsharded,odc,odc-hybrid";
  bool steal = false;
  std::vector<std::string> rank_slowdown;  // RANK:FACTOR, one per --rank-slowdown
  // The cluster's defaults are simulate::Sweep's, named there once.
  int64_t gpus_per_node = kSweepDefaults.gpus_per_node;
  double nvlink_gbytes = kSweepDefaults.nvlink_gbytes;
  double nvlink_collective_gbytes = kSweepDefaults.nvlink_collective_gbytes;
  double network_gbits = kSweepDefaults.network_gbits;
  double nvlink_latency_us = kSweepDefaults.nvlink_latency_us;
  double network_latency_us = kSweepDefaults.network_latency_us;
  std::string transport_path;
  double gpu_memory_gbytes = kSweepDefaults.gpu_memory_gbytes;
  std::string format = "table";
};
void add_simulate_options(CLI::App& command, SimulateArgs& args);

// The typed request, or the first option that does not parse (format: "table" or "json").
Result<simulate::Sweep> to_sweep(const SimulateArgs& args);

// One line for a CLI11 parse error that names the option, the value typed and the form it takes:
// "--ranks takes a comma-separated list without spaces, got '8 16': --ranks 8,16". `command` is
// the (sub)command whose options were parsed, `args` the words after its name (where the stray or
// unconvertible values are looked up); other errors keep CLI11's words.
std::string parse_error_message(const CLI::ParseError& error, const CLI::App& command,
                                const std::vector<std::string>& args);

}  // namespace odc::tools
