// The ODC protocol on top of a Transport: symmetric buffers, gather, scatter-accumulate and the
// one synchronization per minibatch. Invariants:
//   - a pushed contribution is added exactly once at its owner: each sender writes only its own
//     fp32 slot at each owner (no two writers share memory), and owners fold the slots into the
//     accumulator only after the minibatch-end barrier has ordered every push before the fold;
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

// A symmetric buffer: `count` elements of `dtype` on every rank. Accumulators are fp32 and carry
// one staging slot per sender at their owner.
struct Buffer {
  const Communicator* owner = nullptr;
  uint64_t id = 0;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  bool accumulator = false;
  std::unique_ptr<SymmetricRegion> data;   // the shard, count elements
  std::unique_ptr<SymmetricRegion> slots;  // accumulators only: world_size x count fp32

  void* local() const { return data->local(); }
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
  // the buffer's dtype.
  Status gather(void* dst, size_t dst_count, const Buffer* buffer);
  // For every owner r: accumulator@r += src[r*count:(r+1)*count] (fp32 accumulation).
  Status scatter_accumulate(const void* src, size_t src_count, DataType src_dtype,
                            Buffer* accumulator);
  Status minibatch_begin();  // collective: zero own accumulators, then meet every rank
  Status minibatch_end();    // collective: returns when every push is applied everywhere
  Status barrier();          // collective

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
