// Regions on NVSHMEM's symmetric heap. nvshmem_malloc and nvshmem_free are collectives that wait
// forever for a missing PE, so each is entered only after a bounded bootstrap collective saw
// every rank, and skipped (memory leaked until exit) once the job is known to be broken.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>

#include "bootstrap/bootstrap.h"
#include "common/status.h"
#include "core/transport.h"

namespace odc::nvshmem {

// Shared by a transport and every region it allocated, which may outlive it.
struct SymmetricHeap {
  std::shared_ptr<Bootstrap> bootstrap;
  int device = 0;
  // Set once the job is broken (a rank failed, a bootstrap collective did not complete): no
  // NVSHMEM collective is entered any more.
  std::atomic<bool> failed{false};
};

// Collective: `bytes` of zeroed memory on every rank's symmetric heap; peer(r) is NVSHMEM's
// mapping of rank r's copy into this GPU (nvshmem_ptr), nullptr where only NVSHMEM's calls reach
// rank r (another node). Fails on every rank when it fails on one. Freed collectively when the
// region goes (every rank frees its regions in the same order).
Result<std::unique_ptr<SymmetricRegion>> allocate_symmetric(
    const std::shared_ptr<SymmetricHeap>& heap, size_t bytes);

}  // namespace odc::nvshmem
