// Kernel variants that lost in dev/cuda_lab and that the product does not run: gather through
// copy engines, and the per-push staged scatter-accumulate (copy into per-sender slots, owner
// accumulates on a device flag). Kept with their lab for re-measurement; docs/cuda_lab.md has the
// numbers. Same conventions as src/kernels/kernels.h (raw pointers, counts, a stream).
#pragma once

#include <cuda_runtime.h>

#include "kernels/kernels.h"

namespace odc::kernels {

// Auxiliary streams on the current device (one per rank) and the events that fork them from and
// join them back to the caller's stream, for the copy-engine variants.
struct CopyEngineSet {
  int num_streams = 0;
  cudaStream_t streams[kMaxRanks] = {};
  cudaEvent_t fork = nullptr;
  cudaEvent_t joined[kMaxRanks] = {};
};
cudaError_t copy_engine_set_create(CopyEngineSet* set, int num_streams);
cudaError_t copy_engine_set_destroy(CopyEngineSet* set);

// ---- gather ----------------------------------------------------------------------------------
// (a) one cudaMemcpyAsync per rank, each on its own stream of `engines` (no SMs used).
cudaError_t gather_copy_engine(void* dst, const PeerPointers& shards, size_t shard_bytes,
                               const RankInfo& info, const CopyEngineSet& engines,
                               cudaStream_t stream);
// ---- scatter-accumulate ----------------------------------------------------------------------
// (b) staged push: the caller copies owner r's slice into its own slot of r's staging buffer,
// then raises r's ready flag; then, on its own device, waits for every sender's slot, adds all
// of them plus its own slice into its accumulator, and releases the slots (freed flags). Before
// pushing push `seq` it waits until the owner has released push seq-1. Calls on every rank must
// use the same sequence 1, 2, 3, ... (all ranks call it the same number of times).
enum class PushEngine : int32_t { kCopyEngine = 0, kSm = 1 };
struct StagedBuffers {
  PeerPointers staging;  // per rank: staging_bytes(...) bytes of device memory
  PeerPointers signals;  // per rank: one SignalBlock
  PeerPointers accs;  // per rank: the fp32 accumulator (slots are laid out to match its alignment)
};
size_t staging_slot_bytes(size_t shard_elems, ElemType src_type);
size_t staging_bytes(size_t shard_elems, ElemType src_type, int num_ranks);
cudaError_t scatter_accumulate_staged(const void* src, ElemType src_type,
                                      const StagedBuffers& buffers, size_t shard_elems,
                                      const RankInfo& info, uint64_t seq, PushEngine engine,
                                      const CopyEngineSet* engines, int num_blocks,
                                      int64_t timeout_ns, WaitError* error, cudaStream_t stream);

}  // namespace odc::kernels
