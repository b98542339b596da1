// scatter-accumulate: each rank adds owner r's slice of its source into r's fp32 accumulator by
// remote vectorized fp32 reductions through peer pointers (atomic at system scope, so any number
// of ranks may push concurrently). The per-push staged variant lost: dev/cuda_lab.
#include <cuda_bf16.h>

#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 512;

struct ReduceJobs {
  float* acc[kMaxRanks];
  const void* src[kMaxRanks];
  // When set and holding an error: do nothing (a failed barrier must not be followed by writes
  // into peers that may be gone).
  const WaitError* error;
};

template <typename T, bool kSys>
__device__ __forceinline__ void reduce_into(float* acc, const T* src, size_t n, size_t tid,
                                            size_t num_threads) {
  using Raw = typename detail::Vec4<T>::Raw;
  // Scalar head until acc is 16-byte aligned; the vector path also needs src aligned there.
  size_t head =
      min(n, static_cast<size_t>(((16 - (reinterpret_cast<uintptr_t>(acc) & 15)) & 15) / 4));
  if (reinterpret_cast<uintptr_t>(src + head) % sizeof(Raw) != 0) head = n;
  for (size_t i = tid; i < head; i += num_threads)
    detail::red_add<kSys>(acc + i, detail::to_float(src[i]));
  if (head == n) return;
  const size_t num_vec = (n - head) / 4;
  const Raw* vs = reinterpret_cast<const Raw*>(src + head);
  float* va = acc + head;
  constexpr int kUnroll = 4;
  size_t i = tid;
  for (; i + (kUnroll - 1) * num_threads < num_vec; i += kUnroll * num_threads) {
    Raw r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = vs[i + u * num_threads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      detail::red_add_v4<kSys>(va + 4 * (i + u * num_threads), detail::Vec4<T>::to_float4(r[u]));
  }
  for (; i < num_vec; i += num_threads)
    detail::red_add_v4<kSys>(va + 4 * i, detail::Vec4<T>::to_float4(vs[i]));
  for (size_t j = head + num_vec * 4 + tid; j < n; j += num_threads)
    detail::red_add<kSys>(acc + j, detail::to_float(src[j]));
}

template <typename T, bool kSys>
__global__ void __launch_bounds__(kThreads) reduce_kernel(ReduceJobs jobs, size_t n) {
  if (jobs.error != nullptr && *reinterpret_cast<const volatile int32_t*>(&jobs.error->site) != 0)
    return;
  const int job = blockIdx.y;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  reduce_into<T, kSys>(detail::pick(jobs.acc, job),
                       static_cast<const T*>(detail::pick(jobs.src, job)), n, tid, num_threads);
}

}  // namespace

cudaError_t scatter_accumulate_reduce(const void* src, ElemType src_type, const PeerPointers& accs,
                                      size_t shard_elems, const RankInfo& info, int num_blocks,
                                      cudaStream_t stream, bool sys_scope, const WaitError* error) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  if (shard_elems == 0) return cudaSuccess;
  const size_t eb = elem_bytes(src_type);
  ReduceJobs jobs{};
  jobs.error = error;
  for (int i = 0; i < info.num_ranks; ++i) {
    const int owner = (info.rank + 1 + i) % info.num_ranks;
    if (reinterpret_cast<uintptr_t>(accs.ptr[owner]) % 4 != 0) return cudaErrorMisalignedAddress;
    jobs.acc[i] = static_cast<float*>(accs.ptr[owner]);
    jobs.src[i] = static_cast<const char*>(src) + owner * shard_elems * eb;
  }
  const dim3 grid(detail::auto_blocks(info, num_blocks, info.num_ranks, shard_elems * eb),
                  info.num_ranks);
  if (src_type == ElemType::kFloat32) {
    if (sys_scope)
      reduce_kernel<float, true><<<grid, kThreads, 0, stream>>>(jobs, shard_elems);
    else
      reduce_kernel<float, false><<<grid, kThreads, 0, stream>>>(jobs, shard_elems);
  } else {
    if (sys_scope)
      reduce_kernel<__nv_bfloat16, true><<<grid, kThreads, 0, stream>>>(jobs, shard_elems);
    else
      reduce_kernel<__nv_bfloat16, false><<<grid, kThreads, 0, stream>>>(jobs, shard_elems);
  }
  return cudaGetLastError();
}

}  // namespace odc::kernels
