// Lab variants of bulk_kernels.h. The bulk (TMA) paths need sm_90; the lab builds for sm_90 only.
#include <cuda_bf16.h>

#include <algorithm>

#include "bulk_kernels.h"
#include "kernels/device_sync.cuh"

namespace odc::kernels::lab {
namespace {

constexpr int kThreads = 512;

// ---- PTX wrappers for the bulk-copy unit (sm_90) ----------------------------------------------
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void barrier_init_fence() {
  // Makes the initialized barriers visible to the async proxy that completes them.
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_load(void* smem, const void* global, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(smem)),
      "l"(global), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* global, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global),
               "r"(shared_address(smem)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_reduce_add(float* global, const void* smem, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(global),
      "r"(shared_address(smem)), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {  // smem of all but kPending groups reusable
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {  // every committed group complete
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_shared() {
  // Generic-proxy writes to shared memory become visible to the bulk unit's reads.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

struct CopyJobs {
  char* dst[kMaxRanks];
  const char* src[kMaxRanks];
};

// ---- kLoadHint ------------------------------------------------------------------------------
__device__ __forceinline__ uint4 load_hinted(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__global__ void __launch_bounds__(kThreads) hinted_copy_kernel(CopyJobs jobs, size_t bytes) {
  const int job = blockIdx.y;
  char* dst = detail::pick(jobs.dst, job);
  const char* src = detail::pick(jobs.src, job);
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t num_vec = bytes / 16;  // bases are 16-byte aligned (checked by the caller)
  const auto* vs = reinterpret_cast<const uint4*>(src);
  auto* vd = reinterpret_cast<uint4*>(dst);
  constexpr int kUnroll = 4;
  size_t i = tid;
  for (; i + (kUnroll - 1) * num_threads < num_vec; i += kUnroll * num_threads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = load_hinted(vs + i + u * num_threads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) vd[i + u * num_threads] = r[u];
  }
  for (; i < num_vec; i += num_threads) vd[i] = load_hinted(vs + i);
  for (size_t j = num_vec * 16 + tid; j < bytes; j += num_threads) dst[j] = src[j];
}

// ---- kBulk ----------------------------------------------------------------------------------
constexpr uint32_t kBulkChunk = 16 << 10;  // bytes per bulk load/store
constexpr int kBulkStages = 4;             // 64 KiB of shared memory per block

// One warp per block; lane 0 drives the bulk unit: kBulkStages - 1 loads in flight ahead of the
// store of the oldest stage, a stage reloaded once its store has read it.
__global__ void __launch_bounds__(32) bulk_copy_kernel(CopyJobs jobs, size_t bytes) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ __align__(8) uint64_t loaded[kBulkStages];
  const int job = blockIdx.y;
  char* dst = detail::pick(jobs.dst, job);
  const char* src = detail::pick(jobs.src, job);
  const size_t bulk_bytes = bytes & ~static_cast<size_t>(15);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kBulkStages; ++s) barrier_init(&loaded[s]);
    barrier_init_fence();
    const size_t num_chunks = (bulk_bytes + kBulkChunk - 1) / kBulkChunk;
    const size_t mine =
        blockIdx.x < num_chunks ? (num_chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    auto chunk_at = [&](size_t k) { return (blockIdx.x + k * gridDim.x) * kBulkChunk; };
    auto chunk_len = [&](size_t offset) {
      return static_cast<uint32_t>(min(static_cast<size_t>(kBulkChunk), bulk_bytes - offset));
    };
    auto load = [&](size_t k) {
      const int s = static_cast<int>(k % kBulkStages);
      const size_t offset = chunk_at(k);
      const uint32_t len = chunk_len(offset);
      barrier_expect(&loaded[s], len);
      bulk_load(stages + s * kBulkChunk, src + offset, len, &loaded[s]);
    };
    for (size_t k = 0; k < mine && k < kBulkStages - 1; ++k) load(k);
    for (size_t k = 0; k < mine; ++k) {
      const int s = static_cast<int>(k % kBulkStages);
      barrier_wait(&loaded[s], static_cast<uint32_t>((k / kBulkStages) & 1));
      const size_t offset = chunk_at(k);
      bulk_store(dst + offset, stages + s * kBulkChunk, chunk_len(offset));
      bulk_commit();
      // Chunk k + stages - 1 reuses the stage of chunk k - 1: its store must have read it.
      bulk_wait_read<1>();
      if (k + kBulkStages - 1 < mine) load(k + kBulkStages - 1);
    }
    bulk_wait_all();
    if (blockIdx.x == 0)
      for (size_t j = bulk_bytes; j < bytes; ++j) dst[j] = src[j];
  }
}

// ---- kWrite ---------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) write_copy_kernel(CopyJobs jobs, size_t bytes) {
  const int job = blockIdx.y;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  detail::copy_bytes(detail::pick(jobs.dst, job), detail::pick(jobs.src, job), bytes, tid,
                     num_threads);
}

// ---- bulk scatter-accumulate -----------------------------------------------------------------
constexpr int kReduceChunkElems = 2048;  // 8 KiB of fp32 per bulk reduction
constexpr int kReduceStages = 4;         // 32 KiB of shared memory per block

struct ReduceJobs {
  float* acc[kMaxRanks];
  const void* src[kMaxRanks];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) bulk_reduce_kernel(ReduceJobs jobs, size_t n) {
  __shared__ __align__(128) float stage[kReduceStages][kReduceChunkElems];
  using Raw = typename detail::Vec4<T>::Raw;
  const int job = blockIdx.y;
  float* acc = detail::pick(jobs.acc, job);
  const T* src = static_cast<const T*>(detail::pick(jobs.src, job));
  const size_t bulk_elems = n & ~static_cast<size_t>(3);
  const size_t num_chunks = (bulk_elems + kReduceChunkElems - 1) / kReduceChunkElems;
  size_t k = 0;
  for (size_t c = blockIdx.x; c < num_chunks; c += gridDim.x, ++k) {
    const int s = static_cast<int>(k % kReduceStages);
    // The stage's previous reduction (chunk k - stages) must have read it before it is refilled.
    if (threadIdx.x == 0 && k >= kReduceStages) bulk_wait_read<kReduceStages - 1>();
    __syncthreads();
    const size_t offset = c * kReduceChunkElems;
    const int len =
        static_cast<int>(min(static_cast<size_t>(kReduceChunkElems), bulk_elems - offset));
    const Raw* vs = reinterpret_cast<const Raw*>(src + offset);
    for (int i = threadIdx.x; i < len / 4; i += blockDim.x)
      reinterpret_cast<float4*>(stage[s])[i] = detail::Vec4<T>::to_float4(vs[i]);
    fence_proxy_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) {
      bulk_reduce_add(acc + offset, stage[s], static_cast<uint32_t>(len) * 4);
      bulk_commit();
    }
  }
  if (threadIdx.x == 0) bulk_wait_all();
  if (blockIdx.x == 0)
    for (size_t j = bulk_elems + threadIdx.x; j < n; j += blockDim.x)
      detail::red_add<true>(acc + j, detail::to_float(src[j]));
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

cudaError_t gather_variant(GatherVariant variant, void* dst, const PeerPointers& dsts,
                           const PeerPointers& shards, size_t shard_bytes, const RankInfo& info,
                           int num_blocks, cudaStream_t stream) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  if (shard_bytes == 0) return cudaSuccess;
  CopyJobs jobs{};
  for (int i = 0; i < info.num_ranks; ++i) {
    const int peer = (info.rank + 1 + i) % info.num_ranks;
    if (variant == GatherVariant::kWrite) {  // my shard into every rank's dst, at my slot
      jobs.dst[i] = static_cast<char*>(dsts.ptr[peer]) + info.rank * shard_bytes;
      jobs.src[i] = static_cast<const char*>(shards.ptr[info.rank]);
    } else {
      jobs.dst[i] = static_cast<char*>(dst) + peer * shard_bytes;
      jobs.src[i] = static_cast<const char*>(shards.ptr[peer]);
    }
    if (!aligned16(jobs.dst[i]) || !aligned16(jobs.src[i])) return cudaErrorMisalignedAddress;
  }
  if (variant == GatherVariant::kBulk) {
    const size_t chunks = (shard_bytes + kBulkChunk - 1) / kBulkChunk;
    // Default: three blocks per SM over all jobs (64 KiB of stages each), at most one per chunk.
    int per_job = num_blocks > 0 ? num_blocks / info.num_ranks
                                 : 3 * (info.num_sms > 0 ? info.num_sms : 132) / info.num_ranks;
    per_job = static_cast<int>(std::min<size_t>(std::max(per_job, 1), std::max<size_t>(chunks, 1)));
    const size_t smem = static_cast<size_t>(kBulkStages) * kBulkChunk;
    cudaError_t e = cudaFuncSetAttribute(
        bulk_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    bulk_copy_kernel<<<dim3(per_job, info.num_ranks), 32, smem, stream>>>(jobs, shard_bytes);
    return cudaGetLastError();
  }
  const dim3 grid(detail::auto_blocks(info, num_blocks, info.num_ranks, shard_bytes),
                  info.num_ranks);
  if (variant == GatherVariant::kLoadHint)
    hinted_copy_kernel<<<grid, kThreads, 0, stream>>>(jobs, shard_bytes);
  else
    write_copy_kernel<<<grid, kThreads, 0, stream>>>(jobs, shard_bytes);
  return cudaGetLastError();
}

cudaError_t scatter_accumulate_bulk(const void* src, ElemType src_type, const PeerPointers& accs,
                                    size_t shard_elems, const RankInfo& info, int num_blocks,
                                    cudaStream_t stream) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  if (shard_elems == 0) return cudaSuccess;
  const size_t eb = elem_bytes(src_type);
  ReduceJobs jobs{};
  for (int i = 0; i < info.num_ranks; ++i) {
    const int owner = (info.rank + 1 + i) % info.num_ranks;
    jobs.acc[i] = static_cast<float*>(accs.ptr[owner]);
    jobs.src[i] = static_cast<const char*>(src) + owner * shard_elems * eb;
    if (!aligned16(jobs.acc[i]) || reinterpret_cast<uintptr_t>(jobs.src[i]) % (4 * eb) != 0)
      return cudaErrorMisalignedAddress;
  }
  const dim3 grid(detail::auto_blocks(info, num_blocks, info.num_ranks, shard_elems * eb),
                  info.num_ranks);
  if (src_type == ElemType::kFloat32)
    bulk_reduce_kernel<float><<<grid, kThreads, 0, stream>>>(jobs, shard_elems);
  else
    bulk_reduce_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(jobs, shard_elems);
  return cudaGetLastError();
}

}  // namespace odc::kernels::lab
