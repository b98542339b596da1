// Put-with-signal (the CUDA transport's puts, gets and signals, the NVSHMEM transport's direct
// gathers) and local accumulation. Invariants: a signal is stored (system-scope release) only
// after every block of its put has copied its share and fenced; a rank whose error record is set
// writes nothing more (it stays silent, so its peers time out and name it).
#include <cuda_bf16.h>

#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ bool failed(const WaitError* error) {
  return error != nullptr && *reinterpret_cast<const volatile int32_t*>(&error->site) != kWaitNone;
}

// blockIdx.y picks the job; the blocks of that column split its bytes. The last block of a job to
// finish raises the job's signal.
__global__ void __launch_bounds__(kThreads)
    put_signal_kernel(PutSignalJobs jobs, size_t bytes, uint64_t value, uint32_t* done,
                      const WaitError* error) {
  if (failed(error)) return;
  const int job = blockIdx.y;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  detail::copy_bytes(static_cast<char*>(detail::pick(jobs.dst, job)),
                     static_cast<const char*>(detail::pick(jobs.src, job)), bytes, tid,
                     num_threads);
  uint64_t* signal = detail::pick(jobs.signal, job);
  if (signal == nullptr) return;
  // As in cooperative groups' grid sync: the block barrier orders the block's stores before
  // thread 0's system fence, which orders them before the arrival on the job's counter.
  __syncthreads();
  if (gridDim.x == 1) {
    // One block (a signal alone): no counter, so launches on different streams (a background
    // node fetch's signals beside the caller's) never share one.
    if (threadIdx.x == 0) {
      __threadfence_system();
      detail::st_release_sys(signal, value);
    }
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence_system();
    const uint32_t prev = atomicAdd(&done[job], 1u);
    if (prev == gridDim.x - 1) {
      done[job] = 0;  // the next launch that uses it is ordered after this one by the stream
      __threadfence_system();
      detail::st_release_sys(signal, value);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    accumulate_local_kernel(float* dst, const T* src, size_t n, const WaitError* error) {
  if (failed(error)) return;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] += detail::to_float(src[i]);
}

__global__ void wait_slots_kernel(const uint64_t* slots, SlotWaits waits, uint64_t value, int rank,
                                  int32_t site, int64_t timeout_ns, const uint64_t* peer_failed,
                                  WaitError* error) {
  const int j = threadIdx.x;
  if (j >= waits.num || detail::failed_before(error)) return;
  const int peer = waits.peer[j];
  const uint64_t start = detail::global_timer_ns();
  for (;;) {
    const uint64_t seen = detail::ld_acquire_sys(slots + peer);
    if (seen >= value) return;
    if (detail::failed_before(error)) return;  // another wait failed: stop, it is recorded
    if (peer_failed != nullptr &&
        detail::ld_acquire_sys(peer_failed + peer) == kBarrierPeerFailed) {
      detail::record_error(error, kWaitFetchPeerFailed, rank, peer, value, seen);
      return;
    }
    if (static_cast<int64_t>(detail::global_timer_ns() - start) > timeout_ns) {
      detail::record_error(error, site, rank, peer, value, seen);
      return;
    }
  }
}

int elementwise_blocks(const RankInfo& info, size_t n) {
  const size_t wanted = (n + kThreads - 1) / kThreads;
  const size_t most = static_cast<size_t>(4 * (info.num_sms > 0 ? info.num_sms : 132));
  const size_t blocks = wanted < most ? wanted : most;
  return blocks > 0 ? static_cast<int>(blocks) : 1;
}

}  // namespace

cudaError_t put_signal(const PutSignalJobs& jobs, size_t bytes, uint64_t value, uint32_t* done,
                       const RankInfo& info, const WaitError* error, cudaStream_t stream) {
  if (jobs.num_jobs < 1 || jobs.num_jobs > kMaxRanks || done == nullptr)
    return cudaErrorInvalidValue;
  const dim3 grid(bytes == 0 ? 1 : detail::auto_blocks(info, 0, jobs.num_jobs, bytes),
                  jobs.num_jobs);
  put_signal_kernel<<<grid, kThreads, 0, stream>>>(jobs, bytes, value, done, error);
  return cudaGetLastError();
}

cudaError_t wait_slots(const uint64_t* slots, const SlotWaits& waits, uint64_t value, int rank,
                       int32_t site, int64_t timeout_ns, const uint64_t* peer_failed,
                       WaitError* error, cudaStream_t stream) {
  if (waits.num < 1 || waits.num > kMaxRanks || slots == nullptr || error == nullptr) {
    return cudaErrorInvalidValue;
  }
  wait_slots_kernel<<<1, kMaxRanks, 0, stream>>>(slots, waits, value, rank, site, timeout_ns,
                                                 peer_failed, error);
  return cudaGetLastError();
}

cudaError_t accumulate_local(float* dst, const void* src, ElemType src_type, size_t n,
                             const RankInfo& info, const WaitError* error, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = elementwise_blocks(info, n);
  if (src_type == ElemType::kFloat32) {
    accumulate_local_kernel<float>
        <<<blocks, kThreads, 0, stream>>>(dst, static_cast<const float*>(src), n, error);
  } else {
    accumulate_local_kernel<__nv_bfloat16>
        <<<blocks, kThreads, 0, stream>>>(dst, static_cast<const __nv_bfloat16*>(src), n, error);
  }
  return cudaGetLastError();
}

}  // namespace odc::kernels
