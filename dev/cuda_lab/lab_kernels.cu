// The lab's losing kernel variants (see lab_kernels.h). Invariant of the staged push: a sender
// writes its slot for push `seq` only after the owner released push seq-1 (freed flag), and the
// owner reads it only after the sender's ready flag says seq landed.
#include <cuda_bf16.h>

#include "kernels/device_sync.cuh"
#include "lab_kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kSmallThreads = 32;  // flag kernels: one thread per rank
static_assert(kMaxRanks <= kSmallThreads, "one thread per rank in the flag kernels");

// ---- (b) staged push ------------------------------------------------------------------------

struct PushJobs {
  const char* src[kMaxRanks];        // the caller's slice for this owner
  char* slot[kMaxRanks];             // the caller's slot at this owner (alignment pad included)
  const uint64_t* freed[kMaxRanks];  // local: owner released our previous push
  uint64_t* ready[kMaxRanks];        // at the owner: our push landed
  uint32_t* done[kMaxRanks];         // local block counter for this owner
  int owner[kMaxRanks];
  int num_jobs;
};

struct PushParams {
  size_t bytes;
  uint64_t seq;
  int64_t timeout_ns;
  WaitError* error;
  int rank;
};

// Raises `ready` once every block of this job column has copied its share (last block signals).
__device__ __forceinline__ void finish_and_signal(uint32_t* done, unsigned num_blocks,
                                                  uint64_t* flag, uint64_t value) {
  // As in cooperative groups' grid sync: the barrier orders the block's stores before thread 0's
  // system fence, which orders them before the arrival (cheaper than a fence in every thread).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const uint32_t prev = atomicAdd(done, 1u);
    if (prev == num_blocks - 1) {
      *done = 0;  // the next launch that uses it is ordered after this one by the stream
      __threadfence_system();
      detail::st_release_sys(flag, value);
    }
  }
}

__global__ void __launch_bounds__(kThreads) push_sm_kernel(PushJobs jobs, PushParams p) {
  const int job = blockIdx.y;
  __shared__ int ok;
  if (threadIdx.x == 0)
    ok = detail::wait_at_least(detail::pick(jobs.freed, job), p.seq - 1, p.timeout_ns, p.error,
                               kWaitSlotFree, p.rank, detail::pick(jobs.owner, job));
  __syncthreads();
  if (!ok) return;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  detail::copy_bytes(detail::pick(jobs.slot, job), detail::pick(jobs.src, job), p.bytes, tid,
                     num_threads);
  finish_and_signal(detail::pick(jobs.done, job), gridDim.x, detail::pick(jobs.ready, job), p.seq);
}

// Copy-engine path, before the copies: wait until every owner released our slot.
__global__ void wait_slots_free_kernel(PushJobs jobs, PushParams p) {
  const int job = threadIdx.x;
  if (job < jobs.num_jobs)
    detail::wait_at_least(jobs.freed[job], p.seq - 1, p.timeout_ns, p.error, kWaitSlotFree, p.rank,
                          jobs.owner[job]);
}

// Copy-engine path, after the copies (stream order: they are complete): raise the ready flags,
// unless this rank has an error (its copies may have overwritten a slot still in use).
__global__ void signal_ready_kernel(PushJobs jobs, PushParams p) {
  const int job = threadIdx.x;
  __threadfence_system();
  if (job < jobs.num_jobs && *reinterpret_cast<volatile int32_t*>(&p.error->site) == kWaitNone)
    detail::st_release_sys(jobs.ready[job], p.seq);
}

struct AccumulateArgs {
  float* acc;
  const void* own;                  // the caller's own slice of its source
  const void* slot[kMaxRanks - 1];  // local slots of the other senders (pad included)
  const uint64_t* ready[kMaxRanks - 1];
  uint64_t* freed[kMaxRanks - 1];  // at each sender: we released its slot
  int sender[kMaxRanks - 1];
  int num_slots;
  uint32_t* done;
  size_t n;
  uint64_t seq;
  int64_t timeout_ns;
  WaitError* error;
  int rank;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(AccumulateArgs a) {
  using Raw = typename detail::Vec4<T>::Raw;
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (int s = 0; s < a.num_slots && ok; ++s)
      ok = detail::wait_at_least(a.ready[s], a.seq, a.timeout_ns, a.error, kWaitSlotReady, a.rank,
                                 a.sender[s]);
  }
  __syncthreads();  // with thread 0's acquire, orders every thread's slot reads after the flags
  if (!ok) return;

  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t num_threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const T* own = static_cast<const T*>(a.own);
  const T* slot[kMaxRanks - 1];
#pragma unroll
  for (int s = 0; s < kMaxRanks - 1; ++s) slot[s] = static_cast<const T*>(a.slot[s]);

  auto scalar = [&](size_t i) {
    float v = a.acc[i] + detail::to_float(own[i]);
#pragma unroll
    for (int s = 0; s < kMaxRanks - 1; ++s)
      if (s < a.num_slots) v += detail::to_float(slot[s][i]);
    a.acc[i] = v;
  };
  // Slots are laid out so that they are aligned wherever acc is 16-byte aligned.
  const size_t head =
      min(a.n, static_cast<size_t>(((16 - (reinterpret_cast<uintptr_t>(a.acc) & 15)) & 15) / 4));
  const bool own_vec = reinterpret_cast<uintptr_t>(own + head) % sizeof(Raw) == 0;
  for (size_t i = tid; i < head; i += num_threads) scalar(i);
  const size_t num_vec = (a.n - head) / 4;
  float4* acc4 = reinterpret_cast<float4*>(a.acc + head);
  for (size_t k = tid; k < num_vec; k += num_threads) {
    const size_t e = head + 4 * k;
    float4 in[kMaxRanks];
#pragma unroll
    for (int s = 0; s < kMaxRanks - 1; ++s)
      if (s < a.num_slots)
        in[s] = detail::Vec4<T>::to_float4(*reinterpret_cast<const Raw*>(slot[s] + e));
    if (own_vec) {
      in[kMaxRanks - 1] = detail::Vec4<T>::to_float4(*reinterpret_cast<const Raw*>(own + e));
    } else {
      in[kMaxRanks - 1] = make_float4(detail::to_float(own[e]), detail::to_float(own[e + 1]),
                                      detail::to_float(own[e + 2]), detail::to_float(own[e + 3]));
    }
    float4 v = acc4[k];
    v.x += in[kMaxRanks - 1].x;
    v.y += in[kMaxRanks - 1].y;
    v.z += in[kMaxRanks - 1].z;
    v.w += in[kMaxRanks - 1].w;
#pragma unroll
    for (int s = 0; s < kMaxRanks - 1; ++s) {
      if (s < a.num_slots) {
        v.x += in[s].x;
        v.y += in[s].y;
        v.z += in[s].z;
        v.w += in[s].w;
      }
    }
    acc4[k] = v;
  }
  for (size_t i = head + 4 * num_vec + tid; i < a.n; i += num_threads) scalar(i);

  // Release every sender's slot once all blocks have read theirs (and written acc).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned num_blocks = gridDim.x;
    const uint32_t prev = atomicAdd(a.done, 1u);
    if (prev == num_blocks - 1) {
      *a.done = 0;
      __threadfence_system();
      for (int s = 0; s < a.num_slots; ++s) detail::st_release_sys(a.freed[s], a.seq);
    }
  }
}

size_t round_up(size_t x, size_t to) {
  return (x + to - 1) / to * to;
}

// Elements of padding before the slot's data, so that slot + pad + i is 16-byte aligned exactly
// where acc + i is (for fp32 and bf16 slots alike).
size_t slot_pad_elems(const void* acc) {
  return (reinterpret_cast<uintptr_t>(acc) & 15) / 4;
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

size_t staging_slot_bytes(size_t shard_elems, ElemType src_type) {
  return round_up((shard_elems + 4) * elem_bytes(src_type), 256);
}

size_t staging_bytes(size_t shard_elems, ElemType src_type, int num_ranks) {
  return staging_slot_bytes(shard_elems, src_type) * static_cast<size_t>(num_ranks);
}

cudaError_t scatter_accumulate_staged(const void* src, ElemType src_type,
                                      const StagedBuffers& buffers, size_t shard_elems,
                                      const RankInfo& info, uint64_t seq, PushEngine engine,
                                      const CopyEngineSet* engines, int num_blocks,
                                      int64_t timeout_ns, WaitError* error, cudaStream_t stream) {
  const int n_ranks = info.num_ranks;
  if (n_ranks < 1 || n_ranks > kMaxRanks || seq == 0 || error == nullptr)
    return cudaErrorInvalidValue;
  if (engine == PushEngine::kCopyEngine &&
      (engines == nullptr || engines->num_streams < n_ranks - 1))
    return cudaErrorInvalidValue;
  if (shard_elems == 0) return cudaSuccess;
  const size_t eb = elem_bytes(src_type);
  const size_t slot_bytes = staging_slot_bytes(shard_elems, src_type);
  const size_t bytes = shard_elems * eb;
  auto* local_sig = static_cast<SignalBlock*>(buffers.signals.ptr[info.rank]);
  for (int r = 0; r < n_ranks; ++r)
    if (reinterpret_cast<uintptr_t>(buffers.accs.ptr[r]) % 4 != 0)
      return cudaErrorMisalignedAddress;

  PushJobs jobs{};
  jobs.num_jobs = n_ranks - 1;
  for (int i = 0; i < n_ranks - 1; ++i) {
    const int owner = (info.rank + 1 + i) % n_ranks;
    jobs.owner[i] = owner;
    jobs.src[i] = static_cast<const char*>(src) + owner * bytes;
    jobs.slot[i] = static_cast<char*>(buffers.staging.ptr[owner]) + info.rank * slot_bytes +
                   slot_pad_elems(buffers.accs.ptr[owner]) * eb;
    jobs.freed[i] = &local_sig->freed[owner];
    jobs.ready[i] = &static_cast<SignalBlock*>(buffers.signals.ptr[owner])->ready[info.rank];
    jobs.done[i] = &local_sig->push_done[owner];
  }
  const PushParams params{bytes, seq, timeout_ns, error, info.rank};

  if (n_ranks > 1) {
    if (engine == PushEngine::kSm) {
      const dim3 grid(detail::auto_blocks(info, num_blocks, n_ranks - 1, bytes), n_ranks - 1);
      push_sm_kernel<<<grid, kThreads, 0, stream>>>(jobs, params);
      ODC_CUDA_TRY(cudaGetLastError());
    } else {
      wait_slots_free_kernel<<<1, kSmallThreads, 0, stream>>>(jobs, params);
      ODC_CUDA_TRY(cudaGetLastError());
      ODC_CUDA_TRY(cudaEventRecord(engines->fork, stream));
      for (int i = 0; i < n_ranks - 1; ++i) {
        cudaStream_t s = engines->streams[i];
        ODC_CUDA_TRY(cudaStreamWaitEvent(s, engines->fork, 0));
        ODC_CUDA_TRY(cudaMemcpyAsync(jobs.slot[i], jobs.src[i], bytes, cudaMemcpyDefault, s));
        ODC_CUDA_TRY(cudaEventRecord(engines->joined[i], s));
        ODC_CUDA_TRY(cudaStreamWaitEvent(stream, engines->joined[i], 0));
      }
      signal_ready_kernel<<<1, kSmallThreads, 0, stream>>>(jobs, params);
      ODC_CUDA_TRY(cudaGetLastError());
    }
  }

  AccumulateArgs acc{};
  acc.acc = static_cast<float*>(buffers.accs.ptr[info.rank]);
  acc.own = static_cast<const char*>(src) + info.rank * bytes;
  const size_t pad = slot_pad_elems(acc.acc) * eb;
  for (int i = 0; i < n_ranks - 1; ++i) {
    const int sender = (info.rank + 1 + i) % n_ranks;
    acc.sender[i] = sender;
    acc.slot[i] =
        static_cast<const char*>(buffers.staging.ptr[info.rank]) + sender * slot_bytes + pad;
    acc.ready[i] = &local_sig->ready[sender];
    acc.freed[i] = &static_cast<SignalBlock*>(buffers.signals.ptr[sender])->freed[info.rank];
  }
  acc.num_slots = n_ranks - 1;
  acc.done = &local_sig->accumulate_done;
  acc.n = shard_elems;
  acc.seq = seq;
  acc.timeout_ns = timeout_ns;
  acc.error = error;
  acc.rank = info.rank;
  const int blocks = detail::auto_blocks(info, num_blocks, 1, shard_elems * 4);
  if (src_type == ElemType::kFloat32)
    accumulate_kernel<float><<<blocks, kThreads, 0, stream>>>(acc);
  else
    accumulate_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(acc);
  return cudaGetLastError();
}

}  // namespace odc::kernels
