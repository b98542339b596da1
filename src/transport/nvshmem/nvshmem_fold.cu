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
// store. Credits only grow, and a sender acts on a value only once it reads at least what it
// needs.
struct NvshmemCredit {
  __device__ void operator()(uint64_t* slot, uint64_t value, int sender) const {
    nvshmem_uint64_p(slot, value, sender);
  }
};

}  // namespace

cudaError_t fold_streamed(const kernels::StreamedFold& fold, kernels::WaitError* error,
                          cudaStream_t stream) {
  return kernels::detail::launch_streamed_fold(fold, NvshmemCredit{}, nullptr, error, stream);
}

}  // namespace odc::nvshmem
