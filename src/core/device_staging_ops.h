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

 protected:
  // Owned by the transport that implements it (never deleted through this interface).
  ~DeviceStagingOps() = default;
};

}  // namespace odc
