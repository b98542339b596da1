// CUDA kernels of the ODC data paths within a node: gather (pull every owner's shard),
// scatter-accumulate (push each owner's slice into its fp32 accumulator) and a stream-ordered
// device barrier. Raw pointers, element counts, a table of peer pointers and a stream: no torch,
// no NCCL. Invariant: every inter-rank wait is bounded and reports (rank, peer, value seen) in a
// WaitError instead of hanging; a block whose wait expired does no further work.
//
// What the product runs; the losing variants (copy-engine gather, per-push staged
// scatter-accumulate) live in dev/cuda_lab/lab_kernels.h with the lab that measured them.
// Measured (dev/cuda_lab, docs/cuda_lab.md; 4 x H200, NCCL 2.28.9, 2026-11-21), all GPUs at once:
// gather: gather_sm wins at every size, 2.01x NCCL all-gather at 1 MiB, 1.19x at 64 MiB, 1.03x at
//   512 MiB; gather_copy_engine reaches 390 GB/s for one GPU alone but ~195 GB/s busbw when all
//   pull; bulk copies (TMA) and L2 load hints are no faster (2026-11-29, bulk_kernels.h). Its
//   grid keeps ~24 blocks reading remote owners (kernels/grid_size.h).
// scatter-accumulate, fp32 source: scatter_accumulate_reduce wins (1.85x / 1.15x / 0.99x NCCL
//   reduce-scatter at 1 / 64 / 512 MiB). bf16 source: reduce up to 4 MiB (1.61x at 1 MiB), then
//   staged with PushEngine::kSm (0.91x / 0.89x NCCL bf16 at 64 / 512 MiB): reductions carry fp32.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/streamed_fold.h"
#include "kernels/wait_record.h"

namespace odc::kernels {

inline constexpr int kMaxRanks = 8;

// One pointer per rank, each valid on the calling device (peer-mapped, IPC-opened or local).
// Passed by value to kernels.
struct PeerPointers {
  void* ptr[kMaxRanks] = {};
};

// Per-rank flags in device memory that peers write through peer pointers. Zero-initialize once
// (cudaMemset) before first use; all values are monotonic counters, never reset while in use.
struct SignalBlock {
  uint64_t barrier[kMaxRanks];    // barrier[p]: barrier_word() rank p last announced to this rank
  uint64_t ready[kMaxRanks];      // ready[p]: last push seq whose staging slot from sender p landed
  uint64_t freed[kMaxRanks];      // freed[r]: last push seq owner r finished reading from our slot
  uint32_t push_done[kMaxRanks];  // local: blocks done pushing to owner r (reset by the last)
  uint32_t accumulate_done;       // local: blocks done accumulating (reset by the last)
  uint32_t reserved[7];
};

enum class ElemType : int32_t { kFloat32 = 0, kBfloat16 = 1 };

inline constexpr size_t elem_bytes(ElemType type) {
  return type == ElemType::kFloat32 ? 4 : 2;
}

// Common description of the calling rank and its peers.
struct RankInfo {
  int rank = 0;
  int num_ranks = 0;
  int num_sms = 0;  // of the calling device; used to size grids when num_blocks == 0
};

// ---- gather ----------------------------------------------------------------------------------
// dst[r*shard_bytes : (r+1)*shard_bytes] = shards.ptr[r][0 : shard_bytes] for every rank r.
// Owners do nothing; their shards must not be rewritten until the call completes (stream order).

// One SM kernel with 16-byte loads from peer memory (byte-wise head/tail; pairs whose
// addresses differ in alignment mod 16 fall back to byte copies). num_blocks == 0: automatic,
// read_blocks_per_job (kernels/grid_size.h); else num_blocks / ranks per owner.
// `error` (optional): when it records a failed wait, the kernel copies nothing.
cudaError_t gather_sm(void* dst, const PeerPointers& shards, size_t shard_bytes,
                      const RankInfo& info, int num_blocks, cudaStream_t stream,
                      const WaitError* error = nullptr);

// Narrowing copies: for every job j < num_jobs, dst[j] (bf16)[i] = src[j] (fp32)[i] rounded to
// nearest even, for i < count; local or peer memory on either side. A gather of float32 shards
// into a bfloat16 destination (mixed-precision parameters) reads 4 bytes per element from the
// owners but writes only 2, with no float32 copy of the whole gathered tensor: that copy was
// the largest transient buffer of odc.torch's mixed-precision all-gather
// (docs/benchmarks-archive.md, "odc.torch memory at 64K").
// 16-byte loads / 8-byte stores where the pair's alignment allows, element-wise otherwise.
// `error` (optional): when it records a failed wait, the kernel writes nothing.
struct NarrowJobs {
  void* dst[kMaxRanks] = {};
  const void* src[kMaxRanks] = {};
  int num_jobs = 0;
};
cudaError_t copy_narrow(const NarrowJobs& jobs, size_t count, const RankInfo& info, int num_blocks,
                        cudaStream_t stream, const WaitError* error = nullptr);
// The gather of gather_sm, narrowing: dst (bf16)[r*shard_elems + i] = shards.ptr[r] (fp32)[i].
cudaError_t gather_sm_narrow(void* dst, const PeerPointers& shards, size_t shard_elems,
                             const RankInfo& info, int num_blocks, cudaStream_t stream,
                             const WaitError* error = nullptr);

// ---- scatter-accumulate ----------------------------------------------------------------------
// For every owner r: accs.ptr[r][0:shard_elems] += src[r*shard_elems : (r+1)*shard_elems], in
// fp32, src fp32 or bf16. Every rank may call it concurrently with every other rank.

// Vectorized fp32 reductions (red.global.add.v4.f32, system scope) straight into each owner's
// accumulator. Accumulators must be 4-byte aligned; 16-byte alignment enables the vector path.
// `sys_scope` false uses gpu scope (lab comparison only: atomicity across devices is only
// guaranteed at system scope).
// `error` (optional): when it records a failed wait, the kernel writes nothing.
cudaError_t scatter_accumulate_reduce(const void* src, ElemType src_type, const PeerPointers& accs,
                                      size_t shard_elems, const RankInfo& info, int num_blocks,
                                      cudaStream_t stream, bool sys_scope = true,
                                      const WaitError* error = nullptr);

// ---- put-with-signal, local arithmetic ------------------------------------------------------
// For every job j < num_jobs: copy `bytes` from src[j] to dst[j] (local or peer memory), then,
// when signal[j] is set, store `value` there (system-scope release) once every block of job j
// has copied its share. `done`: kMaxRanks zeroed device counters owned by the caller, not shared
// by concurrent launches. Copies and signals nothing when `error` records a failed wait.
struct PutSignalJobs {
  void* dst[kMaxRanks] = {};
  const void* src[kMaxRanks] = {};
  uint64_t* signal[kMaxRanks] = {};
  int num_jobs = 0;
};
cudaError_t put_signal(const PutSignalJobs& jobs, size_t bytes, uint64_t value, uint32_t* done,
                       const RankInfo& info, const WaitError* error, cudaStream_t stream);
// Stream-ordered: returns (on the device) when slots[peer[j]] >= value for every j < num (this
// GPU's memory, written by peers; system-scope acquire); on expiry of `timeout_ns` records
// (site, rank, peer[j], value, seen) in `error` and lets the stream go on. `peer_failed`
// (optional): slot p is kBarrierPeerFailed once rank p failed, which ends the wait at once
// (kWaitFetchPeerFailed).
struct SlotWaits {
  int peer[kMaxRanks] = {};
  int num = 0;
};
cudaError_t wait_slots(const uint64_t* slots, const SlotWaits& waits, uint64_t value, int rank,
                       int32_t site, int64_t timeout_ns, const uint64_t* peer_failed,
                       WaitError* error, cudaStream_t stream);
// dst[i] += src[i] (fp32 or bf16 source) for i < n; local memory. Nothing after a failed wait.
cudaError_t accumulate_local(float* dst, const void* src, ElemType src_type, size_t n,
                             const RankInfo& info, const WaitError* error, cudaStream_t stream);
// ---- streamed staging (kernels/streamed_fold.h; the owner's fold is streamed_fold.cuh) -------
// dst[0:64] = header, dst[64 : 64+bytes] = src[0:bytes] (src local device memory): one chunk,
// packed where the transport puts it from. After a failed wait a header no owner accepts
// (sequence and minibatch all ones), so a put already queued behind it is refused, not summed.
cudaError_t pack_chunk(void* dst, const ChunkHeader& header, const void* src, size_t bytes,
                       const RankInfo& info, const WaitError* error, cudaStream_t stream);

// ---- barrier ---------------------------------------------------------------------------------
// Stream-ordered: returns (on the device) when every rank has reached `epoch` (1, 2, 3, ... on
// every rank, below 2^56) in the same collective `op` (< 256). Work enqueued before it on every
// rank's stream, peer writes included, is complete and visible afterwards. On expiry of
// `timeout_ns` records (kWaitBarrier, rank, peer, barrier_word expected, word seen) in `error`;
// when a peer announced this epoch with another op, records (kWaitMismatch, rank, peer, this
// rank's word, the peer's word) at once. Either way the stream goes on (the caller checks the
// record before trusting what follows: poll_error).
cudaError_t device_barrier(const PeerPointers& signals, const RankInfo& info, uint64_t epoch,
                           uint32_t op, int64_t timeout_ns, WaitError* error, cudaStream_t stream);

// ---- claims (the core's work board) ------------------------------------------------------
// One 64-bit compare-and-swap: *word becomes `desired` if it is `expected`. `word` is addressable
// from the calling device: a peer mapping (CUDA transport), or a symmetric address whose owner is
// PE `pe` (NVSHMEM, which ignores nothing else).
struct CompareSwapJob {
  uint64_t* word = nullptr;
  uint64_t expected = 0;
  uint64_t desired = 0;
  int32_t pe = 0;
};

// Stream-ordered, one thread per job: old_values[i] = atomicCAS_system(jobs[i].word, ...), so
// each op is atomic against every other GPU's and the host's system-scope atomics on that word.
// `jobs` and `old_values`: memory the device addresses (pinned, mapped host memory).
cudaError_t compare_swap_system(const CompareSwapJob* jobs, int count, uint64_t* old_values,
                                cudaStream_t stream);

}  // namespace odc::kernels
