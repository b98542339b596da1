// Lab variants for issue #47 (byte movers at the wire's speed): what limits a gather when every
// GPU gathers at once (each GPU serves N-1 readers while it reads from N-1), and whether the
// Hopper bulk-copy unit (TMA: cp.async.bulk, cp.reduce.async.bulk) moves peer bytes better than
// per-thread 16-byte loads and vector reductions. Same conventions as src/kernels/kernels.h.
// Not product code: a variant that wins here moves into src/kernels with its measurement.
#pragma once

#include <cuda_runtime.h>

#include "kernels/kernels.h"

namespace odc::kernels::lab {

// Gathers (dst[r*shard_bytes ...] = shards.ptr[r][...] for every r), one-sided pulls:
//  kLoadHint  per-thread 16-byte loads through the non-coherent path with an L2 256-byte
//             prefetch hint (ld.global.nc.L2::256B): fewer, larger read requests on the link?
//  kBulk      one thread per block drives the TMA: bulk loads from the owner into shared
//             memory (a ring of stages), bulk stores into dst; the SM's threads stay idle.
// and one that is not one-sided, as the write-path reference (what NCCL's all-gather does):
//  kWrite     every rank stores its own shard into every peer's dst (all ranks must call it,
//             `dsts` holds every rank's dst); a rank's dst is complete once every rank's kernel
//             has finished.
enum class GatherVariant : int { kLoadHint = 0, kBulk = 1, kWrite = 2 };
cudaError_t gather_variant(GatherVariant variant, void* dst, const PeerPointers& dsts,
                           const PeerPointers& shards, size_t shard_bytes, const RankInfo& info,
                           int num_blocks, cudaStream_t stream);

// Scatter-accumulate by bulk reductions: the block's threads widen a chunk of the source to
// fp32 in shared memory, one thread sends it with cp.reduce.async.bulk .add.f32 into the owner's
// accumulator (the reduction runs at the owner's memory, as red.global does, but one request per
// chunk instead of one per 16 bytes). Accumulators and sources must be 16-byte aligned
// (cudaErrorMisalignedAddress otherwise); a tail below 4 elements goes through red.global.
cudaError_t scatter_accumulate_bulk(const void* src, ElemType src_type, const PeerPointers& accs,
                                    size_t shard_elems, const RankInfo& info, int num_blocks,
                                    cudaStream_t stream);

}  // namespace odc::kernels::lab
