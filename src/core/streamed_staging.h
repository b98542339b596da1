// Streamed staged accumulation (AccumulationScheme::kStreamed): how pushes reach their owners on
// transports without a remote fp32 add, during the minibatch and in memory bounded by a fixed
// budget whatever the model and the world size. Every owner keeps one ring of `depth` slots per
// sender in its staging region. A sender puts a chunk (a header, then up to a slot's payload of
// its push, in the push's dtype) into its next free slot at the owner and raises its arrival
// signal there to the chunk's sequence number; the owner folds arrived chunks into its fp32 sums
// in sequence order whenever it enters odc (every push, gather and minibatch_end) and raises the
// sender's credit signal to the last sequence it consumed, which frees the slots. A sender whose
// ring is full raises its hunger signal at the owner and waits; every rank waiting in odc watches
// its hungry senders and folds for them, so ranks waiting for each other's credit all progress.
// At minibatch_end a sender ends its sequence with an end number (no slot: it never waits for
// credit), raised on the owner's end signal after all its chunks.
// Node-aggregated pushes (with more than one node, for the accumulators the aggregation budget
// has room for; core/node_relay.h): a push's slice for an owner on another node goes, through the
// same rings, to the rank of this node that carries that owner, which folds it into its relay row
// for the owner. At minibatch_end every rank first ends its sequence at its own node's ranks and
// folds until they all ended here (its relay rows then hold the node's slices whole), then
// forwards every relay row whole, as its own chunks, to the row's owner, then ends its sequence
// at the other nodes' ranks and folds until every sender ended. One rule on the host and the
// device (the host never sees a device fold, so nothing leaves earlier on either): each owner
// receives, per accumulator and other node, one fp32 slice instead of the c slices the ranks of
// that node pushed for it. Invariants:
//   - a slot is read only after a signal that covers it (an arrival or the end, acquire) and
//     rewritten only after the credit that frees it; every chunk carries its sequence number and
//     minibatch: each chunk is folded exactly once, and a lost or stale one is named, never summed;
//   - an owner's sums are complete once it consumed every sender's end of the minibatch (the end
//     covers every chunk before it, so a lost arrival signal loses nothing);
//   - a relay row's contributions each go out exactly once: all are folded before the row's one
//     forward (the node's ends cover them), none after it (host folds check it), and the
//     forward's chunks are folded at the owner once each, as any chunk;
//   - every wait is bounded by the transport's timeout and names rank, peer and operation.
// On transports whose calls complete on return the folds run on the host, inside odc's calls
// (HostStreamedStaging); on stream-ordered (device) transports a kernel enqueued on the caller's
// stream at the same points folds on the device (DeviceStreamedStaging), see
// core/device_streamed_staging.h and docs/runtime.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "common/status.h"
#include "core/dtype.h"
#include "core/node_relay.h"
#include "core/node_traffic.h"
#include "core/topology.h"
#include "core/transport.h"
#include "kernels/streamed_fold.h"

namespace odc {

// Staging budget per rank when neither the caller nor ODC_STAGING_BYTES gives one.
inline constexpr size_t kDefaultStagingBytes = size_t{256} << 20;
// A slot is a 64-byte header and a payload. Larger slots mean fewer signals per pushed byte; at
// most 1 MiB of payload on the host (whose folds are CPU loops inside odc's calls), so that a
// ring of a large world still holds several.
inline constexpr size_t kChunkHeaderBytes = 64;
inline constexpr size_t kMaxChunkPayloadBytes = size_t{1} << 20;
// On device transports every chunk is a credit check, a pack and a put with its signal on the
// caller's stream, each with a fixed cost, and a fold at the owner: larger chunks amortize them.
// With the folds beside the sends, back-to-back NVSHMEM pushes between 2 H200s moved 92, 125 and
// 135 GB/s from 64 MiB with 4, 8 and 16 MiB payloads (docs/benchmarks.md, section 4; 4 MiB
// against 1 MiB before: 38-40 GB/s instead of 34). The budget bounds the rings: at the default
// 256 MiB, 16 MiB slots at 2 and 3 ranks, smaller ones from 4 ranks (8 slots per sender first).
inline constexpr size_t kMaxDeviceChunkPayloadBytes = size_t{16} << 20;
// The smallest slot the budget may come down to: 64 fp32 elements of payload.
inline constexpr size_t kMinChunkPayloadBytes = 256;

// How a budget is cut into rings: the signals (five words per peer) first, then one ring per
// sender of `depth` slots of `slot_bytes`: 8 slots per sender where the budget allows, larger
// slots up to the largest payload, then more slots up to 16 (so the budget is an upper bound:
// 256 MiB over 2 ranks takes 32 MiB with 1 MiB payloads, 128 MiB with 4 MiB ones). A payload
// never exceeds what one push puts into one chunk, the largest accumulator's shard (its slice per
// owner; `largest_slice_bytes`, rounded up to 64 bytes, at least the smallest payload): the rings
// hold what the model can put in flight, up to the budget, not the budget whatever the model.
struct RingGeometry {
  size_t slot_bytes = 0;  // header + payload, a multiple of 64
  size_t depth = 0;       // slots per sender
  size_t ring_bytes() const { return slot_bytes * depth; }
  size_t payload_bytes() const { return slot_bytes - kChunkHeaderBytes; }
  // Where chunk `sequence` (from 1) of `sender` lies in an owner's rings.
  size_t slot_offset(int sender, uint64_t sequence) const {
    return static_cast<size_t>(sender) * ring_bytes() +
           static_cast<size_t>((sequence - 1) % depth) * slot_bytes;
  }
  // What the rings and signals of `world_size` ranks take per rank (<= the budget).
  size_t total_bytes(int world_size) const;
  // The least budget for_budget() takes for `world_size` ranks (one slot of the smallest payload
  // per sender, and the signals).
  static size_t least_budget(int world_size);
  // InvalidArgument naming the budget, the world size and the least that works, when too small.
  // Payloads of at most `max_payload_bytes` (kMaxChunkPayloadBytes on the host,
  // kMaxDeviceChunkPayloadBytes on device transports).
  static Result<RingGeometry> for_budget(size_t budget_bytes, int world_size,
                                         size_t max_payload_bytes = kMaxChunkPayloadBytes,
                                         size_t largest_slice_bytes = SIZE_MAX);
  bool operator==(const RingGeometry& other) const {
    return slot_bytes == other.slot_bytes && depth == other.depth;
  }
};

// The streamed staging of one communicator: on the host (HostStreamedStaging, transports whose
// calls complete on return) or on the device (DeviceStreamedStaging,
// core/device_streamed_staging.h: stream-ordered transports, whose devices fold).
class StreamedStaging {
 public:
  // Where a chunk for accumulator `buffer_id` lands: this rank's sums of that accumulator, from
  // element `first`, `count` elements; an error when no such accumulator or range exists.
  using Destination = std::function<Result<float*>(uint64_t buffer_id, size_t first, size_t count)>;

  // Collective (every rank, same budget and slice): the rings and their signals, on the host or
  // the device as the transport's capabilities say. Host folds find their targets through
  // `destination`; device folds through set_targets(). Host rings take payloads of at most
  // `largest_slice_bytes` (RingGeometry::for_budget); device rings are cut from the budget alone
  // (made once: queued kernels of peers may use them until a communicator's destroy).
  static Result<std::unique_ptr<StreamedStaging>> create(Transport& transport, size_t budget_bytes,
                                                         Destination destination,
                                                         size_t largest_slice_bytes = SIZE_MAX);
  virtual ~StreamedStaging() = default;

  const RingGeometry& geometry() const { return geometry_; }
  // The header of chunk `sequence` of the open minibatch: `count` elements of `dtype` for
  // accumulator `buffer_id` from element `first` of the owner's shard.
  kernels::ChunkHeader chunk_header(uint64_t sequence, uint64_t buffer_id, uint64_t first,
                                    size_t count, DataType dtype) const {
    kernels::ChunkHeader header{};
    header.sequence = sequence;
    header.minibatch = minibatch_;
    header.buffer_id = buffer_id;
    header.first = first;
    header.count = count;
    header.dtype = static_cast<uint32_t>(dtype);
    return header;
  }
  // The symmetric memory it holds on this rank (<= the budget).
  virtual size_t allocated_bytes() const = 0;
  uint64_t chunks_sent() const { return chunks_sent_; }
  // Chunks this rank had to wait for credit before sending (flow control engaged), so far.
  virtual Result<uint64_t> credit_waits() const = 0;

  // Local: the accumulators a device fold adds into (every live one and their relay rows; host
  // folds ignore it).
  virtual Status set_targets(const std::vector<kernels::FoldTarget>& targets) = 0;
  // Local: minibatch `minibatch` is open (every rank passed its opening barrier, and this rank
  // zeroed its sums on `stream`).
  virtual Status begin(uint64_t minibatch, StreamHandle stream) = 0;
  // Local, at minibatch_begin before its barrier: the progress thread's work for the minibatch
  // before ends here (device: `stream` waits for its passes, so none runs once peers push the
  // next minibatch). Host: nothing (it serves only inside a minibatch, under the call lock).
  virtual Status end_progress(StreamHandle) { return Status::Ok(); }
  // For every owner r: `src` elements [r*count, (r+1)*count) (fp32 or bf16) added into owner r's
  // sums of `buffer_id` (this rank's own slice directly; a relayed accumulator's slices for other
  // nodes through the rank of this node that carries their owner). Waits for credit where a ring
  // is full.
  Status push(const void* src, DataType dtype, size_t count, uint64_t buffer_id,
              StreamHandle stream);
  // Never waits: folds every chunk that has arrived and returns credits.
  virtual Status fold_arrived(StreamHandle stream) = 0;
  // From the progress thread (core/host_progress.h); never waits. Host: called only while a
  // minibatch is open and no call of this rank's communicator runs (under its call lock): folds
  // for the senders hungry here and returns their credit. Device: called whatever this rank's
  // thread does (a push call returns only once its stream ran its credit waits, so the host
  // holds the call lock as long as its stream is blocked): enqueues one pass of the fold on the
  // background stream, unless the last one has not run yet, from begin() until the next
  // end_progress() (at most the timeout past minibatch_end's call). A failure is kept and returned
  // by this staging's next call (which fails the communicator). Returns whether a minibatch is
  // open for it (false: the thread may sleep).
  virtual bool progress() = 0;
  // minibatch_end: ends this rank's sequence at every other owner (with relays: at its node's
  // first, then forwards its relay rows, then at the other nodes'), then folds until every
  // sender's end of this minibatch arrived (bounded by the timeout).
  Status finish(StreamHandle stream);
  // Inside a minibatch, before any other collective (a barrier, an allocation): waits until every
  // rank arrived here, folding for hungry senders meanwhile, so that no rank waits in the
  // transport's collective while a peer still waits for its credit. `operation` names the wait.
  virtual Status meet(const char* operation, StreamHandle stream) = 0;

  // ---- node-aggregated pushes (core/node_relay.h) -------------------------------------------
  // Local, before the first relay: who carries which owner, and this rank's node, ranks
  // [node_first, node_last) (nodes of consecutive ranks). Without it nothing is relayed.
  void set_routes(NodeRoutes routes, int node_first, int node_last) {
    relay_ = std::make_unique<NodeRelay>(std::move(routes), node_first, node_last);
  }
  // Local: the relayed accumulators (every rank the same; made only where routes are set,
  // Communicator::add_relay, so ignored without them).
  void set_relays(std::vector<NodeRelay::Relay> relays) {
    if (relay_ != nullptr) relay_->set_relays(std::move(relays));
  }
  const std::vector<NodeRelay::Relay>& relays() const;

  // ---- what crosses nodes (core/node_traffic.h) -----------------------------------------------
  // Local, once: the node of every rank (Topology::node), for node_traffic().
  void set_node_of(std::vector<int> node_of) { node_traffic_.set_node_of(std::move(node_of)); }
  const NodeTraffic& node_traffic() const { return node_traffic_.totals(); }

  // ---- when larger rings replace these (between minibatches) ----------------------------------
  // What the counters above say so far; carry_counts() makes a new staging's go on from there.
  struct Counts {
    uint64_t chunks_sent = 0;
    uint64_t credit_waits = 0;
    NodeTraffic node_traffic;
  };
  Counts counts() const;
  void carry_counts(const Counts& before);

 protected:
  StreamedStaging(RingGeometry geometry, int rank, int world_size)
      : geometry_(geometry), rank_(rank), world_size_(world_size), node_traffic_(rank) {}
  // The steps push() and finish() are written in, on the host or the device:
  // one chunk of `count` elements for fold target `target_id` from element `first` into this
  // rank's ring at `owner`, once a slot is free (waiting for credit, folding meanwhile);
  virtual Status send_chunk(int owner, uint64_t target_id, uint64_t first, const void* data,
                            DataType dtype, size_t count, StreamHandle stream) = 0;
  // the same elements added into this rank's own fold target (no ring);
  virtual Status add_local(uint64_t target_id, uint64_t first, const void* data, DataType dtype,
                           size_t count, StreamHandle stream) = 0;
  // this rank's end of the minibatch at `owner` (a sequence number, no slot);
  virtual Status end_at(int owner, StreamHandle stream) = 0;
  // folds until the ends of senders [from, to) (this rank aside) of this minibatch are consumed.
  virtual Status wait_ends(int from, int to, StreamHandle stream) = 0;
  // send_chunk, counted in node_traffic() when `owner` is on another node.
  Status send(int owner, uint64_t target_id, uint64_t first, const void* data, DataType dtype,
              size_t count, StreamHandle stream);
  // Sends `count` elements of `data` (the owner's shard view) to `owner` in chunks.
  Status send_slice(int owner, uint64_t target_id, uint64_t first, const char* data, DataType dtype,
                    size_t count, StreamHandle stream);
  // Host folds: Ok unless a chunk of `minibatch` for `target_id` may not be added any more (the
  // relay rows it targets were forwarded already, NodeRelay::check_fold).
  Status check_fold(uint64_t target_id, uint64_t minibatch) const {
    return relay_ != nullptr ? relay_->check_fold(target_id, minibatch) : Status::Ok();
  }

  RingGeometry geometry_;
  const int rank_;
  const int world_size_;
  uint64_t minibatch_ = 0;  // the open minibatch (begin())
  uint64_t chunks_sent_ = 0;
  uint64_t credit_waits_carried_ = 0;  // credit waits of the stagings this one replaced

 private:
  std::unique_ptr<NodeRelay> relay_;  // null: nothing relayed (one node, or aggregation off)
  NodeTrafficCounter node_traffic_;
};

// The host fold (see the top of this file).
class HostStreamedStaging final : public StreamedStaging {
 public:
  static Result<std::unique_ptr<StreamedStaging>> create(Transport& transport, size_t budget_bytes,
                                                         Destination destination,
                                                         size_t largest_slice_bytes = SIZE_MAX);

  size_t allocated_bytes() const override;
  Result<uint64_t> credit_waits() const override { return credit_waits_carried_ + credit_waits_; }
  Status set_targets(const std::vector<kernels::FoldTarget>&) override { return Status::Ok(); }
  Status begin(uint64_t minibatch, StreamHandle stream) override;
  Status fold_arrived(StreamHandle stream) override;
  bool progress() override;
  Status meet(const char* operation, StreamHandle stream) override;

 protected:
  Status send_chunk(int owner, uint64_t target_id, uint64_t first, const void* data, DataType dtype,
                    size_t count, StreamHandle stream) override;
  Status add_local(uint64_t target_id, uint64_t first, const void* data, DataType dtype,
                   size_t count, StreamHandle stream) override;
  Status end_at(int owner, StreamHandle stream) override;
  Status wait_ends(int from, int to, StreamHandle stream) override;

 private:
  HostStreamedStaging(Transport& transport, RingGeometry geometry, Destination destination,
                      std::unique_ptr<SymmetricRegion> rings,
                      std::unique_ptr<SymmetricRegion> arrivals,
                      std::unique_ptr<SymmetricRegion> credits,
                      std::unique_ptr<SymmetricRegion> hunger,
                      std::unique_ptr<SymmetricRegion> ends,
                      std::unique_ptr<SymmetricRegion> meetings);
  Status fold_arrived();
  // Waits, folding for hungry senders, until this rank may put one more chunk to `owner`.
  Status wait_for_credit(int owner);
  // Folds sender `sender`'s data chunks up to sequence `last` (not beyond what it put).
  Status fold_from(int sender, uint64_t last);
  // Consumes sender `sender`'s end `end_sequence`: folds its chunks before it, returns credit.
  Status consume_end(int sender, uint64_t end_sequence);
  // Polls `watches` (the first `num_all` one all-condition, as Transport::poll_signals) and the
  // hunger of every sender still sending, waiting up to `limit`; folds for the hungry ones.
  // seen[i]: the value of watches[i].
  Status poll_serving_hunger(std::vector<SignalWatch> watches, size_t num_all,
                             std::chrono::duration<double> limit, std::vector<uint64_t>* seen);

  Transport& transport_;
  Destination destination_;
  std::unique_ptr<SymmetricRegion> rings_;     // here: sender s's ring at s * ring_bytes
  std::unique_ptr<SymmetricRegion> arrivals_;  // slot s here: last chunk sender s put here
  std::unique_ptr<SymmetricRegion> credits_;   // slot r here: last sequence of ours r consumed
  std::unique_ptr<SymmetricRegion> hunger_;    // slot s here: the credit sender s waits for
  std::unique_ptr<SymmetricRegion> ends_;      // slot s here: sender s's last end sequence
  std::unique_ptr<SymmetricRegion> meetings_;  // slot s here: meetings rank s entered so far
  std::vector<uint64_t> sent_;                 // per owner: last sequence used there (chunk or end)
  std::vector<uint64_t> credit_;               // per owner: its credit signal as last read
  std::vector<uint64_t> hunger_raised_;        // per owner: the hunger this rank last raised there
  std::vector<uint64_t> folded_;               // per sender: last sequence consumed here
  std::vector<uint64_t> hunger_served_;        // per sender: its hunger as last served
  std::vector<char> ended_;                    // per sender: its end of this minibatch consumed
  uint64_t meetings_entered_ = 0;
  uint64_t credit_waits_ = 0;
  Status progress_failure_;  // progress()'s failure, returned by the next call
};

}  // namespace odc
