// Split planning: choose which outliers run as context-parallel chunks on which group of ranks,
// then balance the remaining samples around the groups. Groups within a minibatch are disjoint (a
// rank serves at most one split sample, first in its minibatch), so under collectives every group
// meets at step 0 and under ODC no group waits for another.
#include "planner/split.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <utility>

#include "planner/packing.h"
#include "planner/plan.h"

namespace odc::planner {
namespace {

// Causal query-key pairs of tokens [begin, end): token t attends to t + 1 keys.
double causal_pairs(int64_t begin, int64_t end) {
  const double b = static_cast<double>(begin);
  const double e = static_cast<double>(end);
  return (e * (e + 1.0) - b * (b + 1.0)) / 2.0;
}

double speed_of(const PlanOptions& options, size_t rank) {
  return options.rank_speed.empty() ? 1.0 : options.rank_speed[rank];
}

// The state being evaluated: which local samples are split, and how.
struct Candidate {
  std::vector<SplitSample> splits;
  std::vector<char> is_split;  // per local sample
};

// Time each rank spends in its group before its own microbatches (0 outside every group). A
// group moves at its slowest member.
std::vector<double> group_times(const std::vector<SplitSample>& splits,
                                const PlanOptions& options) {
  std::vector<double> time(static_cast<size_t>(options.num_ranks), 0.0);
  for (const SplitSample& split : splits) {
    double slowest = 0.0;
    for (size_t m = 0; m < split.ranks.size(); ++m) {
      slowest = std::max(
          slowest, split.chunk_costs[m] / speed_of(options, static_cast<size_t>(split.ranks[m])));
    }
    for (int64_t rank : split.ranks) time[static_cast<size_t>(rank)] += slowest;
  }
  return time;
}

// Distributes `items` (local indices, heaviest first) over ranks that already carry `base` time:
// longest-processing-time greedy, then moves and swaps between the slowest and the fastest rank
// while that lowers the slower of the two. A rank's samples cost their sum, but at least the cost
// floor less c once it has any (they run as at least one microbatch of its own; c, common to
// every rank with work, is left out as before), so with a floor a group member that would run
// one short microbatch after its chunk is charged what that microbatch takes. With
// `equal_counts` (LB-Micro) sample counts differ by at most one: the greedy respects it and
// refinement only swaps (or moves from a fuller rank).
Bins partition_around(const std::vector<int>& items, std::span<const double> costs,
                      const std::vector<double>& base, const PlanOptions& options,
                      bool equal_counts) {
  const size_t num_ranks = base.size();
  Bins bins(num_ranks);
  std::vector<double> load(num_ranks, 0.0);
  const double least_work = options.cost.floor - options.cost.c;  // <= 0: no floor in effect
  // Rank r's time with `count` samples costing `samples` in all (count, not the sum, says
  // whether it has any: a sum left by subtractions need not be exactly 0).
  auto time_at = [&](size_t r, double samples, size_t count) {
    const double work = count > 0 ? std::max(samples, least_work) : 0.0;
    return base[r] + work / speed_of(options, r);
  };
  auto time_now = [&](size_t r) { return time_at(r, load[r], bins[r].size()); };
  auto time_with = [&](size_t r, int item) {
    return time_at(r, load[r] + costs[item], bins[r].size() + 1);
  };
  const size_t floor_count = items.size() / num_ranks;
  const size_t num_at_ceiling = items.size() % num_ranks;
  size_t at_ceiling = 0;
  // Whether rank r may take another item; once it may not, it never may again (counts and
  // at_ceiling only grow).
  auto has_room = [&](size_t r) {
    if (!equal_counts) return true;
    const size_t count = bins[r].size();
    return count < floor_count || (count == floor_count && at_ceiling < num_at_ceiling);
  };
  // The greedy takes, for each item, the rank of least (time with the item, load, index): ties
  // (with a floor, every rank below it takes the same time) go to the lighter rank, so that short
  // samples spread instead of piling onto the first rank beyond the token cap. Ranks of equal base
  // and speed form a class in which that time never decreases with load (each floating-point step
  // of time_at is monotone), so a class's least rank is its lightest, lowest index on ties, and
  // comparing one rank per class picks what a scan of every rank picks. A split search builds a
  // plan per candidate group size, and base has at most one value per group plus 0, so this is
  // O(items x groups) per plan instead of O(items x ranks), which counts at about one sample per
  // rank (e.g. ranks = samples = 512).
  // Each class is a binary min-heap of (load, rank) entries; an entry is stale once its rank
  // took another item (a newer entry holds its load), and a rank without room never regains it,
  // so both are dropped when they reach the top.
  struct Entry {
    double load;
    size_t rank;
    uint32_t version;
  };
  auto after = [](const Entry& x, const Entry& y) {
    return x.load > y.load || (x.load == y.load && x.rank > y.rank);
  };
  std::map<std::pair<double, double>, size_t> class_index;
  std::vector<std::vector<Entry>> classes;
  std::vector<size_t> class_of(num_ranks);
  std::vector<uint32_t> version(num_ranks, 0);
  for (size_t r = 0; r < num_ranks; ++r) {
    const auto [it, added] = class_index.emplace(std::pair(base[r], speed_of(options, r)), 0);
    if (added) {
      it->second = classes.size();
      classes.emplace_back();
    }
    class_of[r] = it->second;
    classes[it->second].push_back(Entry{0.0, r, 0});  // ascending ranks: already a heap
  }
  for (int item : items) {
    size_t best = num_ranks;
    double best_time = 0.0;
    for (auto& heap : classes) {
      while (!heap.empty() &&
             (heap.front().version != version[heap.front().rank] || !has_room(heap.front().rank))) {
        std::pop_heap(heap.begin(), heap.end(), after);
        heap.pop_back();
      }
      if (heap.empty()) continue;
      const size_t r = heap.front().rank;
      const double time = time_with(r, item);
      if (best == num_ranks || time < best_time ||
          (time == best_time && (load[r] < load[best] || (load[r] == load[best] && r < best)))) {
        best = r;
        best_time = time;
      }
    }
    if (equal_counts && bins[best].size() == floor_count) ++at_ceiling;
    bins[best].push_back(item);
    load[best] += costs[item];
    auto& heap = classes[class_of[best]];
    heap.push_back(Entry{load[best], best, ++version[best]});
    std::push_heap(heap.begin(), heap.end(), after);
  }

  // Refinement. Each applied step strictly lowers the larger time of the pair it touches and
  // changes no other rank, so the sorted vector of rank times decreases: the loop terminates.
  // Rank times are cached: a step changes two ranks only.
  std::vector<double> now(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) now[r] = time_now(r);
  const int max_steps = 100 + 10 * static_cast<int>(items.size());
  for (int step = 0; step < max_steps && num_ranks > 1; ++step) {
    size_t slow = 0;
    size_t fast = 0;
    for (size_t r = 1; r < num_ranks; ++r) {
      if (now[r] > now[slow]) slow = r;
      if (now[r] < now[fast]) fast = r;
    }
    if (slow == fast) break;
    const double slow_time = time_now(slow);
    double best = slow_time * (1.0 - 1e-12);
    int move_index = -1;
    int swap_index = -1;
    const bool may_move = !equal_counts || bins[slow].size() > bins[fast].size();
    for (size_t i = 0; i < bins[slow].size(); ++i) {
      const double shifted = costs[bins[slow][i]];
      if (may_move) {
        const double worse = std::max(time_at(slow, load[slow] - shifted, bins[slow].size() - 1),
                                      time_at(fast, load[fast] + shifted, bins[fast].size() + 1));
        if (worse < best) best = worse, move_index = static_cast<int>(i), swap_index = -1;
      }
      // Swaps cost |slow| x |fast| per step; minibatches with outliers are small, but stay bounded.
      if (bins[slow].size() * bins[fast].size() > 1000000) continue;
      for (size_t j = 0; j < bins[fast].size(); ++j) {
        const double delta = shifted - costs[bins[fast][j]];
        if (delta <= 0.0) continue;
        const double worse = std::max(time_at(slow, load[slow] - delta, bins[slow].size()),
                                      time_at(fast, load[fast] + delta, bins[fast].size()));
        if (worse < best)
          best = worse, move_index = static_cast<int>(i), swap_index = static_cast<int>(j);
      }
    }
    if (move_index < 0) break;
    const int moved = bins[slow][move_index];
    bins[slow].erase(bins[slow].begin() + move_index);
    load[slow] -= costs[moved];
    if (swap_index >= 0) {
      const int back = bins[fast][swap_index];
      bins[fast].erase(bins[fast].begin() + swap_index);
      load[fast] -= costs[back];
      bins[slow].push_back(back);
      load[slow] += costs[back];
    }
    bins[fast].push_back(moved);
    load[fast] += costs[moved];
    now[slow] = time_now(slow);
    now[fast] = time_now(fast);
  }
  for (auto& bin : bins) std::sort(bin.begin(), bin.end());
  return bins;
}

double microbatch_cost(const std::vector<int>& microbatch, std::span<const double> costs,
                       const CostModel& cost) {
  double samples = 0.0;
  for (int item : microbatch) samples += costs[item];
  return cost.microbatch(samples);
}

// Packs each rank's samples into microbatches (local indices, heaviest first). LB-Mini: as few as
// the token cap allows. LB-Micro: every rank runs the same number of steps, its chunk included.
std::vector<Bins> pack_ranks(const Bins& by_rank, std::span<const int64_t> tokens,
                             std::span<const double> costs, const std::vector<int>& num_chunks,
                             const PlanOptions& options) {
  const bool common_count = options.policy == Policy::kLbMicro;
  std::vector<std::vector<int64_t>> rank_tokens(by_rank.size());
  std::vector<std::vector<double>> rank_costs(by_rank.size());
  std::vector<Bins> fewest(by_rank.size());
  size_t common = 0;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    for (int item : by_rank[r]) {
      rank_tokens[r].push_back(tokens[item]);
      rank_costs[r].push_back(costs[item]);
    }
    if (!by_rank[r].empty()) {
      fewest[r] = pack_fewest(PackingInput{rank_tokens[r], rank_costs[r], options.max_tokens});
    }
    common = std::max(common, static_cast<size_t>(num_chunks[r]) + fewest[r].size());
  }
  std::vector<Bins> ranks(by_rank.size());
  for (size_t r = 0; r < by_rank.size(); ++r) {
    Bins packed = fewest[r];
    if (common_count) {
      const size_t target = common - static_cast<size_t>(num_chunks[r]);
      if (packed.size() != target) {
        packed = by_rank[r].empty()
                     ? Bins(target)
                     : pack_exact(PackingInput{rank_tokens[r], rank_costs[r], options.max_tokens},
                                  static_cast<int>(target));
      }
    }
    for (auto& bin : packed) {
      std::vector<int> local;
      for (int k : bin) local.push_back(by_rank[r][k]);
      std::sort(local.begin(), local.end());
      ranks[r].push_back(std::move(local));
    }
    std::stable_sort(ranks[r].begin(), ranks[r].end(), [&](const auto& x, const auto& y) {
      return microbatch_cost(x, costs, options.cost) > microbatch_cost(y, costs, options.cost);
    });
  }
  return ranks;
}

// The full plan of a candidate: remaining samples balanced around its groups and packed.
// `rest`: the samples the candidate leaves unsplit, heaviest first (ties in index order).
SplitMinibatch build(const Candidate& candidate, const std::vector<int>& rest,
                     std::span<const int64_t> tokens, std::span<const double> costs,
                     const PlanOptions& options) {
  const std::vector<double> base = group_times(candidate.splits, options);
  std::vector<int> num_chunks(base.size(), 0);
  for (const SplitSample& split : candidate.splits) {
    for (int64_t rank : split.ranks) ++num_chunks[static_cast<size_t>(rank)];
  }
  const Bins by_rank =
      partition_around(rest, costs, base, options, options.policy == Policy::kLbMicro);
  SplitMinibatch result;
  result.ranks = pack_ranks(by_rank, tokens, costs, num_chunks, options);
  result.splits = candidate.splits;
  return result;
}

double span_of(const SplitMinibatch& minibatch, std::span<const int64_t> tokens,
               const PlanOptions& options) {
  std::vector<RankPlan> ranks(minibatch.ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const auto& bin : minibatch.ranks[r]) {
      ranks[r].microbatches.emplace_back(bin.begin(), bin.end());
    }
  }
  const MinibatchTimes times = predict_times(ranks, minibatch.splits, tokens, options);
  return options.policy == Policy::kLbMicro ? times.collective : times.odc;
}

}  // namespace

std::vector<SplitChunk> zigzag_chunks(int64_t length, int group_size) {
  const int64_t num_pieces = 2 * static_cast<int64_t>(group_size);
  const int64_t quotient = length / num_pieces;
  const int64_t remainder = length % num_pieces;
  // floor(j * L / P) without forming j * L (L may be large): j*q + floor(j*r / P).
  auto boundary = [&](int64_t j) { return j * quotient + j * remainder / num_pieces; };
  std::vector<SplitChunk> chunks;
  for (int64_t i = 0; i < group_size; ++i) {
    const int64_t mirror = num_pieces - 1 - i;
    chunks.push_back({{boundary(i), boundary(i + 1)}, {boundary(mirror), boundary(mirror + 1)}});
  }
  return chunks;
}

double split_chunk_cost(const CostModel& cost, double exchange, int64_t length,
                        const SplitChunk& chunk) {
  double tokens = 0.0;
  double pairs = 0.0;
  for (const TokenRange& range : chunk) {
    tokens += static_cast<double>(range[1] - range[0]);
    pairs += causal_pairs(range[0], range[1]);
  }
  const double total = static_cast<double>(length);
  const double attention = cost.b * total * total * pairs / causal_pairs(0, length);
  return cost.microbatch(cost.a * tokens + attention + exchange * cost.a * (total - tokens));
}

namespace {

// LB-Micro's collective time with `num_members` ranks in groups (the slowest at `group_time`) and
// the samples `left` (costs, ascending) placed with counts within one of each other: floor or
// floor + 1 each, so the members hold at least q of them, and the heaviest a member holds costs at
// least the q-th lightest, p. That microbatch is a member's second step (its chunk is the first,
// its microbatches follow heaviest first). The heaviest sample h runs either on a non-member, at
// the first step (>= max(group_time, h) + p over two steps), or on a member, from the second step
// (>= group_time + h). With ranks = samples this is what the search finds: the members take the
// lightest samples.
double equal_counts_bound(const std::vector<double>& left, int64_t num_members, double group_time,
                          double heaviest, const CostModel& cost, double fastest,
                          int64_t num_ranks) {
  const auto num_left = static_cast<int64_t>(left.size());
  const int64_t floor_count = num_left / num_ranks;
  const int64_t on_members =
      std::max(num_left - (num_ranks - num_members) * (floor_count + 1), num_members * floor_count);
  if (on_members < 1 || on_members > num_left) return 0.0;
  const double lightest = cost.microbatch(left[static_cast<size_t>(on_members - 1)]) / fastest;
  return std::min(std::max(group_time, heaviest) + lightest, group_time + heaviest);
}

// The greedy split search: outliers heaviest first, each kept with the group size that lowers
// the span most, where it lowers the span below the best so far.
//
// A trial is kept only when its span is below best_span * (1 - 1e-9), so a trial whose span is
// provably at least best_span is skipped without building its plan: the plans are those of trying
// every group size, at a fraction of the work (trying them all at ranks = samples = 512 built
// ~100,000 plans, 96 s). Every bound below holds for the span predict_times computes, ODC or
// collective (collective time >= ODC time): a rank's total is at least each of its steps, and the
// rounding of the bounds' own sums is far below the 1e-9 margin.
//   - A sample left unsplit runs in some microbatch: span >= microbatch(its cost) / fastest speed.
//   - A group already chosen runs first on its ranks: span >= its time.
//   - The new group moves at its slowest member, at least its mean chunk: mean over the members
//     of c + a n_m + b L^2 P_m / P + x a (L - n_m) = c + (a L + b L^2 + x a L (k - 1)) / k.
//   - Work: span >= (sum of all costs: the samples left, every chunk) / (sum of rank speeds).
//     It grows with k (exchange), so once it prunes, every larger k is pruned too.
// With ranks = samples, once a group's time or the next outlier sets the span, every later
// candidate and group size is skipped this way, and the plans built are about one per split.
SplitMinibatch search_splits(std::span<const int64_t> tokens, std::span<const double> costs,
                             const PlanOptions& options, double unsplit_span,
                             SplitSearchStats* stats) {
  const size_t num_samples = tokens.size();
  const double share =
      std::accumulate(costs.begin(), costs.end(), 0.0) / static_cast<double>(options.num_ranks);
  std::vector<int> candidates;
  for (size_t i = 0; i < num_samples; ++i) {
    if (costs[i] > share && tokens[i] >= 4) candidates.push_back(static_cast<int>(i));
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](int x, int y) { return costs[x] > costs[y]; });

  const CostModel& cost = options.cost;
  double fastest = 1.0;
  double total_speed = static_cast<double>(options.num_ranks);
  if (!options.rank_speed.empty()) {
    fastest = *std::max_element(options.rank_speed.begin(), options.rank_speed.end());
    total_speed = std::accumulate(options.rank_speed.begin(), options.rank_speed.end(), 0.0);
  }
  // Samples by descending cost, ties in index order.
  std::vector<int> by_cost(num_samples);
  std::iota(by_cost.begin(), by_cost.end(), 0);
  std::stable_sort(by_cost.begin(), by_cost.end(),
                   [&](int x, int y) { return costs[x] > costs[y]; });
  const double total_cost = std::accumulate(costs.begin(), costs.end(), 0.0);

  Candidate chosen;
  chosen.is_split.assign(num_samples, 0);
  SplitMinibatch best_plan;
  double best_span = unsplit_span;
  double split_cost = 0.0;   // costs of the samples split so far
  double chunk_cost = 0.0;   // their chunks' costs
  double chosen_time = 0.0;  // the slowest group so far
  std::vector<char> busy_rank(static_cast<size_t>(options.num_ranks), 0);
  const bool prune = stats == nullptr || !stats->exhaustive;
  int64_t members_before = 0;  // ranks in the groups so far
  for (int sample : candidates) {
    if (stats) ++stats->candidates;
    // The samples left unsplit besides this one: heaviest first (what build places), and their
    // costs lightest first (for the bounds).
    std::vector<int> rest;
    for (int i : by_cost) {
      if (i != sample && !chosen.is_split[static_cast<size_t>(i)]) rest.push_back(i);
    }
    std::vector<double> left;
    for (auto it = rest.rbegin(); it != rest.rend(); ++it) left.push_back(costs[*it]);
    const double heaviest_left = left.empty() ? 0.0 : cost.microbatch(left.back()) / fastest;
    const double fixed_bound = std::max(heaviest_left, chosen_time);
    const double rest_cost = total_cost - split_cost - costs[sample];
    const double length = static_cast<double>(tokens[sample]);
    const double whole = cost.a * length + cost.b * length * length;

    std::vector<int64_t> free_ranks;
    for (int64_t r = 0; r < options.num_ranks; ++r) {
      if (!busy_rank[static_cast<size_t>(r)]) free_ranks.push_back(r);
    }
    std::optional<Candidate> best_here;
    for (size_t k = 2; k <= free_ranks.size() && static_cast<int64_t>(2 * k) <= tokens[sample];
         ++k) {
      if (prune && fixed_bound >= best_span) break;  // also once a group size reached it
      const double members = static_cast<double>(k);
      const double chunks = whole + options.split_exchange * cost.a * length * (members - 1.0);
      const double new_chunks = std::max(members * cost.floor, members * cost.c + chunks);
      if (prune && (rest_cost + chunk_cost + new_chunks) / total_speed >= best_span) break;
      const double group_time = cost.microbatch(chunks / members) / fastest;
      if (prune && group_time >= best_span) continue;
      if (prune && options.policy == Policy::kLbMicro &&
          equal_counts_bound(left, members_before + static_cast<int64_t>(k),
                             std::max(chosen_time, group_time), heaviest_left, cost, fastest,
                             options.num_ranks) >= best_span) {
        continue;
      }
      Candidate trial = chosen;
      SplitSample split;
      split.sample = sample;
      split.ranks.assign(free_ranks.begin(), free_ranks.begin() + static_cast<int64_t>(k));
      split.chunks = zigzag_chunks(tokens[sample], static_cast<int>(k));
      for (const SplitChunk& chunk : split.chunks) {
        split.chunk_costs.push_back(
            split_chunk_cost(options.cost, options.split_exchange, tokens[sample], chunk));
      }
      trial.splits.push_back(std::move(split));
      trial.is_split[static_cast<size_t>(sample)] = 1;
      SplitMinibatch plan = build(trial, rest, tokens, costs, options);
      if (stats) ++stats->plans_built;
      const double span = span_of(plan, tokens, options);
      // Strictly better (relative margin against rounding); ties keep the smaller group.
      if (span < best_span * (1.0 - 1e-9)) {
        best_span = span;
        best_plan = std::move(plan);
        best_here = std::move(trial);
      }
    }
    if (best_here) {
      chosen = std::move(*best_here);
      const SplitSample& added = chosen.splits.back();
      split_cost += costs[sample];
      double slowest = 0.0;
      for (size_t m = 0; m < added.ranks.size(); ++m) {
        chunk_cost += added.chunk_costs[m];
        slowest = std::max(
            slowest, added.chunk_costs[m] / speed_of(options, static_cast<size_t>(added.ranks[m])));
      }
      chosen_time = std::max(chosen_time, slowest);
      for (int64_t rank : added.ranks) busy_rank[static_cast<size_t>(rank)] = 1;
      members_before += static_cast<int64_t>(added.ranks.size());
    }
  }
  return best_plan;  // no splits (and no ranks) when none helped
}

}  // namespace

SplitMinibatch plan_minibatch_with_splits(std::span<const int64_t> tokens,
                                          std::span<const double> costs, const PlanOptions& options,
                                          double unsplit_span, SplitSearchStats* stats) {
  SplitMinibatch planned = search_splits(tokens, costs, options, unsplit_span, stats);
  if (options.cost.floor <= 0.0) return planned;
  // With a floor each member's extra microbatch can hide the gain of one split on its own while
  // splitting several outliers together pays (8 ranks, four 42K-59K-token outliers, floor 1 s:
  // no split, 5.98 s, against 4.07 s for the splits planned without the floor). So also search as
  // if there were none, cost that plan's chunks with the floor, and keep the faster of the two.
  PlanOptions blind = options;
  blind.cost.floor = 0.0;
  SplitMinibatch alternative =
      search_splits(tokens, costs, blind, std::numeric_limits<double>::infinity(), stats);
  if (alternative.splits.empty()) return planned;
  for (SplitSample& split : alternative.splits) {
    for (size_t m = 0; m < split.chunks.size(); ++m) {
      split.chunk_costs[m] = split_chunk_cost(options.cost, options.split_exchange,
                                              tokens[split.sample], split.chunks[m]);
    }
  }
  const double planned_span =
      planned.splits.empty() ? unsplit_span : span_of(planned, tokens, options);
  if (span_of(alternative, tokens, options) < planned_span * (1.0 - 1e-9)) return alternative;
  return planned;
}

}  // namespace odc::planner
