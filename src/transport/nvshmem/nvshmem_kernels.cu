// Bounded barrier waits for the NVSHMEM transport (see nvshmem_kernels.h). Invariant: a wait reads
// the error record first (fail fast, as every kernel wait does), and acquires each word at system
// scope, so what a peer completed before announcing its word is visible once the word is seen.
#include "kernels/device_sync.cuh"
#include "transport/nvshmem/nvshmem_kernels.h"

namespace odc::nvshmem {
namespace {

constexpr int kThreads = 128;

__global__ void wait_barrier_words_kernel(const uint64_t* words, int num_ranks, uint64_t mine,
                                          int rank, int64_t timeout_ns, kernels::WaitError* error) {
  for (int peer = threadIdx.x; peer < num_ranks; peer += blockDim.x) {
    if (!kernels::detail::wait_barrier_word(words + peer, mine, timeout_ns, error, rank, peer)) {
      break;  // recorded (or another wait already failed): stop, the stream goes on
    }
  }
  __syncthreads();
}

__global__ void store_u64_kernel(uint64_t* dst, uint64_t value) {
  *dst = value;
}

__global__ void publish_u64_kernel(uint64_t* flag, uint64_t value,
                                   const kernels::WaitError* error) {
  if (kernels::detail::failed_before(error)) return;
  __threadfence_system();
  kernels::detail::st_release_sys(flag, value);
}

__global__ void spin_kernel(int64_t nanoseconds) {
  const uint64_t start = kernels::detail::global_timer_ns();
  while (static_cast<int64_t>(kernels::detail::global_timer_ns() - start) < nanoseconds) {
  }
}

}  // namespace

cudaError_t store_u64(uint64_t* dst, uint64_t value, cudaStream_t stream) {
  store_u64_kernel<<<1, 1, 0, stream>>>(dst, value);
  return cudaGetLastError();
}

cudaError_t publish_u64(uint64_t* flag, uint64_t value, const kernels::WaitError* error,
                        cudaStream_t stream) {
  publish_u64_kernel<<<1, 1, 0, stream>>>(flag, value, error);
  return cudaGetLastError();
}

cudaError_t spin_for(int64_t nanoseconds, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

cudaError_t wait_barrier_words(const uint64_t* words, int num_ranks, uint64_t mine, int rank,
                               int64_t timeout_ns, kernels::WaitError* error, cudaStream_t stream) {
  if (num_ranks < 1 || words == nullptr || error == nullptr) return cudaErrorInvalidValue;
  wait_barrier_words_kernel<<<1, kThreads, 0, stream>>>(words, num_ranks, mine, rank, timeout_ns,
                                                        error);
  return cudaGetLastError();
}

}  // namespace odc::nvshmem
