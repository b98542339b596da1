// `odc simulate`: per-layer event simulation of one training configuration (ranks, policy,
// communication mode, SFT or GRPO's training phase) on the planner's own plans and cost model, no
// CUDA. Key invariant: with free communication and no optimizer time, a simulated minibatch takes
// exactly the planner's predicted time (collective, fsdp2-deferred: sum_k max_r C[r][k]; odc,
// odc-hybrid, fsdp2-unsharded: max_r sum_k C[r][k]; a forward-only minibatch the same on its
// forward-scaled costs); everything else (exposed transfers, contention, barrier, cross-node
// reduction, optimizer) only adds to it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "planner/plan.h"

namespace odc::simulate {

// The arms odc.train runs (python/odc/train/arms.py), named as it names them.
enum class Mode {
  kCollective,  // FSDP2: per-layer all-gather / reduce-scatter, every rank waits for the slowest
  // FSDP2 with gradient sync deferred to the last microbatch (verl's default): the per-layer
  // all-gathers of every microbatch stay (lockstep), one reduce-scatter per layer per minibatch.
  kFsdp2Deferred,
  // FSDP2 with resharding off and sync deferred: every unit all-gathered once at the minibatch's
  // start, nothing in between, one reduce-scatter per layer in the last microbatch's backward.
  // Ranks may run different microbatch counts; they meet at the start and in that backward.
  kFsdp2Unsharded,
  kOdcFlat,    // ODC: every rank owns 1/N of the state; pulls and pushes, one barrier per minibatch
  kOdcHybrid,  // ODC within a node, replicated across nodes, one cross-node reduction per minibatch
};

std::string_view mode_name(Mode mode);
Result<Mode> parse_mode(std::string_view name);  // the message names every mode

// Whether ranks meet at every microbatch (collective, fsdp2-deferred: every rank must run the
// same microbatch count, and the planner's collective time applies) or only at the minibatch's
// edges (the others: counts may differ, the planner's odc time applies).
bool lockstep(Mode mode);
bool is_odc(Mode mode);  // odc or odc-hybrid; the other modes are the FSDP2 baselines

// The policies odc.train runs (arms.POLICIES): the planner's three, and lb-mini-padded, LB-Mini's
// plan with every rank padded to the minibatch's largest microbatch count with empty microbatches
// (cost c each, appended: LB-Mini sorts a rank's microbatches by cost, descending), which lockstep
// modes can run (arms.adapt_plan).
struct PolicyChoice {
  planner::Policy policy = planner::Policy::kLbMini;
  bool padded = false;
};
std::string policy_label(const PolicyChoice& choice);
Result<PolicyChoice> parse_policy_choice(std::string_view name);  // the message names every one

// Bytes per parameter element moved, as odc.torch runs bf16 mixed precision with fp32 master
// weights (docs/torch.md "What happens", "Memory"): FSDP2's all-gather moves the bf16 cast; ODC
// publishes FSDP2's fp32 shards in place and its gathers pull fp32, narrowing to bf16 on arrival
// (odcGatherAs), so a pull moves 4 bytes; gradients are pushed or reduce-scattered in fp32.
inline constexpr double kAllGatherBytes = 2.0;  // collective: bf16 parameters
inline constexpr double kPullBytes = 4.0;       // ODC: the published fp32 shards
inline constexpr double kGradBytes = 4.0;       // both: fp32 gradients

// Parameter counts of the model (elements).
struct ModelShape {
  int64_t num_layers = 0;
  double layer_params = 0.0;  // per transformer layer
  double other_params = 0.0;  // embeddings, LM head, final norm: the root FSDP unit
};

// Bounds the simulator checks: its time grows with layers x microbatches x ranks, and the cost
// calibration (cost_calibration_ranks) runs a lockstep minibatch of that many ranks per
// microbatch. Real models have ~100 layers and nodes a few dozen GPUs.
inline constexpr int64_t kMaxLayers = 10000;
inline constexpr int64_t kMaxCalibrationRanks = 1024;

// The Qwen2-shaped presets of odc.train: "tiny", "0.5b", "1.5b" (1.54B, tied head), "7b" (7.6B).
Result<ModelShape> model_preset(std::string_view name);

struct Link {
  double bytes_per_second = 0.0;  // per GPU, per direction
  double latency_seconds = 0.0;   // per transfer
};

// Measured bus bandwidth against transfer size (per-rank bytes, as odc_bench and nccl-tests
// report it), ascending sizes; looked up linearly in log(size), clamped at both ends.
struct Curve {
  std::vector<std::pair<double, double>> points;  // (bytes, bytes per second)
  bool empty() const { return points.empty(); }
  double bandwidth(double bytes) const;
};

// Within a node, from `odc_bench` (python -m odc.simulate --curves converts its output): when a
// curve is present it replaces the constant NVLink bandwidth (and latency) for that operation.
struct TransportCurves {
  Curve gather;          // ODC gather (pulls)
  Curve scatter;         // ODC scatter-accumulate, back-to-back pushes in one minibatch
  Curve all_gather;      // NCCL all-gather
  Curve reduce_scatter;  // NCCL reduce-scatter
};

struct Topology {
  int64_t gpus_per_node = 8;
  // Measured on 4 H200s (docs/design.md, "Measuring"): ODC pulls/pushes ~290 GB/s when every GPU
  // moves data at once, NCCL all-gather / reduce-scatter ~300 GB/s bus bandwidth at 64-512 MiB.
  Link nvlink{290e9, 10e-6};
  Link nvlink_collective{300e9, 15e-6};
  Link network{50e9, 10e-6};  // a 400 Gb/s NIC per GPU
  TransportCurves curves;
};

struct SimulateOptions {
  Mode mode = Mode::kOdcFlat;
  planner::PlanOptions plan;  // ranks, policy, max_tokens, minibatch_size, cost (seconds)
  ModelShape model;
  Topology topology;
  // Share of a microbatch's cost spent in the forward pass; with activation checkpointing the
  // backward recomputes the forward, so forward : backward = 1 : 3 (without it 1 : 2, 1/3:
  // odc.train's grpo_run.FORWARD_FRACTION). Also what a forward-only microbatch costs:
  // forward_cost().
  double forward_fraction = 0.25;
  // lb-mini-padded (PolicyChoice): plan.policy is kLbMini and every rank's microbatches are padded
  // to the minibatch's largest count before simulating.
  bool pad_to_equal_counts = false;
  // A forward-only minibatch (GRPO's old and reference log-probabilities): gathers only, no
  // backward, no gradient pushes or reduce-scatters, no optimizer step. The plan was made with
  // forward_cost(cost, forward_fraction), so each microbatch's cost is already its forward's.
  bool forward_only = false;
  // Optimizer step (AdamW + gradient clipping) on a rank's shard: bytes of HBM traffic per
  // parameter element over this bandwidth.
  double optimizer_bytes_per_param = 32.0;
  double hbm_bytes_per_second = 3.0e12;
  bool free_communication = false;  // every transfer takes no time (tests and the breakdown)
  // ODC modes only: ranks steal microbatches (planner/steal.h, docs/planner.md "Work stealing").
  // Which rank runs which microbatch, and in which order, is played out on compute times with the
  // runtime's rule (choices by the plan's predicted costs, durations by the actual ones, slowdowns
  // included); the per-layer simulation then runs each rank's resulting sequence.
  bool steal = false;
  // What the plan does not know: rank r runs rank_slowdown[r] times slower than planned (> 0;
  // empty: none). Every arm runs slower alike; only stealing can move work off such a rank.
  std::vector<double> rank_slowdown;
  // When > 0, the cost model was fitted (odc.train's calibration) under FSDP2 on this many ranks
  // of one node with these links, every rank running the same microbatch: its times include
  // that run's exposed collective time. The simulator removes it from each microbatch's cost
  // (C minus the lockstep run's exposed communication for C) before simulating, so that
  // communication is not counted twice. 0: the cost is compute alone.
  int64_t cost_calibration_ranks = 0;
};

// Where the time of a configuration goes, summed over minibatches (seconds; per rank means).
struct SimulateResult {
  int64_t num_minibatches = 0;
  double seconds = 0.0;               // sum of minibatch times
  double compute_seconds = 0.0;       // mean over ranks of busy (forward + backward) time
  double exposed_comm_seconds = 0.0;  // seconds minus the same run with free communication
  double idle_seconds = 0.0;          // waiting for other ranks (imbalance)
  double optimizer_seconds = 0.0;
  double planner_seconds = 0.0;  // the planner's predicted time for the same plan
  double bubble = 0.0;           // 1 - sum(busy) / (N * sum(T)), T with everything included
  std::vector<double> minibatch_seconds;
};

Status validate_simulate_options(const SimulateOptions& options);

// Memory per GPU of a layout (bytes) as the runtime lays it out, not measured here: model state
// from docs/multinode.md ("Choosing"), ODC's buffers from docs/runtime.md ("Memory") and
// docs/multinode.md. Activations are not in it: they follow a microbatch's tokens, the model and
// activation checkpointing, which the simulator does not model.
struct MemoryPerGpu {
  // Sharded state, 16 B per parameter in every layout: FSDP2 over N (fp32 parameter 4, gradient 4,
  // AdamW 8); ODC flat over N (odc.torch publishes FSDP2's fp32 shards in place, no copy, and its
  // fp32 accumulator is the gradient); hybrid over the node's G GPUs (replicated across nodes).
  double state_bytes = 0.0;
  // Full units in flight, the same in every layout (odc.torch gathers into FSDP2's buffers): bf16
  // parameters of two layers (one-layer prefetch) and of the root unit, and the fp32 gradient of
  // the larger unit before it is pushed or reduce-scattered.
  double gathered_bytes = 0.0;
  // Held unsharded on every GPU by the FSDP2 baselines that keep them between microbatches:
  // fsdp2-deferred the fp32 gradients of the whole model (4 B per parameter), accumulated until
  // the last microbatch's reduce-scatter; fsdp2-unsharded also the bf16 parameters (2 + 4 B).
  double unsharded_bytes = 0.0;
  // ODC's own buffers beyond the shards: none within a node (CUDA's remote adds); flat across
  // nodes (NVSHMEM) the streamed staging budget and the node cache of remote parameter shards
  // ((nodes - 1) x the fp32 shard, at most its budget); the runtime's defaults, 256 MiB each.
  double odc_bytes = 0.0;
  double total_bytes() const { return state_bytes + gathered_bytes + unsharded_bytes + odc_bytes; }
};

inline constexpr double kStagingBudgetBytes = 256.0 * 1024 * 1024;    // ODC_STAGING_BYTES
inline constexpr double kNodeCacheBudgetBytes = 256.0 * 1024 * 1024;  // ODC_NODE_CACHE_BYTES

// `reference_model`: GRPO's training phase also holds a frozen reference model, sharded like the
// policy (its fp32 parameters: 4 B per parameter over the sharding group), in state_bytes.
MemoryPerGpu memory_per_gpu(const ModelShape& model, Mode mode, int64_t num_ranks,
                            int64_t gpus_per_node, bool reference_model = false);

// Simulates every minibatch of `plan` (made with options.plan from `lengths`).
Result<SimulateResult> simulate_plan(const planner::Plan& plan, std::span<const int64_t> lengths,
                                     const SimulateOptions& options);

// Plans `lengths` with options.plan, then simulates. Lockstep modes (collective, fsdp2-deferred)
// cannot run LB-Mini unpadded (unequal microbatch counts): that is an error naming the combination.
Result<SimulateResult> simulate(std::span<const int64_t> lengths, const SimulateOptions& options);

// The plan as the mode and policy run it (odc.train's arms.adapt_plan): lb-mini-padded pads every
// rank to the minibatch's largest microbatch count; fsdp2-unsharded gives a rank without
// microbatches one empty microbatch (its backward carries the rank's part of the minibatch's
// reduce-scatter). Predicted times are recomputed. simulate_plan applies it itself.
planner::Plan adapt_plan(const planner::Plan& plan, std::span<const int64_t> lengths,
                         const SimulateOptions& options);

// The cost model of a forward-only microbatch: every term (a, b, c and the floor) times
// `forward_fraction`, as odc.train's grpo_run._step_plans scales it.
planner::CostModel forward_cost(const planner::CostModel& cost, double forward_fraction);

// GRPO's training phase (odc.train --task grpo, docs/design.md "RL workload"): per RL step of S =
// options.plan.minibatch_size rollouts, two forward-only minibatches over all S (old log-probs on
// the policy, reference log-probs on a frozen model of the same shape), then K update minibatches
// of S / K rollouts. Planned as grpo_run._step_plans plans them: one forward-only plan per step
// with forward_cost(), one update plan of K minibatches with the full cost.
struct GrpoPlans {
  planner::Plan forward_only;  // one minibatch per RL step
  planner::Plan update;        // K minibatches per RL step
};
// The planning alone (no model or links needed; `odc compare --task grpo` uses it): `lengths`
// whole RL steps of options.minibatch_size rollouts.
Result<GrpoPlans> plan_grpo(std::span<const int64_t> lengths, const planner::PlanOptions& options,
                            double forward_fraction, int64_t minibatches_per_step);
Result<GrpoPlans> make_grpo_plans(std::span<const int64_t> lengths, const SimulateOptions& options,
                                  int64_t minibatches_per_step);

struct GrpoResult {
  int64_t num_rl_steps = 0;
  // One forward-only phase over every RL step (the reference's phase runs the same plan on a
  // model of the same shape, so it takes the same simulated time; an RL step holds two).
  SimulateResult forward_phase;
  SimulateResult update;  // every update minibatch
  // Per RL step, everything: seconds = 2 x forward phase + K updates; minibatch_seconds holds one
  // entry per RL step and num_minibatches counts RL steps; bubble over all of it.
  SimulateResult rl_step;
};
Result<GrpoResult> simulate_grpo_plans(const GrpoPlans& plans, std::span<const int64_t> lengths,
                                       const SimulateOptions& options,
                                       int64_t minibatches_per_step);
// `lengths` hold whole RL steps (a multiple of options.plan.minibatch_size).
Result<GrpoResult> simulate_grpo(std::span<const int64_t> lengths, const SimulateOptions& options,
                                 int64_t minibatches_per_step);

// `num_samples` lengths: `source` in order, repeated as often as needed, each further pass in a
// fixed pseudo-random order (seeded by `seed`), so that large rank counts get enough minibatches.
// Reads the curves file: {"curves": {"gather": [[bytes, GB/s], ...], ...}} (docs/simulate.md).
Result<TransportCurves> read_transport_curves(const std::string& path);

std::vector<int64_t> resample_lengths(std::span<const int64_t> source, int64_t num_samples,
                                      uint64_t seed);

}  // namespace odc::simulate
