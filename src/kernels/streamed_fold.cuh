// The owner's half of the streamed staging on the device (core/streamed_staging.h): fold arrived
// chunks into the fp32 sums in sequence order and return credits, until what the launch waits
// for holds (kernels/streamed_fold.h). A template over how a credit reaches its sender (a store
// through a peer mapping, NVSHMEM's single-word put), so each device transport instantiates it
// with its own remote write; everything else is the protocol's, written once here.
// Invariants: a slot is read only after an arrival signal or an end that covers it (acquired at
// system scope by the block's leader, then a block barrier); a chunk whose header does not carry
// the expected sequence and minibatch is never added (recorded as kWaitBadChunk); every wait is
// bounded by timeout_ns and recorded with (site, rank, peer, expected, seen); after any recorded
// error (this launch's or an earlier one) nothing more is folded or credited.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"
#include "kernels/streamed_fold.h"

namespace odc::kernels {
namespace detail {

// A block folds one sender's chunks (kernels launch one per sender, up to kMaxFoldBlocks): with
// few senders a block's loads in flight bound the owner's fold rate, so blocks are large and
// unrolled. 256 threads with one load in flight each folded 2 H200s' streamed pushes at 14 GB/s,
// these at 34 (docs/benchmarks-archive.md, nineteenth round; measured at 2 ranks). Below 4 MiB per
// push the larger block is slower (a lone 1 MiB push 35 -> 42 us).
inline constexpr int kFoldThreads = 512;
inline constexpr int kFoldUnroll = 8;
inline constexpr int kMaxFoldBlocks = 32;

// What a block decided (in shared memory, so every thread takes the same branch).
enum FoldVerdict : int { kGoOn = 0, kMet = 1, kStop = 2 };

// Raw payload loads bypass L1 (__ldcg): a slot is rewritten by its sender between folds.
__device__ __forceinline__ float4 load_payload4(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ float4 load_payload4(const __nv_bfloat16* p) {
  return Vec4<__nv_bfloat16>::to_float4(__ldcg(reinterpret_cast<const uint2*>(p)));
}
__device__ __forceinline__ float load_payload(const float* p) {
  return __ldcg(p);
}
__device__ __forceinline__ float load_payload(const __nv_bfloat16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p)))
                         << 16);
}

// sums[i] += payload[i] for i < count, by the whole block. Blocks fold different senders'
// chunks at once, possibly into the same elements: adds are reductions (gpu scope: only this
// GPU writes its sums).
template <typename T>
__device__ __forceinline__ void fold_payload(float* sums, const T* payload, uint64_t count) {
  // Vectors where both sides allow (payloads start 64-byte aligned; sums at an element offset).
  const bool aligned = (reinterpret_cast<uintptr_t>(sums) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(payload) & (4 * sizeof(T) - 1)) == 0;
  uint64_t done = 0;
  if (aligned) {
    const uint64_t num_vec = count / 4;
    const uint64_t stride = blockDim.x;
    uint64_t i = threadIdx.x;
    // One block folds a sender's whole chunk, so its speed is the loads it has in flight: the
    // reductions are asm with a memory clobber, which the compiler never moves a load across,
    // so a plain loop waits out one load's latency per vector. Load kFoldUnroll first, then add.
    for (; i + (kFoldUnroll - 1) * stride < num_vec; i += kFoldUnroll * stride) {
      float4 values[kFoldUnroll];
#pragma unroll
      for (int u = 0; u < kFoldUnroll; ++u)
        values[u] = load_payload4(payload + 4 * (i + u * stride));
#pragma unroll
      for (int u = 0; u < kFoldUnroll; ++u)
        red_add_v4<false>(sums + 4 * (i + u * stride), values[u]);
    }
    for (; i < num_vec; i += stride) {
      red_add_v4<false>(sums + 4 * i, load_payload4(payload + 4 * i));
    }
    done = num_vec * 4;
  }
  for (uint64_t i = done + threadIdx.x; i < count; i += blockDim.x) {
    red_add<false>(sums + i, load_payload(payload + i));
  }
}

// The leader's check of a chunk's header; the target's sums at its first element, or null
// (recorded) when the chunk is not the one expected or lies outside every target. With
// f.leave_unknown, a chunk in order but of another minibatch or for no target of the table is
// null with `*leave` set and nothing recorded (StreamedFold::leave_unknown).
__device__ __forceinline__ float* check_chunk(const StreamedFold& f, const ChunkHeader& header,
                                              int sender, uint64_t sequence, WaitError* error,
                                              int* leave) {
  const uint64_t payload_bytes = f.slot_bytes - sizeof(ChunkHeader);
  const uint64_t element = header.dtype == 0 ? 4 : (header.dtype == 1 ? 2 : 0);
  if (header.sequence != sequence || element == 0 || header.count * element > payload_bytes) {
    record_error(error, kWaitBadChunk, f.rank, sender, sequence, header.sequence);
    return nullptr;
  }
  if (header.minibatch == f.minibatch) {
    for (int t = 0; t < f.num_targets; ++t) {
      const FoldTarget& target = f.targets[t];
      if (target.buffer_id != header.buffer_id) continue;
      if (header.first > target.count || header.count > target.count - header.first) break;
      return target.sums + header.first;
    }
  }
  if (f.leave_unknown) {
    *leave = 1;
    return nullptr;
  }
  record_error(error, kWaitBadChunk, f.rank, sender, sequence, header.sequence);
  return nullptr;
}

// Folds can run at once (a gather's and a push's, on different streams): a block folds a sender
// only while it holds that sender's lock, so every chunk is folded exactly once. The leader takes
// it (false: another fold holds it; `wait`: spin until free, held only while folding).
__device__ __forceinline__ bool lock_sender(const StreamedFold& f, int sender, bool wait) {
  unsigned long long* lock = reinterpret_cast<unsigned long long*>(f.locks + sender);
  while (atomicCAS(lock, 0ull, 1ull) != 0ull) {
    if (!wait) return false;
  }
  __threadfence();  // the previous holder's folded[] and sums are visible from here
  return true;
}

__device__ __forceinline__ void unlock_sender(const StreamedFold& f, int sender) {
  __threadfence_system();  // the credit (a write to the sender's memory) before the next holder
  atomicExch(reinterpret_cast<unsigned long long*>(f.locks + sender), 0ull);
}

// With sender `sender`'s lock held: folds its chunks after folded[sender] up to `last` (covered by
// a signal or end the leader acquired), then, when `end` is set, consumes that end (its sequence
// follows the last chunk), and credits the sender. Returns false when a chunk or the end was
// refused (recorded). Every thread of the block calls it.
// kEnds: whether this launch waits for sender s's end: one of [ends_from, ends_to), not this
// rank, and not consumed already in this minibatch (a node's ends come before the others').
__device__ __forceinline__ bool awaits_end(const StreamedFold& f, int s) {
  return s != f.rank && s >= f.ends_from && s < f.ends_to &&
         *reinterpret_cast<const volatile uint64_t*>(f.ended + s) != f.minibatch;
}

template <class SendCredit>
__device__ bool fold_sender(const StreamedFold& f, int sender, uint64_t last, uint64_t end,
                            const SendCredit& send_credit, WaitError* error) {
  __shared__ ChunkHeader header;
  __shared__ float* sums;
  __shared__ uint64_t start;
  __shared__ int refused;
  __shared__ int leave;
  if (threadIdx.x == 0) {
    start = *reinterpret_cast<volatile uint64_t*>(f.folded + sender);
    refused = 0;
    leave = 0;
    if (end != 0 && end <= start) {  // an end that covers nothing new is a stale one
      record_error(error, kWaitBadChunk, f.rank, sender, start + 1, end);
      refused = 1;
    } else if (last > start + f.depth) {  // more unfolded than the ring holds: a stray signal
      record_error(error, kWaitBadChunk, f.rank, sender, start + 1, last);
      refused = 1;
    }
  }
  __syncthreads();
  if (refused != 0) return false;
  uint64_t folded = start;
  const char* ring = f.rings + static_cast<uint64_t>(sender) * f.depth * f.slot_bytes;
  while (folded < last) {
    const uint64_t sequence = folded + 1;
    const char* slot = ring + ((sequence - 1) % f.depth) * f.slot_bytes;
    if (threadIdx.x == 0) {
      const auto* words = reinterpret_cast<const unsigned long long*>(slot);
      auto* copy = reinterpret_cast<unsigned long long*>(&header);
      for (size_t w = 0; w < sizeof(ChunkHeader) / 8; ++w) copy[w] = __ldcg(words + w);
      sums = check_chunk(f, header, sender, sequence, error, &leave);
    }
    __syncthreads();
    if (leave != 0) break;  // left to the caller's folds; what came before is credited below
    if (sums == nullptr) return false;
    const char* payload = slot + sizeof(ChunkHeader);
    if (header.dtype == 0) {
      fold_payload(sums, reinterpret_cast<const float*>(payload), header.count);
    } else {
      fold_payload(sums, reinterpret_cast<const __nv_bfloat16*>(payload), header.count);
    }
    __syncthreads();  // every read of the slot is done before its credit frees it
    if (threadIdx.x == 0) {
      // The sender rewrites a slot only after the credit that frees it; a stray credit could let
      // it rewrite this one while it was being added. Look again (the header lands with the
      // payload): the communicator then fails, so the sums touched are never reported.
      const uint64_t now = __ldcg(reinterpret_cast<const unsigned long long*>(slot));
      if (now != sequence) {
        record_error(error, kWaitBadChunk, f.rank, sender, sequence, now);
        refused = 1;
      }
    }
    __syncthreads();
    // `refused` is written again only after the next iteration's barrier: every thread reads it
    // first (`sums` and `header` are rewritten before that barrier, so they are not read here).
    if (refused != 0) return false;
    folded = sequence;
  }
  if (end != 0) folded = end;
  if (threadIdx.x == 0 && folded != start) {
    f.folded[sender] = folded;
    send_credit(f.credit_slots + f.rank, folded, sender);
  }
  __syncthreads();
  return true;
}

template <class SendCredit>
__global__ void __launch_bounds__(kFoldThreads)
    streamed_fold_kernel(const __grid_constant__ StreamedFold f, SendCredit send_credit,
                         const uint64_t* peer_failed, WaitError* error) {
  __shared__ uint64_t word;
  __shared__ int verdict;
  const bool leader = threadIdx.x == 0;
  const uint64_t start = global_timer_ns();
  bool final_pass = false;
  bool counted = false;
  for (;;) {
    if (leader) verdict = failed_before(error) ? kStop : kGoOn;
    __syncthreads();
    if (verdict == kStop) return;
    __syncthreads();
    // Fold what arrived from this block's senders (those another fold holds are its to fold).
    for (int s = blockIdx.x; s < f.world_size; s += gridDim.x) {
      if (s == f.rank) continue;
      if (leader) {
        word = 0;
        const uint64_t arrived = ld_acquire_sys(f.arrivals + s);
        if (arrived > *reinterpret_cast<volatile uint64_t*>(f.folded + s) &&
            lock_sender(f, s, /*wait=*/false)) {
          word = arrived;
        }
      }
      __syncthreads();
      const uint64_t arrived = word;
      __syncthreads();
      if (arrived == 0) continue;
      const bool folded = fold_sender(f, s, arrived, 0, send_credit, error);
      if (leader) unlock_sender(f, s);
      if (!folded) return;
    }
    if (f.until == FoldUntil::kOnce || final_pass) return;
    // Does what this launch waits for hold? The leader looks (acquire) and tells the block.
    if (leader) {
      int short_peer = -1;
      uint64_t expected = f.value;
      uint64_t seen = 0;
      int32_t site = kWaitCredit;
      if (f.until == FoldUntil::kCredit) {
        seen = ld_acquire_sys(f.credits + f.peer);
        if (seen < f.value) short_peer = f.peer;
        if (short_peer >= 0 && !counted && f.credit_waits != nullptr && blockIdx.x == 0) {
          atomicAdd(reinterpret_cast<unsigned long long*>(f.credit_waits), 1ull);
        }
        counted = true;
      } else if (f.until == FoldUntil::kEnds) {
        // The ends of this minibatch of every sender the launch awaits, not only this block's:
        // with a range (node-aggregated pushes) a block none of whose senders is awaited must
        // go on folding them, since they may still be pushing and wait for its credit.
        site = kWaitStreamEnd;
        // The mark and the sequence are two signals: either may arrive first (a network may
        // deliver them out of order), so an end counts once both are there.
        for (int s = 0; s < f.world_size && short_peer < 0; ++s) {
          if (!awaits_end(f, s)) continue;
          seen = ld_acquire_sys(f.end_marks + s);
          expected = f.minibatch;
          if (seen < f.minibatch) {
            short_peer = s;
            break;
          }
          seen = ld_acquire_sys(f.end_sequences + s);
          expected = *reinterpret_cast<volatile uint64_t*>(f.folded + s) + 1;
          if (seen < expected) short_peer = s;
        }
      } else {
        site = kWaitMeeting;
        for (int s = 0; s < f.world_size && short_peer < 0; ++s) {
          if (s == f.rank) continue;
          seen = ld_acquire_sys(f.meetings + s);
          if (seen < f.value) short_peer = s;
        }
      }
      if (short_peer < 0) {
        verdict = kMet;
      } else if (failed_before(error)) {
        verdict = kStop;
      } else if (peer_failed != nullptr &&
                 ld_acquire_sys(peer_failed + short_peer) == kBarrierPeerFailed) {
        record_error(error, kWaitPeerFailed, f.rank, short_peer, expected, seen);
        verdict = kStop;
      } else if (static_cast<int64_t>(global_timer_ns() - start) > f.timeout_ns) {
        record_error(error, site, f.rank, short_peer, expected, seen);
        verdict = kStop;
      } else {
        verdict = kGoOn;
      }
    }
    __syncthreads();
    const int decided = verdict;
    __syncthreads();
    if (decided == kStop) return;
    if (decided != kMet) continue;
    if (f.until == FoldUntil::kCredit) return;
    if (f.until == FoldUntil::kEnds) {
      // Every sender of this block ended: fold up to each end (its signals follow every chunk
      // before it, so they are all there, whatever arrival signals say), then consume the end.
      for (int s = blockIdx.x; s < f.world_size; s += gridDim.x) {
        if (!awaits_end(f, s)) continue;
        if (leader) {
          word = ld_acquire_sys(f.end_sequences + s);
          lock_sender(f, s, /*wait=*/true);
        }
        __syncthreads();
        const uint64_t end = word;
        __syncthreads();
        const bool folded = fold_sender(f, s, end - 1, end, send_credit, error);
        if (leader) {
          if (folded) *reinterpret_cast<volatile uint64_t*>(f.ended + s) = f.minibatch;
          unlock_sender(f, s);
        }
        if (!folded) return;
      }
      return;
    }
    final_pass = true;  // kMeetings: everything put before the meetings is there: one more pass
  }
}

// Launches the fold on `stream`: one block per sender up to kMaxFoldBlocks (blocks share the
// rest). `send_credit(slot, value, sender)` writes `value` into `slot` (this rank's slot of the
// credits region, by its local address) at rank `sender`; `peer_failed` (optional): slot p is
// kBarrierPeerFailed once rank p failed.
template <class SendCredit>
cudaError_t launch_streamed_fold(const StreamedFold& fold, const SendCredit& send_credit,
                                 const uint64_t* peer_failed, WaitError* error,
                                 cudaStream_t stream) {
  if (fold.world_size < 2 || fold.depth == 0 || error == nullptr) return cudaErrorInvalidValue;
  const int blocks = fold.world_size - 1 < kMaxFoldBlocks ? fold.world_size - 1 : kMaxFoldBlocks;
  streamed_fold_kernel<<<blocks, kFoldThreads, 0, stream>>>(fold, send_credit, peer_failed, error);
  return cudaGetLastError();
}

// Runs the fold kernel of this credit once over nothing (two ranks, nothing arrived: a pass that
// reads two zero words and returns), on its own stream, and waits for it. Why, at a transport's
// start: the first launch of a kernel in a process may wait for every kernel running on the
// device. Under CUDA's lazy loading (torch's default) that launch loads the kernel, and loading
// may synchronize the context; and the first kernel that needs local memory (the fold's stack)
// makes the driver reserve it, which synchronizes too (dev/gpu/lazy_loading_probe.cu shows
// both on an H100). A fold pass that the progress thread enqueues while the caller's stream runs
// a long kernel, or a collective waiting for the very sender the pass would credit, would then
// wait for that kernel: no progress, or a deadlock until the timeout.
template <class SendCredit>
cudaError_t warm_up_streamed_fold(const SendCredit& send_credit, WaitError* error) {
  uint64_t* words = nullptr;  // arrivals, folded, locks, credit slots: two each
  cudaError_t status = cudaMalloc(&words, 8 * sizeof(uint64_t));
  if (status != cudaSuccess) return status;
  cudaStream_t stream = nullptr;
  status = cudaMemset(words, 0, 8 * sizeof(uint64_t));
  if (status == cudaSuccess) status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (status == cudaSuccess) {
    StreamedFold nothing{};
    nothing.world_size = 2;
    nothing.rank = 0;
    nothing.depth = 1;
    nothing.until = FoldUntil::kOnce;
    nothing.arrivals = words;
    nothing.folded = words + 2;
    nothing.locks = words + 4;
    nothing.credit_slots = words + 6;
    status = launch_streamed_fold(nothing, send_credit, nullptr, error, stream);
    const cudaError_t ran = cudaStreamSynchronize(stream);
    if (status == cudaSuccess) status = ran;
  }
  if (stream != nullptr) cudaStreamDestroy(stream);
  cudaFree(words);
  return status;
}

}  // namespace detail
}  // namespace odc::kernels
