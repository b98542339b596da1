// The owner's half of the streamed staging on the device (core/streamed_staging.h): fold arrived
// chunks into the fp32 sums in sequence order and return credits, until what the launch waits
// for holds (kernels/streamed_fold.h). A template over how a credit reaches its sender (a store
// through a peer mapping, NVSHMEM's single-word put), so each device transport instantiates it
// with its own remote write; everything else is the protocol's, written once here.
// A sender's chunks are folded by a group of blocks (a thread block cluster on sm_90: one
// hardware barrier, and the leader block's shared memory read by all), so one sender's fold rate
// is no longer one SM's.
// Invariants: a slot is read only after an arrival signal or an end that covers it (acquired at
// system scope by the group's leader, then a group barrier); a chunk whose header does not carry
// the expected sequence and minibatch is never added (recorded as kWaitBadChunk); every wait is
// bounded by timeout_ns and recorded with (site, rank, peer, expected, seen); after any recorded
// error (this launch's or an earlier one) nothing more is folded or credited.
#pragma once

#include <cstdint>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/device_sync.cuh"
#include "kernels/kernels.h"
#include "kernels/streamed_fold.h"

namespace odc::kernels {
namespace detail {

// A group of blocks folds one sender's chunks (kernels launch one group per sender, up to
// kMaxFoldBlocks blocks in all): a block's loads in flight bound its fold rate, so blocks are
// large and unrolled. 256 threads with one load in flight each folded 2 H200s' streamed pushes at
// 14 GB/s, these at 34 (docs/benchmarks-archive.md, nineteenth round; measured at 2 ranks, one
// block per sender). That one block (one SM) was then the push's bound: 34-38 GB/s at 2 ranks
// against the CUDA transport's 300-320, so a sender gets up to kMaxFoldGroupBlocks blocks (a
// cluster) where the senders leave room under kMaxFoldBlocks. 16, above the portable 8 (sm_90
// runs clusters of up to 16 where the kernel asks): with folds beside the sends and 16 MiB
// chunks, back-to-back NVSHMEM pushes between 2 H200s moved 126-149 GB/s from 128 MiB against
// 115-123 with 8 (the fold bounds them there), and odc.train's 1.5b step over NVSHMEM was the
// same (docs/benchmarks.md, section 4).
inline constexpr int kFoldThreads = 512;
inline constexpr int kFoldUnroll = 8;
inline constexpr int kMaxFoldBlocks = 32;
inline constexpr int kMaxFoldGroupBlocks = 16;
inline constexpr int kPortableClusterBlocks = 8;

// The blocks that fold one sender together. On sm_90 a thread block cluster: sync() is the
// cluster's barrier (release/acquire at cluster scope, so what the leader block wrote into its
// shared memory before it is read after it by every block), leader_copy() the leader block's
// instance of a __shared__ variable. Elsewhere (or launched without clusters) a block alone.
struct FoldGroup {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __device__ FoldGroup()
      : size(cooperative_groups::this_cluster().num_blocks()),
        rank(cooperative_groups::this_cluster().block_rank()) {}
  __device__ void sync() const {
    cooperative_groups::this_cluster().sync();
  }
  template <typename T>
  __device__ T* leader_copy(T* mine) const {
    return size == 1 ? mine : cooperative_groups::this_cluster().map_shared_rank(mine, 0);
  }
#else
  __device__ FoldGroup() : size(1), rank(0) {}
  __device__ void sync() const {
    __syncthreads();
  }
  template <typename T>
  __device__ T* leader_copy(T* mine) const {
    return mine;
  }
#endif
  unsigned size;  // blocks in the group
  unsigned rank;  // this block's place in it
  __device__ int index() const {
    return static_cast<int>(blockIdx.x / size);
  }
  __device__ int count() const {
    return static_cast<int>(gridDim.x / size);
  }
  __device__ bool leader() const {
    return rank == 0 && threadIdx.x == 0;
  }
};

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

// sums[i] += payload[i] for i < count, by the whole group. Groups fold different senders'
// chunks at once, possibly into the same elements: adds are reductions (gpu scope: only this
// GPU writes its sums).
template <typename T>
__device__ __forceinline__ void fold_payload(const FoldGroup& group, float* sums, const T* payload,
                                             uint64_t count) {
  // Vectors where both sides allow (payloads start 64-byte aligned; sums at an element offset).
  const bool aligned = (reinterpret_cast<uintptr_t>(sums) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(payload) & (4 * sizeof(T) - 1)) == 0;
  uint64_t done = 0;
  if (aligned) {
    const uint64_t num_vec = count / 4;
    const uint64_t stride = static_cast<uint64_t>(group.size) * blockDim.x;
    uint64_t i = static_cast<uint64_t>(group.rank) * blockDim.x + threadIdx.x;
    // One group folds a sender's whole chunk, so its speed is the loads it has in flight: the
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
  const uint64_t threads = static_cast<uint64_t>(group.size) * blockDim.x;
  for (uint64_t i = done + static_cast<uint64_t>(group.rank) * blockDim.x + threadIdx.x; i < count;
       i += threads) {
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

// Folds can run at once (a gather's and a push's, on different streams): a group folds a sender
// only while its leader holds that sender's lock, so every chunk is folded exactly once. The
// leader takes it (false: another fold holds it; `wait`: spin until free, held only while
// folding).
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

// The rank of this owner's j-th sender (j in [0, world - 1)): every rank but this one.
__device__ __forceinline__ int sender_of(const StreamedFold& f, int j) {
  return j < f.rank ? j : j + 1;
}

// kEnds: whether this launch waits for sender s's end: one of [ends_from, ends_to), not this
// rank, and not consumed already in this minibatch (a node's ends come before the others').
__device__ __forceinline__ bool awaits_end(const StreamedFold& f, int s) {
  return s != f.rank && s >= f.ends_from && s < f.ends_to &&
         *reinterpret_cast<const volatile uint64_t*>(f.ended + s) != f.minibatch;
}

// What a group's leader decides and every thread of the group reads (after a group barrier,
// from the leader block's shared memory).
struct SenderShared {
  ChunkHeader header;
  float* sums;
  uint64_t start;
  int refused;
  int leave;
};

// With sender `sender`'s lock held (by the group's leader): folds its chunks after
// folded[sender] up to `last` (covered by a signal or end the leader acquired), then, when `end`
// is set, consumes that end (its sequence follows the last chunk), and credits the sender.
// Returns false when a chunk or the end was refused (recorded). Every thread of the group calls
// it.
template <class SendCredit>
__device__ bool fold_sender(const FoldGroup& group, const StreamedFold& f, int sender,
                            uint64_t last, uint64_t end, const SendCredit& send_credit,
                            WaitError* error) {
  __shared__ SenderShared mine;
  SenderShared* const shared = group.leader_copy(&mine);  // written by the leader only
  const bool leader = group.leader();
  if (leader) {
    shared->start = *reinterpret_cast<volatile uint64_t*>(f.folded + sender);
    shared->refused = 0;
    shared->leave = 0;
    if (end != 0 && end <= shared->start) {  // an end that covers nothing new is a stale one
      record_error(error, kWaitBadChunk, f.rank, sender, shared->start + 1, end);
      shared->refused = 1;
    } else if (last > shared->start + f.depth) {  // more unfolded than the ring holds: a stray
      record_error(error, kWaitBadChunk, f.rank, sender, shared->start + 1, last);
      shared->refused = 1;
    }
  }
  group.sync();
  const uint64_t start = shared->start;
  const int refused = shared->refused;
  group.sync();  // read before the leader writes again, or its block exits (its shared memory)
  if (refused != 0) return false;
  uint64_t folded = start;
  const char* ring = f.rings + static_cast<uint64_t>(sender) * f.depth * f.slot_bytes;
  while (folded < last) {
    const uint64_t sequence = folded + 1;
    const char* slot = ring + ((sequence - 1) % f.depth) * f.slot_bytes;
    if (leader) {
      const auto* words = reinterpret_cast<const unsigned long long*>(slot);
      auto* copy = reinterpret_cast<unsigned long long*>(&shared->header);
      for (size_t w = 0; w < sizeof(ChunkHeader) / 8; ++w) copy[w] = __ldcg(words + w);
      shared->sums = check_chunk(f, shared->header, sender, sequence, error, &shared->leave);
    }
    group.sync();
    const int leave = shared->leave;
    float* const sums = shared->sums;
    const uint64_t count = shared->header.count;
    const uint32_t dtype = shared->header.dtype;
    group.sync();
    if (leave != 0) break;  // left to the caller's folds; what came before is credited below
    if (sums == nullptr) return false;
    const char* payload = slot + sizeof(ChunkHeader);
    if (dtype == 0) {
      fold_payload(group, sums, reinterpret_cast<const float*>(payload), count);
    } else {
      fold_payload(group, sums, reinterpret_cast<const __nv_bfloat16*>(payload), count);
    }
    group.sync();  // every read of the slot (every block's) is done before its credit frees it
    if (leader) {
      // The sender rewrites a slot only after the credit that frees it; a stray credit could let
      // it rewrite this one while it was being added. Look again (the header lands with the
      // payload): the communicator then fails, so the sums touched are never reported.
      const uint64_t now = __ldcg(reinterpret_cast<const unsigned long long*>(slot));
      if (now != sequence) {
        record_error(error, kWaitBadChunk, f.rank, sender, sequence, now);
        shared->refused = 1;
      }
    }
    group.sync();
    const int rewritten = shared->refused;
    group.sync();
    if (rewritten != 0) return false;
    folded = sequence;
  }
  if (end != 0) folded = end;
  if (leader && folded != start) {
    f.folded[sender] = folded;
    send_credit(f.credit_slots + f.rank, folded, sender);
  }
  group.sync();
  return true;
}

// What the group's leader tells the group in the kernel's loop.
struct LoopShared {
  uint64_t word;
  int verdict;
};

template <class SendCredit>
__global__ void __launch_bounds__(kFoldThreads)
    streamed_fold_kernel(const __grid_constant__ StreamedFold f, SendCredit send_credit,
                         const uint64_t* peer_failed, WaitError* error) {
  __shared__ LoopShared mine;
  const FoldGroup group;
  LoopShared* const shared = group.leader_copy(&mine);  // written by the leader only
  const bool leader = group.leader();
  const int first_sender = group.index();
  const int num_groups = group.count();
  const uint64_t start = global_timer_ns();
  bool final_pass = false;
  bool counted = false;
  if (f.until == FoldUntil::kCredit) {
    // A credit already there needs no pass: the caller's stream goes straight on to its put.
    // Folding for peers is then the passes' beside it (DeviceStreamedStaging::send_chunk enqueues
    // one per slot's worth of bytes sent, on the background stream); this fold folds only while
    // it has to wait, which keeps ranks waiting for each other's credit progressing (as the host
    // emulation does).
    if (leader) shared->verdict = ld_acquire_sys(f.credits + f.peer) >= f.value ? kMet : kGoOn;
    group.sync();
    const int free = shared->verdict;
    group.sync();  // read before the leader writes again
    if (free == kMet) return;
  }
  for (;;) {
    if (leader) shared->verdict = failed_before(error) ? kStop : kGoOn;
    group.sync();
    const int failed = shared->verdict;
    group.sync();  // read before the leader writes again, or its block exits (its shared memory)
    if (failed == kStop) return;
    // Fold what arrived from this group's senders (those another fold holds are its to fold).
    // Senders are numbered without this rank, so that world - 1 groups get one sender each.
    for (int j = first_sender; j < f.world_size - 1; j += num_groups) {
      const int s = sender_of(f, j);
      if (leader) {
        shared->word = 0;
        const uint64_t arrived = ld_acquire_sys(f.arrivals + s);
        if (arrived > *reinterpret_cast<volatile uint64_t*>(f.folded + s) &&
            lock_sender(f, s, /*wait=*/false)) {
          shared->word = arrived;
        }
      }
      group.sync();
      const uint64_t arrived = shared->word;
      group.sync();
      if (arrived == 0) continue;
      const bool folded = fold_sender(group, f, s, arrived, 0, send_credit, error);
      if (leader) unlock_sender(f, s);
      if (!folded) return;
    }
    if (f.until == FoldUntil::kOnce || final_pass) return;
    // Does what this launch waits for hold? The leader looks (acquire) and tells the group.
    if (leader) {
      int short_peer = -1;
      uint64_t expected = f.value;
      uint64_t seen = 0;
      int32_t site = kWaitCredit;
      if (f.until == FoldUntil::kCredit) {
        seen = ld_acquire_sys(f.credits + f.peer);
        if (seen < f.value) short_peer = f.peer;
        if (short_peer >= 0 && !counted && f.credit_waits != nullptr && first_sender == 0) {
          atomicAdd(reinterpret_cast<unsigned long long*>(f.credit_waits), 1ull);
        }
        counted = true;
      } else if (f.until == FoldUntil::kEnds) {
        // The ends of this minibatch of every sender the launch awaits, not only this group's:
        // with a range (node-aggregated pushes) a group none of whose senders is awaited must
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
        shared->verdict = kMet;
      } else if (failed_before(error)) {
        shared->verdict = kStop;
      } else if (peer_failed != nullptr &&
                 ld_acquire_sys(peer_failed + short_peer) == kBarrierPeerFailed) {
        record_error(error, kWaitPeerFailed, f.rank, short_peer, expected, seen);
        shared->verdict = kStop;
      } else if (static_cast<int64_t>(global_timer_ns() - start) > f.timeout_ns) {
        record_error(error, site, f.rank, short_peer, expected, seen);
        shared->verdict = kStop;
      } else {
        shared->verdict = kGoOn;
      }
    }
    group.sync();
    const int decided = shared->verdict;
    group.sync();
    if (decided == kStop) return;
    if (decided != kMet) continue;
    if (f.until == FoldUntil::kCredit) return;
    if (f.until == FoldUntil::kEnds) {
      // Every sender of this group ended: fold up to each end (its signals follow every chunk
      // before it, so they are all there, whatever arrival signals say), then consume the end.
      for (int j = first_sender; j < f.world_size - 1; j += num_groups) {
        const int s = sender_of(f, j);
        if (leader) {
          shared->word = 0;  // not awaited (an end met has a sequence of at least 1)
          if (awaits_end(f, s)) {
            shared->word = ld_acquire_sys(f.end_sequences + s);
            lock_sender(f, s, /*wait=*/true);
          }
        }
        group.sync();
        const uint64_t end = shared->word;
        group.sync();
        if (end == 0) continue;
        const bool folded = fold_sender(group, f, s, end - 1, end, send_credit, error);
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

// Blocks per sender: up to kMaxFoldGroupBlocks where the senders leave room under kMaxFoldBlocks
// (2 and 3 ranks: 16; 4 ranks: 10; 9 ranks: 4; 33 or more: 1, as before groups).
inline int fold_group_blocks(int world_size) {
  const int senders = world_size - 1;
  const int per_sender = kMaxFoldBlocks / (senders > 0 ? senders : 1);
  return per_sender < 1 ? 1 : (per_sender > kMaxFoldGroupBlocks ? kMaxFoldGroupBlocks : per_sender);
}

// Launches the fold on `stream`: one group per sender up to kMaxFoldBlocks blocks (groups share
// the rest). A group of several blocks is a cluster (sm_90); where the kernel was not compiled for
// sm_90 or the launch refuses clusters, single blocks as before (the protocol holds for any
// grouping: a sender is folded only under its lock). `send_credit(slot, value, sender)` writes
// `value` into `slot` (this rank's slot of the credits region, by its local address) at rank
// `sender`; `peer_failed` (optional): slot p is kBarrierPeerFailed once rank p failed.
template <class SendCredit>
cudaError_t launch_streamed_fold(const StreamedFold& fold, const SendCredit& send_credit,
                                 const uint64_t* peer_failed, WaitError* error,
                                 cudaStream_t stream) {
  if (fold.world_size < 2 || fold.depth == 0 || error == nullptr) return cudaErrorInvalidValue;
  const int senders = fold.world_size - 1;
#if defined(__CUDACC__) && CUDART_VERSION >= 11080  // clusters and cudaLaunchKernelEx: CUDA 11.8
  int per_sender = fold_group_blocks(fold.world_size);
  if (per_sender > 1) {
    // Groups only where the kernel that runs was compiled for sm_90 (FoldGroup's cluster branch):
    // its PTX version, not the device's, decides (code built for an older architecture and
    // compiled just in time on an H100 folds in single blocks, so clusters would only idle).
    // Asked once per process (a process drives GPUs of one architecture; a mixed one would get
    // the first device's answer, correct either way), first by warm_up_streamed_fold at the
    // transport's start, where loading the kernel may synchronize the context harmlessly. A
    // failed query means single blocks (the fold without clusters: correct, slower).
    static const bool compiled_for_clusters = [] {
      cudaFuncAttributes attributes{};
      if (cudaFuncGetAttributes(&attributes, streamed_fold_kernel<SendCredit>) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      return attributes.ptxVersion >= 90;
    }();
    if (!compiled_for_clusters) per_sender = 1;
  }
  if (per_sender > kPortableClusterBlocks) {
    // Above the portable size only where the kernel may (asked once; refused: the portable size).
    static const bool non_portable = [] {
      const cudaError_t asked = cudaFuncSetAttribute(
          streamed_fold_kernel<SendCredit>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (asked != cudaSuccess) (void)cudaGetLastError();
      return asked == cudaSuccess;
    }();
    if (!non_portable) per_sender = kPortableClusterBlocks;
  }
  // Smaller groups where a size is refused (not sticky), down to single blocks.
  for (; per_sender > 1; per_sender /= 2) {
    const int groups =
        senders < kMaxFoldBlocks / per_sender ? senders : kMaxFoldBlocks / per_sender;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(groups * per_sender));
    config.blockDim = dim3(kFoldThreads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(per_sender);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    if (cudaLaunchKernelEx(&config, streamed_fold_kernel<SendCredit>, fold, send_credit,
                           peer_failed, error) == cudaSuccess) {
      return cudaSuccess;
    }
    (void)cudaGetLastError();
  }
#endif
  const int blocks = senders < kMaxFoldBlocks ? senders : kMaxFoldBlocks;
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
