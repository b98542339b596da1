// Microbatch packing. Strategy per target count m: a cost-balanced Karmarkar-Karp split, accepted
// if it respects the token cap; else a cap-aware greedy; then refinement that never breaks the cap.
#include "planner/packing.h"

#include <algorithm>
#include <numeric>
#include <optional>

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

Bins first_fit_decreasing(const PackingInput& input) {
  Bins bins;
  std::vector<int64_t> used;
  for (int item : order_by_tokens_descending(input)) {
    size_t b = 0;
    while (b < bins.size() && used[b] + input.tokens[item] > input.token_cap) ++b;
    if (b == bins.size()) {
      bins.emplace_back();
      used.push_back(0);
    }
    bins[b].push_back(item);
    used[b] += input.tokens[item];
  }
  return bins;
}

// Largest items first, each into the cheapest microbatch that still has room for it.
std::optional<Bins> greedy_with_cap(const PackingInput& input, int num_bins) {
  Bins bins(static_cast<size_t>(num_bins));
  std::vector<int64_t> used(bins.size(), 0);
  std::vector<double> cost(bins.size(), 0.0);
  for (int item : order_by_tokens_descending(input)) {
    int best = -1;
    for (int b = 0; b < num_bins; ++b) {
      if (used[b] + input.tokens[item] > input.token_cap) continue;
      if (best < 0 || cost[b] < cost[best]) best = b;
    }
    if (best < 0) return std::nullopt;
    bins[best].push_back(item);
    used[best] += input.tokens[item];
    cost[best] += input.costs[item];
  }
  return bins;
}

void refine_under_cap(Bins& bins, const PackingInput& input) {
  RefineLimits limits;
  limits.item_tokens = input.tokens;
  limits.token_cap = input.token_cap;
  (void)refine(bins, input.costs, limits);
}

std::optional<Bins> balanced_fit(const PackingInput& input, int num_bins) {
  Bins bins = karmarkar_karp(input.costs, num_bins, /*equal_size=*/false);
  if (!within_cap(bins, input)) {
    std::optional<Bins> greedy = greedy_with_cap(input, num_bins);
    if (!greedy) return std::nullopt;
    bins = std::move(*greedy);
  }
  refine_under_cap(bins, input);
  return bins;
}

}  // namespace

Bins pack_fewest(const PackingInput& input) {
  if (input.tokens.empty()) return {};
  Bins packed = first_fit_decreasing(input);
  const int upper = static_cast<int>(packed.size());
  const int lower = static_cast<int>(
      std::max<int64_t>(1, (total_tokens(input) + input.token_cap - 1) / input.token_cap));
  for (int count = lower; count < upper; ++count) {
    if (std::optional<Bins> fit = balanced_fit(input, count)) return std::move(*fit);
  }
  // first-fit-decreasing's count is the fewest found; balance its contents.
  if (std::optional<Bins> fit = balanced_fit(input, upper)) return std::move(*fit);
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
  if (std::optional<Bins> fit = balanced_fit(input, num_microbatches)) return std::move(*fit);
  // Start from the fewest-microbatch packing and give each extra microbatch one item taken from
  // the fullest microbatch; a single item always fits under the cap.
  Bins bins = pack_fewest(input);
  while (static_cast<int>(bins.size()) < num_microbatches) {
    auto fullest = std::max_element(
        bins.begin(), bins.end(), [](const auto& x, const auto& y) { return x.size() < y.size(); });
    const int item = fullest->back();
    fullest->pop_back();
    bins.push_back({item});
  }
  refine_under_cap(bins, input);
  return bins;
}

}  // namespace odc::planner
