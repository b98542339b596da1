// What crosses nodes: the bytes of the streamed chunks one rank put into the rings of ranks on
// other nodes, split where minibatch_end begins. Counted by the staging as it sends; the counts
// only grow, and go on from the old rings' when larger rings replace them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace odc {

// Bytes of the chunks (header and payload) this rank put into the rings of ranks on other nodes,
// so far: while minibatches ran (pushes: they leave during backward) and inside minibatch_end
// (what the tail waits for, node relays' rows among it). Stream-ordered transports count a chunk
// when it is enqueued (it runs in stream order among the caller's kernels). End signals and
// credits are words, not chunks, and not counted.
struct NodeTraffic {
  uint64_t during_minibatches = 0;
  uint64_t in_minibatch_end = 0;
};

// One rank's NodeTraffic, counted chunk by chunk from the node of each chunk's owner.
class NodeTrafficCounter {
 public:
  explicit NodeTrafficCounter(int rank) : rank_(rank) {}

  // Local, once: the node of every rank (Topology::node). Empty: one node, nothing counted.
  void set_node_of(std::vector<int> node_of) { node_of_ = std::move(node_of); }
  // A chunk of `bytes` (header and payload) put into `owner`'s rings.
  void count(int owner, uint64_t bytes) {
    const auto o = static_cast<size_t>(owner);
    const auto me = static_cast<size_t>(rank_);
    if (o >= node_of_.size() || me >= node_of_.size() || node_of_[o] == node_of_[me]) return;
    (in_minibatch_end_ ? totals_.in_minibatch_end : totals_.during_minibatches) += bytes;
  }
  const NodeTraffic& totals() const { return totals_; }
  // Larger rings replace these: their counts go on from `before`.
  void carry(const NodeTraffic& before) {
    totals_.during_minibatches += before.during_minibatches;
    totals_.in_minibatch_end += before.in_minibatch_end;
  }

  // While one lives, chunks count as minibatch_end's, also when that call fails on the way.
  class InMinibatchEnd {
   public:
    explicit InMinibatchEnd(NodeTrafficCounter& counter) : counter_(counter) {
      counter_.in_minibatch_end_ = true;
    }
    ~InMinibatchEnd() { counter_.in_minibatch_end_ = false; }
    InMinibatchEnd(const InMinibatchEnd&) = delete;
    InMinibatchEnd& operator=(const InMinibatchEnd&) = delete;

   private:
    NodeTrafficCounter& counter_;
  };

 private:
  const int rank_;
  std::vector<int> node_of_;
  NodeTraffic totals_;
  bool in_minibatch_end_ = false;
};

}  // namespace odc
