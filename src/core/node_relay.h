// Node-aggregated pushes (streamed scheme, more than one node): a push's slice for an owner on
// another node goes to the rank of this node that carries that owner, whose fold adds it into its
// relay row for the owner; at minibatch_end, once every rank of its node ended there, the carrier
// forwards every row whole to its owner. One rule on the host and the device (whose folds the host
// never sees), so the CPU tests prove what NVSHMEM runs. Invariant: every contribution reaches its
// owner exactly once, inside the one forward of its row in that minibatch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "common/status.h"
#include "core/topology.h"

namespace odc {

// The fold target id of an accumulator's relay rows: the accumulator's id with this bit set
// (accumulator ids are allocation counters, far below it).
inline constexpr uint64_t kRelayTargetBit = uint64_t{1} << 63;

// The routes and relay rows of one rank's streamed staging; the staging sends what it forwards.
class NodeRelay {
 public:
  // An accumulator whose pushes to other nodes are aggregated: this rank's relay rows (fp32 in
  // the transport's memory, one row of `count` per owner this rank carries, routes.my_owners).
  struct Relay {
    uint64_t buffer_id = 0;
    float* rows = nullptr;
    size_t count = 0;
  };
  // Where one owner's slice of a push goes.
  struct Route {
    int to = 0;              // the rank that adds it: the owner, or the owner's carrier here
    uint64_t target_id = 0;  // the fold target there: the accumulator, or its relay rows
    uint64_t first = 0;      // the target's element where the slice starts
  };
  // How forward_rows() sends one row: `count` fp32 sums added into `owner`'s shard of accumulator
  // `buffer_id` from its element 0, as chunks of this rank's rings (waiting for credit where a
  // ring is full).
  using SendRow =
      std::function<Status(int owner, uint64_t buffer_id, const float* row, size_t count)>;

  // Who carries which owner, and this rank's node, ranks [node_first, node_last) (nodes of
  // consecutive ranks: the staging awaits a node's ends as one range).
  NodeRelay(NodeRoutes routes, int node_first, int node_last)
      : routes_(std::move(routes)), node_first_(node_first), node_last_(node_last) {}

  int node_first() const { return node_first_; }
  int node_last() const { return node_last_; }
  // Local: the relayed accumulators (every rank the same, in the same order). A new relay's rows
  // are zero, as every row is from minibatch_begin on (the communicator zeroes them).
  void set_relays(std::vector<Relay> relays) { relays_ = std::move(relays); }
  const std::vector<Relay>& relays() const { return relays_; }

  // Owner `owner`'s slice of `count` elements of a push of accumulator `buffer_id`: into its row
  // at the carrier when the accumulator is relayed and the owner is on another node, else
  // straight into the owner's shard.
  Route route(uint64_t buffer_id, int owner, size_t count) const;
  // minibatch_end, after every rank of this node ended here (its slices are then all in the
  // rows): every row of every relay, whole, to its owner through `send_row`, whether any rank
  // pushed into it or not (a device fold is not seen by the host, so neither rule may ask).
  // Remembers `minibatch` for check_fold().
  Status forward_rows(uint64_t minibatch, const SendRow& send_row);
  // Host folds, before adding a chunk of `minibatch` into fold target `target_id`: an
  // InternalError when it is a relay row whose forward already went out this minibatch (the
  // contribution would never reach its owner). After the node's ends only other nodes' ranks
  // send here, and they route relay slices to their own carriers, so this names a bug.
  Status check_fold(uint64_t target_id, uint64_t minibatch) const;

 private:
  NodeRoutes routes_;
  int node_first_ = 0;
  int node_last_ = 0;
  std::vector<Relay> relays_;
  // The minibatch whose rows forward_rows() sent last; 0: none (minibatches count from 1).
  uint64_t forwarded_minibatch_ = 0;
};

}  // namespace odc
