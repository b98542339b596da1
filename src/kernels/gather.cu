// gather: every rank pulls every owner's shard into its own full buffer, through copy engines
// (one stream per owner, forked from and joined back to the caller's stream) or through one SM
// kernel reading peer memory. Owners take no part; the caller's stream orders everything.
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

cudaError_t copy_engine_set_create(CopyEngineSet* set, int num_streams) {
  if (set == nullptr || num_streams < 1 || num_streams > kMaxRanks) return cudaErrorInvalidValue;
  *set = CopyEngineSet{};
  set->num_streams = num_streams;
  ODC_CUDA_TRY(cudaEventCreateWithFlags(&set->fork, cudaEventDisableTiming));
  for (int i = 0; i < num_streams; ++i) {
    ODC_CUDA_TRY(cudaStreamCreateWithFlags(&set->streams[i], cudaStreamNonBlocking));
    ODC_CUDA_TRY(cudaEventCreateWithFlags(&set->joined[i], cudaEventDisableTiming));
  }
  return cudaSuccess;
}

cudaError_t copy_engine_set_destroy(CopyEngineSet* set) {
  if (set == nullptr) return cudaErrorInvalidValue;
  cudaError_t first = cudaSuccess;
  auto keep = [&first](cudaError_t e) {
    if (first == cudaSuccess) first = e;
  };
  for (int i = set->num_streams - 1; i >= 0; --i) {
    if (set->joined[i] != nullptr) keep(cudaEventDestroy(set->joined[i]));
    if (set->streams[i] != nullptr) keep(cudaStreamDestroy(set->streams[i]));
  }
  if (set->fork != nullptr) keep(cudaEventDestroy(set->fork));
  *set = CopyEngineSet{};
  return first;
}

cudaError_t gather_copy_engine(void* dst, const PeerPointers& shards, size_t shard_bytes,
                               const RankInfo& info, const CopyEngineSet& engines,
                               cudaStream_t stream) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks || engines.num_streams < info.num_ranks)
    return cudaErrorInvalidValue;
  if (shard_bytes == 0) return cudaSuccess;
  ODC_CUDA_TRY(cudaEventRecord(engines.fork, stream));
  for (int i = 0; i < info.num_ranks; ++i) {
    // Start with the next rank so that the ranks' first reads go to different owners.
    const int owner = (info.rank + 1 + i) % info.num_ranks;
    cudaStream_t s = engines.streams[i];
    ODC_CUDA_TRY(cudaStreamWaitEvent(s, engines.fork, 0));
    ODC_CUDA_TRY(cudaMemcpyAsync(static_cast<char*>(dst) + owner * shard_bytes, shards.ptr[owner],
                                 shard_bytes, cudaMemcpyDefault, s));
    ODC_CUDA_TRY(cudaEventRecord(engines.joined[i], s));
    ODC_CUDA_TRY(cudaStreamWaitEvent(stream, engines.joined[i], 0));
  }
  return cudaSuccess;
}

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
