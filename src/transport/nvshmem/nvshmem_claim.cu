// The work board's claims across nodes (see nvshmem_kernels.h): NVSHMEM's device-side atomic
// compare-and-swap, one thread per op. Device-side AMOs work over NVLink and over InfiniBand
// without GDRCopy (the proxy thread carries them); host-side ones work only over NVLink.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport/nvshmem/nvshmem_kernels.h"

namespace odc::nvshmem {
namespace {

constexpr int kThreads = 128;

__global__ void compare_swap_kernel(const kernels::CompareSwapJob* jobs, int count,
                                    uint64_t* old_values) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const kernels::CompareSwapJob job = jobs[i];
  old_values[i] = nvshmem_uint64_atomic_compare_swap(job.word, job.expected, job.desired, job.pe);
}

}  // namespace

cudaError_t compare_swap(const kernels::CompareSwapJob* jobs, int count, uint64_t* old_values,
                         cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (jobs == nullptr || old_values == nullptr) return cudaErrorInvalidValue;
  compare_swap_kernel<<<(count + kThreads - 1) / kThreads, kThreads, 0, stream>>>(jobs, count,
                                                                                  old_values);
  return cudaGetLastError();
}

}  // namespace odc::nvshmem
