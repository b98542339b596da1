// The streamed staging on a stream-ordered (device) transport: the protocol of
// core/streamed_staging.h, with every step enqueued on the caller's stream and the owner's folds
// run by its device (kernels/streamed_fold.cuh, through DeviceStagingOps::fold_streamed). The host
// only counts sequences; no CPU thread polls and no call waits on the host.
//   push          per chunk to owner p: a one-pass fold of what arrived here, on the background
//                 stream (per slot's worth of bytes sent; skipped while the last one there
//                 runs), so that the owner's folding runs beside this rank's sends instead of
//                 between them; on the caller's stream
//                 a fold that returns once p's credit frees the chunk's slot (at once where it
//                 is free; folding what arrived meanwhile while it waits, so ranks waiting for
//                 each other's credit all progress), the chunk packed into the next of this
//                 rank's two outbox slots (header and payload, in the push's dtype; once the
//                 put of the chunk packed there before has run), and on the transport's send
//                 lane (DeviceStagingOps::fork_sends: one stream, so puts land in order) one
//                 put-with-signal of that slot into the ring's, raising this rank's arrival
//                 signal at p to the chunk's sequence. The caller's stream packs the next chunk
//                 and adds the push's own slice while the lane moves this one (the end's and
//                 the meetings' signals, below, wait for the lane and quiet every earlier put);
//   every entry   (push, gather) a fold of whatever has arrived (one pass, no wait);
//   finish        per owner: the end's sequence and its mark (the minibatch), each a signal
//                 after every earlier put to that owner; then a fold until every sender's mark
//                 and end sequence arrived (in either order), which folds each sender's chunks
//                 up to its end by their headers (an arrival signal lost on the way loses
//                 nothing) and consumes the end (the fold's `ended` word records it, so with
//                 node-aggregated pushes the node's ends consumed first count in the last fold);
//   meet          a meeting signal to every rank, then a fold until every rank's arrived, and
//                 one more pass (everything put before a meeting is there).
// Memory per rank: the rings and signals of the budget's geometry, two outbox slots and the fold's
// counters, all inside the budget.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "core/device_staging_ops.h"
#include "core/streamed_staging.h"

namespace odc {

class DeviceStreamedStaging final : public StreamedStaging {
 public:
  // The outbox: chunks are packed into its slots in turn, so that one is packed while the put of
  // the other runs (one slot more of the budget than a single outbox; measured in
  // docs/benchmarks.md, section 4, "The puts on a lane of their own").
  static constexpr size_t kOutboxSlots = 2;

  // Collective (every rank, same budget).
  static Result<std::unique_ptr<StreamedStaging>> create(Transport& transport, size_t budget_bytes);
  // The rings create() cuts from `budget_bytes` for `world_size` ranks: RingGeometry's cut with
  // payloads up to kMaxDeviceChunkPayloadBytes, shallower where the outbox slots and the fold's
  // words must fit too; InvalidArgument naming the least that works when nothing does.
  static Result<RingGeometry> geometry_for(size_t budget_bytes, int world_size);
  // What create() allocates per rank for that geometry (rings, signals, fold words, outbox).
  static size_t bytes_for(const RingGeometry& geometry, int world_size);

  size_t allocated_bytes() const override;
  Result<uint64_t> credit_waits() const override;
  Status set_targets(const std::vector<kernels::FoldTarget>& targets) override;
  // The table the folds take now (tests: a pass whose table is older than a peer's push).
  std::vector<kernels::FoldTarget> targets() const;
  // Also orders the background stream (the progress thread's passes) after the caller's zeroing.
  Status begin(uint64_t minibatch, StreamHandle stream) override;
  Status end_progress(StreamHandle stream) override;
  Status fold_arrived(StreamHandle stream) override;
  bool progress() override;
  Status meet(const char* operation, StreamHandle stream) override;

 protected:
  Status send_chunk(int owner, uint64_t target_id, uint64_t first, const void* data, DataType dtype,
                    size_t count, StreamHandle stream) override;
  Status add_local(uint64_t target_id, uint64_t first, const void* data, DataType dtype,
                   size_t count, StreamHandle stream) override;
  Status end_at(int owner, StreamHandle stream) override;
  // One fold until the ends of [from, to) are consumed (earlier consumed ones count). The
  // progress thread's passes go on until the next end_progress(), at most the timeout from here
  // (the stream reaches this fold later than the host returns; a sender still waiting then has
  // timed out).
  Status wait_ends(int from, int to, StreamHandle stream) override;

 private:
  // The regions, in the order create() allocates them.
  enum Region {
    kRings,
    kArrivals,
    kCredits,
    kEndSequences,
    kEndMarks,
    kMeetings,
    kFolded,
    kOutbox,
    kNumRegions
  };
  DeviceStreamedStaging(Transport& transport, DeviceStagingOps& device, RingGeometry geometry,
                        std::vector<std::unique_ptr<SymmetricRegion>> regions);
  const SymmetricRegion& region(Region which) const { return *regions_[which]; }
  uint64_t* words(Region which) const { return static_cast<uint64_t*>(regions_[which]->local()); }
  // A fold of this rank's rings until `until` (peer, value and the senders whose ends kEnds
  // awaits as kernels::StreamedFold says).
  kernels::StreamedFold fold_of(kernels::FoldUntil until, int peer, uint64_t value,
                                int ends_from = 0, int ends_to = 0) const;
  // That fold enqueued on `stream`.
  Status fold(kernels::FoldUntil until, int peer, uint64_t value, StreamHandle stream,
              int ends_from = 0, int ends_to = 0);
  // A one-pass fold on the background stream, unless the last one there still runs: the
  // progress thread's pass, also enqueued by each chunk a push sends. Where the minibatch is open
  // only (begin() .. end_progress()). Takes progress_mutex_.
  Status fold_beside();
  // That pass, enqueued (progress_mutex_ held).
  Status enqueue_pass();
  // end_at(): `stream` waits for the send lane's puts so far (DeviceStagingOps::join_sends),
  // unless it already did in this minibatch_end since the last chunk was sent.
  Status join_sends(StreamHandle stream);

  Transport& transport_;
  DeviceStagingOps& device_;  // transport_.device_staging(): folds, packing, local reads
  std::vector<std::unique_ptr<SymmetricRegion>> regions_;
  std::vector<kernels::FoldTarget> targets_;
  std::vector<uint64_t> sent_;  // per owner: the last sequence used there (chunk or end)
  uint64_t meetings_entered_ = 0;
  size_t bytes_since_pass_ = 0;  // sent since the last pass beside the sends (send_chunk)
  uint64_t outbox_turns_ = 0;    // chunks packed so far: the next one's outbox slot is this % 2
  // The stream that last joined the send lane in end_at(), unset once a chunk went out after it
  // and at each wait_ends() and begin().
  std::optional<StreamHandle> lane_joined_;

  // The progress thread's side. Written by the caller's thread under progress_mutex_ (with
  // targets_ and minibatch_, which the passes read), read by the progress thread under it.
  mutable std::mutex progress_mutex_;
  bool progress_open_ = false;                            // begin() .. end_progress()
  std::chrono::steady_clock::time_point progress_until_;  // wait_ends() + the timeout
  StreamHandle progress_stream_ = nullptr;                // the background stream (begin())
  Status progress_failure_;                               // a pass that could not be enqueued
};

}  // namespace odc
