// Which node every rank is on, and which peers this rank maps directly (plain loads and stores:
// shared memory, NVLink), agreed once when a communicator is created, so that topology-aware
// schemes in the core all see the same picture on every rank. One source order: the caller's
// configuration (ranks per node), then the launcher's environment (ODC_LOCAL_WORLD_SIZE, then
// torchrun's LOCAL_WORLD_SIZE; read by core/comm_config.cc), then the transport's own report (its
// node key per rank).
// Invariants: every rank used the same source (a rank whose launcher said otherwise fails every
// rank, naming both); nodes are numbered 0.. in order of their lowest rank; a rank maps itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/transport.h"

namespace odc {

struct Topology {
  std::vector<int> node_of;  // per rank
  std::vector<char> direct;  // per rank: this rank reaches it with plain loads and stores
  int num_nodes = 1;
  std::string source;  // "config", "ODC_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE" or "transport"

  int node(int rank) const { return node_of[static_cast<size_t>(rank)]; }
  bool maps(int rank) const { return direct[static_cast<size_t>(rank)] != 0; }
  // The ranks on `node`, in rank order.
  std::vector<int> ranks_on(int node) const;
  // "2 nodes (ranks per node: 4, 4; from LOCAL_WORLD_SIZE)", for logs and errors.
  std::string describe() const;
};

// Who carries what between nodes for rank `rank` in the node schemes (node-cached gathers,
// node-aggregated pushes): for every owner on another node, the rank of `rank`'s node that
// fetches its shards for the node (and aggregates the node's pushes to it), picked by the owner's
// place on its own node, so that a node's traffic spreads over all its ranks and one rank deals
// with one rank per other node; and that rank's row for the owner (its owners in rank order).
struct NodeRoutes {
  std::vector<int> my_owners;  // the remote owners `rank` carries for its node, row by row
  std::vector<int> via;        // per owner: the rank of this node carrying it (itself on-node)
  std::vector<size_t> row;     // per remote owner: its row at `via`
  size_t max_rows = 0;         // the most rows any rank has (symmetric memory is sized by it)

  static NodeRoutes of(const Topology& topology, int rank);
};

struct ResolvedConfig;

// Collective (every rank, through the transport's exchange), for communicators made without
// agree_config (core/comm_config.h): `configured_ranks_per_node`, else (0) the transport's report.
// A source that does not divide the world, or that differs across ranks, fails every rank with an
// error naming it.
Result<Topology> agree_topology(Transport& transport, int configured_ranks_per_node);

// The layout words of an exchange record (words 0-2): this rank's source of the ranks per node
// (config.ranks_per_node_source), its value (or the transport's node key) and whether it could
// be read.
void put_topology_source(ExchangeRecord& record, const ResolvedConfig& config,
                         Transport& transport);
// The topology every rank agrees on from every rank's record (put_topology_source), or the error
// naming the rank and source that differ, or `invalid` (why this rank could not read its own).
Result<Topology> topology_from_records(Transport& transport, const std::vector<ExchangeRecord>& all,
                                       const std::string& invalid);

}  // namespace odc
