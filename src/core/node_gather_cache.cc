// Node-cached gathers (see node_gather_cache.h for the scheme and its invariants).
#include "core/node_gather_cache.h"

#include <algorithm>

namespace odc {
namespace {

// Rows start 256-byte aligned, as buffers do: the device copy kernels' vector paths need 16
// bytes, and a float32 row after an odd-sized bfloat16 one must not be misaligned.
constexpr size_t kRowAlignment = 256;

size_t aligned(size_t bytes) {
  return (bytes + kRowAlignment - 1) / kRowAlignment * kRowAlignment;
}

}  // namespace

NodeGatherCache::NodeGatherCache(Transport& transport, const Topology& topology, size_t budget)
    : transport_(transport),
      budget_(budget),
      node_ranks_(topology.ranks_on(topology.node(transport.rank()))),
      routes_(NodeRoutes::of(topology, transport.rank())) {}

Status NodeGatherCache::add(uint64_t id, const SymmetricRegion& shards, size_t shard_bytes) {
  const size_t stride = aligned(shard_bytes);
  const size_t ready_bytes =
      ready_ == nullptr ? static_cast<size_t>(transport_.world_size()) * sizeof(uint64_t) : 0;
  const size_t max_rows = routes_.max_rows;
  const size_t cost = max_rows * stride + ready_bytes;
  // The same sizes on every rank (the agreed topology, an agreed budget): all decide alike.
  if (max_rows == 0 || allocated_bytes_ + cost > budget_) return Status::Ok();
  if (ready_ == nullptr) {
    auto ready = transport_.allocate(ready_bytes);
    if (!ready.ok()) return ready.status().with_context("node cache's ready words");
    ready_ = std::move(ready).value();
    allocated_bytes_ += ready_bytes;
  }
  auto rows = transport_.allocate(max_rows * stride);
  if (!rows.ok()) {
    return rows.status().with_context(
        "node cache of " + std::to_string(max_rows * stride) +
        " bytes for a published buffer (lower ODC_NODE_CACHE_BYTES, or 0 to gather flat)");
  }
  Entry entry;
  entry.shards = &shards;
  entry.bytes = shard_bytes;
  entry.stride = stride;
  entry.rows = std::move(rows).value();
  allocated_bytes_ += entry.rows->bytes();
  entries_.emplace(id, std::move(entry));
  return Status::Ok();
}

void NodeGatherCache::remove(uint64_t id) {
  auto found = entries_.find(id);
  if (found == entries_.end()) return;
  allocated_bytes_ -= found->second.rows->bytes();
  fetched_.erase(id);
  entries_.erase(found);
}

Status NodeGatherCache::begin(StreamHandle stream) {
  fetched_.clear();
  if (entries_.empty()) return Status::Ok();
  // The fetches wait for the barrier the caller just passed (or enqueued), and for nothing of
  // this rank's later work: a rank that runs late, or runs no microbatch, holds no one up.
  auto background = transport_.fork_background(stream);
  if (!background.ok()) return background.status();
  forked_ = true;
  // Buffer by buffer in allocation order (a model's units in the order its forward needs them),
  // each announced to the node as soon as its rows are in.
  for (const auto& [id, entry] : entries_) {
    auto* rows = static_cast<char*>(entry.rows->local());
    for (size_t row = 0; row < routes_.my_owners.size(); ++row) {
      ODC_RETURN_IF_ERROR(transport_.get(rows + row * entry.stride, *entry.shards,
                                         routes_.my_owners[row], 0, entry.bytes,
                                         background.value()));
    }
    ++fetches_;
    fetched_[id] = fetches_;
    for (int peer : node_ranks_) {
      ODC_RETURN_IF_ERROR(transport_.signal(*ready_, peer, fetches_, background.value()));
    }
  }
  return Status::Ok();
}

bool NodeGatherCache::serves(uint64_t id) const {
  return fetched_.count(id) != 0;
}

Status NodeGatherCache::gather(void* dst, uint64_t id, size_t count, DataType dtype,
                               DataType dst_dtype, StreamHandle stream) {
  const auto fetched = fetched_.find(id);
  const auto found = entries_.find(id);
  if (fetched == fetched_.end() || found == entries_.end()) {
    return Status::InternalError("buffer " + std::to_string(id) +
                                 " is not in this minibatch's node cache");
  }
  const Entry& entry = found->second;
  ODC_RETURN_IF_ERROR(transport_.wait_signals(
      *ready_, node_ranks_, fetched->second,
      "gather of a published buffer: the node's fetch of remote shards", stream));
  std::vector<GatherSource> sources(static_cast<size_t>(transport_.world_size()));
  for (size_t owner = 0; owner < sources.size(); ++owner) {
    const int via = routes_.via[owner];
    if (via == static_cast<int>(owner)) {  // this node: the owner's own shard
      sources[owner] = {entry.shards, via, 0};
    } else {
      sources[owner] = {entry.rows.get(), via, routes_.row[owner] * entry.stride};
    }
  }
  return transport_.get_from(dst, sources, count, dtype, dst_dtype, stream);
}

Status NodeGatherCache::end(StreamHandle stream) {
  fetched_.clear();
  if (!forked_) return Status::Ok();
  forked_ = false;
  return transport_.join_background(stream);
}

}  // namespace odc
