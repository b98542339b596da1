// A simulator sweep as a typed request and typed rows: for each rank count, every requested policy
// (and, with split auto, its split variant) x mode is planned on the same lengths and simulated;
// speedup is against collective + lb-micro at the same rank count. No parsing and no rendering
// here: the command line builds a Sweep (src/tools/cli_options.h), sweep_format.h prints it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "planner/plan.h"
#include "simulate/simulate.h"

namespace odc::simulate {

// The samples `odc plan`, `odc compare` and `odc simulate` draw (odc.train's own names): a
// minibatch is ranks x samples_per_rank consecutive samples, after dropping those above
// max_length.
struct SampleSelection {
  std::string lengths_path;  // a lengths file ('-': stdin), unless `given_lengths` is set
  int64_t samples_per_rank = 4;
  std::optional<int64_t> minibatch_size;  // deprecated (plan, compare): samples per minibatch
  std::optional<int64_t> max_tokens;      // token cap per microbatch; default: the longest sample
  std::optional<int64_t> max_length;      // drop samples longer than this
  std::optional<std::vector<int64_t>> given_lengths;  // in place of the file (the C API's)
};

// The lengths a selection keeps: the file's, those above max_length dropped; file_index[i] is
// sample i's position among the file's lengths (plans name samples by it).
struct Samples {
  std::vector<int64_t> lengths;
  std::vector<int64_t> file_index;
  int64_t max_tokens = 0;
};
Result<Samples> read_samples(const SampleSelection& selection);

// sft: every minibatch a training minibatch. grpo: GRPO's training phase (simulate.h, GrpoPlans):
// per RL step of ranks x samples_per_rank rollouts two forward-only minibatches and
// minibatches_per_step updates; `minibatches` then counts RL steps.
enum class Task { kSft, kGrpo };
std::string_view task_name(Task task);
Result<Task> parse_task(std::string_view name);

// Comma-separated names as `odc simulate` takes them ("lb-micro,lb-mini"); the message names the
// first unknown one. An empty text gives an empty list.
Result<std::vector<PolicyChoice>> parse_policy_list(const std::string& text);
Result<std::vector<Mode>> parse_mode_list(const std::string& text);

// An H200's memory, where the presets' costs were fitted: what a sweep assumes unless told.
inline constexpr double kDefaultGpuMemoryGbytes = 141;

// What to simulate. Every field has the command's default; the messages of `run_sweep` name the
// command's options (--ranks, ...), which are this struct's fields.
struct Sweep {
  SampleSelection samples;
  std::string model = "1.5b";  // a preset (model_preset), unless the three below are all set
  std::optional<int64_t> layers;
  std::optional<double> layer_params;
  std::optional<double> other_params;
  std::optional<planner::CostModel> cost;     // seconds; default: the preset's fit on 4 H200s
  std::optional<int64_t> cost_calibrated_on;  // GPUs the cost was fitted on under FSDP2
  std::vector<int64_t> ranks = {8, 16, 32, 64, 128, 256, 512, 1024};
  int64_t minibatches = 20;
  std::vector<PolicyChoice> policies = {{planner::Policy::kLocalSort, false},
                                        {planner::Policy::kLbMicro, false},
                                        {planner::Policy::kLbMini, false},
                                        {planner::Policy::kLbMini, true}};
  planner::MicrobatchMemory microbatch_memory = planner::MicrobatchMemory::kLbMicro;
  // auto adds lb-micro+split and lb-mini+split arms (of the policies given); off runs the split
  // check instead, which names where splitting would pay.
  planner::SplitMode split = planner::SplitMode::kOff;
  double split_exchange = planner::kDefaultSplitExchange;
  std::vector<double> rank_speed;  // one speed per rank (so one rank count); empty: all equal
  // Also simulate every unpadded arm with work stealing ("+steal", ODC modes only).
  bool steal = false;
  // (rank, factor): that rank runs `factor` times slower than the plan assumes, in every arm and
  // at every rank count (so rank < every --ranks); at most one entry per rank.
  std::vector<std::pair<int64_t, double>> rank_slowdown;
  std::vector<Mode> modes = {Mode::kCollective, Mode::kFsdp2Deferred, Mode::kFsdp2Unsharded,
                             Mode::kOdcFlat, Mode::kOdcHybrid};
  Task task = Task::kSft;
  int64_t minibatches_per_step = 2;
  int64_t gpus_per_node = 8;
  double nvlink_gbytes = 290;
  double nvlink_collective_gbytes = 300;
  double network_gbits = 400;
  double nvlink_latency_us = 10;
  double network_latency_us = 10;
  double forward_fraction = 0.25;
  std::string transport_path;  // curves from odc_bench (python -m odc.simulate --curves)
  double gpu_memory_gbytes = kDefaultGpuMemoryGbytes;
};

// One simulated arm at one rank count.
struct SweepRow {
  int64_t ranks = 0;
  std::string policy, mode;  // the labels printed ("lb-mini+split", "lb-mini+steal", "odc")
  SimulateResult result;     // grpo: per RL step (GrpoResult::rl_step)
  // grpo: one forward-only phase and the update minibatches (GrpoResult).
  SimulateResult forward_phase, update;
  double speedup = 0.0;  // baseline step time / this step time; 0 when there is no baseline
  // The same from the planner's times alone (compute only: odc compare's basis).
  double planner_speedup = 0.0;
  std::string label() const { return mode + " + " + policy; }
};

// The state one GPU holds under one layout at one rank count.
struct MemoryRow {
  int64_t ranks = 0;
  Mode mode = Mode::kCollective;
  MemoryPerGpu memory;
  bool fits = false;  // within the GPU's memory
};

// The split check of a sweep without split auto: at each rank count up to kSplitCheckMaxRanks the
// fastest ODC arm with lb-mini is simulated again on lb-mini+split; the rank count where that
// gains most is kept (ranks 0: none split).
struct SplitCheck {
  int64_t ranks = 0;
  std::string mode;
  double without_seconds = 0.0, with_seconds = 0.0;  // per sweep (sums over minibatches)
  double baseline_seconds = 0.0;                     // 0: the baseline was not simulated
  double gain() const { return with_seconds > 0 ? without_seconds / with_seconds : 0.0; }
};
// lb-mini+split's search tries every group size for every outlier: on the development VM 2 s at
// 64 ranks x 20 minibatches of longalign_like.txt, 150 s at 256. So the check runs at rank counts
// up to this one only (split auto simulates any count, at that cost).
inline constexpr int64_t kSplitCheckMaxRanks = 64;

struct SweepResult {
  Sweep request;
  SimulateOptions base;  // what every arm shares: model, cost, topology, plan options
  // By rank count, then policy (unsplit, then split, then each of those with stealing), then mode.
  std::vector<SweepRow> rows;
  std::vector<MemoryRow> memory;  // by rank count, then mode
  SplitCheck split_check;
  double gpu_memory_bytes = 0.0;
  bool fits(const SweepRow& row) const;  // the memory table's verdict for the row's layout
};

// Runs the sweep. Errors name the option at fault; memory running out is an error too (a sweep's
// size is bounded, a small machine's memory is not).
Result<SweepResult> run_sweep(const Sweep& request);

}  // namespace odc::simulate
