// Device-side building blocks shared by the kernels: system-scope acquire/release on peer-visible
// flags, the bounded spin-wait that records a WaitError, vector loads and fp32 reductions.
// Internal to src/kernels.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/grid_size.h"
#include "kernels/kernels.h"

// Host side: returns the CUDA error of `expr` from the enclosing function.
#define ODC_CUDA_TRY(expr)                        \
  do {                                            \
    const cudaError_t odc_err_ = (expr);          \
    if (odc_err_ != cudaSuccess) return odc_err_; \
  } while (0)

namespace odc::kernels::detail {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records the first failed wait in `error` (first writer wins) and mirrors it to the host.
__device__ __forceinline__ void record_error(WaitError* error, int32_t site, int rank, int peer,
                                             uint64_t expected, uint64_t seen) {
  if (error == nullptr || atomicCAS(reinterpret_cast<int*>(&error->site), 0, site) != 0) return;
  error->rank = rank;
  error->peer = peer;
  error->expected = expected;
  error->seen = seen;
  __threadfence_system();
  if (volatile WaitError* mirror = error->host_mirror) {
    mirror->rank = rank;
    mirror->peer = peer;
    mirror->expected = expected;
    mirror->seen = seen;
    __threadfence_system();
    mirror->site = site;  // last: the host reads the record once site is set
    __threadfence_system();
  }
}

// Has this rank recorded an error? Then no later wait succeeds, so no further data moves and
// peers waiting on this rank time out and name it.
__device__ __forceinline__ bool failed_before(const WaitError* error) {
  return error != nullptr && *reinterpret_cast<const volatile int32_t*>(&error->site) != kWaitNone;
}

// Spins until *flag >= expected or timeout_ns passes. On expiry records the first error and
// returns false. Call from one thread.
__device__ __forceinline__ bool wait_at_least(const uint64_t* flag, uint64_t expected,
                                              int64_t timeout_ns, WaitError* error, int32_t site,
                                              int rank, int peer) {
  if (failed_before(error)) return false;  // fail fast
  uint64_t seen = ld_acquire_sys(flag);
  if (seen >= expected) return true;
  const uint64_t start = global_timer_ns();
  while (true) {
    seen = ld_acquire_sys(flag);
    if (seen >= expected) return true;
    if (static_cast<int64_t>(global_timer_ns() - start) > timeout_ns) break;
  }
  record_error(error, site, rank, peer, expected, seen);
  return false;
}

// A device barrier's wait for one peer: until the peer's barrier_word reaches `mine` (same epoch
// and collective, or a later epoch). The same epoch with another collective is a mismatch,
// recorded at once (kWaitMismatch, mine, the peer's word); expiry records kWaitBarrier. Returns
// whether the peer arrived. Call from one thread.
__device__ __forceinline__ bool wait_barrier_word(const uint64_t* flag, uint64_t mine,
                                                  int64_t timeout_ns, WaitError* error, int rank,
                                                  int peer) {
  if (failed_before(error)) return false;  // fail fast
  const uint64_t start = global_timer_ns();
  while (true) {
    const uint64_t seen = ld_acquire_sys(flag);
    if (seen == kBarrierPeerFailed) {  // the peer failed (its host said so): it will not come
      record_error(error, kWaitPeerFailed, rank, peer, mine, seen);
      return false;
    }
    const BarrierWordState state = barrier_word_state(seen, mine);
    if (state == BarrierWordState::kArrived) return true;
    if (state == BarrierWordState::kMismatch) {
      record_error(error, kWaitMismatch, rank, peer, mine, seen);
      return false;
    }
    if (failed_before(error)) return false;  // another peer's wait of this barrier failed
    if (static_cast<int64_t>(global_timer_ns() - start) > timeout_ns) {
      record_error(error, kWaitBarrier, rank, peer, mine, seen);
      return false;
    }
  }
}

template <typename T>
struct Vec4;  // four elements of T, loaded with one instruction
template <>
struct Vec4<float> {
  using Raw = float4;
  __device__ __forceinline__ static float4 to_float4(Raw r) { return r; }
};
template <>
struct Vec4<__nv_bfloat16> {
  using Raw = uint2;
  __device__ __forceinline__ static float4 to_float4(Raw r) {
    // bf16 is the upper half of an fp32: widening is a shift.
    return make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u),
                       __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xffff0000u));
  }
};

__device__ __forceinline__ float to_float(float v) {
  return v;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <bool kSys>
__device__ __forceinline__ void red_add(float* p, float v);

// One 16-byte reduction (sm_90+: red.global.add.v4.f32); four scalar ones on older targets.
template <bool kSys>
__device__ __forceinline__ void red_add_v4(float* p, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kSys) {
    asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(p), "f"(v.x),
                 "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
  } else {
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(p), "f"(v.x),
                 "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
  }
#else
  red_add<kSys>(p, v.x);
  red_add<kSys>(p + 1, v.y);
  red_add<kSys>(p + 2, v.z);
  red_add<kSys>(p + 3, v.w);
#endif
}

template <bool kSys>
__device__ __forceinline__ void red_add(float* p, float v) {
  if constexpr (kSys) {
    asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
  } else {
    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
  }
}

// Copies n bytes with 16-byte accesses where src and dst share their alignment mod 16, by bytes
// otherwise. Work is split over `num_threads` threads, this one being `tid`.
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, size_t n, size_t tid,
                                           size_t num_threads) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  size_t head = n;
  if (((d ^ s) & 15) == 0) head = min(n, static_cast<size_t>((16 - (d & 15)) & 15));
  for (size_t i = tid; i < head; i += num_threads) dst[i] = src[i];
  if (head == n) return;
  const size_t num_vec = (n - head) / 16;
  const uint4* vs = reinterpret_cast<const uint4*>(src + head);
  uint4* vd = reinterpret_cast<uint4*>(dst + head);
  constexpr int kUnroll = 4;  // 64 bytes in flight per thread before the first store
  size_t i = tid;
  for (; i + (kUnroll - 1) * num_threads < num_vec; i += kUnroll * num_threads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = vs[i + u * num_threads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) vd[i + u * num_threads] = r[u];
  }
  for (; i < num_vec; i += num_threads) vd[i] = vs[i];
  const size_t done = head + num_vec * 16;
  for (size_t j = done + tid; j < n; j += num_threads) dst[j] = src[j];
}

// arr[i] for a run-time i without copying the (kernel-parameter) array to local memory.
template <typename T, int kN>
__device__ __forceinline__ T pick(const T (&arr)[kN], int i) {
  T v = arr[0];
#pragma unroll
  for (int j = 1; j < kN; ++j)
    if (j == i) v = arr[j];
  return v;
}

// Blocks per job (kernels/grid_size.h has the rules and why): writes, reductions and local
// copies, and reads of peer memory.
inline int auto_blocks(const RankInfo& info, int num_blocks, int num_jobs, size_t bytes_per_job) {
  return write_blocks_per_job(info.num_sms, num_blocks, num_jobs, bytes_per_job);
}
inline int read_blocks(const RankInfo& info, int num_blocks, int num_jobs, size_t bytes_per_job) {
  return read_blocks_per_job(info.num_sms, num_blocks, num_jobs, bytes_per_job);
}

}  // namespace odc::kernels::detail
