// Load-balancing plans for one or more minibatches: which rank runs which samples, in which
// microbatches, and the bubble each plan is predicted to leave under collective and ODC execution.
// Definitions follow design.md ("Load balancing: exact definitions") to the letter.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "planner/cost_model.h"

namespace odc::planner {

enum class Policy {
  kLocalSort,  // rank r takes samples r, r+N, ...; one sample per microbatch, shortest first
  kLbMicro,    // equal sample counts, equal microbatch counts (runs under collectives and ODC)
  kLbMini,     // cost-balanced ranks, each packed independently (ODC only)
};

std::string_view policy_name(Policy policy);
Result<Policy> parse_policy(std::string_view name);

// Plans cost memory proportional to samples x ranks; beyond this many ranks a plan is a mistake.
inline constexpr int64_t kMaxRanks = 65536;

// Minibatch size meaning "all samples in one minibatch".
inline constexpr int64_t kAllSamples = INT64_MAX;

struct PlanOptions {
  int64_t num_ranks = 1;
  int64_t max_tokens = 0;
  Policy policy = Policy::kLbMini;
  int64_t minibatch_size = kAllSamples;  // consecutive samples per minibatch
  CostModel cost;
  std::vector<double> rank_speed;  // empty = every rank at speed 1
};

// Checks options, then lengths against them; the messages are the ones the CLI and Python show.
Status validate_plan_options(const PlanOptions& options);
Status validate_plan_inputs(std::span<const int64_t> lengths, const PlanOptions& options);

using Microbatch = std::vector<int64_t>;  // global sample indices

struct RankPlan {
  std::vector<Microbatch> microbatches;
};

// Predicted time accounting of one minibatch (design.md): busy = sum of all microbatch times,
// collective = sum over steps of the slowest rank, odc = the slowest rank's total.
struct MinibatchTimes {
  double busy = 0.0;
  double collective = 0.0;
  double odc = 0.0;
};

struct Bubble {
  double collective = 0.0;
  double odc = 0.0;
};

struct MinibatchPlan {
  std::vector<int64_t> samples;  // global indices, in file order
  std::vector<RankPlan> ranks;   // num_ranks entries
  MinibatchTimes times;
  Bubble bubble;
};

struct Plan {
  PlanOptions options;
  std::vector<MinibatchPlan> minibatches;
  Bubble bubble;  // over all minibatches: 1 - sum(busy) / (N * sum(T))
};

// Validates, then plans every minibatch. Same inputs give the same plan on every machine.
Result<Plan> make_plan(std::span<const int64_t> lengths, const PlanOptions& options);

// Predicted times of a minibatch from its microbatches (time = cost / rank speed).
MinibatchTimes predict_times(const std::vector<RankPlan>& ranks, std::span<const int64_t> lengths,
                             const PlanOptions& options);

// 1 - busy / (num_ranks * span); 0 when nothing runs.
double bubble_rate(double busy, int64_t num_ranks, double span);

}  // namespace odc::planner
