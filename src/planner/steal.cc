// The work-stealing simulation of steal.h: an event queue of free ranks ordered by (time, rank),
// and an ordered set of queues with unclaimed items ordered by (predicted sum desc, rank asc), so
// a claim costs O(log ranks); a theft re-adds exact sums only where rounding could decide.
#include "planner/steal.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <string>
#include <utility>

#include "planner/plan_io.h"

namespace odc::planner {
namespace {

// `what` names one value (e.g. "speed of rank 2"); ok when finite and > 0 (positive) or >= 0.
Status check_value(double value, const std::string& what, bool positive) {
  if (std::isfinite(value) && (positive ? value > 0 : value >= 0)) return Status::Ok();
  return Status::InvalidArgument(what + " is " + number_text(value) +
                                 ": expected a finite number " + (positive ? "> 0" : ">= 0"));
}

// Item costs, flat queue by queue; messages name the queue and the item's index in it.
Status check_costs(std::span<const double> costs, std::span<const int64_t> counts,
                   const char* what) {
  size_t item = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    for (int64_t i = 0; i < counts[r] && item < costs.size(); ++i, ++item) {
      ODC_RETURN_IF_ERROR(check_value(
          costs[item],
          std::string(what) + " of queue " + std::to_string(r) + "'s item " + std::to_string(i),
          false));
    }
  }
  return Status::Ok();
}

Status check_input(const StealInput& input, size_t& num_items) {
  const size_t num_ranks = input.counts.size();
  num_items = 0;
  for (size_t r = 0; r < num_ranks; ++r) {
    if (input.counts[r] < 0) {
      return Status::InvalidArgument("queue " + std::to_string(r) + " has a negative count " +
                                     std::to_string(input.counts[r]));
    }
    num_items += static_cast<size_t>(input.counts[r]);
  }
  if (input.predicted.size() != num_items) {
    return Status::InvalidArgument("predicted costs: got " +
                                   std::to_string(input.predicted.size()) + " values for " +
                                   std::to_string(num_items) + " items (the sum of the counts)");
  }
  if (!input.actual.empty() && input.actual.size() != num_items) {
    return Status::InvalidArgument(
        "actual costs: got " + std::to_string(input.actual.size()) + " values for " +
        std::to_string(num_items) +
        " items (the sum of the counts); give none to use the predicted");
  }
  for (const auto& [values, what] :
       {std::pair{input.rank_speed, "rank_speed"}, std::pair{input.rank_start, "rank_start"}}) {
    if (!values.empty() && values.size() != num_ranks) {
      return Status::InvalidArgument(std::string(what) + " must have one entry per rank: got " +
                                     std::to_string(values.size()) + " for " +
                                     std::to_string(num_ranks) + " ranks");
    }
  }
  ODC_RETURN_IF_ERROR(check_costs(input.predicted, input.counts, "predicted cost"));
  ODC_RETURN_IF_ERROR(check_costs(input.actual, input.counts, "actual cost"));
  for (size_t r = 0; r < input.rank_speed.size(); ++r) {
    ODC_RETURN_IF_ERROR(
        check_value(input.rank_speed[r], "speed of rank " + std::to_string(r), true));
  }
  for (size_t r = 0; r < input.rank_start.size(); ++r) {
    ODC_RETURN_IF_ERROR(
        check_value(input.rank_start[r], "start of rank " + std::to_string(r), false));
  }
  return Status::Ok();
}

}  // namespace

double StealResult::total_busy() const {
  return std::accumulate(busy.begin(), busy.end(), 0.0);
}

Result<StealResult> simulate_stealing(const StealInput& input) {
  size_t num_items = 0;
  ODC_RETURN_IF_ERROR(check_input(input, num_items));
  const size_t num_ranks = input.counts.size();
  std::vector<size_t> first(num_ranks + 1, 0);  // queue r's items are flat [first[r], first[r+1])
  for (size_t r = 0; r < num_ranks; ++r) {
    first[r + 1] = first[r] + static_cast<size_t>(input.counts[r]);
  }
  std::vector<size_t> front(first.begin(), first.end() - 1), back(first.begin() + 1, first.end());
  // The thieves' key: a queue's unclaimed predicted sum as the runtime's work board adds it, item
  // by item from its front in index order (src/core/work_board.cc, WorkPlan::cost), so that sums
  // equal only up to rounding break ties the same way. That sum cannot be updated per claim, so
  // the queues are ordered by prefix[back] - prefix[front] (O(log ranks) per claim), which is
  // within `slack` of it, and the exact sums are added up only for the queues whose ordered sum
  // lies within both slacks of the largest one: usually just the largest, so one theft costs
  // O(log ranks), and the choice is the exact rule's whatever the rounding.
  std::vector<double> prefix(num_items + num_ranks, 0.0);  // queue r: prefix[first[r] + r + i]
  std::vector<double> slack(num_ranks, 0.0);
  for (size_t r = 0; r < num_ranks; ++r) {
    double sum = 0.0;
    for (size_t i = first[r]; i < first[r + 1]; ++i) {
      prefix[i + r] = sum;
      sum += input.predicted[i];
    }
    prefix[first[r + 1] + r] = sum;
    // Both sums are within (items + 1) roundings of the exact one, each at most eps x the
    // queue's total: 4 (items + 2) eps x total bounds their difference with room to spare.
    slack[r] = 4.0 * static_cast<double>(first[r + 1] - first[r] + 2) *
               std::numeric_limits<double>::epsilon() * sum;
  }
  const double most_slack = num_ranks ? *std::max_element(slack.begin(), slack.end()) : 0.0;
  auto ordered_sum = [&](size_t r) { return prefix[back[r] + r] - prefix[front[r] + r]; };
  auto exact_sum = [&](size_t r) {
    double sum = 0.0;
    for (size_t i = front[r]; i < back[r]; ++i) sum += input.predicted[i];
    return sum;
  };
  using Victim = std::pair<double, size_t>;  // (ordered sum, rank): largest sum, then lowest rank
  auto victim_order = [](const Victim& x, const Victim& y) {
    return x.first != y.first ? x.first > y.first : x.second < y.second;
  };
  std::set<Victim, decltype(victim_order)> victims(victim_order);
  for (size_t r = 0; r < num_ranks; ++r) {
    if (front[r] < back[r]) victims.insert({ordered_sum(r), r});
  }
  // The rule's victim: the largest exact sum, ties the lowest rank. A queue whose exact sum is at
  // least the top one's has an ordered sum of at least the top's minus both slacks.
  auto choose_victim = [&]() {
    const auto top = victims.begin();
    const double lowest_candidate = top->first - slack[top->second] - most_slack;
    auto next = std::next(top);
    if (next == victims.end() || next->first < lowest_candidate) return top->second;
    size_t best = top->second;
    double best_sum = exact_sum(best);
    for (auto it = next; it != victims.end() && it->first >= lowest_candidate; ++it) {
      const double sum = exact_sum(it->second);
      if (sum > best_sum || (sum == best_sum && it->second < best)) {
        best = it->second;
        best_sum = sum;
      }
    }
    return best;
  };

  StealResult result;
  result.finish.assign(num_ranks, 0.0);
  result.busy.assign(num_ranks, 0.0);
  result.runner.assign(num_items, -1);
  result.run_order.reserve(num_items);
  using Event = std::pair<double, size_t>;  // (time the rank is free, rank)
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> free_ranks;
  for (size_t r = 0; r < num_ranks; ++r) {
    result.finish[r] = input.rank_start.empty() ? 0.0 : input.rank_start[r];
    free_ranks.push({result.finish[r], r});
  }
  while (!free_ranks.empty()) {
    const auto [now, rank] = free_ranks.top();
    free_ranks.pop();
    size_t owner = rank;
    if (front[rank] == back[rank]) {
      if (victims.empty()) continue;  // nothing unclaimed: this rank stops at `now`
      owner = choose_victim();
    }
    victims.erase({ordered_sum(owner), owner});
    const size_t item = owner == rank ? front[owner]++ : --back[owner];
    if (front[owner] < back[owner]) victims.insert({ordered_sum(owner), owner});
    const double cost = input.actual.empty() ? input.predicted[item] : input.actual[item];
    const double duration = cost / (input.rank_speed.empty() ? 1.0 : input.rank_speed[rank]);
    result.runner[item] = static_cast<int64_t>(rank);
    result.run_order.push_back(static_cast<int64_t>(item));
    result.busy[rank] += duration;
    result.finish[rank] = now + duration;
    if (owner != rank) ++result.num_moved;
    free_ranks.push({result.finish[rank], rank});
  }
  for (double finish : result.finish) result.span = std::max(result.span, finish);
  return result;
}

}  // namespace odc::planner
