// The hooks only the device's streamed staging (core/device_streamed_staging.h) needs from a
// stream-ordered transport: enqueue the owner's fold, pack a chunk, read a local word. Kept out of
// the byte-mover table (core/transport.h) so that host transports neither carry nor refuse them;
// a transport hands them out through Transport::device_staging(), null where it has none.
// Invariant: every call is in this transport's memory space and stream order, like its table's.
#pragma once

#include <cstddef>

#include "common/status.h"
#include "core/transport.h"
#include "kernels/streamed_fold.h"

namespace odc {

class DeviceStagingOps {
 public:
  // Enqueues the owner's fold of the streamed staging (core/streamed_staging.h, the loop in
  // kernels/streamed_fold.cuh) on `stream`: folds arrived chunks into the targets' sums and
  // returns credits (this transport's remote write of fold.credit_slots) until fold.until holds.
  // An expired wait or a refused chunk is recorded and reported by the transport's poll_error().
  virtual Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) = 0;
  // As fold_streamed() (a one-pass fold, FoldUntil::kOnce), unless the fold this method enqueued
  // last has not finished yet: then nothing, and false. For the progress thread
  // (core/host_progress.h), which calls it on the background stream from its own thread, also
  // while a call of the caller's thread runs, and must never queue folds faster than the device
  // runs them.
  virtual Result<bool> fold_streamed_if_idle(const kernels::StreamedFold& fold,
                                             StreamHandle stream) = 0;
  // Local: dst = header (64 bytes) then src[0 : bytes], in this transport's memory, in stream
  // order.
  virtual Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src,
                            size_t bytes, StreamHandle stream) = 0;
  // Local, host-blocking: host_dst[0 : bytes] = src[0 : bytes] (this transport's memory) as it
  // is now; work queued on streams may still change it (counters).
  virtual Status read_local(void* host_dst, const void* src, size_t bytes) = 0;

  // ---- the send lane: a stream of the transport's own for the chunks' puts ---------------------
  // A chunk's put reads only the outbox, never the caller's data, so it may run beside the
  // caller's stream: the next chunk's credit wait and pack (into another outbox slot), and the
  // push's own slice, run while this chunk moves (before, one after another on one stream).
  // Local: the lane, ordered after everything enqueued on `stream` so far (made at the first
  // call). Transports whose calls complete on return give `stream` back.
  virtual Result<StreamHandle> fork_sends(StreamHandle stream) = 0;
  // Local: what the lane has enqueued so far is mark `index` (0 or 1), until marked again.
  virtual Status mark_sends(int index) = 0;
  // Local: `stream` runs on once the lane ran up to mark `index` as last set (none: at once).
  virtual Status wait_sends(int index, StreamHandle stream) = 0;
  // Local: `stream` runs on once everything enqueued on the lane so far ran.
  virtual Status join_sends(StreamHandle stream) = 0;

 protected:
  // Owned by the transport that implements it (never deleted through this interface).
  ~DeviceStagingOps() = default;
};

}  // namespace odc
