// Karmarkar-Karp differencing, speed-aware greedy and refinement. Invariant of every function here:
// each input item lands in exactly one bin, and equal inputs give equal outputs on every machine.
#include "planner/partition.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numeric>
#include <queue>
#include <set>
#include <utility>

namespace odc::planner {
namespace {

// Items sorted by weight, heaviest first; ties by ascending index so the order is total.
std::vector<int> order_by_weight_descending(std::span<const double> weights) {
  std::vector<int> order(weights.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return weights[x] > weights[y]; });
  return order;
}

// One subset of a differencing tuple. Items are kept in a singly linked list threaded through a
// shared `next` array, so merging two subsets is O(1).
struct Subset {
  double sum = 0.0;
  int head = -1;
  int tail = -1;
};

// A k-tuple. Sparse tuples (see karmarkar_karp) store only their non-empty subsets: the missing
// ones are empty, weigh 0 and sort last.
struct Tuple {
  std::vector<Subset> subsets;  // sorted by sum, largest first
  int64_t id = 0;               // creation order: the deterministic tie-break
  double spread = 0.0;          // heaviest minus lightest subset, kept for the heap

  Tuple(std::vector<Subset> sorted_subsets, int64_t tuple_id, size_t num_bins)
      : subsets(std::move(sorted_subsets)),
        id(tuple_id),
        spread(subsets.front().sum - (subsets.size() < num_bins ? 0.0 : subsets.back().sum)) {}
};

struct WiderSpreadFirst {
  bool operator()(const Tuple& x, const Tuple& y) const {
    if (x.spread != y.spread) return x.spread < y.spread;
    return x.id > y.id;
  }
};

// Stable sort by sum, largest first (what std::stable_sort gives), without allocating: bottom-up
// merge sort through a scratch vector reused across the whole differencing run.
void sort_subsets(std::vector<Subset>& subsets, std::vector<Subset>& scratch) {
  const size_t n = subsets.size();
  scratch.resize(n);
  auto heavier = [](const Subset& x, const Subset& y) { return x.sum > y.sum; };
  Subset* from = subsets.data();
  Subset* to = scratch.data();
  for (size_t width = 1; width < n; width *= 2) {
    for (size_t lo = 0; lo < n; lo += 2 * width) {
      const size_t mid = std::min(lo + width, n);
      const size_t hi = std::min(lo + 2 * width, n);
      std::merge(from + lo, from + mid, from + mid, from + hi, to + lo, heavier);
    }
    std::swap(from, to);
  }
  if (from != subsets.data()) subsets.swap(scratch);  // the sorted run ended in scratch
}

}  // namespace

Bins karmarkar_karp(std::span<const double> weights, int num_bins, bool equal_size) {
  const int num_items = static_cast<int>(weights.size());
  Bins bins(static_cast<size_t>(std::max(num_bins, 0)));
  if (num_bins <= 0 || num_items == 0) return bins;

  const std::vector<int> order = order_by_weight_descending(weights);
  // Equal-size mode pads with weightless dummies (indices >= num_items) up to a multiple of k; the
  // dummies sit in one group, so they land in distinct bins and counts differ by at most one.
  const int num_dummies = equal_size ? (num_bins - num_items % num_bins) % num_bins : 0;
  std::vector<int> next(static_cast<size_t>(num_items + num_dummies), -1);

  // A heap kept by hand (not std::priority_queue) so tuples are moved out, never copied.
  std::vector<Tuple> queue;
  queue.reserve(equal_size ? (num_items + num_dummies) / num_bins : num_items);
  const WiderSpreadFirst wider;
  auto push = [&](Tuple tuple) {
    queue.push_back(std::move(tuple));
    std::push_heap(queue.begin(), queue.end(), wider);
  };
  auto pop = [&]() {
    std::pop_heap(queue.begin(), queue.end(), wider);
    Tuple top = std::move(queue.back());
    queue.pop_back();
    return top;
  };
  int64_t next_id = 0;
  std::vector<Subset> scratch;
  // Without the equal-size constraint, and when every weight is positive (so a non-empty subset
  // never ties with an empty one), tuples are kept sparse: a merge of tuples with k1 and k2
  // non-empty subsets, k1 + k2 <= k, is the stable sort of the first's subsets followed by the
  // second's in reverse (where the dense merge puts them), in O((k1 + k2) log) instead of
  // O(k log k), and the n singletons hold 1 subset each instead of k. Results are identical.
  const bool sparse =
      !equal_size && std::all_of(weights.begin(), weights.end(), [](double w) { return w > 0.0; });
  if (equal_size) {
    std::vector<int> padded = order;
    for (int d = 0; d < num_dummies; ++d) padded.push_back(num_items + d);
    for (size_t start = 0; start < padded.size(); start += static_cast<size_t>(num_bins)) {
      std::vector<Subset> subsets(static_cast<size_t>(num_bins));
      for (int b = 0; b < num_bins; ++b) {
        const int item = padded[start + static_cast<size_t>(b)];
        subsets[b] = Subset{item < num_items ? weights[item] : 0.0, item, item};
      }
      push(Tuple(std::move(subsets), next_id++, bins.size()));
    }
  } else {
    for (int item : order) {
      std::vector<Subset> subsets(sparse ? 1 : static_cast<size_t>(num_bins));
      subsets[0] = Subset{weights[item], item, item};
      push(Tuple(std::move(subsets), next_id++, bins.size()));
    }
  }

  // Repeatedly combine the two tuples of widest spread, pairing the heaviest subset of one with the
  // lightest of the other: the differences largely cancel.
  while (queue.size() > 1) {
    Tuple first = pop();
    Tuple second = pop();
    const size_t k1 = first.subsets.size();
    const size_t k2 = second.subsets.size();
    if (sparse && k1 + k2 <= bins.size()) {
      std::vector<Subset> merged = std::move(first.subsets);
      merged.insert(merged.end(), second.subsets.rbegin(), second.subsets.rend());
      sort_subsets(merged, scratch);
      push(Tuple(std::move(merged), next_id++, bins.size()));
      continue;
    }
    first.subsets.resize(bins.size());  // make both dense: the missing subsets are empty
    second.subsets.resize(bins.size());
    // Built in place of the first tuple's subsets (entry b reads only entry b of them).
    std::vector<Subset> merged = std::move(first.subsets);
    for (int b = 0; b < num_bins; ++b) {
      const Subset heavy = merged[b];
      const Subset& light = second.subsets[num_bins - 1 - b];
      Subset& out = merged[b];
      out.sum = heavy.sum + light.sum;
      if (heavy.head < 0) {
        out.head = light.head;
        out.tail = light.tail;
      } else {
        out.head = heavy.head;
        out.tail = light.head < 0 ? heavy.tail : light.tail;
        if (light.head >= 0) next[heavy.tail] = light.head;
      }
    }
    sort_subsets(merged, scratch);
    push(Tuple(std::move(merged), next_id++, bins.size()));
  }

  const Tuple& last = queue.front();
  for (int b = 0; b < static_cast<int>(last.subsets.size()); ++b) {
    for (int item = last.subsets[b].head; item >= 0; item = next[item]) {
      if (item < num_items) bins[b].push_back(item);
    }
    std::sort(bins[b].begin(), bins[b].end());
  }
  return bins;
}

Bins greedy_by_speed(std::span<const double> weights, std::span<const double> bin_speeds) {
  Bins bins(bin_speeds.size());
  if (bin_speeds.empty()) return bins;
  std::vector<double> loads(bin_speeds.size(), 0.0);
  const bool equal_speeds = std::all_of(bin_speeds.begin(), bin_speeds.end(),
                                        [&](double s) { return s == bin_speeds.front(); });
  if (equal_speeds) {
    std::set<std::pair<double, size_t>> by_load;  // (load, bin)
    for (size_t b = 0; b < bin_speeds.size(); ++b) by_load.emplace(0.0, b);
    for (int item : order_by_weight_descending(weights)) {
      const size_t best = by_load.begin()->second;
      by_load.erase(by_load.begin());
      loads[best] += weights[item];
      bins[best].push_back(item);
      by_load.emplace(loads[best], best);
    }
    for (auto& bin : bins) std::sort(bin.begin(), bin.end());
    return bins;
  }
  for (int item : order_by_weight_descending(weights)) {
    size_t best = 0;
    double best_finish = (loads[0] + weights[item]) / bin_speeds[0];
    for (size_t b = 1; b < bin_speeds.size(); ++b) {
      const double finish = (loads[b] + weights[item]) / bin_speeds[b];
      if (finish < best_finish) {
        best_finish = finish;
        best = b;
      }
    }
    loads[best] += weights[item];
    bins[best].push_back(item);
  }
  for (auto& bin : bins) std::sort(bin.begin(), bin.end());
  return bins;
}

std::vector<double> bin_loads(const Bins& bins, std::span<const double> weights) {
  std::vector<double> loads(bins.size(), 0.0);
  for (size_t b = 0; b < bins.size(); ++b) {
    for (int item : bins[b]) loads[b] += weights[item];
  }
  return loads;
}

namespace {

// State of refine(): loads, token totals and speeds per bin.
class Refiner {
 public:
  Refiner(Bins& bins, std::span<const double> weights, const RefineLimits& limits)
      : bins_(bins), weights_(weights), limits_(limits), loads_(bin_loads(bins, weights)) {
    tokens_.assign(bins.size(), 0);
    if (has_cap()) {
      for (size_t b = 0; b < bins.size(); ++b) {
        for (int item : bins[b]) tokens_[b] += limits.item_tokens[item];
      }
    }
    for (size_t b = 0; b < bins.size(); ++b) by_time_.emplace(time(b), b);
  }

  // One improving move or swap between the slowest and the fastest bin; false when none helps.
  bool step() {
    // The slowest bin (lowest index among equals) and the fastest (likewise), in O(log bins).
    const size_t fast = by_time_.begin()->second;
    const size_t slow = by_time_.lower_bound({std::prev(by_time_.end())->first, 0})->second;
    if (slow == fast) return false;
    const double current = time(slow);
    // A change must beat the current maximum by a relative margin, so rounding noise cannot make
    // the pass cycle.
    const double must_beat = current - 1e-12 * std::abs(current);
    const double slow_speed = speed(slow);
    const double fast_speed = speed(fast);
    auto pair_time_after = [&](double moved_weight) {
      return std::max((loads_[slow] - moved_weight) / slow_speed,
                      (loads_[fast] + moved_weight) / fast_speed);
    };

    double best_time = must_beat;
    int best_out = -1;  // item leaving the slow bin
    int best_in = -1;   // item leaving the fast bin (swap), or -1 (move)

    const bool may_move = !limits_.keep_counts_balanced || bins_[slow].size() > bins_[fast].size();
    if (may_move && bins_[slow].size() > 1) {
      for (int item : bins_[slow]) {
        if (weights_[item] <= 0.0) continue;
        if (has_cap() && tokens_[fast] + limits_.item_tokens[item] > limits_.token_cap) continue;
        const double after = pair_time_after(weights_[item]);
        if (after < best_time) {
          best_time = after;
          best_out = item;
          best_in = -1;
        }
      }
    }

    // Swaps: the pair time depends only on d = w_out - w_in and is V-shaped around the d that
    // equalizes the two bins, so for each outgoing item only the incoming items whose weights sit
    // next to that target need checking (a small window when a token cap may rule some out).
    const double ideal_shift =
        (loads_[slow] * fast_speed - loads_[fast] * slow_speed) / (slow_speed + fast_speed);
    std::vector<int> fast_items = bins_[fast];
    std::stable_sort(fast_items.begin(), fast_items.end(),
                     [&](int x, int y) { return weights_[x] < weights_[y]; });
    const int window = has_cap() ? 8 : 1;
    for (int out : bins_[slow]) {
      const double target = weights_[out] - ideal_shift;
      auto pos = std::lower_bound(fast_items.begin(), fast_items.end(), target,
                                  [&](int item, double value) { return weights_[item] < value; });
      const auto center = pos - fast_items.begin();
      const auto lo = std::max<ptrdiff_t>(0, center - window);
      const auto hi =
          std::min<ptrdiff_t>(static_cast<ptrdiff_t>(fast_items.size()), center + window);
      for (ptrdiff_t i = lo; i < hi; ++i) {
        const int in = fast_items[static_cast<size_t>(i)];
        const double shift = weights_[out] - weights_[in];
        if (shift <= 0.0) continue;
        if (has_cap()) {
          const int64_t delta = limits_.item_tokens[out] - limits_.item_tokens[in];
          if (tokens_[fast] + delta > limits_.token_cap) continue;
          if (tokens_[slow] - delta > limits_.token_cap) continue;
        }
        const double after = pair_time_after(shift);
        if (after < best_time) {
          best_time = after;
          best_out = out;
          best_in = in;
        }
      }
    }
    if (best_out < 0) return false;
    transfer(best_out, slow, fast);
    if (best_in >= 0) transfer(best_in, fast, slow);
    return true;
  }

  void finish() {
    for (auto& bin : bins_) std::sort(bin.begin(), bin.end());
  }

 private:
  bool has_cap() const { return !limits_.item_tokens.empty(); }
  double speed(size_t b) const { return limits_.bin_speeds.empty() ? 1.0 : limits_.bin_speeds[b]; }
  double time(size_t b) const { return loads_[b] / speed(b); }

  void transfer(int item, size_t from, size_t to) {
    auto& source = bins_[from];
    source.erase(std::find(source.begin(), source.end(), item));
    bins_[to].push_back(item);
    by_time_.erase({time(from), from});
    by_time_.erase({time(to), to});
    loads_[from] -= weights_[item];
    loads_[to] += weights_[item];
    by_time_.emplace(time(from), from);
    by_time_.emplace(time(to), to);
    if (has_cap()) {
      tokens_[from] -= limits_.item_tokens[item];
      tokens_[to] += limits_.item_tokens[item];
    }
  }

  Bins& bins_;
  std::span<const double> weights_;
  const RefineLimits& limits_;
  std::vector<double> loads_;
  std::vector<int64_t> tokens_;
  std::set<std::pair<double, size_t>> by_time_;  // (time, bin) of every bin
};

}  // namespace

int refine(Bins& bins, std::span<const double> weights, const RefineLimits& limits) {
  if (bins.size() < 2) return 0;
  size_t num_items = 0;
  for (const auto& bin : bins) num_items += bin.size();
  // Each step lowers the sorted vector of bin times lexicographically, so the pass ends; the cap
  // only bounds the work on adversarial inputs.
  const int max_steps = static_cast<int>(4 * num_items + 64);
  Refiner refiner(bins, weights, limits);
  int steps = 0;
  while (steps < max_steps && refiner.step()) ++steps;
  refiner.finish();
  return steps;
}

}  // namespace odc::planner
