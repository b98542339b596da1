// Microbatch packing. Strategy per target count m: a cost-balanced Karmarkar-Karp split, accepted
// if it respects the token cap; else a cap-aware greedy; then refinement that never breaks the cap.
// Near-linear: first-fit uses a segment tree, the greedy keeps its bins in ordered sets, the count
// is searched by galloping and bisection, and Karmarkar-Karp (O(items x bins) memory and time) runs
// only while items x bins stays under kKarmarkarKarpBudget. Token sums cannot overflow: plan
// inputs are validated so that the total of all tokens fits int64_t.
#include "planner/packing.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>
#include <queue>
#include <set>
#include <utility>

namespace odc::planner {
namespace {

int64_t total_tokens(const PackingInput& input) {
  return std::accumulate(input.tokens.begin(), input.tokens.end(), int64_t{0});
}

bool within_cap(const Bins& bins, const PackingInput& input) {
  for (const auto& bin : bins) {
    int64_t sum = 0;
    for (int item : bin) sum += input.tokens[item];
    if (sum > input.token_cap) return false;
  }
  return true;
}

// Items by token count, largest first (ties by index).
std::vector<int> order_by_tokens_descending(const PackingInput& input) {
  std::vector<int> order(input.tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return input.tokens[x] > input.tokens[y]; });
  return order;
}

// First-fit decreasing. Bins not opened yet count as empty bins after the open ones, so "the first
// bin with room" over a max-tree of remaining room is exactly first fit, in O(log n) per item.
Bins first_fit_decreasing(const PackingInput& input, const std::vector<int>& order) {
  const size_t num_items = input.tokens.size();
  size_t leaves = 1;
  while (leaves < num_items) leaves <<= 1;
  std::vector<int64_t> room(2 * leaves, 0);
  for (size_t b = 0; b < num_items; ++b) room[leaves + b] = input.token_cap;
  for (size_t node = leaves - 1; node >= 1; --node) {
    room[node] = std::max(room[2 * node], room[2 * node + 1]);
  }
  Bins bins;
  for (int item : order) {
    const int64_t tokens = input.tokens[item];
    size_t node = 1;  // every item fits an empty bin, so the root has room
    while (node < leaves) node = room[2 * node] >= tokens ? 2 * node : 2 * node + 1;
    const size_t b = node - leaves;
    if (b >= bins.size()) bins.resize(b + 1);
    bins[b].push_back(item);
    room[node] -= tokens;
    for (node /= 2; node >= 1; node /= 2) {
      room[node] = std::max(room[2 * node], room[2 * node + 1]);
    }
  }
  return bins;
}

// Largest items first, each into the cheapest microbatch that still has room for it (ties: lowest
// index). Items come in non-increasing token order, so a bin with room for this item has room for
// every later one until it receives an item: `eligible` holds those bins by (cost, index), and
// `waiting` the others by remaining room, promoted as the items get smaller.
std::optional<Bins> greedy_with_cap(const PackingInput& input, const std::vector<int>& order,
                                    int num_bins) {
  Bins bins(static_cast<size_t>(num_bins));
  std::vector<int64_t> used(bins.size(), 0);
  std::vector<double> cost(bins.size(), 0.0);
  // Min-heap by (cost, index); each bin sits in exactly one of the two heaps.
  std::priority_queue<std::pair<double, int>, std::vector<std::pair<double, int>>, std::greater<>>
      eligible;
  std::priority_queue<std::pair<int64_t, int>> waiting;  // (room, bin); largest room first
  for (int b = 0; b < num_bins; ++b) eligible.emplace(0.0, b);
  for (int item : order) {
    const int64_t tokens = input.tokens[item];
    while (!waiting.empty() && waiting.top().first >= tokens) {
      const int b = waiting.top().second;
      waiting.pop();
      eligible.emplace(cost[b], b);
    }
    if (eligible.empty()) return std::nullopt;
    const int best = eligible.top().second;
    eligible.pop();
    bins[best].push_back(item);
    used[best] += tokens;
    cost[best] += input.costs[item];
    const int64_t room = input.token_cap - used[best];
    if (room >= tokens) {
      eligible.emplace(cost[best], best);
    } else {
      waiting.emplace(room, best);
    }
  }
  return bins;
}

void refine_under_cap(Bins& bins, const PackingInput& input) {
  RefineLimits limits;
  limits.item_tokens = input.tokens;
  limits.token_cap = input.token_cap;
  (void)refine(bins, input.costs, limits);
}

// `order`: the items by tokens, largest first (computed once per packing, not per attempt).
std::optional<Bins> balanced_fit(const PackingInput& input, const std::vector<int>& order,
                                 int num_bins) {
  Bins bins;
  const int64_t num_items = static_cast<int64_t>(input.tokens.size());
  const bool try_differencing = num_items * num_bins <= kKarmarkarKarpBudget;
  if (try_differencing) bins = karmarkar_karp(input.costs, num_bins, /*equal_size=*/false);
  if (!try_differencing || !within_cap(bins, input)) {
    std::optional<Bins> greedy = greedy_with_cap(input, order, num_bins);
    if (!greedy) return std::nullopt;
    bins = std::move(*greedy);
  }
  refine_under_cap(bins, input);
  return bins;
}

}  // namespace

Bins pack_fewest(const PackingInput& input) {
  if (input.tokens.empty()) return {};
  const std::vector<int> order = order_by_tokens_descending(input);
  Bins packed = first_fit_decreasing(input, order);
  const int upper = static_cast<int>(packed.size());
  // ceil(total / cap), written so that it cannot overflow near INT64_MAX.
  const int64_t total = total_tokens(input);
  const int lower = static_cast<int>(
      std::max<int64_t>(1, total / input.token_cap + (total % input.token_cap != 0 ? 1 : 0)));
  // The fewest count in [lower, upper) that balanced_fit() packs. More microbatches leave more
  // room, so rather than one attempt per count (a full packing each: quadratic), the search tries
  // `lower` (most inputs stop there), then `upper - 1` (where first-fit is already tight, nothing
  // below it packs either), then gallops up from lower + 1 (lower + 1, + 2, + 4, ...) and bisects
  // the last gap: O(log(upper - lower)) attempts.
  std::optional<Bins> best;
  int infeasible = lower - 1;  // largest count known to fail
  int feasible = upper;        // smallest count known to pack (first-fit's count always does)
  auto attempt = [&](int count) {
    std::optional<Bins> fit = balanced_fit(input, order, count);
    if (fit) {
      feasible = count;
      best = std::move(fit);
    } else {
      infeasible = count;
    }
    return best.has_value() && feasible == count;
  };
  if (lower < upper && !attempt(lower) && upper - 1 > lower && attempt(upper - 1)) {
    for (int step = 1; lower + step < feasible; step *= 2) {
      if (attempt(lower + step)) break;
    }
  }
  while (best && feasible - infeasible > 1) {
    attempt(infeasible + (feasible - infeasible) / 2);
  }
  if (best) return std::move(*best);
  // first-fit-decreasing's count is the fewest found; balance its contents.
  if (std::optional<Bins> fit = balanced_fit(input, order, upper)) return std::move(*fit);
  refine_under_cap(packed, input);
  return packed;
}

Bins pack_exact(const PackingInput& input, int num_microbatches) {
  const int num_items = static_cast<int>(input.tokens.size());
  if (num_items <= num_microbatches) {
    Bins bins(static_cast<size_t>(num_microbatches));
    for (int item = 0; item < num_items; ++item) bins[item].push_back(item);
    return bins;
  }
  const std::vector<int> order = order_by_tokens_descending(input);
  if (std::optional<Bins> fit = balanced_fit(input, order, num_microbatches)) {
    return std::move(*fit);
  }
  // Start from the fewest-microbatch packing and give each extra microbatch one item taken from
  // the fullest microbatch (most items, lowest index first); a single item always fits under the
  // cap.
  Bins bins = pack_fewest(input);
  auto fuller_first = [](const std::pair<size_t, size_t>& x, const std::pair<size_t, size_t>& y) {
    return x.first != y.first ? x.first > y.first : x.second < y.second;
  };
  std::set<std::pair<size_t, size_t>, decltype(fuller_first)> by_size(fuller_first);
  for (size_t b = 0; b < bins.size(); ++b) by_size.emplace(bins[b].size(), b);
  while (static_cast<int>(bins.size()) < num_microbatches) {
    const size_t fullest = by_size.begin()->second;
    by_size.erase(by_size.begin());
    const int item = bins[fullest].back();
    bins[fullest].pop_back();
    by_size.emplace(bins[fullest].size(), fullest);
    bins.push_back({item});
    by_size.emplace(1, bins.size() - 1);
  }
  refine_under_cap(bins, input);
  return bins;
}

}  // namespace odc::planner
