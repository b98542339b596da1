// The streamed staging's device fold (kernels/streamed_fold.cuh) with NVSHMEM's credit write: the
// one kernel of the plugin that calls NVSHMEM on the device, so the one compiled relocatable and
// linked with NVSHMEM's device library.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "kernels/streamed_fold.cuh"
#include "transport/nvshmem/nvshmem_kernels.h"

namespace odc::nvshmem {
namespace {

// A credit is NVSHMEM's single-word put to the sender's copy of the slot: an RMA put, not an
// atomic, so remote transports without atomics (UCX without GDRCopy) carry it too; over NVLink a
// store. Then a quiet: the next credit to the same sender may come from another block or
// kernel (after the sender's lock changed hands), and NVSHMEM orders puts of different threads
// only through their completion, so a credit must have landed before a larger one is sent, or
// the sender could see its credit go backwards and wait for nothing.
struct NvshmemCredit {
  __device__ void operator()(uint64_t* slot, uint64_t value, int sender) const {
    nvshmem_uint64_p(slot, value, sender);
    nvshmem_quiet();
  }
};

}  // namespace

cudaError_t fold_streamed(const kernels::StreamedFold& fold, kernels::WaitError* error,
                          cudaStream_t stream) {
  return kernels::detail::launch_streamed_fold(fold, NvshmemCredit{}, nullptr, error, stream);
}

cudaError_t warm_up_fold_streamed(kernels::WaitError* error) {
  return kernels::detail::warm_up_streamed_fold(NvshmemCredit{}, error);
}

}  // namespace odc::nvshmem
