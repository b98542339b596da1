// Regions on NVSHMEM's symmetric heap (see nvshmem_heap.h).
#include "transport/nvshmem/nvshmem_heap.h"

#include <cuda_runtime.h>
#include <nvshmem_host.h>

#include <string>
#include <vector>

#include "transport/device/cuda_check.h"
#include "transport/nvshmem/nvshmem_process.h"

namespace odc::nvshmem {
namespace {

class NvshmemRegion final : public SymmetricRegion {
 public:
  NvshmemRegion(std::vector<void*> peers, int rank, size_t bytes,
                std::shared_ptr<SymmetricHeap> heap)
      : SymmetricRegion(std::move(peers), rank, bytes), heap_(std::move(heap)) {}
  ~NvshmemRegion() override {
    if (heap_->failed.load()) return;  // nvshmem_free would wait for every PE: leak instead
    cuda::DeviceGuard guard(heap_->device);
    cudaDeviceSynchronize();  // nothing queued may still touch it
    // Every rank frees (regions go in the same order on every rank); only free once all came.
    if (!heap_->bootstrap->barrier("nvshmem free").ok()) {
      heap_->failed.store(true);
      return;
    }
    nvshmem_free(local());
  }

 private:
  std::shared_ptr<SymmetricHeap> heap_;
};

// This rank's block of `bytes`, zeroed, or why not. A block that some ranks got stays allocated
// when others did not (freeing it is a collective the others miss).
Status allocate_zeroed(size_t bytes, void** memory) {
  *memory = nvshmem_malloc(bytes);
  if (*memory == nullptr) return Status::SystemError("nvshmem_malloc returned no memory");
  ODC_CUDA_CHECK(cudaMemset(*memory, 0, bytes));
  ODC_CUDA_CHECK(cudaDeviceSynchronize());
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<SymmetricRegion>> allocate_symmetric(
    const std::shared_ptr<SymmetricHeap>& heap, size_t bytes) {
  if (heap->failed.load()) {
    return Status::RemoteError("the NVSHMEM transport failed earlier: nothing more is allocated");
  }
  Bootstrap& bootstrap = *heap->bootstrap;
  const int rank = bootstrap.rank();
  const int world_size = bootstrap.world_size();
  cuda::DeviceGuard guard(heap->device);
  // Every rank is here and asks for the same size before NVSHMEM's collective (unbounded) malloc.
  const uint64_t mine = bytes;
  std::vector<uint64_t> sizes(static_cast<size_t>(world_size));
  ODC_RETURN_IF_ERROR(bootstrap.allgather(&mine, sizes.data(), sizeof(mine), "nvshmem alloc"));
  for (int r = 0; r < world_size; ++r) {
    if (sizes[static_cast<size_t>(r)] != mine) {
      return Status::InvalidArgument("NVSHMEM allocation sizes differ: rank " + std::to_string(r) +
                                     " asked for " + std::to_string(sizes[static_cast<size_t>(r)]) +
                                     " bytes, this rank for " + std::to_string(bytes));
    }
  }
  void* memory = nullptr;
  const Status allocated = allocate_zeroed(bytes, &memory);
  ODC_RETURN_IF_ERROR(agree_on_success(
      bootstrap, allocated, "nvshmem alloc",
      "could not allocate " + std::to_string(bytes) +
          " bytes on the NVSHMEM symmetric heap (NVSHMEM_SYMMETRIC_SIZE=" + symmetric_heap_size() +
          " bytes per GPU, fixed at init: raise it, or ODC_NVSHMEM_HEAP_GIB, before the first "
          "communicator; docs/multinode.md says how much odc needs)"));
  std::vector<void*> peers(static_cast<size_t>(world_size), nullptr);
  for (int r = 0; r < world_size; ++r) peers[static_cast<size_t>(r)] = nvshmem_ptr(memory, r);
  peers[static_cast<size_t>(rank)] = memory;
  return std::unique_ptr<SymmetricRegion>(new NvshmemRegion(std::move(peers), rank, bytes, heap));
}

}  // namespace odc::nvshmem
