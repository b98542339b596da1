// Node-cached gathers of published buffers, a core scheme over transport primitives (get,
// get_from, signal, wait_signals, a background stream). With more than one node, every shard of a
// remote owner crosses the network once per node and minibatch instead of once per gathering rank
// and gather: at minibatch_begin each rank fetches, for its node, the shards of the remote owners
// it is the fetcher of (one per other node), into its rows of the cache, on the transport's
// background stream, and raises a ready word at every rank of its node, buffer by buffer in
// allocation order; a gather inside the minibatch waits for its node's ready words, then reads
// its own node's owners from their shards and the remote owners from the fetchers' rows (plain
// loads where the transport maps them: shared memory, NVLink).
//
// Memory: a cached buffer costs rows x its shard on every rank (rows: the most remote owners one
// rank fetches, nodes - 1 with equal nodes), about 1/ranks-per-node of the whole buffer (with one
// rank per node, every other rank's shard: then it saves the gathers after a buffer's first in a
// minibatch, forward and backward of every microbatch, not bytes between a node's ranks);
// buffers are cached in allocation order while the budget lasts (CommOptions::node_cache_bytes),
// the rest are gathered flat. Owners rewrite published shards only between minibatches (their
// allocation says so), so a minibatch's copies are exact.
//
// Invariants: every rank makes the same decisions (sizes come from the agreed topology and the
// budget every rank agreed on); ready words only grow (the value is the count of buffer fetches
// since the cache was made, the same on every rank); a fetch of the next minibatch rewrites rows
// only after the barrier that every reader passed after its last read (minibatch_end's); a
// fetcher that failed or died is named by its node peers' gathers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/topology.h"
#include "core/transport.h"

namespace odc {

// The node cache's budget per rank when neither the config nor $ODC_NODE_CACHE_BYTES says.
inline constexpr size_t kDefaultNodeCacheBytes = size_t{256} << 20;

class NodeGatherCache {
 public:
  // Only where the topology has more than one node and the budget is positive.
  NodeGatherCache(Transport& transport, const Topology& topology, size_t budget);

  size_t budget() const { return budget_; }
  // Symmetric memory it holds on this rank (rows of cached buffers, ready words).
  size_t allocated_bytes() const { return allocated_bytes_; }
  // Buffers cached (served from the cache in the minibatches that start after their allocation).
  size_t num_cached() const { return entries_.size(); }

  // Collective, at the allocation of published buffer `id` (every rank, same order): caches it
  // when the budget has room for its rows, else leaves it flat (the same choice on every rank).
  Status add(uint64_t id, const SymmetricRegion& shards, size_t shard_bytes);
  // Local: at its release (after the release's barrier: nobody reads its rows any more).
  void remove(uint64_t id);

  // After minibatch_begin's barrier (owners' shards are final for the minibatch): fetches this
  // rank's rows of every cached buffer on the background stream, raising ready words as it goes.
  Status begin(StreamHandle stream);
  // Whether gathers of `id` in the open minibatch read from the cache.
  bool serves(uint64_t id) const;
  // A gather of cached buffer `id` (`count` elements of `dtype` per owner) into dst, of
  // `dst_dtype`: waits for the node's fetchers, then reads every owner's shard where it is.
  Status gather(void* dst, uint64_t id, size_t count, DataType dtype, DataType dst_dtype,
                StreamHandle stream);
  // Before minibatch_end's barrier: this rank's fetches are complete before it (owners may
  // rewrite their shards after it), in stream order.
  Status end(StreamHandle stream);

 private:
  struct Entry {
    const SymmetricRegion* shards = nullptr;  // the buffer's (owned by its communicator)
    size_t bytes = 0;                         // one shard
    size_t stride = 0;                        // bytes between rows
    std::unique_ptr<SymmetricRegion> rows;
  };
  Transport& transport_;
  const size_t budget_;
  const std::vector<int> node_ranks_;  // this rank's node, in rank order
  const NodeRoutes routes_;            // who fetches which remote owner, and its row
  size_t allocated_bytes_ = 0;
  std::unique_ptr<SymmetricRegion> ready_;  // one word per rank, made with the first entry
  std::map<uint64_t, Entry> entries_;       // by buffer id: allocation order
  uint64_t fetches_ = 0;                    // buffer fetches since the cache was made
  std::map<uint64_t, uint64_t> fetched_;    // open minibatch: buffer id -> its ready value
  bool forked_ = false;                     // fetches queued on the background stream
};

}  // namespace odc
