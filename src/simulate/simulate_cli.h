// The `odc simulate` subcommand: options, the sweep over rank counts, policies and modes, and its
// table / JSON output. Kept beside the simulator so odc_main.cc only wires it in.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "common/status.h"
#include "planner/plan.h"

namespace odc::simulate {

// The sample options `odc plan`, `odc compare` and `odc simulate` share, with one spelling and
// one default each (odc.train's own names): a minibatch is ranks x samples_per_rank
// consecutive samples of the file, after dropping those above max_length.
struct SampleArgs {
  std::string lengths_path;
  int64_t samples_per_rank = 4;
  std::optional<int64_t> minibatch_size;  // deprecated (plan, compare): samples per minibatch
  std::optional<int64_t> max_tokens;      // token cap per microbatch; default: the longest sample
  std::optional<int64_t> max_length;      // drop samples longer than this
  // Lengths given in place of a file (the C API's odcSimulate): read_samples uses them when set.
  std::optional<std::vector<int64_t>> given_lengths;
};

// `deprecated_minibatch_size`: also accept --minibatch-size (plan and compare had it).
void add_sample_options(CLI::App& command, SampleArgs& args, bool deprecated_minibatch_size);

// The lengths the options select: the file's, those above max_length dropped; file_index[i] is
// sample i's position among the file's lengths (plans name samples by it).
struct Samples {
  std::vector<int64_t> lengths;
  std::vector<int64_t> file_index;
  int64_t max_tokens = 0;
};
Result<Samples> read_samples(const SampleArgs& args);

struct CliArgs {
  SampleArgs samples;
  std::string model = "1.5b";
  std::optional<int64_t> layers;
  std::optional<double> layer_params;
  std::optional<double> other_params;
  std::string cost;  // A,B,C seconds; default: the model preset's fit on 4 H200s
  std::optional<int64_t> cost_calibrated_on;  // GPUs the cost was fitted on under FSDP2
  std::string ranks = "8,16,32,64,128,256,512,1024";
  int64_t minibatches = 20;
  std::string policies = "local-sort,lb-micro,lb-mini,lb-mini-padded";
  std::string microbatch_memory = "lb-micro";  // LB-Mini's microbatch bound (planner/plan.h)
  // As in plan and compare: auto adds lb-micro+split and lb-mini+split arms (of the policies
  // given); off runs the split check and prints compare's hint where splitting would pay.
  std::string split = "off";
  double split_exchange = planner::kDefaultSplitExchange;
  std::string rank_speed;  // S0,S1,...: one speed per rank, so one rank count in --ranks
  std::string modes = "collective,fsdp2-deferred,fsdp2-unsharded,odc,odc-hybrid";
  // sft: every minibatch a training minibatch. grpo: GRPO's training phase (simulate.h,
  // GrpoPlans): per RL step of ranks x samples_per_rank rollouts two forward-only minibatches and
  // minibatches_per_step updates; --minibatches then counts RL steps.
  std::string task = "sft";
  int64_t minibatches_per_step = 2;
  int64_t gpus_per_node = 8;
  double nvlink_gbytes = 290;
  double nvlink_collective_gbytes = 300;
  double network_gbits = 400;
  double nvlink_latency_us = 10;
  double network_latency_us = 10;
  double forward_fraction = 0.25;
  std::string transport_path;      // curves from odc_bench (python -m odc.simulate --curves)
  double gpu_memory_gbytes = 141;  // an H200's, where the presets' costs were fitted
  std::string format = "table";
};

void add_cli_options(CLI::App& command, CliArgs& args);

// CLI11 2.1 saturates an integer beyond int64_t (99999999999999999999 reads as INT64_MAX, and the
// error, if any, then names a number nobody typed): every integer option of `odc` checks the text.
CLI::Validator int64_range();

// Runs the sweep and writes the table or JSON to `out`; returns 0, or 2 with `error` set. With
// `document`, the JSON is also stored there (for --plot under the table).
int run_cli(const CliArgs& args, std::ostream& out, std::string& error,
            std::string* document = nullptr);

}  // namespace odc::simulate
