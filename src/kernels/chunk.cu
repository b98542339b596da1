// Packing a streamed chunk (kernels/streamed_fold.h) on the sender's device: its header from the
// kernel's parameters and its payload from the pushed tensor, into this rank's outbox, from which
// the transport puts it whole into the owner's ring. After a failed wait only a header no owner
// accepts.
#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    pack_chunk_kernel(char* dst, ChunkHeader header, const char* src, size_t bytes,
                      const WaitError* error) {
  if (detail::failed_before(error)) {
    // A rank that failed (say its credit wait expired) still has puts queued behind this pack:
    // they must not deliver the outbox's previous chunk as if it were this one. A header no
    // owner accepts makes every such put refused, loudly.
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      ChunkHeader poisoned{};
      poisoned.sequence = ~uint64_t{0};
      poisoned.minibatch = ~uint64_t{0};
      *reinterpret_cast<ChunkHeader*>(dst) = poisoned;
    }
    return;
  }
  if (blockIdx.x == 0 && threadIdx.x < sizeof(ChunkHeader) / 8) {
    reinterpret_cast<uint64_t*>(dst)[threadIdx.x] =
        reinterpret_cast<const uint64_t*>(&header)[threadIdx.x];
  }
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  detail::copy_bytes(dst + sizeof(ChunkHeader), src, bytes, tid, num_threads);
}

}  // namespace

cudaError_t pack_chunk(void* dst, const ChunkHeader& header, const void* src, size_t bytes,
                       const RankInfo& info, const WaitError* error, cudaStream_t stream) {
  if (dst == nullptr || (bytes > 0 && src == nullptr)) return cudaErrorInvalidValue;
  const int blocks = detail::auto_blocks(info, 0, 1, bytes);
  pack_chunk_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<char*>(dst), header,
                                                     static_cast<const char*>(src), bytes, error);
  return cudaGetLastError();
}

}  // namespace odc::kernels
