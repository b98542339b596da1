// Load-balancing plans for one or more minibatches: which rank runs which samples, in which
// microbatches, and the bubble each plan is predicted to leave under collective and ODC execution.
// Definitions follow docs/design.md ("Load balancing: exact definitions") to the letter.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "planner/cost_model.h"
#include "planner/split.h"

namespace odc::planner {

enum class Policy {
  kLocalSort,  // rank r takes samples r, r+N, ...; one sample per microbatch, shortest first
  kLbMicro,    // equal sample counts, equal microbatch counts (runs under collectives and ODC)
  kLbMini,     // cost-balanced ranks, each packed independently (ODC only)
};

std::string_view policy_name(Policy policy);
Result<Policy> parse_policy(std::string_view name);

// Splitting outliers (split.h): off, or automatic (a sample above the minibatch's ideal per-rank
// share runs on a group of ranks when that lowers the predicted span). LB-Mini and LB-Micro only.
enum class SplitMode { kOff, kAuto };
std::string_view split_mode_name(SplitMode mode);
Result<SplitMode> parse_split_mode(std::string_view name);

// How large LB-Mini may make a microbatch. Activation memory follows a microbatch's tokens, and
// LB-Mini's fewest-microbatch packing fills the token cap where LB-Micro's shared count leaves
// room: on the 7b preset at 64K that alone cost 1.3x FSDP2's peak memory
// (docs/benchmarks-archive.md).
//   kLbMicro: no LB-Mini microbatch exceeds the largest one LB-Micro builds for the same
//             minibatch, so ODC + LB-Mini needs no more activation memory than collective +
//             LB-Micro (default; a rank may take a few more microbatches, c each).
//   kCap:     up to max_tokens: the fastest predicted plan, at more activation memory.
// Other policies ignore it.
enum class MicrobatchMemory { kLbMicro, kCap };
std::string_view microbatch_memory_name(MicrobatchMemory memory);
Result<MicrobatchMemory> parse_microbatch_memory(std::string_view name);

// Default K/V exchange cost of a split chunk per token received, as a fraction of the per-token
// cost a (split_chunk_cost). Qwen2-1.5B shape: 28 layers x K and V x 2 heads x 128 x 2 bytes =
// 28 KiB per token, moved three times (forward, recomputation, gradient) = 86 KB per token; at an
// effective ~100 GB/s that is 0.86 us against a = 1.7e-5 s: 0.05.
inline constexpr double kDefaultSplitExchange = 0.05;

// Plans cost memory proportional to samples x ranks; beyond this many ranks a plan is a mistake.
inline constexpr int64_t kMaxRanks = 65536;

// Most samples one plan takes: packing addresses a minibatch's samples with int.
inline constexpr int64_t kMaxSamples = INT32_MAX;

// Minibatch size meaning "all samples in one minibatch".
inline constexpr int64_t kAllSamples = INT64_MAX;

struct PlanOptions {
  int64_t num_ranks = 1;
  int64_t max_tokens = 0;
  Policy policy = Policy::kLbMini;
  int64_t minibatch_size = kAllSamples;  // consecutive samples per minibatch
  CostModel cost;
  std::vector<double> rank_speed;  // empty = every rank at speed 1
  SplitMode split = SplitMode::kOff;
  double split_exchange = kDefaultSplitExchange;                    // >= 0, see split_chunk_cost
  MicrobatchMemory microbatch_memory = MicrobatchMemory::kLbMicro;  // LB-Mini only
  // Also predict every minibatch with work stealing (steal.h; docs/planner.md, "Work stealing"):
  // MinibatchPlan::steal and Plan::steal_bubble. The plan itself does not change.
  bool steal = false;
};

// Checks options, then lengths against them; the messages are the ones the CLI and Python show.
Status validate_plan_options(const PlanOptions& options);
Status validate_plan_inputs(std::span<const int64_t> lengths, const PlanOptions& options);

using Microbatch = std::vector<int64_t>;  // global sample indices

struct RankPlan {
  std::vector<Microbatch> microbatches;
};

// Predicted time accounting of one minibatch (docs/design.md, "Load balancing: exact
// definitions"): busy = sum of all microbatch times, collective = sum over steps of the slowest
// rank, odc = the slowest rank's total.
struct MinibatchTimes {
  double busy = 0.0;
  double collective = 0.0;
  double odc = 0.0;
};

struct Bubble {
  double collective = 0.0;
  double odc = 0.0;
};

// A minibatch run under ODC with work stealing (steal.h): span and busy time (seconds or cost
// units, as the plan's times) and how many microbatches ran on a rank other than their planned one.
struct StealTimes {
  double span = 0.0;
  double busy = 0.0;
  int64_t num_moved = 0;
  double bubble = 0.0;  // 1 - busy / (N * span)
};

struct MinibatchPlan {
  std::vector<int64_t> samples;  // global indices, in file order
  std::vector<RankPlan> ranks;   // num_ranks entries; split samples appear in none
  // Samples run as context-parallel chunks, in execution order (global indices); every group
  // member runs its chunk before its microbatches. Groups are disjoint. Empty without splitting.
  std::vector<SplitSample> splits;
  MinibatchTimes times;
  Bubble bubble;
  StealTimes steal;  // with options.steal only
};

struct Plan {
  PlanOptions options;
  std::vector<MinibatchPlan> minibatches;
  Bubble bubble;  // over all minibatches: 1 - sum(busy) / (N * sum(T))
  // With options.steal: ODC with stealing over all minibatches, 1 - sum(busy) / (N * sum(span)).
  double steal_bubble = 0.0;
};

// Validates, then plans every minibatch. Same inputs give the same plan on every machine.
Result<Plan> make_plan(std::span<const int64_t> lengths, const PlanOptions& options);

// Predicted times of a minibatch from its microbatches (time = cost / rank speed).
MinibatchTimes predict_times(const std::vector<RankPlan>& ranks, std::span<const int64_t> lengths,
                             const PlanOptions& options);

// The same with split samples: a group member first spends its group's time (the slowest member's
// chunk) as its first step, then runs its microbatches; busy counts each member's own chunk.
MinibatchTimes predict_times(const std::vector<RankPlan>& ranks,
                             const std::vector<SplitSample>& splits,
                             std::span<const int64_t> lengths, const PlanOptions& options);

// One minibatch of a plan run under ODC with work stealing (steal.h): queue r is rank r's
// microbatches in plan order, predicted cost = the microbatch's cost (cost model, floor included);
// rank r runs an item in cost / (rank speed x its slowdown) and starts after its split group's time
// (the group's slowest chunk), which counts as busy as in predict_times. `rank_slowdown`: empty,
// or one factor > 0 per rank the plan did not know of (the rank runs that many times slower).
Result<StealTimes> predict_stealing(const MinibatchPlan& minibatch,
                                    std::span<const int64_t> lengths, const PlanOptions& options,
                                    std::span<const double> rank_slowdown = {});

// 1 - busy / (num_ranks * span); 0 when nothing runs.
double bubble_rate(double busy, int64_t num_ranks, double span);

}  // namespace odc::planner
