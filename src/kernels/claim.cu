// The work board's claims within a node (see kernels.h): a batch of system-scope 64-bit
// compare-and-swaps on peer-mapped words, one thread each, old values into pinned host memory.
#include "kernels/kernels.h"

namespace odc::kernels {
namespace {

constexpr int kThreads = 128;

__global__ void compare_swap_system_kernel(const CompareSwapJob* jobs, int count,
                                           uint64_t* old_values) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const CompareSwapJob job = jobs[i];
  old_values[i] = atomicCAS_system(reinterpret_cast<unsigned long long*>(job.word),
                                   static_cast<unsigned long long>(job.expected),
                                   static_cast<unsigned long long>(job.desired));
}

}  // namespace

cudaError_t compare_swap_system(const CompareSwapJob* jobs, int count, uint64_t* old_values,
                                cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (jobs == nullptr || old_values == nullptr) return cudaErrorInvalidValue;
  compare_swap_system_kernel<<<(count + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      jobs, count, old_values);
  return cudaGetLastError();
}

}  // namespace odc::kernels
