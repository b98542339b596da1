// gather: every rank pulls every owner's shard into its own full buffer through one SM kernel
// reading peer memory (the copy-engine variant lost: dev/cuda_lab). Owners take no part; the
// caller's stream orders everything.
#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 512;

struct CopyJobs {
  char* dst[kMaxRanks];
  const char* src[kMaxRanks];
  const WaitError* error;  // when set and holding an error: copy nothing
};

// blockIdx.y picks the job (one per owner); the blocks of that column split it.
__global__ void __launch_bounds__(kThreads) multi_copy_kernel(CopyJobs jobs, size_t bytes) {
  if (jobs.error != nullptr && *reinterpret_cast<const volatile int32_t*>(&jobs.error->site) != 0)
    return;
  const int job = blockIdx.y;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  detail::copy_bytes(detail::pick(jobs.dst, job), detail::pick(jobs.src, job), bytes, tid,
                     num_threads);
}

}  // namespace

cudaError_t gather_sm(void* dst, const PeerPointers& shards, size_t shard_bytes,
                      const RankInfo& info, int num_blocks, cudaStream_t stream,
                      const WaitError* error) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  if (shard_bytes == 0) return cudaSuccess;
  CopyJobs jobs{};
  jobs.error = error;
  for (int i = 0; i < info.num_ranks; ++i) {
    const int owner = (info.rank + 1 + i) % info.num_ranks;
    jobs.dst[i] = static_cast<char*>(dst) + owner * shard_bytes;
    jobs.src[i] = static_cast<const char*>(shards.ptr[owner]);
  }
  const dim3 grid(detail::auto_blocks(info, num_blocks, info.num_ranks, shard_bytes),
                  info.num_ranks);
  multi_copy_kernel<<<grid, kThreads, 0, stream>>>(jobs, shard_bytes);
  return cudaGetLastError();
}

}  // namespace odc::kernels
