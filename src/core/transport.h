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

// A small fixed-size record every rank contributes to exchange().
struct ExchangeRecord {
  uint64_t words[4] = {0, 0, 0, 0};
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Collective: every rank contributes `mine`; returns all records in rank order.
  virtual Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) = 0;

  // Collective: `bytes` (> 0, equal on every rank; callers check with exchange() first) of
  // zeroed memory on every rank, mapped so that each rank can address every peer's copy.
  virtual Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) = 0;

  // Collective: returns once every rank has called barrier() with the same `op`.
  virtual Status barrier(CollectiveOp op) = 0;

  // Marks this rank failed with `reason`, so peers waiting on it fail at once instead of timing
  // out. Idempotent.
  virtual void mark_failed(const std::string& reason) = 0;

  // Data movement, in the order called. dst/src may be peer addresses from a SymmetricRegion.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // dst[i] += src[i] in fp32, for `count` elements of `src_type`.
  virtual void accumulate(float* dst, const void* src, DataType src_type, size_t count) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
};

}  // namespace odc
