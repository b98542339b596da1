// gather: every rank pulls every owner's shard into its own full buffer through one SM kernel
// reading peer memory, on a grid that keeps about 24 blocks (~0.8 MiB of loads) on remote owners
// (kernels/grid_size.h).
// The copy-engine, bulk-copy (TMA) and load-hint variants lost: dev/cuda_lab. Owners take no
// part; the caller's stream orders everything.
#include <cuda_bf16.h>

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

__device__ __forceinline__ uint16_t to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

// blockIdx.y picks the job; its blocks split the elements. Vector path: four floats (16 bytes)
// in, four bf16 (8 bytes) out, when both pointers allow it.
__global__ void __launch_bounds__(kThreads)
    narrow_copy_kernel(NarrowJobs jobs, size_t count, const WaitError* error) {
  if (error != nullptr && *reinterpret_cast<const volatile int32_t*>(&error->site) != 0) return;
  const int job = blockIdx.y;
  auto* dst = static_cast<uint16_t*>(detail::pick(jobs.dst, job));
  const auto* src = static_cast<const float*>(detail::pick(jobs.src, job));
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    const size_t num_vec = count / 4;
    const auto* vs = reinterpret_cast<const float4*>(src);
    auto* vd = reinterpret_cast<uint2*>(dst);
    constexpr int kUnroll = 4;  // 64 bytes of loads in flight per thread before the first store
    size_t i = tid;
    for (; i + (kUnroll - 1) * num_threads < num_vec; i += kUnroll * num_threads) {
      float4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = vs[i + u * num_threads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        uint2 out;
        out.x = to_bf16_bits(r[u].x) | (static_cast<uint32_t>(to_bf16_bits(r[u].y)) << 16);
        out.y = to_bf16_bits(r[u].z) | (static_cast<uint32_t>(to_bf16_bits(r[u].w)) << 16);
        vd[i + u * num_threads] = out;
      }
    }
    for (; i < num_vec; i += num_threads) {
      const float4 r = vs[i];
      uint2 out;
      out.x = to_bf16_bits(r.x) | (static_cast<uint32_t>(to_bf16_bits(r.y)) << 16);
      out.y = to_bf16_bits(r.z) | (static_cast<uint32_t>(to_bf16_bits(r.w)) << 16);
      vd[i] = out;
    }
    done = num_vec * 4;
  }
  for (size_t i = done + tid; i < count; i += num_threads) dst[i] = to_bf16_bits(src[i]);
}

cudaError_t launch_narrow(const NarrowJobs& jobs, size_t count, int blocks_per_job,
                          cudaStream_t stream, const WaitError* error) {
  const dim3 grid(blocks_per_job, jobs.num_jobs);
  narrow_copy_kernel<<<grid, kThreads, 0, stream>>>(jobs, count, error);
  return cudaGetLastError();
}

}  // namespace

cudaError_t copy_narrow(const NarrowJobs& jobs, size_t count, const RankInfo& info, int num_blocks,
                        cudaStream_t stream, const WaitError* error) {
  if (jobs.num_jobs < 0 || jobs.num_jobs > kMaxRanks) return cudaErrorInvalidValue;
  if (jobs.num_jobs == 0 || count == 0) return cudaSuccess;
  return launch_narrow(jobs, count,
                       detail::auto_blocks(info, num_blocks, jobs.num_jobs, count * sizeof(float)),
                       stream, error);
}

cudaError_t gather_sm_narrow(void* dst, const PeerPointers& shards, size_t shard_elems,
                             const RankInfo& info, int num_blocks, cudaStream_t stream,
                             const WaitError* error) {
  if (info.num_ranks < 1 || info.num_ranks > kMaxRanks) return cudaErrorInvalidValue;
  NarrowJobs jobs;
  for (int i = 0; i < info.num_ranks; ++i) {
    const int owner = (info.rank + 1 + i) % info.num_ranks;  // ranks start at different owners
    jobs.dst[i] = static_cast<uint16_t*>(dst) + owner * shard_elems;
    jobs.src[i] = shards.ptr[owner];
  }
  jobs.num_jobs = info.num_ranks;
  if (shard_elems == 0) return cudaSuccess;
  // Reads of every owner at once: the peer-read grid (kernels/grid_size.h), not copy_narrow's
  // write rule (which its other callers keep: local copies and NVSHMEM's direct pulls).
  return launch_narrow(
      jobs, shard_elems,
      detail::read_blocks(info, num_blocks, info.num_ranks, shard_elems * sizeof(float)), stream,
      error);
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
  const dim3 grid(detail::read_blocks(info, num_blocks, info.num_ranks, shard_bytes),
                  info.num_ranks);
  multi_copy_kernel<<<grid, kThreads, 0, stream>>>(jobs, shard_bytes);
  return cudaGetLastError();
}

}  // namespace odc::kernels
