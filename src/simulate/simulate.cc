// Event simulation of the FSDP2 arms (collective, deferred sync, resharding off) and ODC on the
// planner's plans. Each microbatch's cost (the planner's cost model, seconds) is spread evenly over
// the layers, forward then backward (a forward-only microbatch: its whole cost in the forward);
// transfers run on their own channel and overlap compute as FSDP2's one-layer prefetch allows.
// Contention between a rank's pulls and the pushes landing on it (and between serving others'
// pulls and its own pushes) is mean-field: a second pass runs with each flow's bandwidth divided by
// 1 + u, u being the share of the link's time the competing traffic used in the first pass.
#include "simulate/simulate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "planner/plan_io.h"
#include "planner/steal.h"

namespace odc::simulate {
namespace {

double rank_speed(const planner::PlanOptions& options, size_t rank) {
  return options.rank_speed.empty() ? 1.0 : options.rank_speed[rank];
}

// Rank r's speed as it runs: the plan's speed over the slowdown the plan did not know of.
double run_speed(const planner::PlanOptions& plan, const SimulateOptions& options, size_t rank) {
  const double slowdown = options.rank_slowdown.empty() ? 1.0 : options.rank_slowdown[rank];
  return rank_speed(plan, rank) / slowdown;
}

// Each split group's time (its slowest member's chunk: the chunks exchange K/V, so the group
// moves together), per rank; 0 for ranks in no group. Groups are disjoint.
std::vector<double> split_group_times(const planner::MinibatchPlan& minibatch,
                                      const planner::PlanOptions& plan,
                                      const SimulateOptions& options) {
  std::vector<double> group_time(minibatch.ranks.size(), 0.0);
  for (const planner::SplitSample& split : minibatch.splits) {
    double slowest = 0.0;
    for (size_t m = 0; m < split.ranks.size(); ++m) {
      slowest =
          std::max(slowest, split.chunk_costs[m] /
                                run_speed(plan, options, static_cast<size_t>(split.ranks[m])));
    }
    for (int64_t rank : split.ranks) group_time[static_cast<size_t>(rank)] = slowest;
  }
  return group_time;
}

// Per-microbatch, per-rank costs of one minibatch (seconds), as the planner's predict_times steps
// them, at the speeds the ranks run: a split sample's group members first run their chunk, each
// taking the group's time, then their own microbatches. A chunk is a forward and backward over
// every layer like a microbatch, so it gathers and pushes the same units.
// With options.steal: the microbatches each rank runs under work stealing, in the order it claims
// them (planner::simulate_stealing on the plan's predicted costs, at the speeds the ranks run).
Result<std::vector<std::vector<double>>> microbatch_costs(const planner::MinibatchPlan& minibatch,
                                                          std::span<const int64_t> lengths,
                                                          const planner::PlanOptions& plan,
                                                          const SimulateOptions& options) {
  const size_t num_ranks = minibatch.ranks.size();
  const std::vector<double> group_time = split_group_times(minibatch, plan, options);
  std::vector<std::vector<double>> costs(num_ranks);
  for (const planner::SplitSample& split : minibatch.splits) {
    for (int64_t rank : split.ranks) {
      costs[static_cast<size_t>(rank)].push_back(group_time[static_cast<size_t>(rank)]);
    }
  }
  std::vector<int64_t> counts(num_ranks);
  std::vector<double> predicted, speed(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    speed[r] = run_speed(plan, options, r);
    counts[r] = static_cast<int64_t>(minibatch.ranks[r].microbatches.size());
    for (const auto& microbatch : minibatch.ranks[r].microbatches) {
      double samples = 0.0;
      for (int64_t sample : microbatch) samples += plan.cost.sample_cost(lengths[sample]);
      predicted.push_back(plan.cost.microbatch(samples));
      if (!options.steal) costs[r].push_back(predicted.back() / speed[r]);
    }
  }
  if (!options.steal) return costs;
  auto played = planner::simulate_stealing({counts, predicted, {}, speed, group_time});
  if (!played.ok()) return played.status();
  for (int64_t item : played.value().run_order) {
    const auto runner = static_cast<size_t>(played.value().runner[static_cast<size_t>(item)]);
    costs[runner].push_back(predicted[static_cast<size_t>(item)] / speed[runner]);
  }
  return costs;
}

// Seconds a rank spends on each kind of link, per direction, in one minibatch (for contention).
struct LinkUse {
  double nvlink_in = 0.0, nvlink_out = 0.0, network_in = 0.0, network_out = 0.0;
};

// Bandwidth shares left to pulls (inbound) and pushes (outbound) by the other direction's traffic.
struct Shares {
  double nvlink_in = 1.0, nvlink_out = 1.0, network_in = 1.0, network_out = 1.0;
};

class Simulator {
 public:
  explicit Simulator(const SimulateOptions& options) : o_(options), n_(options.plan.num_ranks) {
    const int64_t g = std::max<int64_t>(1, std::min(o_.topology.gpus_per_node, n_));
    local_ = g;
    nodes_ = (n_ + g - 1) / g;
  }

  // Minibatch time with everything included; adds busy seconds and link use.
  double minibatch(const std::vector<std::vector<double>>& costs, double& busy) {
    for (const auto& rank : costs) busy += std::accumulate(rank.begin(), rank.end(), 0.0);
    // A forward-only minibatch has no optimizer step (and nothing to reduce across nodes).
    const double optimizer = o_.forward_only ? 0.0 : optimizer_seconds(n_);
    switch (o_.mode) {
      case Mode::kCollective:
        return collective(costs, ReduceScatters::kEveryMicrobatch) + optimizer;
      case Mode::kFsdp2Deferred:
        return collective(costs, ReduceScatters::kLastMicrobatch) + optimizer;
      case Mode::kFsdp2Unsharded:
        return unsharded(costs) + optimizer;
      case Mode::kOdcFlat:
      case Mode::kOdcHybrid: {
        LinkUse use;
        const double first = odc(costs, Shares{}, use);
        // Second pass: what the other direction used of each link is not there for this one.
        const double span = std::max(first, 1e-30) * static_cast<double>(n_);
        // Processor sharing: a flow meets on average u other flows, u = the other traffic's
        // share of the link's time, so it gets 1 / (1 + u) of the bandwidth.
        Shares shares;
        shares.nvlink_in = 1.0 / (1.0 + use.nvlink_out / span);
        shares.nvlink_out = 1.0 / (1.0 + use.nvlink_in / span);
        shares.network_in = 1.0 / (1.0 + use.network_out / span);
        shares.network_out = 1.0 / (1.0 + use.network_in / span);
        LinkUse unused;
        const double span_seconds = odc(costs, shares, unused);
        if (o_.forward_only) return span_seconds;
        const int64_t shard_ranks = o_.mode == Mode::kOdcHybrid ? local_ : n_;
        return span_seconds + cross_node_reduction() + optimizer_seconds(shard_ranks);
      }
    }
    return 0.0;
  }

  double optimizer_seconds(int64_t shard_ranks) const {
    const double params = o_.model.other_params + o_.model.layer_params * o_.model.num_layers;
    return params / static_cast<double>(shard_ranks) * o_.optimizer_bytes_per_param /
           o_.hbm_bytes_per_second;
  }

 private:
  // NCCL ring collective moving `bytes` (the full unit) among all N ranks: bus bandwidth is the
  // slowest link of the ring (the NIC once the job spans nodes).
  double collective_seconds(double bytes, const Curve& curve) const {
    if (o_.free_communication || n_ == 1) return 0.0;
    const double moved = bytes * static_cast<double>(n_ - 1) / static_cast<double>(n_);
    const Topology& t = o_.topology;
    if (nodes_ == 1) {
      if (!curve.empty()) return moved / curve.bandwidth(bytes);
      return static_cast<double>(n_ - 1) * t.nvlink_collective.latency_seconds +
             moved / t.nvlink_collective.bytes_per_second;
    }
    return static_cast<double>(local_ - 1) * t.nvlink_collective.latency_seconds +
           static_cast<double>(nodes_ - 1) * t.network.latency_seconds +
           moved / std::min(t.network.bytes_per_second, t.nvlink_collective.bytes_per_second);
  }

  // One FSDP2 unit's collectives: bf16 parameters gathered, fp32 gradients reduce-scattered.
  struct UnitSeconds {
    double all_gather_layer = 0.0, all_gather_root = 0.0;
    double reduce_scatter_layer = 0.0, reduce_scatter_root = 0.0;
  };
  UnitSeconds collective_unit_seconds() const {
    const TransportCurves& curves = o_.topology.curves;
    const ModelShape& m = o_.model;
    return UnitSeconds{collective_seconds(kAllGatherBytes * m.layer_params, curves.all_gather),
                       collective_seconds(kAllGatherBytes * m.other_params, curves.all_gather),
                       collective_seconds(kGradBytes * m.layer_params, curves.reduce_scatter),
                       collective_seconds(kGradBytes * m.other_params, curves.reduce_scatter)};
  }

  // One rank pulling (inbound) or pushing (outbound) its 1/N-slices of `bytes` to or from every
  // owner: the node's peers over NVLink and, in flat mode, the other nodes' over the network,
  // both at once.
  double transfer_seconds(double bytes, bool inbound, const Shares& shares, LinkUse& use) const {
    if (o_.free_communication) return 0.0;
    const Topology& t = o_.topology;
    const bool flat = o_.mode == Mode::kOdcFlat;
    const double group = static_cast<double>(flat ? n_ : local_);
    const double local_bytes = bytes * static_cast<double>(local_ - 1) / group;
    const double remote_bytes = flat ? bytes * static_cast<double>(n_ - local_) / group : 0.0;
    double local_seconds = 0.0, remote_seconds = 0.0;
    if (local_bytes > 0) {
      const double share = inbound ? shares.nvlink_in : shares.nvlink_out;
      const Curve& curve = inbound ? t.curves.gather : t.curves.scatter;
      // A measured curve already holds the latency and the all-at-once load of its run.
      const double bandwidth = curve.empty() ? t.nvlink.bytes_per_second : curve.bandwidth(bytes);
      const double latency = curve.empty() ? t.nvlink.latency_seconds : 0.0;
      local_seconds = latency + local_bytes / (bandwidth * share);
      (inbound ? use.nvlink_in : use.nvlink_out) += local_bytes / bandwidth;
    }
    if (remote_bytes > 0) {
      const double share = inbound ? shares.network_in : shares.network_out;
      remote_seconds =
          t.network.latency_seconds + remote_bytes / (t.network.bytes_per_second * share);
      (inbound ? use.network_in : use.network_out) += remote_bytes / t.network.bytes_per_second;
    }
    return std::max(local_seconds, remote_seconds);
  }

  // Hybrid: the node-sharded gradient is all-reduced across nodes (ring) once per minibatch.
  double cross_node_reduction() const {
    if (o_.mode != Mode::kOdcHybrid || nodes_ == 1 || o_.free_communication) return 0.0;
    const double params = o_.model.other_params + o_.model.layer_params * o_.model.num_layers;
    const double bytes = kGradBytes * params / static_cast<double>(local_);
    const double nodes = static_cast<double>(nodes_);
    return 2.0 * (nodes - 1) * o_.topology.network.latency_seconds +
           2.0 * (nodes - 1) / nodes * bytes / o_.topology.network.bytes_per_second;
  }

  // ODC's one barrier per minibatch (dissemination: log2 N rounds).
  double barrier_seconds() const {
    if (o_.free_communication || n_ == 1) return 0.0;
    const double rounds = std::ceil(std::log2(static_cast<double>(n_)));
    const double latency =
        nodes_ > 1 ? o_.topology.network.latency_seconds : o_.topology.nvlink.latency_seconds;
    return rounds * latency;
  }

  // Where an FSDP2 arm reduce-scatters a layer's gradient: after its backward in every
  // microbatch (collective), only in the last microbatch's (fsdp2-deferred), or never
  // (forward-only).
  enum class ReduceScatters { kEveryMicrobatch, kLastMicrobatch };

  // Lockstep FSDP2: a collective completes when every rank has issued it; a rank computes a layer
  // once its all-gather is done. One comm channel carries all-gathers and reduce-scatters in issue
  // order; the next layer's all-gather is issued when every rank has started the current one.
  // Deferred sync keeps every all-gather (resharding stays on), so the ranks still meet at every
  // layer of every microbatch; only the reduce-scatters move to the last microbatch.
  double collective(const std::vector<std::vector<double>>& costs, ReduceScatters reduce) {
    const int64_t layers = o_.model.num_layers;
    const UnitSeconds unit = collective_unit_seconds();
    size_t steps = 0;
    for (const auto& rank : costs) steps = std::max(steps, rank.size());
    std::vector<double> ready(n_, 0.0), start(n_, 0.0);
    double channel = 0.0;
    auto all_ready = [&] { return *std::max_element(ready.begin(), ready.end()); };
    // A forward-only microbatch's cost is its forward's (forward_cost), all of it in the forward.
    const double forward_share = o_.forward_only ? 1.0 : o_.forward_fraction;
    for (size_t k = 0; k < steps; ++k) {
      double issue = all_ready();  // every rank enters the microbatch (root all-gather)
      // FSDP2 never reshards the root after forward: with a backward it reshards after it (so
      // every microbatch gathers it again); a forward-only minibatch gathers it once, and
      // odc.train reshards it when the phase ends (arms.GradientSync.forward_only).
      if (!o_.forward_only || k == 0) channel = std::max(channel, issue) + unit.all_gather_root;
      issue = std::max(issue, channel);
      auto run_layer = [&](double fraction) {
        const double gathered = std::max(channel, issue) + unit.all_gather_layer;
        channel = gathered;
        double latest_start = 0.0;
        for (int64_t r = 0; r < n_; ++r) {
          const double cost = k < costs[r].size() ? costs[r][k] : 0.0;
          start[r] = std::max(ready[r], gathered);
          ready[r] = start[r] + cost * fraction / static_cast<double>(layers);
          latest_start = std::max(latest_start, start[r]);
        }
        issue = latest_start;  // prefetch of the next layer, issued by every rank
      };
      for (int64_t l = 0; l < layers; ++l) run_layer(forward_share);
      if (o_.forward_only) continue;
      const bool reduces = reduce == ReduceScatters::kEveryMicrobatch || k + 1 == steps;
      issue = all_ready();  // backward starts after the loss on every rank
      for (int64_t l = 0; l < layers; ++l) {
        run_layer(1.0 - o_.forward_fraction);
        // gradients of the layer
        if (reduces) channel = std::max(channel, all_ready()) + unit.reduce_scatter_layer;
      }
      if (reduces) channel = std::max(channel, all_ready()) + unit.reduce_scatter_root;
    }
    return std::max(all_ready(), channel);
  }

  // FSDP2 with resharding off and sync deferred (arms.GradientSync): at the minibatch's start
  // every rank issues every unit's all-gather, root first then the layers in forward order, on
  // its one channel; they complete in that order, every rank issuing at once. A rank's first
  // forward waits for each unit there; after that no collective until its last microbatch's
  // backward, which reduce-scatters each layer after its backward. A reduce-scatter completes
  // once every rank has issued it, and FSDP2 keeps at most one in flight: a unit's post-backward
  // makes the compute stream wait for the previous unit's reduce-scatter before it issues its
  // own (torch 2.11, FSDPParamGroup.post_backward, `reduce_scatter_state.event`), so in the
  // last backward a rank computes layer j + 1 only once every rank has finished layer j - 1 of
  // its own last backward: the ranks meet there layer by layer, whatever their earlier
  // microbatches. (Measured on 2 H100s, 8 units: a rank with one 16K-token microbatch against
  // one with 15K + 1K tokens took 238 ms with sync on in the last microbatch, 165-170 ms with it
  // off; the coupling gives the 238.) Forward-only: the gathers and the forwards only.
  double unsharded(const std::vector<std::vector<double>>& costs) {
    const int64_t layers = o_.model.num_layers;
    const UnitSeconds unit = collective_unit_seconds();
    double channel = unit.all_gather_root;
    const double root_gathered = channel;
    std::vector<double> layer_gathered(static_cast<size_t>(layers));
    for (int64_t l = 0; l < layers; ++l) layer_gathered[l] = channel += unit.all_gather_layer;
    const double forward_share = o_.forward_only ? 1.0 : o_.forward_fraction;
    // Per rank: when its last microbatch's backward starts, and its per-layer backward seconds.
    std::vector<double> now(n_, 0.0), backward_layer(n_, 0.0);
    for (int64_t r = 0; r < n_; ++r) {
      double compute = 0.0;
      for (size_t k = 0; k < costs[r].size(); ++k) {
        const double cost = costs[r][k];
        if (k == 0) compute = std::max(compute, root_gathered);
        for (int64_t l = 0; l < layers; ++l) {
          if (k == 0) compute = std::max(compute, layer_gathered[l]);
          compute += cost * forward_share / static_cast<double>(layers);
        }
        if (o_.forward_only) continue;
        const double per_layer = cost * (1.0 - o_.forward_fraction) / static_cast<double>(layers);
        if (k + 1 == costs[r].size()) {
          backward_layer[r] = per_layer;  // the last backward: coupled below
        } else {
          compute += per_layer * static_cast<double>(layers);
        }
      }
      now[r] = compute;
    }
    if (o_.forward_only) return std::max(*std::max_element(now.begin(), now.end()), channel);
    // The last backwards, layer by layer (backward order), the ranks coupled through the
    // reduce-scatters: `previous` is when the last reduce-scatter issued completed.
    double previous = 0.0;
    for (int64_t l = 0; l < layers; ++l) {
      double issued = 0.0;
      for (int64_t r = 0; r < n_; ++r) {
        now[r] += backward_layer[r];                     // this layer's backward
        if (l > 0) now[r] = std::max(now[r], previous);  // post-backward waits the previous one
        issued = std::max(issued, now[r]);
      }
      channel = std::max(channel, issued) + unit.reduce_scatter_layer;
      previous = channel;
    }
    // The root's post-backward: waits for the last layer's reduce-scatter, then its own.
    double slowest = 0.0;
    for (int64_t r = 0; r < n_; ++r) slowest = std::max(slowest, std::max(now[r], previous));
    channel = std::max(channel, slowest) + unit.reduce_scatter_root;
    return std::max(slowest, channel);
  }

  // ODC: every rank on its own; pulls one layer ahead of compute, pushes after each layer's
  // backward, and meets the others once, at the minibatch-end barrier.
  double odc(const std::vector<std::vector<double>>& costs, const Shares& shares, LinkUse& total) {
    const int64_t layers = o_.model.num_layers;
    double slowest = 0.0;
    // Transfer times and link use are the same for every rank (uniform shards).
    LinkUse pull_layer_use, pull_root_use, push_layer_use, push_root_use;
    const double pull_layer =
        transfer_seconds(kPullBytes * o_.model.layer_params, true, shares, pull_layer_use);
    const double pull_root =
        transfer_seconds(kPullBytes * o_.model.other_params, true, shares, pull_root_use);
    const double push_layer =
        transfer_seconds(kGradBytes * o_.model.layer_params, false, shares, push_layer_use);
    const double push_root =
        transfer_seconds(kGradBytes * o_.model.other_params, false, shares, push_root_use);
    double num_microbatches = 0.0;
    for (int64_t r = 0; r < n_; ++r) {
      double compute = 0.0, pull = 0.0, push = 0.0;
      for (double cost : costs[r]) {
        pull = std::max(pull, compute) + pull_root;
        double issue = pull;
        auto run_layer = [&](double fraction) {
          pull = std::max(pull, issue) + pull_layer;
          const double begin = std::max(compute, pull);
          compute = begin + cost * fraction / static_cast<double>(layers);
          issue = begin;
        };
        if (o_.forward_only) {  // gathers only: the cost is the forward's, nothing pushed
          for (int64_t l = 0; l < layers; ++l) run_layer(1.0);
          continue;
        }
        for (int64_t l = 0; l < layers; ++l) run_layer(o_.forward_fraction);
        issue = compute;
        for (int64_t l = 0; l < layers; ++l) {
          run_layer(1.0 - o_.forward_fraction);
          push = std::max(push, compute) + push_layer;
        }
        push = std::max(push, compute) + push_root;
      }
      slowest = std::max(slowest, std::max(compute, push));
      num_microbatches += static_cast<double>(costs[r].size());
    }
    // Per microbatch: 2 pulls and 1 push of every layer, 1 pull and 1 push of the root unit;
    // forward-only: 1 pull of every unit, no push.
    const double layer_count = static_cast<double>(layers) * num_microbatches;
    const double pulls_per_layer = o_.forward_only ? 1.0 : 2.0;
    const double pushes = o_.forward_only ? 0.0 : 1.0;
    total.nvlink_in += pulls_per_layer * layer_count * pull_layer_use.nvlink_in +
                       num_microbatches * pull_root_use.nvlink_in;
    total.network_in += pulls_per_layer * layer_count * pull_layer_use.network_in +
                        num_microbatches * pull_root_use.network_in;
    total.nvlink_out += pushes * (layer_count * push_layer_use.nvlink_out +
                                  num_microbatches * push_root_use.nvlink_out);
    total.network_out += pushes * (layer_count * push_layer_use.network_out +
                                   num_microbatches * push_root_use.network_out);
    return slowest + barrier_seconds();
  }

  const SimulateOptions& o_;
  int64_t n_;
  int64_t local_ = 1;
  int64_t nodes_ = 1;
};

}  // namespace

double Curve::bandwidth(double bytes) const {
  if (points.size() == 1 || bytes <= points.front().first) return points.front().second;
  if (bytes >= points.back().first) return points.back().second;
  auto above =
      std::lower_bound(points.begin(), points.end(), bytes,
                       [](const auto& point, double value) { return point.first < value; });
  auto below = above - 1;
  const double t = std::log(bytes / below->first) / std::log(above->first / below->first);
  return below->second + t * (above->second - below->second);
}

Result<TransportCurves> read_transport_curves(const std::string& path) {
  // A directory opens as a stream and fails on the first read (an exception, not a status): only
  // regular files and pipes (/dev/stdin) are read.
  std::error_code code;
  const auto type = std::filesystem::status(path, code).type();
  if (type == std::filesystem::file_type::directory) {
    return Status::InvalidArgument("transport curves '" + path + "' is a directory, not a file");
  }
  std::ifstream input(path);
  if (!input) return Status::InvalidArgument("cannot open transport curves '" + path + "'");
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(input);
  } catch (const nlohmann::json::exception& error) {
    return Status::InvalidArgument("transport curves '" + path + "': not JSON (" +
                                   std::string(error.what()) + ")");
  } catch (const std::exception& error) {  // a read error (std::ios_base::failure)
    return Status::InvalidArgument("cannot read transport curves '" + path +
                                   "': " + std::string(error.what()));
  }
  if (!document.is_object() || !document.contains("curves") || !document["curves"].is_object()) {
    return Status::InvalidArgument("transport curves '" + path + "': expected {\"curves\": {...}}");
  }
  TransportCurves curves;
  const std::pair<const char*, Curve*> names[] = {{"gather", &curves.gather},
                                                  {"scatter", &curves.scatter},
                                                  {"all_gather", &curves.all_gather},
                                                  {"reduce_scatter", &curves.reduce_scatter}};
  for (const auto& [key, curve] : names) {
    if (!document["curves"].contains(key)) continue;
    const auto& points = document["curves"][key];
    const std::string where = "transport curves '" + path + "', " + key;
    if (!points.is_array() || points.empty()) {
      return Status::InvalidArgument(where + ": expected a non-empty list of [bytes, GB/s]");
    }
    for (const auto& point : points) {
      if (!point.is_array() || point.size() != 2 || !point[0].is_number() ||
          !point[1].is_number()) {
        return Status::InvalidArgument(where + ": every point must be [bytes, GB/s]");
      }
      const double bytes = point[0].get<double>();
      const double gbytes = point[1].get<double>();
      if (!(bytes > 0) || !(gbytes > 0) || !std::isfinite(bytes) || !std::isfinite(gbytes)) {
        return Status::InvalidArgument(where + ": sizes and bandwidths must be finite and > 0");
      }
      if (!curve->points.empty() && bytes <= curve->points.back().first) {
        return Status::InvalidArgument(where + ": sizes must increase");
      }
      curve->points.emplace_back(bytes, gbytes * 1e9);
    }
  }
  return curves;
}

std::string_view mode_name(Mode mode) {
  switch (mode) {
    case Mode::kCollective:
      return "collective";
    case Mode::kFsdp2Deferred:
      return "fsdp2-deferred";
    case Mode::kFsdp2Unsharded:
      return "fsdp2-unsharded";
    case Mode::kOdcFlat:
      return "odc";
    case Mode::kOdcHybrid:
      return "odc-hybrid";
  }
  return "unknown";
}

Result<Mode> parse_mode(std::string_view name) {
  if (name == "collective") return Mode::kCollective;
  if (name == "fsdp2-deferred") return Mode::kFsdp2Deferred;
  if (name == "fsdp2-unsharded") return Mode::kFsdp2Unsharded;
  if (name == "odc") return Mode::kOdcFlat;
  if (name == "odc-hybrid") return Mode::kOdcHybrid;
  return Status::InvalidArgument(
      "unknown mode '" + std::string(name) +
      "': expected collective, fsdp2-deferred, fsdp2-unsharded, odc or odc-hybrid");
}

bool lockstep(Mode mode) {
  return mode == Mode::kCollective || mode == Mode::kFsdp2Deferred;
}

bool is_odc(Mode mode) {
  return mode == Mode::kOdcFlat || mode == Mode::kOdcHybrid;
}

std::string policy_label(const PolicyChoice& choice) {
  return choice.padded ? "lb-mini-padded" : std::string(planner::policy_name(choice.policy));
}

Result<PolicyChoice> parse_policy_choice(std::string_view name) {
  if (name == "lb-mini-padded") return PolicyChoice{planner::Policy::kLbMini, true};
  auto policy = planner::parse_policy(name);
  if (!policy.ok()) {
    return Status::InvalidArgument("unknown policy " + planner::quote_text(name) +
                                   ": expected local-sort, lb-micro, lb-mini or lb-mini-padded");
  }
  return PolicyChoice{policy.value(), false};
}

Result<ModelShape> model_preset(std::string_view name) {
  // The presets of python/odc/train/model.py (Qwen2: hidden h, layers n, key/value width kv =
  // KV heads x head size, SwiGLU intermediate i, vocabulary v): per layer 2*h*h + 2*h*kv + 3*h*i
  // (+ biases and norms, <0.1%); the embeddings, and the LM head where it is not tied.
  auto shape = [](int64_t n, double h, double kv, double i, double v, bool tied) {
    return ModelShape{n, 2 * h * h + 2 * h * kv + 3 * h * i, (tied ? 1 : 2) * h * v};
  };
  if (name == "tiny") return shape(2, 64, 32, 176, 1024, true);
  if (name == "0.5b") return shape(24, 896, 128, 4864, 151936, true);
  if (name == "1.5b") return shape(28, 1536, 256, 8960, 151936, true);
  if (name == "7b") return shape(28, 3584, 512, 18944, 152064, false);
  return Status::InvalidArgument("unknown model preset '" + std::string(name) +
                                 "': expected tiny, 0.5b, 1.5b or 7b, or give --layers, "
                                 "--layer-params and --other-params");
}

MemoryPerGpu memory_per_gpu(const ModelShape& model, Mode mode, int64_t num_ranks,
                            int64_t gpus_per_node, bool reference_model) {
  // fp32 weights 4 + AdamW 8 + gradient (FSDP2) or accumulator (ODC) 4.
  constexpr double kStateBytes = 16.0;
  const double params = model.other_params + model.layer_params * model.num_layers;
  const int64_t ranks = std::max<int64_t>(1, num_ranks);
  const int64_t local = std::max<int64_t>(1, std::min(gpus_per_node, ranks));
  const int64_t nodes = (ranks + local - 1) / local;
  MemoryPerGpu memory;
  // Gathered into FSDP2's own bf16 buffers in every layout (ODC narrows as it pulls).
  memory.gathered_bytes = kAllGatherBytes * (2.0 * model.layer_params + model.other_params) +
                          kGradBytes * std::max(model.layer_params, model.other_params);
  switch (mode) {
    case Mode::kCollective:
      memory.state_bytes = kStateBytes * params / static_cast<double>(ranks);
      break;
    case Mode::kFsdp2Deferred:
      // FSDP2's layout, and with sync off every parameter's unsharded fp32 gradient stays on the
      // GPU between microbatches (accumulated until the last microbatch's reduce-scatter): 4 B
      // per parameter of the whole model. The per-layer gathers stay (resharding is on).
      memory.state_bytes = kStateBytes * params / static_cast<double>(ranks);
      memory.unsharded_bytes = kGradBytes * params;
      break;
    case Mode::kFsdp2Unsharded:
      // Resharding off: every unit's bf16 parameters stay gathered from the minibatch's start to
      // its last backward, and its unsharded fp32 gradient accumulates beside them: 2 + 4 B per
      // parameter of the whole model on top of the sharded state. The gathered units are those
      // parameters; but FSDP2's reduce-scatter allocates a fresh fp32 input per unit while that
      // unit's accumulated gradient is still alive (foreach_reduce), so the largest unit's fp32
      // gradient is held once more at that moment.
      memory.state_bytes = kStateBytes * params / static_cast<double>(ranks);
      memory.unsharded_bytes = (kAllGatherBytes + kGradBytes) * params;
      memory.gathered_bytes = kGradBytes * std::max(model.layer_params, model.other_params);
      break;
    case Mode::kOdcFlat:
      memory.state_bytes = kStateBytes * params / static_cast<double>(ranks);
      if (nodes > 1) {
        const double cache =
            static_cast<double>(nodes - 1) * kPullBytes * params / static_cast<double>(ranks);
        memory.odc_bytes = kStagingBudgetBytes + std::min(kNodeCacheBudgetBytes, cache);
      }
      break;
    case Mode::kOdcHybrid:
      memory.state_bytes = kStateBytes * params / static_cast<double>(local);
      break;
  }
  if (reference_model) {
    // GRPO's frozen reference, sharded like the policy: its fp32 parameters only (no gradient,
    // no optimizer state), over the same sharding group (the node's GPUs under hybrid).
    const double group = static_cast<double>(mode == Mode::kOdcHybrid ? local : ranks);
    memory.state_bytes += kPullBytes * params / group;
  }
  return memory;
}

Status validate_simulate_options(const SimulateOptions& options) {
  ODC_RETURN_IF_ERROR(planner::validate_plan_options(options.plan));
  const ModelShape& m = options.model;
  if (m.num_layers < 1) return Status::InvalidArgument("the model needs at least one layer");
  if (m.num_layers > kMaxLayers) {
    return Status::InvalidArgument("the model has " + std::to_string(m.num_layers) +
                                   " layers, at most " + std::to_string(kMaxLayers) +
                                   " are simulated");
  }
  if (!(m.layer_params >= 0) || !(m.other_params >= 0) || !std::isfinite(m.layer_params) ||
      !std::isfinite(m.other_params)) {
    return Status::InvalidArgument("parameter counts must be finite and >= 0");
  }
  // Bytes moved per step are counts x 4 x layers: they must stay finite too (1e308 is not).
  const double total_params = m.other_params + m.layer_params * static_cast<double>(m.num_layers);
  if (!std::isfinite(total_params * kGradBytes * 4.0)) {
    return Status::InvalidArgument("parameter counts are too large: the model's bytes overflow");
  }
  const Topology& t = options.topology;
  if (t.gpus_per_node < 1) return Status::InvalidArgument("gpus per node must be >= 1");
  for (const Link* link : {&t.nvlink, &t.nvlink_collective, &t.network}) {
    if (!(link->bytes_per_second > 0) || !std::isfinite(link->bytes_per_second) ||
        !(link->latency_seconds >= 0) || !std::isfinite(link->latency_seconds)) {
      return Status::InvalidArgument("link bandwidths must be > 0 and latencies >= 0, finite");
    }
  }
  if (options.cost_calibration_ranks < 0 || options.cost_calibration_ranks > kMaxCalibrationRanks) {
    return Status::InvalidArgument(
        "cost calibration ranks must be 0 to " + std::to_string(kMaxCalibrationRanks) +
        " (the GPUs of one node), got " + std::to_string(options.cost_calibration_ranks));
  }
  if (!(options.forward_fraction > 0 && options.forward_fraction < 1)) {
    return Status::InvalidArgument("forward fraction must lie strictly between 0 and 1");
  }
  if (!(options.optimizer_bytes_per_param >= 0) || !(options.hbm_bytes_per_second > 0)) {
    return Status::InvalidArgument("optimizer bytes must be >= 0 and HBM bandwidth > 0");
  }
  if (options.pad_to_equal_counts && options.plan.policy != planner::Policy::kLbMini) {
    return Status::InvalidArgument(
        "padding to equal microbatch counts is lb-mini-padded's: "
        "the policy must be lb-mini");
  }
  if (options.steal && !is_odc(options.mode)) {
    return Status::InvalidArgument("work stealing is odc's (any rank may run any microbatch): " +
                                   std::string(mode_name(options.mode)) +
                                   " runs every microbatch on its planned rank");
  }
  if (!options.rank_slowdown.empty()) {
    if (static_cast<int64_t>(options.rank_slowdown.size()) != options.plan.num_ranks) {
      return Status::InvalidArgument("rank slowdown must have one entry per rank: got " +
                                     std::to_string(options.rank_slowdown.size()) + " for " +
                                     std::to_string(options.plan.num_ranks) + " ranks");
    }
    for (double factor : options.rank_slowdown) {
      if (!(factor > 0) || !std::isfinite(factor)) {
        return Status::InvalidArgument("rank slowdowns must be finite numbers > 0");
      }
    }
  }
  if (lockstep(options.mode) && options.plan.policy == planner::Policy::kLbMini &&
      !options.pad_to_equal_counts) {
    const std::string mode(mode_name(options.mode));
    return Status::InvalidArgument("lb-mini gives ranks different microbatch counts, which " +
                                   mode + " cannot run: use lb-mini-padded, lb-micro or " +
                                   "local-sort with " + mode);
  }
  return Status::Ok();
}

Result<SimulateResult> simulate_plan(const planner::Plan& plan, std::span<const int64_t> lengths,
                                     const SimulateOptions& options) {
  ODC_RETURN_IF_ERROR(validate_simulate_options(options));
  if (plan.options.num_ranks != options.plan.num_ranks) {
    return Status::InvalidArgument("the plan was made for a different number of ranks");
  }
  const planner::Plan adapted = adapt_plan(plan, lengths, options);
  SimulateOptions free_options = options;
  free_options.free_communication = true;
  Simulator full(options), free(free_options);
  // The calibration run: collective, one node of cost_calibration_ranks GPUs, equal microbatches
  // of forward and backward (the cost model was fitted on such).
  SimulateOptions calibration_options = options;
  calibration_options.mode = Mode::kCollective;
  calibration_options.forward_only = false;
  calibration_options.pad_to_equal_counts = false;
  calibration_options.plan.num_ranks = std::max<int64_t>(1, options.cost_calibration_ranks);
  calibration_options.plan.rank_speed.clear();
  calibration_options.topology.gpus_per_node = calibration_options.plan.num_ranks;
  Simulator calibration(calibration_options);
  // A forward-only microbatch's cost is the forward share of a full one (forward_cost): the
  // calibration's communication is removed from the full cost, and the share taken of the rest.
  const double cost_scale = options.forward_only ? options.forward_fraction : 1.0;
  auto compute_only = [&](std::vector<std::vector<double>> costs) {
    if (options.cost_calibration_ranks <= 0) return costs;
    for (auto& rank : costs) {
      for (double& cost : rank) {
        const double full_cost = cost / cost_scale;
        const std::vector<std::vector<double>> lockstep_run(
            static_cast<size_t>(calibration_options.plan.num_ranks),
            std::vector<double>{full_cost});
        double unused = 0.0;
        const double measured = calibration.minibatch(lockstep_run, unused) -
                                calibration.optimizer_seconds(calibration_options.plan.num_ranks);
        cost = cost_scale * std::max(0.0, full_cost - (measured - full_cost));
      }
    }
    return costs;
  };
  SimulateResult result;
  double busy = 0.0, busy_free = 0.0, free_seconds = 0.0;
  const double n = static_cast<double>(options.plan.num_ranks);
  for (const auto& minibatch : adapted.minibatches) {
    auto run = microbatch_costs(minibatch, lengths, adapted.options, options);
    if (!run.ok()) return run.status();
    const auto costs = compute_only(std::move(run).value());
    const double seconds = full.minibatch(costs, busy);
    free_seconds += free.minibatch(costs, busy_free);
    result.minibatch_seconds.push_back(seconds);
    result.seconds += seconds;
    if (options.steal) {  // the planner's own prediction of stealing: it knows no slowdown
      auto predicted = planner::predict_stealing(minibatch, lengths, adapted.options);
      if (!predicted.ok()) return predicted.status();
      result.planner_seconds += predicted.value().span;
    } else {
      result.planner_seconds +=
          lockstep(options.mode) ? minibatch.times.collective : minibatch.times.odc;
    }
  }
  result.num_minibatches = static_cast<int64_t>(adapted.minibatches.size());
  const int64_t shard_ranks = options.mode == Mode::kOdcHybrid
                                  ? std::min(options.topology.gpus_per_node, options.plan.num_ranks)
                                  : options.plan.num_ranks;
  result.optimizer_seconds =
      options.forward_only ? 0.0 : full.optimizer_seconds(shard_ranks) * result.num_minibatches;
  result.compute_seconds = busy / n;
  result.exposed_comm_seconds = std::max(0.0, result.seconds - free_seconds);
  result.idle_seconds = std::max(0.0, free_seconds - result.optimizer_seconds - busy / n);
  result.bubble = planner::bubble_rate(busy, options.plan.num_ranks, result.seconds);
  return result;
}

Result<SimulateResult> simulate(std::span<const int64_t> lengths, const SimulateOptions& options) {
  ODC_RETURN_IF_ERROR(validate_simulate_options(options));
  auto plan = planner::make_plan(lengths, options.plan);
  if (!plan.ok()) return plan.status();
  return simulate_plan(plan.value(), lengths, options);
}

planner::Plan adapt_plan(const planner::Plan& plan, std::span<const int64_t> lengths,
                         const SimulateOptions& options) {
  const bool unsharded = options.mode == Mode::kFsdp2Unsharded;
  if (!options.pad_to_equal_counts && !unsharded) return plan;
  planner::Plan adapted = plan;
  double busy = 0.0, collective = 0.0, odc = 0.0;
  for (planner::MinibatchPlan& minibatch : adapted.minibatches) {
    size_t count = 1;  // fsdp2-unsharded: at least one microbatch on every rank
    if (options.pad_to_equal_counts) {
      for (const planner::RankPlan& rank : minibatch.ranks) {
        count = std::max(count, rank.microbatches.size());
      }
    }
    for (planner::RankPlan& rank : minibatch.ranks) {
      if (rank.microbatches.size() < count) rank.microbatches.resize(count);  // empty ones
    }
    minibatch.times =
        planner::predict_times(minibatch.ranks, minibatch.splits, lengths, adapted.options);
    const int64_t n = adapted.options.num_ranks;
    minibatch.bubble = {planner::bubble_rate(minibatch.times.busy, n, minibatch.times.collective),
                        planner::bubble_rate(minibatch.times.busy, n, minibatch.times.odc)};
    busy += minibatch.times.busy;
    collective += minibatch.times.collective;
    odc += minibatch.times.odc;
  }
  adapted.bubble = {planner::bubble_rate(busy, adapted.options.num_ranks, collective),
                    planner::bubble_rate(busy, adapted.options.num_ranks, odc)};
  return adapted;
}

planner::CostModel forward_cost(const planner::CostModel& cost, double forward_fraction) {
  planner::CostModel forward = cost;
  forward.a *= forward_fraction;
  forward.b *= forward_fraction;
  forward.c *= forward_fraction;
  forward.floor *= forward_fraction;
  return forward;
}

Result<GrpoPlans> plan_grpo(std::span<const int64_t> lengths, const planner::PlanOptions& options,
                            double forward_fraction, int64_t minibatches_per_step) {
  const int64_t step_samples = options.minibatch_size;
  if (minibatches_per_step < 1) {
    return Status::InvalidArgument("minibatches per RL step must be >= 1, got " +
                                   std::to_string(minibatches_per_step));
  }
  if (step_samples == planner::kAllSamples || step_samples % minibatches_per_step != 0) {
    return Status::InvalidArgument("an RL step's " + std::to_string(step_samples) +
                                   " rollouts do not split evenly into " +
                                   std::to_string(minibatches_per_step) + " update minibatches");
  }
  const auto num_samples = static_cast<int64_t>(lengths.size());
  if (num_samples == 0 || num_samples % step_samples != 0) {
    return Status::InvalidArgument(std::to_string(num_samples) +
                                   " lengths are not whole RL steps of " +
                                   std::to_string(step_samples) + " rollouts");
  }
  // grpo_run._step_plans plans each RL step on its own: the forward-only plan one minibatch of
  // the step, the update plan K consecutive minibatches of it. The planner plans consecutive
  // minibatches independently, so one plan over every step gives the same minibatches.
  planner::PlanOptions forward = options;
  forward.cost = forward_cost(options.cost, forward_fraction);
  planner::PlanOptions update = options;
  update.minibatch_size = step_samples / minibatches_per_step;
  auto forward_plan = planner::make_plan(lengths, forward);
  if (!forward_plan.ok()) return forward_plan.status();
  auto update_plan = planner::make_plan(lengths, update);
  if (!update_plan.ok()) return update_plan.status();
  return GrpoPlans{std::move(forward_plan).value(), std::move(update_plan).value()};
}

Result<GrpoPlans> make_grpo_plans(std::span<const int64_t> lengths, const SimulateOptions& options,
                                  int64_t minibatches_per_step) {
  ODC_RETURN_IF_ERROR(validate_simulate_options(options));
  return plan_grpo(lengths, options.plan, options.forward_fraction, minibatches_per_step);
}

Result<GrpoResult> simulate_grpo_plans(const GrpoPlans& plans, std::span<const int64_t> lengths,
                                       const SimulateOptions& options,
                                       int64_t minibatches_per_step) {
  const auto steps = static_cast<int64_t>(plans.forward_only.minibatches.size());
  if (minibatches_per_step < 1 ||
      static_cast<int64_t>(plans.update.minibatches.size()) != steps * minibatches_per_step) {
    return Status::InvalidArgument("the update plan needs " + std::to_string(minibatches_per_step) +
                                   " minibatches per RL step of the forward-only plan");
  }
  SimulateOptions forward_options = options;
  forward_options.forward_only = true;
  auto forward = simulate_plan(plans.forward_only, lengths, forward_options);
  if (!forward.ok()) return forward.status();
  SimulateOptions update_options = options;
  update_options.forward_only = false;
  auto update = simulate_plan(plans.update, lengths, update_options);
  if (!update.ok()) return update.status();
  GrpoResult result;
  result.num_rl_steps = steps;
  result.forward_phase = std::move(forward).value();
  result.update = std::move(update).value();
  // Two forward-only phases (old and reference log-probs), then the K updates.
  const SimulateResult& f = result.forward_phase;
  const SimulateResult& u = result.update;
  SimulateResult& total = result.rl_step;
  total.num_minibatches = steps;
  total.seconds = 2 * f.seconds + u.seconds;
  total.compute_seconds = 2 * f.compute_seconds + u.compute_seconds;
  total.exposed_comm_seconds = 2 * f.exposed_comm_seconds + u.exposed_comm_seconds;
  total.idle_seconds = 2 * f.idle_seconds + u.idle_seconds;
  total.optimizer_seconds = u.optimizer_seconds;
  total.planner_seconds = 2 * f.planner_seconds + u.planner_seconds;
  // compute_seconds is busy / N, so this is 1 - sum(busy) / (N x sum(T)) over both phases.
  total.bubble = total.seconds > 0 ? 1.0 - total.compute_seconds / total.seconds : 0.0;
  for (int64_t s = 0; s < steps; ++s) {
    double seconds = 2 * f.minibatch_seconds[s];
    for (int64_t k = 0; k < minibatches_per_step; ++k) {
      seconds += u.minibatch_seconds[s * minibatches_per_step + k];
    }
    total.minibatch_seconds.push_back(seconds);
  }
  return result;
}

Result<GrpoResult> simulate_grpo(std::span<const int64_t> lengths, const SimulateOptions& options,
                                 int64_t minibatches_per_step) {
  auto plans = make_grpo_plans(lengths, options, minibatches_per_step);
  if (!plans.ok()) return plans.status();
  return simulate_grpo_plans(plans.value(), lengths, options, minibatches_per_step);
}

std::vector<int64_t> resample_lengths(std::span<const int64_t> source, int64_t num_samples,
                                      uint64_t seed) {
  std::vector<int64_t> out;
  if (source.empty() || num_samples <= 0) return out;
  out.reserve(static_cast<size_t>(num_samples));
  std::vector<size_t> order(source.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 random(seed);
  for (int64_t pass = 0; static_cast<int64_t>(out.size()) < num_samples; ++pass) {
    if (pass > 0) std::shuffle(order.begin(), order.end(), random);
    for (size_t i = 0; i < order.size() && static_cast<int64_t>(out.size()) < num_samples; ++i) {
      out.push_back(source[order[i]]);
    }
  }
  return out;
}

}  // namespace odc::simulate
