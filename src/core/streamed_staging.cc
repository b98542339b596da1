// Streamed staged accumulation (see streamed_staging.h for the protocol and its invariants).
#include "core/streamed_staging.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>

#include "common/deadline.h"
#include "common/interrupt.h"
#include "core/device_streamed_staging.h"

namespace odc {
namespace {

using kernels::ChunkHeader;
static_assert(sizeof(ChunkHeader) == kChunkHeaderBytes, "a chunk header fills its slot's head");

// How long one poll sleeps before the caller looks at its deadline and the interrupt check
// again. Polls wake at once when a watched signal arrives.
constexpr std::chrono::duration<double> kPollSlice = std::chrono::milliseconds(20);

// Slots per sender the geometry aims for, and the most it makes.
constexpr size_t kTargetDepth = 8;
constexpr size_t kMaxDepth = 16;

// Arrival, credit, hunger, end and meeting signals: one word per peer each.
constexpr size_t kSignalWordsPerPeer = 5;

size_t round_down_64(size_t bytes) {
  return bytes / 64 * 64;
}

size_t round_up_64(size_t bytes) {
  return (bytes + 63) / 64 * 64;
}

}  // namespace

size_t RingGeometry::total_bytes(int world_size) const {
  const auto world = static_cast<size_t>(world_size);
  return world * ring_bytes() + kSignalWordsPerPeer * world * sizeof(uint64_t);
}

size_t RingGeometry::least_budget(int world_size) {
  const auto world = static_cast<size_t>(world_size);
  return kSignalWordsPerPeer * world * sizeof(uint64_t) +
         world * (kChunkHeaderBytes + kMinChunkPayloadBytes);
}

Result<RingGeometry> RingGeometry::for_budget(size_t budget_bytes, int world_size,
                                              size_t max_payload_bytes,
                                              size_t largest_slice_bytes) {
  const auto world = static_cast<size_t>(world_size);
  const size_t signal_bytes = kSignalWordsPerPeer * world * sizeof(uint64_t);
  const size_t min_slot = kChunkHeaderBytes + kMinChunkPayloadBytes;
  const size_t least = least_budget(world_size);
  if (budget_bytes < least) {
    return Status::InvalidArgument(
        "staging budget of " + std::to_string(budget_bytes) + " bytes is too small for " +
        std::to_string(world_size) + " ranks: one slot of " + std::to_string(min_slot) +
        " bytes per sender and the signals need at least " + std::to_string(least) +
        " bytes (raise ODC_STAGING_BYTES or the config's staging_bytes)");
  }
  const size_t per_sender = (budget_bytes - signal_bytes) / world;
  // A chunk holds at most one owner's slice of one push: a larger payload would only hold memory.
  size_t payload_cap = std::max(max_payload_bytes, kMinChunkPayloadBytes);
  if (largest_slice_bytes < payload_cap) {
    payload_cap = std::max(round_up_64(largest_slice_bytes), kMinChunkPayloadBytes);
  }
  RingGeometry geometry;
  // kTargetDepth slots per sender where the budget allows (a sender can run that many chunks
  // ahead of the owner's folds, which happen only when the owner enters odc), each as large as
  // that leaves, between the smallest and the largest payload.
  geometry.slot_bytes = round_down_64(
      std::clamp(per_sender / kTargetDepth, min_slot, kChunkHeaderBytes + payload_cap));
  // The budget is an upper bound: beyond kMaxDepth slots of the largest payload a deeper ring
  // only holds memory (a sender that far ahead waits for its owner's next odc call anyway).
  geometry.depth = std::min(per_sender / geometry.slot_bytes, kMaxDepth);
  return geometry;
}

HostStreamedStaging::HostStreamedStaging(
    Transport& transport, RingGeometry geometry, Destination destination,
    std::unique_ptr<SymmetricRegion> rings, std::unique_ptr<SymmetricRegion> arrivals,
    std::unique_ptr<SymmetricRegion> credits, std::unique_ptr<SymmetricRegion> hunger,
    std::unique_ptr<SymmetricRegion> ends, std::unique_ptr<SymmetricRegion> meetings)
    : StreamedStaging(geometry, transport.rank(), transport.world_size()),
      transport_(transport),
      destination_(std::move(destination)),
      rings_(std::move(rings)),
      arrivals_(std::move(arrivals)),
      credits_(std::move(credits)),
      hunger_(std::move(hunger)),
      ends_(std::move(ends)),
      meetings_(std::move(meetings)),
      sent_(static_cast<size_t>(world_size_), 0),
      credit_(static_cast<size_t>(world_size_), 0),
      hunger_raised_(static_cast<size_t>(world_size_), 0),
      folded_(static_cast<size_t>(world_size_), 0),
      hunger_served_(static_cast<size_t>(world_size_), 0),
      ended_(static_cast<size_t>(world_size_), 0) {}

Result<std::unique_ptr<StreamedStaging>> StreamedStaging::create(Transport& transport,
                                                                 size_t budget_bytes,
                                                                 Destination destination,
                                                                 size_t largest_slice_bytes) {
  if (transport.caps().stream_ordered)
    return DeviceStreamedStaging::create(transport, budget_bytes);
  return HostStreamedStaging::create(transport, budget_bytes, std::move(destination),
                                     largest_slice_bytes);
}

StreamedStaging::Counts StreamedStaging::counts() const {
  Counts counts;
  counts.chunks_sent = chunks_sent_;
  auto waits = credit_waits();
  counts.credit_waits = waits.ok() ? waits.value() : 0;
  counts.node_traffic = node_traffic_.totals();
  return counts;
}

void StreamedStaging::carry_counts(const Counts& before) {
  chunks_sent_ += before.chunks_sent;
  credit_waits_carried_ += before.credit_waits;
  node_traffic_.carry(before.node_traffic);
}

const std::vector<NodeRelay::Relay>& StreamedStaging::relays() const {
  static const std::vector<NodeRelay::Relay> kNone;
  return relay_ != nullptr ? relay_->relays() : kNone;
}

Status StreamedStaging::send(int owner, uint64_t target_id, uint64_t first, const void* data,
                             DataType dtype, size_t count, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(send_chunk(owner, target_id, first, data, dtype, count, stream));
  node_traffic_.count(owner, kChunkHeaderBytes + count * element_bytes(dtype));
  return Status::Ok();
}

Status StreamedStaging::send_slice(int owner, uint64_t target_id, uint64_t first, const char* data,
                                   DataType dtype, size_t count, StreamHandle stream) {
  const size_t element = element_bytes(dtype);
  const size_t per_chunk = geometry_.payload_bytes() / element;
  for (size_t done = 0; done < count; done += per_chunk) {
    const size_t n = std::min(per_chunk, count - done);
    ODC_RETURN_IF_ERROR(
        send(owner, target_id, first + done, data + done * element, dtype, n, stream));
  }
  return Status::Ok();
}

Status StreamedStaging::push(const void* src, DataType dtype, size_t count, uint64_t buffer_id,
                             StreamHandle stream) {
  const size_t element = element_bytes(dtype);
  // An entry into odc: fold what arrived, so senders waiting on this rank move on.
  ODC_RETURN_IF_ERROR(fold_arrived(stream));
  // Start with the next rank, so that the ranks' first chunks go to different owners.
  for (int i = 0; i < world_size_; ++i) {
    const int owner = (rank_ + 1 + i) % world_size_;
    const char* slice =
        static_cast<const char*>(src) + static_cast<size_t>(owner) * count * element;
    // Straight to the owner, or (a relayed accumulator, an owner on another node) into its row at
    // the rank of this node that carries it, which may be this rank.
    const NodeRelay::Route route = relay_ != nullptr ? relay_->route(buffer_id, owner, count)
                                                     : NodeRelay::Route{owner, buffer_id, 0};
    if (route.to == rank_) {
      ODC_RETURN_IF_ERROR(add_local(route.target_id, route.first, slice, dtype, count, stream));
    } else {
      ODC_RETURN_IF_ERROR(
          send_slice(route.to, route.target_id, route.first, slice, dtype, count, stream));
    }
  }
  return Status::Ok();
}

Status StreamedStaging::finish(StreamHandle stream) {
  // What is sent from here on is counted as the tail's (node_traffic()), also when it fails.
  const NodeTrafficCounter::InMinibatchEnd in_minibatch_end(node_traffic_);
  if (relay_ == nullptr || relay_->relays().empty()) {
    for (int i = 1; i < world_size_; ++i) {
      ODC_RETURN_IF_ERROR(end_at((rank_ + i) % world_size_, stream));
    }
    return wait_ends(0, world_size_, stream);
  }
  const int node_first = relay_->node_first();
  const int node_last = relay_->node_last();
  // 1. This node's ranks end here first: their relayed slices are then all in this rank's rows.
  for (int peer = node_first; peer < node_last; ++peer) {
    if (peer != rank_) ODC_RETURN_IF_ERROR(end_at(peer, stream));
  }
  ODC_RETURN_IF_ERROR(wait_ends(node_first, node_last, stream));
  // 2. Every row whole to its owner, as this rank's own chunks (the node's sum of that owner's
  // slices). Host and device alike: a device fold runs later on the stream, unseen by the host,
  // so the host cannot tell which rows took contributions; both send them all. The stream orders
  // a device send after the wait above, the host's call returns after it.
  ODC_RETURN_IF_ERROR(relay_->forward_rows(
      minibatch_, [&](int owner, uint64_t buffer_id, const float* row, size_t count) {
        return send_slice(owner, buffer_id, 0, reinterpret_cast<const char*>(row),
                          DataType::kFloat32, count, stream);
      }));
  // 3. The other nodes' ranks end here after everything this rank sends them.
  for (int i = 1; i < world_size_; ++i) {
    const int peer = (rank_ + i) % world_size_;
    if (peer < node_first || peer >= node_last) ODC_RETURN_IF_ERROR(end_at(peer, stream));
  }
  return wait_ends(0, world_size_, stream);
}

Result<std::unique_ptr<StreamedStaging>> HostStreamedStaging::create(Transport& transport,
                                                                     size_t budget_bytes,
                                                                     Destination destination,
                                                                     size_t largest_slice_bytes) {
  if (transport.caps().stream_ordered) {
    return Status::InternalError(
        "streamed staging folds on the host: the transport must complete calls on return");
  }
  // Every rank computes the same geometry from the same budget (the caller agreed on it) and
  // the same slice (every rank has the same accumulators).
  auto geometry = RingGeometry::for_budget(budget_bytes, transport.world_size(),
                                           kMaxChunkPayloadBytes, largest_slice_bytes);
  if (!geometry.ok()) return geometry.status();
  const size_t signal_bytes = static_cast<size_t>(transport.world_size()) * sizeof(uint64_t);
  auto rings = transport.allocate(geometry.value().ring_bytes() *
                                  static_cast<size_t>(transport.world_size()));
  if (!rings.ok()) return rings.status();
  std::unique_ptr<SymmetricRegion> signals[kSignalWordsPerPeer];
  for (auto& region : signals) {
    auto made = transport.allocate(signal_bytes);
    if (!made.ok()) return made.status();
    region = std::move(made).value();
  }
  return std::unique_ptr<StreamedStaging>(new HostStreamedStaging(
      transport, geometry.value(), std::move(destination), std::move(rings).value(),
      std::move(signals[0]), std::move(signals[1]), std::move(signals[2]), std::move(signals[3]),
      std::move(signals[4])));
}

size_t HostStreamedStaging::allocated_bytes() const {
  return rings_->bytes() + arrivals_->bytes() + credits_->bytes() + hunger_->bytes() +
         ends_->bytes() + meetings_->bytes();
}

Status HostStreamedStaging::begin(uint64_t minibatch, StreamHandle) {
  minibatch_ = minibatch;
  std::fill(ended_.begin(), ended_.end(), 0);
  ended_[static_cast<size_t>(rank_)] = 1;  // its own pushes are added directly
  return Status::Ok();
}

Status HostStreamedStaging::add_local(uint64_t target_id, uint64_t first, const void* data,
                                      DataType dtype, size_t count, StreamHandle) {
  auto sums = destination_(target_id, first, count);
  if (!sums.ok()) return sums.status();
  return transport_.accumulate(sums.value(), data, dtype, count, nullptr);
}

Status HostStreamedStaging::send_chunk(int owner, uint64_t buffer_id, uint64_t first,
                                       const void* data, DataType dtype, size_t count,
                                       StreamHandle) {
  const auto o = static_cast<size_t>(owner);
  if (sent_[o] - credit_[o] >= geometry_.depth) {
    ODC_RETURN_IF_ERROR(wait_for_credit(owner));
  }
  const uint64_t sequence = sent_[o] + 1;
  const ChunkHeader header = chunk_header(sequence, buffer_id, first, count, dtype);
  const size_t slot = geometry_.slot_offset(rank_, sequence);
  ODC_RETURN_IF_ERROR(transport_.put(&header, *rings_, owner, slot, sizeof(header), nullptr));
  ODC_RETURN_IF_ERROR(transport_.put(data, *rings_, owner, slot + kChunkHeaderBytes,
                                     count * element_bytes(dtype), nullptr));
  // The signal follows the puts (a fence, then the store): the owner sees the chunk whole.
  ODC_RETURN_IF_ERROR(transport_.signal(*arrivals_, owner, sequence, nullptr));
  sent_[o] = sequence;
  ++chunks_sent_;
  return Status::Ok();
}

Status HostStreamedStaging::poll_serving_hunger(std::vector<SignalWatch> watches, size_t num_all,
                                                std::chrono::duration<double> limit,
                                                std::vector<uint64_t>* seen) {
  ODC_RETURN_IF_ERROR(progress_failure_);
  // Also wake for every sender still sending whose ring here is full: it waits for our folds.
  const size_t first_hunger = watches.size();
  for (int s = 0; s < world_size_; ++s) {
    if (s == rank_ || ended_[static_cast<size_t>(s)] != 0) continue;  // ended: waits no more
    watches.push_back({hunger_.get(), s, hunger_served_[static_cast<size_t>(s)] + 1});
  }
  auto polled = transport_.poll_signals(watches, num_all, limit, seen);
  if (!polled.ok()) return polled.status();
  std::vector<int> hungry;
  for (size_t i = first_hunger; i < watches.size(); ++i) {
    if ((*seen)[i] >= watches[i].value) {
      hunger_served_[static_cast<size_t>(watches[i].peer)] = (*seen)[i];
      hungry.push_back(watches[i].peer);
    }
  }
  seen->resize(first_hunger);
  if (hungry.empty()) return Status::Ok();
  // A hungry sender put every chunk up to its hunger and more: folding what arrived frees it.
  ODC_RETURN_IF_ERROR(fold_arrived());
  // Its credit again, even when nothing new was folded: a credit lost on the way is repaired.
  for (int sender : hungry) {
    ODC_RETURN_IF_ERROR(
        transport_.signal(*credits_, sender, folded_[static_cast<size_t>(sender)], nullptr));
  }
  return Status::Ok();
}

Status HostStreamedStaging::wait_for_credit(int owner) {
  const auto o = static_cast<size_t>(owner);
  const uint64_t needed = sent_[o] - geometry_.depth + 1;
  const auto deadline = deadline_after(transport_.timeout());
  bool counted = false;
  std::vector<uint64_t> seen;
  for (;;) {
    // The first look does not sleep: the credit may be there already.
    ODC_RETURN_IF_ERROR(
        poll_serving_hunger({{credits_.get(), owner, needed}}, 0,
                            counted ? kPollSlice : std::chrono::duration<double>::zero(), &seen));
    credit_[o] = std::max(credit_[o], seen[0]);
    if (sent_[o] - credit_[o] < geometry_.depth) return Status::Ok();
    if (!counted) {
      counted = true;
      ++credit_waits_;
      // Tell the owner: a rank waiting in odc folds for its hungry senders (one inside its own
      // computation folds at its next odc call).
      if (needed > hunger_raised_[o]) {
        ODC_RETURN_IF_ERROR(transport_.signal(*hunger_, owner, needed, nullptr));
        hunger_raised_[o] = needed;
      }
      continue;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Timeout(
          "credit wait (scatter_accumulate) timed out after " + timeout_text(transport_.timeout()) +
          ": rank " + std::to_string(rank_) + " waited for credit from rank " +
          std::to_string(owner) + " (its last sequence " + std::to_string(sent_[o]) +
          ", consumed up to " + std::to_string(credit_[o]) + ", ring of " +
          std::to_string(geometry_.depth) + " slots)");
    }
    ODC_RETURN_IF_ERROR(poll_interrupt("waiting for credit from rank " + std::to_string(owner) +
                                       " (scatter_accumulate)"));
  }
}

Status HostStreamedStaging::fold_arrived(StreamHandle) {
  return fold_arrived();
}

bool HostStreamedStaging::progress() {
  if (!progress_failure_.ok()) return true;
  std::vector<uint64_t> seen;
  Status served = poll_serving_hunger({}, 0, std::chrono::duration<double>::zero(), &seen);
  if (!served.ok()) {
    progress_failure_ = served.with_context(
        "while its progress thread folded for a waiting sender (outside its calls)");
  }
  return true;
}

Status HostStreamedStaging::fold_arrived() {
  ODC_RETURN_IF_ERROR(progress_failure_);
  std::vector<SignalWatch> watches;
  for (int s = 0; s < world_size_; ++s) {
    if (s == rank_ || ended_[static_cast<size_t>(s)] != 0) continue;
    watches.push_back({arrivals_.get(), s, folded_[static_cast<size_t>(s)] + 1});
  }
  std::vector<uint64_t> seen;
  auto polled = transport_.poll_signals(watches, 0, std::chrono::duration<double>::zero(), &seen);
  if (!polled.ok()) return polled.status();
  if (!polled.value()) return Status::Ok();
  for (size_t i = 0; i < watches.size(); ++i) {
    const int sender = watches[i].peer;
    if (seen[i] <= folded_[static_cast<size_t>(sender)]) continue;
    ODC_RETURN_IF_ERROR(fold_from(sender, seen[i]));
    // The slots are free again once folded: the sender may rewrite them.
    ODC_RETURN_IF_ERROR(
        transport_.signal(*credits_, sender, folded_[static_cast<size_t>(sender)], nullptr));
  }
  return Status::Ok();
}

Status HostStreamedStaging::fold_from(int sender, uint64_t last) {
  const auto s = static_cast<size_t>(sender);
  auto from = [&] {
    return "chunk from rank " + std::to_string(sender) + " at rank " + std::to_string(rank_);
  };
  if (last > folded_[s] + geometry_.depth) {
    return Status::InternalError(from() + ": a signal covers sequence " + std::to_string(last) +
                                 ", " + std::to_string(last - folded_[s]) +
                                 " chunks unfolded, more than its ring's " +
                                 std::to_string(geometry_.depth) + " slots (a stray signal)");
  }
  const auto* ring = static_cast<const char*>(rings_->local()) + s * geometry_.ring_bytes();
  while (folded_[s] < last) {
    const uint64_t sequence = folded_[s] + 1;
    const char* slot = ring + ((sequence - 1) % geometry_.depth) * geometry_.slot_bytes;
    ChunkHeader header;
    std::memcpy(&header, slot, sizeof(header));
    // A slot holding another sequence was never (re)written for this one: a put was lost while a
    // signal covering it arrived, or a signal ran ahead of its data. Named, never summed.
    if (header.sequence != sequence || header.minibatch != minibatch_) {
      return Status::InternalError(
          from() + ": slot holds chunk " + std::to_string(header.sequence) + " of minibatch " +
          std::to_string(header.minibatch) + ", expected chunk " + std::to_string(sequence) +
          " of minibatch " + std::to_string(minibatch_) + " (a lost put or a stray signal)");
    }
    const auto dtype = static_cast<DataType>(header.dtype);
    if (!is_valid(dtype) || header.count * element_bytes(dtype) > geometry_.payload_bytes()) {
      return Status::InternalError(from() + ": malformed chunk " + std::to_string(sequence) +
                                   " (dtype " + std::to_string(header.dtype) + ", " +
                                   std::to_string(header.count) + " elements)");
    }
    if (Status late = check_fold(header.buffer_id, minibatch_); !late.ok()) {
      return late.with_context(from());
    }
    auto sums = destination_(header.buffer_id, header.first, header.count);
    if (!sums.ok()) return sums.status().with_context(from());
    ODC_RETURN_IF_ERROR(transport_.accumulate(sums.value(), slot + kChunkHeaderBytes, dtype,
                                              header.count, nullptr));
    // The sender rewrites a slot only after the credit that frees it; a stray credit could let it
    // rewrite this one while it was being added. Look again (the header is written first): the
    // communicator then fails, so the sums it touched are never reported.
    uint64_t sequence_after = 0;
    std::memcpy(&sequence_after, slot + offsetof(ChunkHeader, sequence), sizeof(sequence_after));
    if (sequence_after != sequence) {
      return Status::InternalError(from() + ": chunk " + std::to_string(sequence) +
                                   " was rewritten (now " + std::to_string(sequence_after) +
                                   ") while it was folded (a stray credit)");
    }
    folded_[s] = sequence;
  }
  return Status::Ok();
}

Status HostStreamedStaging::consume_end(int sender, uint64_t end_sequence) {
  const auto s = static_cast<size_t>(sender);
  // Every sequence before the end is a chunk of this minibatch, put before the end was raised.
  ODC_RETURN_IF_ERROR(fold_from(sender, end_sequence - 1));
  folded_[s] = end_sequence;
  ended_[s] = 1;
  return transport_.signal(*credits_, sender, end_sequence, nullptr);
}

Status HostStreamedStaging::end_at(int owner, StreamHandle) {
  // The end takes a sequence number but no slot: it never waits for credit. Its signal follows
  // every put of this rank to the owner.
  const auto o = static_cast<size_t>(owner);
  sent_[o] += 1;
  return transport_.signal(*ends_, owner, sent_[o], nullptr);
}

Status HostStreamedStaging::wait_ends(int from, int to, StreamHandle) {
  const auto deadline = deadline_after(transport_.timeout());
  std::vector<uint64_t> seen;
  bool first_look = true;
  for (;;) {
    // Sleep until every missing end arrived (one wake, not one per sender), or a sender still
    // sending runs out of credit here (it waits for this rank's folds).
    std::vector<SignalWatch> watches;
    for (int s = from; s < to; ++s) {
      if (ended_[static_cast<size_t>(s)] == 0) {
        watches.push_back({ends_.get(), s, folded_[static_cast<size_t>(s)] + 1});
      }
    }
    if (watches.empty()) return Status::Ok();
    ODC_RETURN_IF_ERROR(poll_serving_hunger(
        watches, watches.size(), first_look ? std::chrono::duration<double>::zero() : kPollSlice,
        &seen));
    first_look = false;
    size_t missing = watches.size();
    for (size_t i = 0; i < watches.size(); ++i) {
      if (seen[i] >= watches[i].value) {
        ODC_RETURN_IF_ERROR(consume_end(watches[i].peer, seen[i]));
      } else if (missing == watches.size()) {
        missing = i;
      }
    }
    if (missing == watches.size()) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline) {
      const int late = watches[missing].peer;
      return Status::Timeout(
          "push wait (minibatch_end) timed out after " + timeout_text(transport_.timeout()) +
          ": rank " + std::to_string(rank_) + " waited for rank " + std::to_string(late) +
          "'s end of minibatch " + std::to_string(minibatch_) + " (folded its chunks up to " +
          std::to_string(folded_[static_cast<size_t>(late)]) + ")");
    }
    ODC_RETURN_IF_ERROR(poll_interrupt("waiting for the pushes of minibatch " +
                                       std::to_string(minibatch_) + " (minibatch_end)"));
  }
}

Status HostStreamedStaging::meet(const char* operation, StreamHandle) {
  ++meetings_entered_;
  for (int i = 0; i < world_size_; ++i) {
    const int peer = (rank_ + 1 + i) % world_size_;
    if (peer != rank_) {
      ODC_RETURN_IF_ERROR(transport_.signal(*meetings_, peer, meetings_entered_, nullptr));
    }
  }
  const auto deadline = deadline_after(transport_.timeout());
  std::vector<uint64_t> seen;
  bool first_look = true;
  for (;;) {
    std::vector<SignalWatch> watches;
    for (int s = 0; s < world_size_; ++s) {
      if (s != rank_) watches.push_back({meetings_.get(), s, meetings_entered_});
    }
    ODC_RETURN_IF_ERROR(poll_serving_hunger(
        watches, watches.size(), first_look ? std::chrono::duration<double>::zero() : kPollSlice,
        &seen));
    first_look = false;
    size_t missing = 0;
    while (missing < watches.size() && seen[missing] >= watches[missing].value) ++missing;
    if (missing == watches.size()) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Timeout(
          std::string(operation) + " inside a minibatch timed out after " +
          timeout_text(transport_.timeout()) + ": rank " + std::to_string(rank_) +
          " waited for rank " + std::to_string(watches[missing].peer) + " to reach it (expected " +
          std::to_string(meetings_entered_) + ", saw " + std::to_string(seen[missing]) + ")");
    }
    ODC_RETURN_IF_ERROR(poll_interrupt(std::string("waiting for every rank to reach ") + operation +
                                       " inside a minibatch"));
  }
}

}  // namespace odc
