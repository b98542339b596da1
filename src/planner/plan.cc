// The three load-balancing policies and the bubble prediction. Within a minibatch, samples are
// addressed by local index (0..M-1) and mapped to global indices only when a plan is emitted.
#include "planner/plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "planner/packing.h"
#include "planner/partition.h"
#include "planner/plan_io.h"
#include "planner/steal.h"

namespace odc::planner {
namespace {

// One minibatch, in local indices.
struct MinibatchInput {
  int64_t first_global_index = 0;
  std::span<const int64_t> tokens;
  std::vector<double> costs;
};

// Local microbatches of one rank.
using LocalBins = Bins;

double microbatch_cost(const std::vector<int>& microbatch, const MinibatchInput& input,
                       const CostModel& cost) {
  double samples = 0.0;
  for (int item : microbatch) samples += input.costs[item];
  return cost.microbatch(samples);
}

// Heaviest microbatch first, so step k lines up across ranks; ties keep packing order.
void sort_by_cost_descending(LocalBins& microbatches, const MinibatchInput& input,
                             const CostModel& cost) {
  std::stable_sort(microbatches.begin(), microbatches.end(), [&](const auto& x, const auto& y) {
    return microbatch_cost(x, input, cost) > microbatch_cost(y, input, cost);
  });
}

// Re-indexes a rank's sample subset (indices into `input`) as its own packing problem.
struct RankSamples {
  std::vector<int> items;  // local minibatch indices
  std::vector<int64_t> tokens;
  std::vector<double> costs;

  RankSamples(const std::vector<int>& rank_items, const MinibatchInput& input) : items(rank_items) {
    for (int item : items) {
      tokens.push_back(input.tokens[item]);
      costs.push_back(input.costs[item]);
    }
  }
  PackingInput packing(int64_t token_cap) const { return PackingInput{tokens, costs, token_cap}; }
  // Maps packed bins (indices into this subset) back to minibatch-local indices.
  LocalBins to_local(const Bins& packed) const {
    LocalBins local(packed.size());
    for (size_t b = 0; b < packed.size(); ++b) {
      for (int k : packed[b]) local[b].push_back(items[k]);
      std::sort(local[b].begin(), local[b].end());
    }
    return local;
  }
};

std::vector<LocalBins> plan_local_sort(const MinibatchInput& input, int num_ranks) {
  std::vector<LocalBins> ranks(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    std::vector<int> mine;
    for (size_t i = static_cast<size_t>(r); i < input.tokens.size(); i += num_ranks) {
      mine.push_back(static_cast<int>(i));
    }
    std::stable_sort(mine.begin(), mine.end(),
                     [&](int x, int y) { return input.tokens[x] < input.tokens[y]; });
    for (int item : mine) ranks[r].push_back({item});
  }
  return ranks;
}

std::vector<LocalBins> plan_lb_micro(const MinibatchInput& input, const PlanOptions& options) {
  const int num_ranks = static_cast<int>(options.num_ranks);
  Bins by_rank = karmarkar_karp(input.costs, num_ranks, /*equal_size=*/true);
  RefineLimits limits;
  limits.keep_counts_balanced = true;
  (void)refine(by_rank, input.costs, limits);

  std::vector<RankSamples> samples;
  std::vector<Bins> fewest;
  int common_count = 0;
  for (const auto& items : by_rank) {
    samples.emplace_back(items, input);
    fewest.push_back(pack_fewest(samples.back().packing(options.max_tokens)));
    common_count = std::max(common_count, static_cast<int>(fewest.back().size()));
  }
  std::vector<LocalBins> ranks;
  for (int r = 0; r < num_ranks; ++r) {
    const PackingInput packing = samples[r].packing(options.max_tokens);
    const Bins packed = static_cast<int>(fewest[r].size()) == common_count
                            ? fewest[r]
                            : pack_exact(packing, common_count);
    ranks.push_back(samples[r].to_local(packed));
    sort_by_cost_descending(ranks.back(), input, options.cost);
  }
  return ranks;
}

double rank_speed(const PlanOptions& options, size_t rank) {
  return options.rank_speed.empty() ? 1.0 : options.rank_speed[rank];
}

int64_t largest_microbatch(const Bins& bins, std::span<const int64_t> tokens) {
  int64_t largest = 0;
  for (const auto& bin : bins) {
    int64_t sum = 0;
    for (int item : bin) sum += tokens[item];
    largest = std::max(largest, sum);
  }
  return largest;
}

// Exactly `count` microbatches, balanced by tokens: refinement then minimizes the largest one.
Bins pack_by_tokens(const PackingInput& input, int count) {
  const std::vector<double> weights(input.tokens.begin(), input.tokens.end());
  return pack_exact(PackingInput{input.tokens, weights, input.token_cap}, count);
}

// LB-Mini's count: the fewest microbatches under the cap (pack_fewest, balanced by cost). Within
// a rank the packing does not change the rank's predicted time (a microbatch's cost is c plus its
// samples' costs), but activation memory grows with a microbatch's tokens: so the same count is
// repacked by tokens, kept where its largest microbatch is smaller.
Bins pack_fewest_by_tokens(const PackingInput& input) {
  Bins fewest = pack_fewest(input);
  if (fewest.size() < 2) return fewest;
  Bins by_tokens = pack_by_tokens(input, static_cast<int>(fewest.size()));
  if (by_tokens.size() == fewest.size() &&
      largest_microbatch(by_tokens, input.tokens) < largest_microbatch(fewest, input.tokens)) {
    return by_tokens;
  }
  return fewest;
}

// No rank needs a microbatch above the minibatch's longest sample (memory follows the largest
// microbatch, and the longest sample sets the minibatch's floor). A rank whose packing exceeds it
// takes more microbatches where its predicted time (each microbatch max(floor, c + its samples'
// costs), over its speed) stays within the slowest rank's: the minibatch's predicted time is
// unchanged. The count is the smallest whose token-balanced packing reaches the longest sample,
// or else the smallest that does as well as the most microbatches the time allows (bisection:
// packings with more microbatches are not larger).
void shrink_microbatches(const std::vector<RankSamples>& samples, std::vector<Bins>& packed,
                         const PlanOptions& options) {
  const CostModel& cost = options.cost;
  auto rank_time = [&](size_t r, const Bins& bins) {
    double time = 0.0;
    for (const auto& bin : bins) {
      double bin_samples = 0.0;
      for (int k : bin) bin_samples += samples[r].costs[k];
      time += cost.microbatch(bin_samples);
    }
    return time / rank_speed(options, r);
  };
  int64_t longest = 0;
  std::vector<double> load(samples.size(), 0.0);
  double slowest = 0.0;
  for (size_t r = 0; r < samples.size(); ++r) {
    for (int64_t tokens : samples[r].tokens) longest = std::max(longest, tokens);
    for (double sample_cost : samples[r].costs) load[r] += sample_cost;
    slowest = std::max(slowest, rank_time(r, packed[r]));
  }
  for (size_t r = 0; r < samples.size(); ++r) {
    const PackingInput input = samples[r].packing(options.max_tokens);
    if (largest_microbatch(packed[r], input.tokens) <= longest) continue;
    const int num_items = static_cast<int>(input.tokens.size());
    // The most microbatches the rank's time allows (every sample alone at most).
    int most = num_items;
    const double budget = slowest * rank_speed(options, r);
    if (cost.c > 0.0) {
      most = static_cast<int>(std::min<double>(most, std::floor((budget - load[r]) / cost.c)));
    }
    if (cost.floor > 0.0) {  // k microbatches take at least k x floor
      most = static_cast<int>(std::min<double>(most, std::floor(budget / cost.floor)));
    }
    int fewer = static_cast<int>(packed[r].size());  // largest count known to stay above `longest`
    if (most <= fewer) continue;
    Bins best = pack_by_tokens(input, most);
    const int64_t reachable = largest_microbatch(best, input.tokens);
    if (reachable >= largest_microbatch(packed[r], input.tokens)) {
      continue;  // more microbatches would not make the largest one smaller
    }
    const int64_t target = std::max(longest, reachable);
    int enough = most;  // smallest count known to reach `target`
    while (enough - fewer > 1) {
      const int count = fewer + (enough - fewer) / 2;
      Bins fit = pack_by_tokens(input, count);
      if (largest_microbatch(fit, input.tokens) <= target) {
        enough = count;
        best = std::move(fit);
      } else {
        fewer = count;
      }
    }
    // The bounds above are necessary, not sufficient, with a floor: short microbatches may cost
    // more than their samples. Keep the fewer microbatches where the new packing would be slower.
    if (rank_time(r, best) > slowest * (1.0 + 1e-12)) continue;
    packed[r] = std::move(best);
  }
}

// Each rank of an LB-Mini partition: the fewest microbatches under options.max_tokens, packed by
// tokens (pack_fewest_by_tokens), then shrunk where time allows (shrink_microbatches).
std::vector<LocalBins> pack_lb_mini(const Bins& by_rank, const MinibatchInput& input,
                                    const PlanOptions& options) {
  std::vector<RankSamples> samples;
  std::vector<Bins> packed;
  for (const auto& items : by_rank) {
    samples.emplace_back(items, input);
    packed.push_back(pack_fewest_by_tokens(samples.back().packing(options.max_tokens)));
  }
  shrink_microbatches(samples, packed, options);
  std::vector<LocalBins> ranks;
  for (size_t r = 0; r < samples.size(); ++r) {
    ranks.push_back(samples[r].to_local(packed[r]));
    sort_by_cost_descending(ranks.back(), input, options.cost);
  }
  return ranks;
}

int64_t largest_microbatch(const std::vector<LocalBins>& ranks, std::span<const int64_t> tokens) {
  int64_t largest = 0;
  for (const LocalBins& bins : ranks) largest = std::max(largest, largest_microbatch(bins, tokens));
  return largest;
}

// The predicted ODC time of a minibatch's plan: its slowest rank's microbatches, c each plus
// their samples' costs, over the rank's speed.
double odc_time(const std::vector<LocalBins>& ranks, const MinibatchInput& input,
                const PlanOptions& options) {
  double slowest = 0.0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    double total = 0.0;
    for (const auto& microbatch : ranks[r])
      total += microbatch_cost(microbatch, input, options.cost);
    slowest = std::max(slowest, total / rank_speed(options, r));
  }
  return slowest;
}

// LB-Mini's token bound under MicrobatchMemory::kLbMicro: the largest microbatch of `micro`
// (LB-Micro's plan of this minibatch; never below its longest sample), within the cap.
int64_t lb_micro_bound(const std::vector<LocalBins>& micro, const MinibatchInput& input,
                       const PlanOptions& options) {
  return std::min(options.max_tokens, largest_microbatch(micro, input.tokens));
}

// LB-Mini (docs/design.md, "Load balancing: exact definitions"): cost-balanced ranks, each
// packed independently. Under kLbMicro the packing is redone under lb_micro_bound where it
// exceeds it; LB-Micro is planned only when a microbatch holds more than the minibatch's longest
// sample (the bound's floor), and the partition is kept.
std::vector<LocalBins> plan_lb_mini(const MinibatchInput& input, const PlanOptions& options) {
  const int num_ranks = static_cast<int>(options.num_ranks);
  const bool uniform_speed = options.rank_speed.empty() ||
                             std::all_of(options.rank_speed.begin(), options.rank_speed.end(),
                                         [&](double s) { return s == options.rank_speed.front(); });
  RefineLimits limits;
  Bins by_rank;
  const int64_t num_samples = static_cast<int64_t>(input.costs.size());
  if (uniform_speed && num_samples * num_ranks <= kKarmarkarKarpBudget) {
    by_rank = karmarkar_karp(input.costs, num_ranks, /*equal_size=*/false);
  } else if (uniform_speed) {
    // Too large for differencing's memory: least-loaded greedy, then refinement.
    by_rank =
        greedy_by_speed(input.costs, std::vector<double>(static_cast<size_t>(num_ranks), 1.0));
  } else {
    // Differencing balances equal bins; with unequal speeds the greedy that minimizes each
    // sample's finish time starts closer, and refinement then balances cost / speed.
    by_rank = greedy_by_speed(input.costs, options.rank_speed);
    limits.bin_speeds = options.rank_speed;
  }
  (void)refine(by_rank, input.costs, limits);

  std::vector<LocalBins> ranks = pack_lb_mini(by_rank, input, options);
  if (options.microbatch_memory != MicrobatchMemory::kLbMicro) return ranks;
  const int64_t largest = largest_microbatch(ranks, input.tokens);
  const int64_t longest = *std::max_element(input.tokens.begin(), input.tokens.end());
  if (largest <= longest) return ranks;
  std::vector<LocalBins> micro = plan_lb_micro(input, options);
  PlanOptions bounded = options;
  bounded.max_tokens = lb_micro_bound(micro, input, options);
  if (largest <= bounded.max_tokens) return ranks;
  ranks = pack_lb_mini(by_rank, input, bounded);
  // The bound adds microbatches (c each) to ranks the partition balanced without them; where that
  // leaves LB-Mini predicted slower than LB-Micro's plan under ODC, that plan is LB-Mini's (it
  // meets the bound by definition): LB-Mini is never predicted slower than LB-Micro.
  return odc_time(micro, input, options) < odc_time(ranks, input, options) ? micro : ranks;
}

}  // namespace

std::string_view policy_name(Policy policy) {
  switch (policy) {
    case Policy::kLocalSort:
      return "local-sort";
    case Policy::kLbMicro:
      return "lb-micro";
    case Policy::kLbMini:
      return "lb-mini";
  }
  return "unknown";
}

Result<Policy> parse_policy(std::string_view name) {
  for (Policy policy : {Policy::kLocalSort, Policy::kLbMicro, Policy::kLbMini}) {
    if (name == policy_name(policy)) return policy;
  }
  return Status::InvalidArgument("unknown policy " + quote_text(name) +
                                 ": expected local-sort, lb-micro or lb-mini");
}

std::string_view split_mode_name(SplitMode mode) {
  return mode == SplitMode::kAuto ? "auto" : "off";
}

std::string_view microbatch_memory_name(MicrobatchMemory memory) {
  return memory == MicrobatchMemory::kCap ? "cap" : "lb-micro";
}

Result<MicrobatchMemory> parse_microbatch_memory(std::string_view name) {
  if (name == "lb-micro") return MicrobatchMemory::kLbMicro;
  if (name == "cap") return MicrobatchMemory::kCap;
  return Status::InvalidArgument("unknown microbatch memory " + quote_text(name) +
                                 ": expected lb-micro or cap");
}

Result<SplitMode> parse_split_mode(std::string_view name) {
  if (name == "auto") return SplitMode::kAuto;
  if (name == "off") return SplitMode::kOff;
  return Status::InvalidArgument("unknown split mode '" + std::string(name) +
                                 "': expected auto or off");
}

Status validate_plan_options(const PlanOptions& options) {
  if (options.num_ranks < 1) {
    return Status::InvalidArgument("ranks must be at least 1, got " +
                                   std::to_string(options.num_ranks));
  }
  if (options.num_ranks > kMaxRanks) {
    return Status::InvalidArgument("ranks must be at most " + std::to_string(kMaxRanks) + ", got " +
                                   std::to_string(options.num_ranks));
  }
  if (options.max_tokens < 1) {
    return Status::InvalidArgument("max_tokens must be at least 1, got " +
                                   std::to_string(options.max_tokens));
  }
  if (options.minibatch_size < 1) {
    return Status::InvalidArgument("minibatch_size must be at least 1, got " +
                                   std::to_string(options.minibatch_size));
  }
  const CostModel& cost = options.cost;
  for (double coefficient : {cost.a, cost.b, cost.c}) {
    if (!std::isfinite(coefficient) || coefficient < 0.0) {
      return Status::InvalidArgument("malformed cost " + number_text(cost.a) + "," +
                                     number_text(cost.b) + "," + number_text(cost.c) +
                                     ": expected three comma-separated non-negative numbers "
                                     "A,B,C");
    }
  }
  if (!std::isfinite(cost.floor) || cost.floor < 0.0) {
    return Status::InvalidArgument("malformed cost floor " + number_text(cost.floor) +
                                   ": expected a non-negative number (the least cost of a "
                                   "microbatch)");
  }
  if (options.split != SplitMode::kOff && options.split != SplitMode::kAuto) {
    return Status::InvalidArgument("unknown split mode value " +
                                   std::to_string(static_cast<int>(options.split)));
  }
  if (options.split == SplitMode::kAuto && options.policy == Policy::kLocalSort) {
    return Status::InvalidArgument(
        "split auto needs policy lb-mini or lb-micro (local-sort keeps its fixed assignment)");
  }
  if (options.microbatch_memory != MicrobatchMemory::kLbMicro &&
      options.microbatch_memory != MicrobatchMemory::kCap) {
    return Status::InvalidArgument("unknown microbatch memory value " +
                                   std::to_string(static_cast<int>(options.microbatch_memory)));
  }
  if (!std::isfinite(options.split_exchange) || options.split_exchange < 0.0) {
    return Status::InvalidArgument("split_exchange must be a non-negative number, got " +
                                   number_text(options.split_exchange));
  }
  if (!options.rank_speed.empty()) {
    if (static_cast<int64_t>(options.rank_speed.size()) != options.num_ranks) {
      return Status::InvalidArgument("rank_speed must have one entry per rank: got " +
                                     std::to_string(options.rank_speed.size()) + " for " +
                                     std::to_string(options.num_ranks) + " ranks");
    }
    for (size_t r = 0; r < options.rank_speed.size(); ++r) {
      const double speed = options.rank_speed[r];
      if (!std::isfinite(speed) || speed <= 0.0) {
        return Status::InvalidArgument("rank_speed entries must be positive: got " +
                                       number_text(speed) + " for rank " + std::to_string(r));
      }
    }
  }
  return Status::Ok();
}

Status validate_plan_inputs(std::span<const int64_t> lengths, const PlanOptions& options) {
  ODC_RETURN_IF_ERROR(validate_plan_options(options));
  if (lengths.empty()) return Status::InvalidArgument("empty input: no sample lengths given");
  if (lengths.size() > static_cast<size_t>(kMaxSamples)) {
    return Status::InvalidArgument("too many samples: " + std::to_string(lengths.size()) +
                                   ", at most " + std::to_string(kMaxSamples));
  }
  // Token sums of any set of samples must fit int64_t (the packers add them), and cost sums must
  // stay finite (an infinite cost makes every bubble NaN).
  int64_t total_tokens = 0;
  double total_cost = 0.0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 1) {
      return Status::InvalidArgument("sample " + std::to_string(i) + " has non-positive length " +
                                     std::to_string(lengths[i]));
    }
    if (lengths[i] > options.max_tokens) {
      return Status::InvalidArgument("sample " + std::to_string(i) + " has length " +
                                     std::to_string(lengths[i]) + ", above max_tokens " +
                                     std::to_string(options.max_tokens));
    }
    if (__builtin_add_overflow(total_tokens, lengths[i], &total_tokens)) {
      return Status::InvalidArgument("the sample lengths add up to more than " +
                                     std::to_string(INT64_MAX) + " tokens (at sample " +
                                     std::to_string(i) + ")");
    }
    total_cost += options.cost.sample_cost(lengths[i]) + options.cost.c + options.cost.floor;
    if (!std::isfinite(total_cost)) {
      return Status::InvalidArgument(
          "costs overflow: the cost model " + number_text(options.cost.a) + "," +
          number_text(options.cost.b) + "," + number_text(options.cost.c) +
          " gives an infinite total by sample " + std::to_string(i) + " (length " +
          std::to_string(lengths[i]) + "); scale the coefficients down");
    }
  }
  return Status::Ok();
}

double bubble_rate(double busy, int64_t num_ranks, double span) {
  if (span <= 0.0) return 0.0;
  return 1.0 - busy / (static_cast<double>(num_ranks) * span);
}

MinibatchTimes predict_times(const std::vector<RankPlan>& ranks, std::span<const int64_t> lengths,
                             const PlanOptions& options) {
  return predict_times(ranks, {}, lengths, options);
}

MinibatchTimes predict_times(const std::vector<RankPlan>& ranks,
                             const std::vector<SplitSample>& splits,
                             std::span<const int64_t> lengths, const PlanOptions& options) {
  MinibatchTimes times;
  // Each rank's steps: its group's chunk (the group moves at its slowest member), then its
  // microbatches. Groups are disjoint, so every chunk is step 0.
  std::vector<std::vector<double>> steps(ranks.size());
  for (const SplitSample& split : splits) {
    double slowest = 0.0;
    for (size_t m = 0; m < split.ranks.size(); ++m) {
      const double time =
          split.chunk_costs[m] / rank_speed(options, static_cast<size_t>(split.ranks[m]));
      slowest = std::max(slowest, time);
      times.busy += time;
    }
    for (int64_t rank : split.ranks) steps[static_cast<size_t>(rank)].push_back(slowest);
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const auto& microbatch : ranks[r].microbatches) {
      double samples = 0.0;
      for (int64_t sample : microbatch) samples += options.cost.sample_cost(lengths[sample]);
      const double time = options.cost.microbatch(samples) / rank_speed(options, r);
      times.busy += time;
      steps[r].push_back(time);
    }
  }
  size_t num_steps = 0;
  for (const auto& rank_steps : steps) num_steps = std::max(num_steps, rank_steps.size());
  std::vector<double> slowest_at_step(num_steps, 0.0);
  for (const auto& rank_steps : steps) {
    double rank_total = 0.0;
    for (size_t k = 0; k < rank_steps.size(); ++k) {
      rank_total += rank_steps[k];
      slowest_at_step[k] = std::max(slowest_at_step[k], rank_steps[k]);
    }
    times.odc = std::max(times.odc, rank_total);
  }
  for (double step : slowest_at_step) times.collective += step;
  return times;
}

namespace {

// One minibatch under `policy` and options.split, in global indices, its times predicted.
MinibatchPlan plan_minibatch(const MinibatchInput& input, std::span<const int64_t> lengths,
                             const PlanOptions& options, Policy policy) {
  const int64_t start = input.first_global_index;
  PlanOptions policy_options = options;
  policy_options.policy = policy;
  std::vector<LocalBins> local;
  switch (policy) {
    case Policy::kLocalSort:
      local = plan_local_sort(input, static_cast<int>(options.num_ranks));
      break;
    case Policy::kLbMicro:
      local = plan_lb_micro(input, policy_options);
      break;
    case Policy::kLbMini:
      local = plan_lb_mini(input, policy_options);
      break;
  }

  MinibatchPlan minibatch;
  if (options.split == SplitMode::kAuto) {
    // LB-Mini's microbatch bound holds for the samples left after splitting too.
    PlanOptions minibatch_options = policy_options;
    if (policy == Policy::kLbMini && options.microbatch_memory == MicrobatchMemory::kLbMicro) {
      minibatch_options.max_tokens =
          lb_micro_bound(plan_lb_micro(input, policy_options), input, policy_options);
    }
    std::vector<RankPlan> unsplit(local.size());
    for (size_t r = 0; r < local.size(); ++r) {
      for (const auto& bin : local[r]) unsplit[r].microbatches.emplace_back(bin.begin(), bin.end());
    }
    const MinibatchTimes times = predict_times(unsplit, input.tokens, policy_options);
    const double span = policy == Policy::kLbMicro ? times.collective : times.odc;
    SplitMinibatch split =
        plan_minibatch_with_splits(input.tokens, input.costs, minibatch_options, span);
    if (!split.splits.empty()) {
      local = std::move(split.ranks);
      for (SplitSample& sample : split.splits) {
        sample.sample += start;
        minibatch.splits.push_back(std::move(sample));
      }
    }
  }
  minibatch.samples.resize(input.tokens.size());
  std::iota(minibatch.samples.begin(), minibatch.samples.end(), start);
  for (const auto& rank_bins : local) {
    RankPlan rank;
    for (const auto& bin : rank_bins) {
      Microbatch microbatch;
      for (int item : bin) microbatch.push_back(start + item);
      rank.microbatches.push_back(std::move(microbatch));
    }
    minibatch.ranks.push_back(std::move(rank));
  }
  minibatch.times = predict_times(minibatch.ranks, minibatch.splits, lengths, options);
  return minibatch;
}

int64_t largest_microbatch(const MinibatchPlan& minibatch, std::span<const int64_t> lengths) {
  int64_t largest = 0;
  for (const RankPlan& rank : minibatch.ranks) {
    for (const Microbatch& microbatch : rank.microbatches) {
      int64_t tokens = 0;
      for (int64_t sample : microbatch) tokens += lengths[sample];
      largest = std::max(largest, tokens);
    }
  }
  return largest;
}

// LB-Mini is a superset of LB-Micro under ODC: any LB-Micro plan is a legal LB-Mini plan (its
// empty padding microbatches dropped: under ODC nobody waits for them). LB-Mini's rank split
// balances sample costs and cannot see the c (or floor) of each microbatch that packing adds
// afterwards, so on many short samples per rank it lost to LB-Micro's equal counts (in 14
// of 20 minibatches of aime_rl_like.txt, 64 ranks x 8 samples). So the minibatch keeps whichever
// of the two is predicted faster under ODC; ties keep LB-Mini's. With splitting, LB-Micro's
// candidate must also meet LB-Mini's microbatch bound (its remaining samples are packed up to the
// cap).
void keep_faster_than_lb_micro(MinibatchPlan& minibatch, const MinibatchInput& input,
                               std::span<const int64_t> lengths, const PlanOptions& options) {
  MinibatchPlan micro = plan_minibatch(input, lengths, options, Policy::kLbMicro);
  for (RankPlan& rank : micro.ranks) {
    std::erase_if(rank.microbatches, [](const Microbatch& m) { return m.empty(); });
  }
  micro.times = predict_times(micro.ranks, micro.splits, lengths, options);
  if (!(micro.times.odc < minibatch.times.odc)) return;
  if (!micro.splits.empty() && options.microbatch_memory == MicrobatchMemory::kLbMicro) {
    PlanOptions unsplit = options;
    unsplit.policy = Policy::kLbMicro;
    unsplit.split = SplitMode::kOff;
    const int64_t bound = lb_micro_bound(plan_lb_micro(input, unsplit), input, unsplit);
    if (largest_microbatch(micro, lengths) > bound) return;
  }
  minibatch = std::move(micro);
}

}  // namespace

Result<Plan> make_plan(std::span<const int64_t> lengths, const PlanOptions& options) {
  ODC_RETURN_IF_ERROR(validate_plan_inputs(lengths, options));
  Plan plan;
  plan.options = options;
  const int64_t num_samples = static_cast<int64_t>(lengths.size());
  const int64_t per_minibatch = std::min(options.minibatch_size, num_samples);
  double busy = 0.0;
  double collective = 0.0;
  double odc = 0.0;
  for (int64_t start = 0; start < num_samples; start += per_minibatch) {
    const int64_t count = std::min(per_minibatch, num_samples - start);
    MinibatchInput input;
    input.first_global_index = start;
    input.tokens = lengths.subspan(static_cast<size_t>(start), static_cast<size_t>(count));
    for (int64_t tokens : input.tokens) input.costs.push_back(options.cost.sample_cost(tokens));

    MinibatchPlan minibatch = plan_minibatch(input, lengths, options, options.policy);
    if (options.policy == Policy::kLbMini) {
      keep_faster_than_lb_micro(minibatch, input, lengths, options);
    }
    minibatch.bubble.collective =
        bubble_rate(minibatch.times.busy, options.num_ranks, minibatch.times.collective);
    minibatch.bubble.odc =
        bubble_rate(minibatch.times.busy, options.num_ranks, minibatch.times.odc);
    busy += minibatch.times.busy;
    collective += minibatch.times.collective;
    odc += minibatch.times.odc;
    plan.minibatches.push_back(std::move(minibatch));
  }
  // Costs were checked finite above; dividing by a tiny rank speed (or padding microbatches of
  // cost c) can still overflow: refuse rather than report NaN bubbles.
  for (double total : {busy, collective, odc}) {
    if (!std::isfinite(total) || !std::isfinite(total * static_cast<double>(options.num_ranks))) {
      return Status::InvalidArgument(
          "predicted times overflow (cost model " + number_text(options.cost.a) + "," +
          number_text(options.cost.b) + "," + number_text(options.cost.c) +
          " with the given rank speeds): scale the coefficients or speeds");
    }
  }
  plan.bubble.collective = bubble_rate(busy, options.num_ranks, collective);
  plan.bubble.odc = bubble_rate(busy, options.num_ranks, odc);
  if (options.steal) {
    double steal_busy = 0.0, steal_span = 0.0;
    for (MinibatchPlan& minibatch : plan.minibatches) {
      auto steal = predict_stealing(minibatch, lengths, options);
      if (!steal.ok()) return steal.status();
      minibatch.steal = steal.value();
      steal_busy += minibatch.steal.busy;
      steal_span += minibatch.steal.span;
    }
    plan.steal_bubble = bubble_rate(steal_busy, options.num_ranks, steal_span);
  }
  return plan;
}

Result<StealTimes> predict_stealing(const MinibatchPlan& minibatch,
                                    std::span<const int64_t> lengths, const PlanOptions& options,
                                    std::span<const double> rank_slowdown) {
  const size_t num_ranks = minibatch.ranks.size();
  if (!rank_slowdown.empty() && rank_slowdown.size() != num_ranks) {
    return Status::InvalidArgument("rank slowdown must have one entry per rank: got " +
                                   std::to_string(rank_slowdown.size()) + " for " +
                                   std::to_string(num_ranks) + " ranks");
  }
  std::vector<int64_t> counts(num_ranks);
  std::vector<double> predicted, speed(num_ranks), start(num_ranks, 0.0);
  double busy = 0.0;
  for (size_t r = 0; r < num_ranks; ++r) {
    speed[r] = rank_speed(options, r) / (rank_slowdown.empty() ? 1.0 : rank_slowdown[r]);
    counts[r] = static_cast<int64_t>(minibatch.ranks[r].microbatches.size());
    for (const Microbatch& microbatch : minibatch.ranks[r].microbatches) {
      double samples = 0.0;
      for (int64_t sample : microbatch) samples += options.cost.sample_cost(lengths[sample]);
      predicted.push_back(options.cost.microbatch(samples));
    }
  }
  // A split group moves at its slowest member (predict_times): every member starts taking
  // microbatches when the group is done; busy counts each member's own chunk.
  for (const SplitSample& split : minibatch.splits) {
    double slowest = 0.0;
    for (size_t m = 0; m < split.ranks.size(); ++m) {
      const double time = split.chunk_costs[m] / speed[static_cast<size_t>(split.ranks[m])];
      slowest = std::max(slowest, time);
      busy += time;
    }
    for (int64_t rank : split.ranks) start[static_cast<size_t>(rank)] = slowest;
  }
  auto played = simulate_stealing({counts, predicted, {}, speed, start});
  if (!played.ok()) return played.status();
  StealTimes times;
  times.span = played.value().span;
  times.busy = busy + played.value().total_busy();
  times.num_moved = played.value().num_moved;
  times.bubble = bubble_rate(times.busy, static_cast<int64_t>(num_ranks), times.span);
  return times;
}

}  // namespace odc::planner
