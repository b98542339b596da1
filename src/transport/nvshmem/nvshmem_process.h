// NVSHMEM as one process holds it: initialized once per process over odc's bootstrap (a unique id
// from rank 0), its settings chosen before its first call (the symmetric heap's size, as
// core/comm_config.cc resolved it: NVSHMEM_SYMMETRIC_SIZE, else the config's or
// ODC_NVSHMEM_HEAP_GIB; no NCCL communicator of its own; a 32 MiB mapping step; each unless the
// user set it), the job's node boundaries, and never finalized by
// odc (finalize is a collective that waits forever for a dead PE, and NVSHMEM cannot be
// initialized twice). Invariant: every step that can fail on one rank is agreed through the
// bootstrap, so all ranks fail together instead of some entering an NVSHMEM collective that never
// completes.
#pragma once

#include <string>

#include "bootstrap/bootstrap.h"
#include "common/status.h"

namespace odc::nvshmem {

// Collective over `bootstrap`: afterwards this process is NVSHMEM PE bootstrap.rank() of
// bootstrap.world_size(), bound to `device`. The first call sizes the heap and initializes
// NVSHMEM with a heap of `heap_size` (NVSHMEM_SYMMETRIC_SIZE's syntax); a later one (a later
// communicator) must be the same job (ranks, device, unique id). Fails on every rank when it
// fails on one.
Status join_process_nvshmem(Bootstrap& bootstrap, int device, const std::string& heap_size);

// Collective: the ranks per node (contiguous ranks share a node) every rank agrees on:
// `configured` (the config's, ODC_LOCAL_WORLD_SIZE or torchrun's LOCAL_WORLD_SIZE, as
// core/comm_config.cc resolved it; smaller than the real node: pretended nodes, tests), else (0)
// NVSHMEM's node team. An error names a value that does not divide the world size, or ranks that
// disagree.
Result<int> agree_ranks_per_node(Bootstrap& bootstrap, int configured);

// NVSHMEM_SYMMETRIC_SIZE as NVSHMEM saw it at init (bytes per GPU; "" before), for messages.
std::string symmetric_heap_size();

// "3.4.5": the NVSHMEM this plugin runs with.
std::string nvshmem_version_text();

// Every rank learns whether every rank's `mine` is Ok: Ok when all are, else an error naming the
// first rank that failed ("rank R " + `failure`), with this rank's own reason where it is R.
// `operation` names the step in the bootstrap's errors.
Status agree_on_success(Bootstrap& bootstrap, const Status& mine, const char* operation,
                        const std::string& failure);

// An NVSHMEM host call that returns 0 on success, as a Status naming the call and file:line.
inline Status nvshmem_call_status(int code, const char* call, const char* file, int line) {
  if (code == 0) return Status::Ok();
  return Status::SystemError(std::string(call) + " failed with status " + std::to_string(code) +
                             " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace odc::nvshmem

#define ODC_NVSHMEM_STATUS(call) \
  ::odc::nvshmem::nvshmem_call_status((call), #call, __FILE__, __LINE__)
