// The transport interface: what the ODC protocol (core/communicator) needs from a backend.
// A transport moves bytes between ranks and synchronizes them; it knows nothing of minibatches,
// shards or accumulators. Backends: transport/shm (host shared memory), later CUDA and NVSHMEM.
// Invariant: collective calls (exchange, allocate, barrier, release) are made by every rank in the
// same order; a transport reports a mismatch or a missing rank as an error, never a hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "core/dtype.h"

namespace odc {

// Which collective a rank is in: ranks that meet in different collectives fail with a message
// naming both, instead of silently pairing up.
enum class CollectiveOp : uint32_t {
  kInit = 1,
  kExchange,
  kAllocate,
  kRelease,
  kMinibatchBegin,
  kMinibatchEnd,
  kMinibatchApplied,
  kBarrier,
};

const char* collective_op_name(CollectiveOp op);

// Memory of the same size on every rank; peer(r) is rank r's copy as addressable from this rank.
class SymmetricRegion {
 public:
  virtual ~SymmetricRegion() = default;
  void* local() const { return peers_[local_rank_]; }
  void* peer(int rank) const { return peers_[static_cast<size_t>(rank)]; }
  size_t bytes() const { return bytes_; }

 protected:
  SymmetricRegion(std::vector<void*> peers, int local_rank, size_t bytes)
      : peers_(std::move(peers)), local_rank_(static_cast<size_t>(local_rank)), bytes_(bytes) {}

 private:
  std::vector<void*> peers_;
  size_t local_rank_;
  size_t bytes_;
};

// A small fixed-size record every rank contributes to exchange() (big enough for a CUDA IPC
// handle or an NCCL unique id).
struct ExchangeRecord {
  uint64_t words[16] = {};
};

// Where stream-ordered transports enqueue work (a cudaStream_t); host transports ignore it.
using StreamHandle = void*;

// An fp32 accumulator of `count` elements per rank, plus whatever the transport needs so that
// pushes from every rank land exactly once (staging slots, signals, ...).
class AccumulatorRegion {
 public:
  virtual ~AccumulatorRegion() = default;
  virtual float* local() const = 0;                 // this rank's sums, valid after settle()
  virtual const SymmetricRegion& sums() const = 0;  // every rank's accumulator, for gather
  size_t count() const { return count_; }

 protected:
  explicit AccumulatorRegion(size_t count) : count_(count) {}

 private:
  size_t count_;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Collective, host-blocking: every rank contributes `mine`; returns all records in rank order.
  virtual Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) = 0;

  // Collective, host-blocking: `bytes` (> 0, equal on every rank; callers check with exchange()
  // first) of zeroed memory on every rank, mapped so that each rank can address every peer's copy.
  virtual Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) = 0;
  virtual Result<std::unique_ptr<AccumulatorRegion>> allocate_accumulator(size_t count) = 0;

  // Collective: every rank must call barrier() with the same `op`. Work issued before it on
  // every rank (copies, pushes) is complete and visible after it. Stream-ordered transports may
  // return before the barrier completes; its failure then surfaces from poll_error().
  virtual Status barrier(CollectiveOp op, StreamHandle stream) = 0;

  // A failure detected asynchronously (a device-side wait that expired), or Ok.
  virtual Status poll_error() = 0;

  // Marks this rank failed with `reason`, so peers waiting on it fail at once instead of timing
  // out. Idempotent.
  virtual void mark_failed(const std::string& reason) = 0;

  // dst[r*shard_bytes:(r+1)*shard_bytes] = shards.peer(r)[0:shard_bytes], for every rank r.
  virtual Status gather(void* dst, const SymmetricRegion& shards, size_t shard_bytes,
                        StreamHandle stream) = 0;
  // Zeroes this rank's accumulator before a minibatch (no peer may push into it until the
  // following barrier).
  virtual Status reset(AccumulatorRegion& accumulator, StreamHandle stream) = 0;
  // For every owner r: accumulator@r += src[r*count:(r+1)*count] in fp32. Concurrent with every
  // other rank's pushes.
  virtual Status push(const void* src, DataType src_type, AccumulatorRegion& accumulator,
                      StreamHandle stream) = 0;
  // After a barrier that ordered every rank's pushes: make this rank's sums final.
  virtual Status settle(AccumulatorRegion& accumulator, StreamHandle stream) = 0;
};

}  // namespace odc
