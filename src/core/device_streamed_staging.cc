// The streamed staging on the device (see device_streamed_staging.h for the steps).
#include "core/device_streamed_staging.h"

#include <algorithm>
#include <string>
#include <utility>

namespace odc {
namespace {

// The fold's words: per sender its last folded sequence, then the credit-wait counter, then per
// sender its lock, then per sender the last minibatch whose end was consumed here.
size_t fold_words(int world_size) {
  return 3 * static_cast<size_t>(world_size) + 1;
}

// Each outbox slot's last put is one of the send lane's marks (DeviceStagingOps::mark_sends).
static_assert(DeviceStreamedStaging::kOutboxSlots == 2, "the send lane keeps two marks");

// What the device variant holds beyond the rings and the five signal regions RingGeometry
// counts: the fold's words and the outbox slots.
size_t extra_bytes(const RingGeometry& geometry, int world_size) {
  return fold_words(world_size) * sizeof(uint64_t) +
         DeviceStreamedStaging::kOutboxSlots * geometry.slot_bytes;
}

int64_t timeout_ns(const Transport& transport) {
  const double seconds = transport.timeout().count();
  if (!(seconds < 9.2e9)) return INT64_MAX;  // infinite (or beyond what fits): never expires
  return static_cast<int64_t>(seconds * 1e9);
}

}  // namespace

Result<RingGeometry> DeviceStreamedStaging::geometry_for(size_t budget_bytes, int world_size) {
  auto geometry = RingGeometry::for_budget(budget_bytes, world_size, kMaxDeviceChunkPayloadBytes);
  if (!geometry.ok()) return geometry.status();
  RingGeometry g = geometry.value();
  // The outbox and the counters come out of the same budget: shallower rings where needed.
  while (bytes_for(g, world_size) > budget_bytes && g.depth > 1) --g.depth;
  if (bytes_for(g, world_size) > budget_bytes) {
    return Status::InvalidArgument(
        "staging budget of " + std::to_string(budget_bytes) + " bytes is too small for " +
        std::to_string(world_size) + " ranks on a device transport: one slot per sender, the " +
        "signals, the outbox and the fold's counters need " +
        std::to_string(bytes_for(g, world_size)) +
        " bytes (raise ODC_STAGING_BYTES or the config's staging_bytes)");
  }
  return g;
}

size_t DeviceStreamedStaging::bytes_for(const RingGeometry& geometry, int world_size) {
  return geometry.total_bytes(world_size) + extra_bytes(geometry, world_size);
}

Result<std::unique_ptr<StreamedStaging>> DeviceStreamedStaging::create(Transport& transport,
                                                                       size_t budget_bytes) {
  DeviceStagingOps* device = transport.device_staging();
  if (device == nullptr) {
    return Status::InternalError(
        "this stream-ordered transport has no device staging (no fold on its device)");
  }
  const int world_size = transport.world_size();
  auto geometry = geometry_for(budget_bytes, world_size);
  if (!geometry.ok()) return geometry.status();
  const RingGeometry g = geometry.value();
  size_t sizes[kNumRegions];
  sizes[kRings] = g.ring_bytes() * static_cast<size_t>(world_size);
  for (Region signals : {kArrivals, kCredits, kEndSequences, kEndMarks, kMeetings}) {
    sizes[signals] = static_cast<size_t>(world_size) * sizeof(uint64_t);  // a word per peer
  }
  sizes[kFolded] = fold_words(world_size) * sizeof(uint64_t);
  sizes[kOutbox] = kOutboxSlots * g.slot_bytes;
  std::vector<std::unique_ptr<SymmetricRegion>> regions;
  for (size_t bytes : sizes) {
    auto made = transport.allocate(bytes);  // zeroed
    if (!made.ok()) return made.status();
    regions.push_back(std::move(made).value());
  }
  return std::unique_ptr<StreamedStaging>(
      new DeviceStreamedStaging(transport, *device, g, std::move(regions)));
}

DeviceStreamedStaging::DeviceStreamedStaging(Transport& transport, DeviceStagingOps& device,
                                             RingGeometry geometry,
                                             std::vector<std::unique_ptr<SymmetricRegion>> regions)
    : StreamedStaging(geometry, transport.rank(), transport.world_size()),
      transport_(transport),
      device_(device),
      regions_(std::move(regions)),
      sent_(static_cast<size_t>(world_size_), 0) {}

size_t DeviceStreamedStaging::allocated_bytes() const {
  size_t bytes = 0;
  for (const auto& region : regions_) bytes += region->bytes();
  return bytes;
}

Result<uint64_t> DeviceStreamedStaging::credit_waits() const {
  uint64_t waits = 0;
  ODC_RETURN_IF_ERROR(device_.read_local(&waits, words(kFolded) + world_size_, sizeof(waits)));
  return waits;
}

Status DeviceStreamedStaging::set_targets(const std::vector<kernels::FoldTarget>& targets) {
  if (targets.size() > static_cast<size_t>(kernels::kMaxFoldTargets)) {
    return Status::InvalidArgument(
        "the device's streamed fold adds into at most " + std::to_string(kernels::kMaxFoldTargets) +
        " accumulators per communicator; this one " + "would have " +
        std::to_string(targets.size()) + " (group parameters into fewer accumulators)");
  }
  // The progress thread's passes take the table from here on (a freed accumulator's is gone
  // before its memory: Communicator::release drains the device after this).
  const std::lock_guard<std::mutex> lock(progress_mutex_);
  targets_ = targets;
  return Status::Ok();
}

std::vector<kernels::FoldTarget> DeviceStreamedStaging::targets() const {
  const std::lock_guard<std::mutex> lock(progress_mutex_);
  return targets_;
}

kernels::StreamedFold DeviceStreamedStaging::fold_of(kernels::FoldUntil until, int peer,
                                                     uint64_t value, int ends_from,
                                                     int ends_to) const {
  kernels::StreamedFold f;
  f.rings = static_cast<const char*>(region(kRings).local());
  f.slot_bytes = geometry_.slot_bytes;
  f.depth = geometry_.depth;
  f.arrivals = words(kArrivals);
  f.end_marks = words(kEndMarks);
  f.end_sequences = words(kEndSequences);
  f.meetings = words(kMeetings);
  f.credits = words(kCredits);
  f.folded = words(kFolded);
  f.credit_slots = words(kCredits);
  f.credit_waits = words(kFolded) + world_size_;
  f.locks = words(kFolded) + world_size_ + 1;
  f.ended = words(kFolded) + 2 * world_size_ + 1;
  f.ends_from = ends_from;
  f.ends_to = ends_to;
  f.rank = rank_;
  f.world_size = world_size_;
  f.minibatch = minibatch_;
  f.until = until;
  f.peer = peer;
  f.value = value;
  f.timeout_ns = timeout_ns(transport_);
  f.num_targets = static_cast<int>(targets_.size());
  std::copy(targets_.begin(), targets_.end(), f.targets);
  return f;
}

Status DeviceStreamedStaging::fold(kernels::FoldUntil until, int peer, uint64_t value,
                                   StreamHandle stream, int ends_from, int ends_to) {
  {
    const std::lock_guard<std::mutex> lock(progress_mutex_);
    ODC_RETURN_IF_ERROR(progress_failure_);
  }
  if (world_size_ < 2) return Status::Ok();  // no sender but itself: nothing ever arrives
  return device_.fold_streamed(fold_of(until, peer, value, ends_from, ends_to), stream);
}

Status DeviceStreamedStaging::begin(uint64_t minibatch, StreamHandle stream) {
  // The passes fold into sums the caller zeroed on `stream`: the background stream runs them
  // after it.
  auto background = transport_.fork_background(stream);
  if (!background.ok()) return background.status();
  lane_joined_.reset();
  const std::lock_guard<std::mutex> lock(progress_mutex_);
  minibatch_ = minibatch;
  progress_stream_ = background.value();
  progress_open_ = true;
  progress_until_ = std::chrono::steady_clock::time_point::max();
  return Status::Ok();
}

Status DeviceStreamedStaging::end_progress(StreamHandle stream) {
  {
    // Waits for a pass being enqueued now; none is enqueued after.
    const std::lock_guard<std::mutex> lock(progress_mutex_);
    progress_open_ = false;
  }
  // Every pass enqueued so far runs before what `stream` runs next (the minibatch_begin barrier,
  // after which peers push the next minibatch, whose chunks a pass of this one would refuse).
  return transport_.join_background(stream);
}

bool DeviceStreamedStaging::progress() {
  const std::lock_guard<std::mutex> lock(progress_mutex_);
  if (!progress_open_ || !progress_failure_.ok() || world_size_ < 2) return progress_open_;
  if (std::chrono::steady_clock::now() > progress_until_) return false;
  // One pass over what has arrived, on the background stream: it runs beside the caller's
  // stream, whatever that waits in (a collective, a long kernel), so senders waiting for this
  // rank's credit move on. Skipped while the last pass has not run yet.
  auto enqueued = enqueue_pass();
  if (!enqueued.ok()) {
    progress_failure_ =
        enqueued.with_context("while its progress thread enqueued a fold (outside its calls)");
  }
  return true;
}

Status DeviceStreamedStaging::enqueue_pass() {
  kernels::StreamedFold pass = fold_of(kernels::FoldUntil::kOnce, 0, 0);
  pass.leave_unknown = true;  // its table may be older than a peer's newest accumulator
  auto enqueued = device_.fold_streamed_if_idle(pass, progress_stream_);
  return enqueued.ok() ? Status::Ok() : enqueued.status();
}

Status DeviceStreamedStaging::fold_beside() {
  const std::lock_guard<std::mutex> lock(progress_mutex_);
  ODC_RETURN_IF_ERROR(progress_failure_);
  if (!progress_open_ || world_size_ < 2) return Status::Ok();
  return enqueue_pass();
}

Status DeviceStreamedStaging::add_local(uint64_t target_id, uint64_t first, const void* data,
                                        DataType dtype, size_t count, StreamHandle stream) {
  auto found = std::find_if(targets_.begin(), targets_.end(),
                            [&](const kernels::FoldTarget& t) { return t.buffer_id == target_id; });
  if (found == targets_.end() || first > found->count || count > found->count - first) {
    return Status::InternalError("no live fold target with id " + std::to_string(target_id) +
                                 " and elements [" + std::to_string(first) + ", " +
                                 std::to_string(first + count) + ") to add into");
  }
  return transport_.accumulate(found->sums + first, data, dtype, count, stream);
}

Status DeviceStreamedStaging::send_chunk(int owner, uint64_t buffer_id, uint64_t first,
                                         const void* data, DataType dtype, size_t count,
                                         StreamHandle stream) {
  const auto o = static_cast<size_t>(owner);
  const uint64_t sequence = sent_[o] + 1;
  // What arrived here is folded beside this rank's sends: the caller's stream only waits for a
  // slot that is still taken, packs and puts (before, a fold ran on it between every two
  // chunks). One pass per slot's worth of bytes sent: per chunk where chunks are whole slots,
  // not a launch (and, emulated, a scan of every sender) per chunk of a tiny slice.
  const size_t bytes = count * element_bytes(dtype);
  bytes_since_pass_ += bytes;
  if (bytes_since_pass_ >= geometry_.payload_bytes()) {
    bytes_since_pass_ = 0;
    ODC_RETURN_IF_ERROR(fold_beside());
  }
  // The slot was last used by sequence - depth: wait (on the device, folding meanwhile) until
  // the owner consumed it.
  if (sequence > geometry_.depth) {
    ODC_RETURN_IF_ERROR(
        fold(kernels::FoldUntil::kCredit, owner, sequence - geometry_.depth, stream));
  }
  // Packed on the caller's stream (which then may reuse `data`) into the outbox slot after the
  // last one, once the lane's put of the chunk packed there before has run; put from the lane,
  // so that it moves while the caller's stream packs the next chunk or adds the push's own slice.
  const int turn = static_cast<int>(outbox_turns_ % kOutboxSlots);
  char* outbox = static_cast<char*>(region(kOutbox).local()) + turn * geometry_.slot_bytes;
  ODC_RETURN_IF_ERROR(device_.wait_sends(turn, stream));
  ODC_RETURN_IF_ERROR(device_.pack_chunk(
      outbox, chunk_header(sequence, buffer_id, first, count, dtype), data, bytes, stream));
  auto lane = device_.fork_sends(stream);
  if (!lane.ok()) return lane.status();
  lane_joined_.reset();
  const size_t slot = geometry_.slot_offset(rank_, sequence);
  // The signal follows its data: the owner sees the chunk whole. One lane: every put to an owner
  // lands in sequence order, so an arrival signal never runs ahead of an earlier chunk's data.
  const Status put =
      transport_.put_signal(outbox, region(kRings), owner, slot, kChunkHeaderBytes + bytes,
                            region(kArrivals), sequence, lane.value());
  // Marked and turned whatever the put returned: one queued before its error surfaced still
  // reads this slot, so the next pack into it must wait for it.
  const Status marked = device_.mark_sends(turn);
  ++outbox_turns_;
  ODC_RETURN_IF_ERROR(put);
  ODC_RETURN_IF_ERROR(marked);
  sent_[o] = sequence;
  ++chunks_sent_;
  return Status::Ok();
}

Status DeviceStreamedStaging::join_sends(StreamHandle stream) {
  // Once per stream and batch of puts inside one minibatch_end, which ends the sequence at every
  // owner in turn on one stream from one thread. Not across calls: one handle value may name
  // another stream there (cudaStreamPerThread on another thread, a stream made anew at a freed
  // one's address), so wait_ends() and begin() forget the join.
  if (lane_joined_.has_value() && *lane_joined_ == stream) return Status::Ok();
  ODC_RETURN_IF_ERROR(device_.join_sends(stream));
  lane_joined_ = stream;
  return Status::Ok();
}

Status DeviceStreamedStaging::fold_arrived(StreamHandle stream) {
  return fold(kernels::FoldUntil::kOnce, 0, 0, stream);
}

Status DeviceStreamedStaging::end_at(int owner, StreamHandle stream) {
  // The end takes a sequence number but no slot: it never waits for credit. Its sequence first,
  // then the mark that says it is this minibatch's (each after every earlier put).
  const auto o = static_cast<size_t>(owner);
  sent_[o] += 1;
  // After every chunk's put (the lane's): the end covers them all.
  ODC_RETURN_IF_ERROR(join_sends(stream));
  ODC_RETURN_IF_ERROR(transport_.signal(region(kEndSequences), owner, sent_[o], stream));
  return transport_.signal(region(kEndMarks), owner, minibatch_, stream);
}

Status DeviceStreamedStaging::wait_ends(int from, int to, StreamHandle stream) {
  lane_joined_.reset();
  {
    const std::lock_guard<std::mutex> lock(progress_mutex_);
    const auto timeout = transport_.timeout();
    progress_until_ =
        timeout.count() < 1e9
            ? std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout)
            : std::chrono::steady_clock::time_point::max();
  }
  return fold(kernels::FoldUntil::kEnds, 0, minibatch_, stream, from, to);
}

Status DeviceStreamedStaging::meet(const char*, StreamHandle stream) {
  ++meetings_entered_;
  // Everything put before a meeting is there once it is over: the lane's puts first (always:
  // the join-once of minibatch_end holds only inside one finish()).
  ODC_RETURN_IF_ERROR(device_.join_sends(stream));
  for (int i = 0; i < world_size_; ++i) {
    const int peer = (rank_ + 1 + i) % world_size_;
    if (peer != rank_) {
      ODC_RETURN_IF_ERROR(transport_.signal(region(kMeetings), peer, meetings_entered_, stream));
    }
  }
  return fold(kernels::FoldUntil::kMeetings, 0, meetings_entered_, stream);
}

}  // namespace odc
