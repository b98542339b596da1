// The ODC protocol on top of a Transport: symmetric buffers, gather, scatter-accumulate and the
// one synchronization per minibatch. Invariants:
//   - a pushed contribution is added exactly once at its owner: the transport lands each push
//     (host: in the sender's own staging slot; GPU: by remote fp32 reductions), and owners
//     settle their sums only after the minibatch-end barrier has ordered every push before it;
//   - a failed call that is the caller's mistake changes nothing; a failure of another rank or a
//     timeout leaves the communicator failed (every later call reports the original error).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "common/status.h"
#include "core/dtype.h"
#include "core/transport.h"

namespace odc {

class Communicator;

// A symmetric buffer: `count` elements of `dtype` on every rank. Accumulators are fp32 and hold
// whatever their transport needs to land pushes.
struct Buffer {
  uint64_t id = 0;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  std::unique_ptr<SymmetricRegion> data;            // plain buffers
  std::unique_ptr<AccumulatorRegion> accumulation;  // accumulators

  bool is_accumulator() const { return accumulation != nullptr; }
  const SymmetricRegion& shards() const { return data ? *data : accumulation->sums(); }
  void* local() const { return shards().local(); }
  size_t bytes() const { return count * element_bytes(dtype); }
};

enum class CommState {
  kReady,        // between minibatches
  kInMinibatch,  // after minibatch_begin, before minibatch_end
  kFailed,       // a peer died, a wait timed out, or ranks disagreed: unusable
};

class Communicator {
 public:
  explicit Communicator(std::unique_ptr<Transport> transport);
  ~Communicator();

  int rank() const { return transport_->rank(); }
  int world_size() const { return transport_->world_size(); }
  CommState state() const { return state_; }

  // Collective. Every rank must ask for the same count, dtype and kind.
  Result<Buffer*> allocate(size_t count, DataType dtype, bool accumulator);
  // Collective. `buffer` is invalid afterwards.
  Status release(Buffer* buffer);
  // dst[r*count:(r+1)*count] = rank r's shard, for all r; dst holds world_size*count elements of
  // the buffer's dtype. `stream` orders the work on stream-ordered transports.
  Status gather(void* dst, size_t dst_count, const Buffer* buffer, StreamHandle stream);
  // For every owner r: accumulator@r += src[r*count:(r+1)*count] (fp32 accumulation).
  Status scatter_accumulate(const void* src, size_t src_count, DataType src_dtype,
                            Buffer* accumulator, StreamHandle stream);
  // Collective: zero own accumulators, then meet every rank.
  Status minibatch_begin(StreamHandle stream);
  // Collective: every push of every rank is applied everywhere when it completes.
  Status minibatch_end(StreamHandle stream);
  Status barrier(StreamHandle stream);  // collective

  // Is `buffer` a live buffer of this communicator?
  bool owns(const Buffer* buffer) const;

 private:
  // Prefixes "rank R: <operation>: " to a failure and, for faults, fails the communicator.
  Status finish(const char* operation, Status status);
  Status usable(const char* operation) const;
  Status check_buffer(const char* operation, const Buffer* buffer) const;

  std::unique_ptr<Transport> transport_;
  CommState state_ = CommState::kReady;
  std::string failure_;  // the error that failed the communicator
  uint64_t next_buffer_id_ = 0;
  std::map<const Buffer*, std::unique_ptr<Buffer>> buffers_;
};

}  // namespace odc
