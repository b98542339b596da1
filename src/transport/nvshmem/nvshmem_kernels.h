// Device waits of the NVSHMEM transport: NVSHMEM's own signal waits are unbounded, so the
// transport polls its barrier words (symmetric memory, local to this GPU) with a deadline and
// records an expiry or a collective mismatch in the same WaitError record as the CUDA transport
// (kernels/wait_record.h), through the same per-peer wait (kernels/device_sync.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kernels.h"

namespace odc::nvshmem {

// Stream-ordered: the wait half of the device barrier. Returns (on the device) once every
// words[p] (p < num_ranks; rank p's barrier_word announced here) reached `mine` (this rank's word:
// the same epoch and collective, or a later epoch). A word of this epoch in another collective
// records (kWaitMismatch, rank, p, mine, seen) at once; expiry of `timeout_ns` records
// (kWaitBarrier, rank, p, mine, seen). Either way the stream goes on (poll_error reports it).
// Any number of ranks (not limited to kernels::kMaxRanks).
cudaError_t wait_barrier_words(const uint64_t* words, int num_ranks, uint64_t mine, int rank,
                               int64_t timeout_ns, kernels::WaitError* error, cudaStream_t stream);

// Stream-ordered: *dst = value (device memory), one thread.
cudaError_t store_u64(uint64_t* dst, uint64_t value, cudaStream_t stream);

// Stream-ordered: *flag = value with system-scope release, so a peer that reads the value with
// system-scope acquire (over NVLink) also sees every write that completed on this stream before.
// Writes nothing once `error` records a failed wait (what came before may not be trustworthy).
cudaError_t publish_u64(uint64_t* flag, uint64_t value, const kernels::WaitError* error,
                        cudaStream_t stream);

// Stream-ordered: the streamed staging's fold of this rank's rings (kernels/streamed_fold.h),
// crediting senders with NVSHMEM's device put; expiry or a refused chunk recorded in `error`.
cudaError_t fold_streamed(const kernels::StreamedFold& fold, kernels::WaitError* error,
                          cudaStream_t stream);

// Runs the fold kernel once over nothing and waits for it: loaded, its local memory reserved,
// before any pass of the progress thread (kernels/streamed_fold.cuh says why). Synchronous.
cudaError_t warm_up_fold_streamed(kernels::WaitError* error);

// Stream-ordered, one thread per job: old_values[i] = nvshmem_uint64_atomic_compare_swap(
// jobs[i].word (a symmetric address), expected, desired, PE jobs[i].pe). The work board's claims;
// `jobs` and `old_values` in pinned mapped host memory.
cudaError_t compare_swap(const kernels::CompareSwapJob* jobs, int count, uint64_t* old_values,
                         cudaStream_t stream);

// Stream-ordered: keeps the stream busy for `nanoseconds` (tests: a late node fetch).
cudaError_t spin_for(int64_t nanoseconds, cudaStream_t stream);

}  // namespace odc::nvshmem
