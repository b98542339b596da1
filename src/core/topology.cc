// Topology agreed across ranks (see topology.h for the source order and invariants).
#include "core/topology.h"

#include <algorithm>
#include <map>

#include "core/comm_config.h"

namespace odc {
namespace {

// The exchange record: which source, its value (ranks per node, or the transport's node key),
// whether this rank could read it, and whether it maps each peer is asked for locally after.
constexpr uint64_t kTransport = static_cast<uint64_t>(RanksPerNodeSource::kTransport);

const char* source_name(uint64_t source) {
  return ranks_per_node_source_name(static_cast<RanksPerNodeSource>(source));
}

}  // namespace

std::vector<int> Topology::ranks_on(int node) const {
  std::vector<int> ranks;
  for (size_t r = 0; r < node_of.size(); ++r) {
    if (node_of[r] == node) ranks.push_back(static_cast<int>(r));
  }
  return ranks;
}

NodeRoutes NodeRoutes::of(const Topology& topology, int rank) {
  const int world = static_cast<int>(topology.node_of.size());
  std::vector<std::vector<int>> nodes(static_cast<size_t>(topology.num_nodes));
  for (int n = 0; n < topology.num_nodes; ++n) nodes[static_cast<size_t>(n)] = topology.ranks_on(n);
  std::vector<size_t> place(static_cast<size_t>(world), 0);  // a rank's place on its node
  for (const std::vector<int>& ranks : nodes) {
    for (size_t i = 0; i < ranks.size(); ++i) place[static_cast<size_t>(ranks[i])] = i;
  }
  // The rank of `node` that carries `owner`: the owner's place on its node, wrapped to `node`.
  auto carrier = [&](int node, int owner) {
    const std::vector<int>& ranks = nodes[static_cast<size_t>(node)];
    return ranks[place[static_cast<size_t>(owner)] % ranks.size()];
  };
  std::vector<std::vector<int>> rows_of(static_cast<size_t>(world));
  NodeRoutes routes;
  for (int r = 0; r < world; ++r) {
    for (int owner = 0; owner < world; ++owner) {
      if (topology.node(owner) != topology.node(r) && carrier(topology.node(r), owner) == r) {
        rows_of[static_cast<size_t>(r)].push_back(owner);
      }
    }
    routes.max_rows = std::max(routes.max_rows, rows_of[static_cast<size_t>(r)].size());
  }
  routes.my_owners = rows_of[static_cast<size_t>(rank)];
  routes.via.assign(static_cast<size_t>(world), 0);
  routes.row.assign(static_cast<size_t>(world), 0);
  for (int owner = 0; owner < world; ++owner) {
    if (topology.node(owner) == topology.node(rank)) {
      routes.via[static_cast<size_t>(owner)] = owner;
      continue;
    }
    const int via = carrier(topology.node(rank), owner);
    const std::vector<int>& rows = rows_of[static_cast<size_t>(via)];
    routes.via[static_cast<size_t>(owner)] = via;
    routes.row[static_cast<size_t>(owner)] =
        static_cast<size_t>(std::find(rows.begin(), rows.end(), owner) - rows.begin());
  }
  return routes;
}

std::string Topology::describe() const {
  std::string sizes;
  for (int n = 0; n < num_nodes; ++n) {
    sizes += (n == 0 ? "" : ", ") + std::to_string(ranks_on(n).size());
  }
  return std::to_string(num_nodes) + (num_nodes == 1 ? " node" : " nodes") +
         " (ranks per node: " + sizes + "; from " + source + ")";
}

void put_topology_source(ExchangeRecord& record, const ResolvedConfig& config,
                         Transport& transport) {
  record.words[0] = static_cast<uint64_t>(config.ranks_per_node_source);
  record.words[1] = config.ranks_per_node_source == RanksPerNodeSource::kTransport
                        ? transport.node_key()
                        : static_cast<uint64_t>(std::max(config.ranks_per_node, 0));
  record.words[2] = config.ranks_per_node_invalid.empty() ? 1 : 0;
}

Result<Topology> agree_topology(Transport& transport, int configured_ranks_per_node) {
  ResolvedConfig config;
  if (configured_ranks_per_node != 0) {
    config.ranks_per_node_source = RanksPerNodeSource::kConfig;
    config.ranks_per_node = configured_ranks_per_node;
    if (configured_ranks_per_node < 0) {
      config.ranks_per_node_invalid =
          "ranks per node " + std::to_string(configured_ranks_per_node) + " in the config";
    }
  }
  ExchangeRecord mine;
  put_topology_source(mine, config, transport);
  auto all = transport.exchange(mine);
  if (!all.ok()) return all.status();
  return topology_from_records(transport, all.value(), config.ranks_per_node_invalid);
}

Result<Topology> topology_from_records(Transport& transport, const std::vector<ExchangeRecord>& all,
                                       const std::string& invalid) {
  const int world = transport.world_size();
  const int rank = transport.rank();
  const ExchangeRecord& mine = all[static_cast<size_t>(rank)];
  if (!invalid.empty()) {
    return Status::InvalidArgument(invalid + " is not a positive number of ranks per node");
  }
  Topology topology;
  topology.source = source_name(mine.words[0]);
  for (int r = 0; r < world; ++r) {
    const ExchangeRecord& theirs = all[static_cast<size_t>(r)];
    if (theirs.words[2] == 0) {
      return Status::InvalidArgument("rank " + std::to_string(r) +
                                     " could not read its ranks per node (its error names why)");
    }
    const bool per_node_source = mine.words[0] != kTransport;
    if (theirs.words[0] != mine.words[0] || (per_node_source && theirs.words[1] != mine.words[1])) {
      auto what = [&](const ExchangeRecord& record) {
        return std::string(source_name(record.words[0])) +
               (record.words[0] == kTransport
                    ? std::string(" (the transport's report)")
                    : " = " + std::to_string(record.words[1]) + " ranks per node");
      };
      return Status::InvalidArgument("ranks disagree on the node layout: rank " +
                                     std::to_string(r) + " has " + what(theirs) + ", this rank (" +
                                     std::to_string(rank) + ") " + what(mine) +
                                     " (set the same ODC_LOCAL_WORLD_SIZE or config everywhere)");
    }
  }
  topology.node_of.assign(static_cast<size_t>(world), 0);
  if (mine.words[0] != kTransport) {
    const auto per_node = static_cast<int>(mine.words[1]);
    if (world % per_node != 0) {
      return Status::InvalidArgument(std::to_string(per_node) + " ranks per node (from " +
                                     topology.source + ") does not divide the world size " +
                                     std::to_string(world));
    }
    for (int r = 0; r < world; ++r) topology.node_of[static_cast<size_t>(r)] = r / per_node;
    topology.num_nodes = world / per_node;
  } else {
    // Nodes numbered in order of their lowest rank; a node's ranks need not be contiguous.
    std::map<uint64_t, int> node_of_key;
    for (int r = 0; r < world; ++r) {
      const uint64_t key = all[static_cast<size_t>(r)].words[1];
      auto found = node_of_key.emplace(key, static_cast<int>(node_of_key.size())).first;
      topology.node_of[static_cast<size_t>(r)] = found->second;
    }
    topology.num_nodes = static_cast<int>(node_of_key.size());
  }
  topology.direct.assign(static_cast<size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    const bool same_node = topology.node(r) == topology.node(rank);
    topology.direct[static_cast<size_t>(r)] =
        r == rank || (same_node && transport.maps_directly(r));
  }
  return topology;
}

}  // namespace odc
