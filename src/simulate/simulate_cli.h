// The `odc simulate` subcommand: options, the sweep over rank counts, policies and modes, and its
// table / JSON output. Kept beside the simulator so odc_main.cc only wires it in.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

namespace odc::simulate {

struct CliArgs {
  std::string lengths_path;
  std::string model = "1.5b";
  std::optional<int64_t> layers;
  std::optional<double> layer_params;
  std::optional<double> other_params;
  std::string cost;  // A,B,C seconds; default: the model preset's fit on 4 H200s
  std::optional<int64_t> cost_calibrated_on;  // GPUs the cost was fitted on under FSDP2
  std::string ranks = "8,16,32,64,128,256,512,1024";
  int64_t samples_per_rank = 4;
  int64_t minibatches = 20;
  std::optional<int64_t> max_tokens;
  std::optional<int64_t> max_length;
  std::string policies = "local-sort,lb-micro,lb-mini";
  std::string microbatch_memory = "lb-micro";  // LB-Mini's microbatch bound (planner/plan.h)
  std::string modes = "collective,odc,odc-hybrid";
  int64_t gpus_per_node = 8;
  double nvlink_gbytes = 290;
  double nvlink_collective_gbytes = 300;
  double network_gbits = 400;
  double nvlink_latency_us = 10;
  double network_latency_us = 10;
  double forward_fraction = 0.25;
  std::string transport_path;  // curves from odc_bench (python -m odc.simulate --curves)
  std::string format = "table";
};

void add_cli_options(CLI::App& command, CliArgs& args);

// CLI11 2.1 saturates an integer beyond int64_t (99999999999999999999 reads as INT64_MAX, and the
// error, if any, then names a number nobody typed): every integer option of `odc` checks the text.
CLI::Validator int64_range();

// Runs the sweep and writes the table or JSON to `out`; returns 0, or 2 with `error` set.
int run_cli(const CliArgs& args, std::ostream& out, std::string& error);

}  // namespace odc::simulate
