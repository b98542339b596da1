// Device waits of the NVSHMEM transport: NVSHMEM's own signal waits are unbounded, so the
// transport polls its signal words (symmetric memory, local to this GPU) with a deadline and
// records an expiry in the same WaitError record as the CUDA transport (kernels.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/kernels.h"

namespace odc::nvshmem {

// Stream-ordered: returns (on the device) when signals[p] >= value for every p < num_slots; on
// expiry of `timeout_ns` records (site, rank, peer first_peer + p, value, seen) in `error` and lets
// the stream go on. Any number of slots (not limited to kernels::kMaxRanks).
cudaError_t wait_all_at_least(const uint64_t* signals, int num_slots, uint64_t value, int rank,
                              int first_peer, int32_t site, int64_t timeout_ns,
                              kernels::WaitError* error, cudaStream_t stream);

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

// Stream-ordered: keeps the stream busy for `nanoseconds` (tests: a late node fetch).
cudaError_t spin_for(int64_t nanoseconds, cudaStream_t stream);

}  // namespace odc::nvshmem
