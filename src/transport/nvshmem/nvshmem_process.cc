// NVSHMEM's process-wide setup (see nvshmem_process.h): its settings (the heap's size among
// them), the unique id agreed, the library initialized, each a step of its own. Serialized by one
// mutex: communicators may be made from several threads, NVSHMEM is one per process.
#include "transport/nvshmem/nvshmem_process.h"

#include <cuda_runtime.h>
#include <nvshmem_host.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/check.h"
#include "transport/device/cuda_check.h"

namespace odc::nvshmem {

namespace {

// NVSHMEM_CUMEM_GRANULARITY odc sets (32 MiB, as NVSHMEM reads it: bytes); see step 0.
constexpr const char* kHeapMappingStepBytes = "33554432";

// What this process's NVSHMEM was initialized as; later communicators must match it.
struct ProcessNvshmem {
  std::mutex mutex;
  bool initialized = false;
  int rank = -1;
  int world_size = 0;
  int device = -1;
  nvshmemx_uniqueid_t id;
  std::string heap_size;  // NVSHMEM_SYMMETRIC_SIZE as NVSHMEM saw it
};

ProcessNvshmem& process_nvshmem() {
  static ProcessNvshmem* state = new ProcessNvshmem();  // never destroyed: NVSHMEM outlives us
  return *state;
}

// Step 0, before NVSHMEM's first call: the settings odc chooses where the user did not. NVSHMEM
// reads them from the environment once, at its first call, which on rank 0 is
// nvshmemx_get_uniqueid (set after it, rank 0's NVSHMEM_INFO still showed the default heap size).
//   NVSHMEM_SYMMETRIC_SIZE   the user's, else the config's heap or ODC_NVSHMEM_HEAP_GIB
//                            (`heap_size`, resolved by core/comm_config.cc; docs/multinode.md);
//   NVSHMEM_DISABLE_NCCL=1   odc calls none of NVSHMEM's host collectives (its only collective
//                            calls are nvshmem_malloc and nvshmem_free), and the NCCL
//                            communicator NVSHMEM opens at init for them holds about 1.5 GiB
//                            per GPU (measured: docs/benchmarks-archive.md, nineteenth round);
//   NVSHMEM_CUMEM_GRANULARITY=32 MiB  NVSHMEM maps its heap in steps of this size (default
//                            512 MiB), so up to a step beyond what odc allocated is held.
// These setenv calls are the one place in src that writes the environment: NVSHMEM reads its
// settings only from there (docs/env.md names them).
Status configure_process_nvshmem(ProcessNvshmem& process, const std::string& heap_size) {
  process.heap_size = heap_size;
  // A value the user set came back as `heap_size` unchanged: writing it again changes nothing.
  ODC_SYSCHECK(setenv("NVSHMEM_SYMMETRIC_SIZE", process.heap_size.c_str(), 1),
               "setenv(NVSHMEM_SYMMETRIC_SIZE)");
  // overwrite = 0: a value the user set stays.
  ODC_SYSCHECK(setenv("NVSHMEM_DISABLE_NCCL", "1", 0), "setenv(NVSHMEM_DISABLE_NCCL)");
  ODC_SYSCHECK(setenv("NVSHMEM_CUMEM_GRANULARITY", kHeapMappingStepBytes, 0),
               "setenv(NVSHMEM_CUMEM_GRANULARITY)");
  return Status::Ok();
}

// Step 1: every rank gets rank 0's unique id (a fresh one, or the one this process was
// initialized with), after checking that a process already in NVSHMEM is asked to join the same
// job again.
Result<nvshmemx_uniqueid_t> agree_unique_id(ProcessNvshmem& process, Bootstrap& bootstrap,
                                            int device) {
  const int rank = bootstrap.rank();
  const int world_size = bootstrap.world_size();
  struct IdRecord {
    uint64_t ok;
    nvshmemx_uniqueid_t id;
  };
  IdRecord mine{};
  Status made = Status::Ok();
  if (process.initialized) {
    if (process.rank != rank || process.world_size != world_size || process.device != device) {
      made = Status::InvalidUsage(
          "NVSHMEM is already initialized in this process as rank " + std::to_string(process.rank) +
          " of " + std::to_string(process.world_size) + " on device " +
          std::to_string(process.device) + " (it cannot be initialized twice)");
    } else {
      mine.id = process.id;
    }
  } else if (rank == 0) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    made = ODC_NVSHMEM_STATUS(nvshmemx_get_uniqueid(&id));
    mine.id = id;
  }
  mine.ok = made.ok() ? 1 : 0;
  std::vector<IdRecord> all(static_cast<size_t>(world_size));
  ODC_RETURN_IF_ERROR(
      bootstrap.allgather(&mine, all.data(), sizeof(IdRecord), "nvshmem unique id"));
  for (int r = 0; r < world_size; ++r) {
    if (all[static_cast<size_t>(r)].ok == 0) {
      return Status::SystemError("rank " + std::to_string(r) + " could not start NVSHMEM" +
                                 (r == rank ? ": " + made.message() : ""));
    }
  }
  if (process.initialized) {
    for (int r = 0; r < world_size; ++r) {
      if (std::memcmp(&all[static_cast<size_t>(r)].id, &all[0].id, sizeof(nvshmemx_uniqueid_t)) !=
          0) {
        return Status::InvalidUsage(
            "ranks 0 and " + std::to_string(r) +
            " run different NVSHMEM jobs (NVSHMEM stays initialized for the life of a process; "
            "a later communicator must have the same ranks)");
      }
    }
  }
  return all[0].id;
}

// Step 2: NVSHMEM's init from the agreed id on the current device, agreed across ranks.
Status start_nvshmem(ProcessNvshmem& process, Bootstrap& bootstrap, nvshmemx_uniqueid_t id,
                     int device) {
  const int rank = bootstrap.rank();
  const int world_size = bootstrap.world_size();
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  Status started =
      ODC_NVSHMEM_STATUS(nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr));
  if (started.ok()) {
    // What nvshmemx_init_attr() does, but returning an error instead of exiting: the host
    // library's init, and the device state of this plugin's kernels that call NVSHMEM (the
    // streamed fold's credits), from NVSHMEM's static device library.
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    nvshmemx_init_init_attr_ver_only(attr);
    int provided = 0;
    started = ODC_NVSHMEM_STATUS(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                                      NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version));
    if (!started.ok()) {
      started = Status::SystemError(started.message() +
                                    "; NVSHMEM_DEBUG=WARN prints why, docs/multinode.md");
    }
  }
  ODC_RETURN_IF_ERROR(
      agree_on_success(bootstrap, started, "nvshmem init", "could not initialize NVSHMEM"));
  process.initialized = true;
  process.rank = rank;
  process.world_size = world_size;
  process.device = device;
  process.id = id;
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world_size) {
    return Status::InternalError("NVSHMEM made this rank PE " + std::to_string(nvshmem_my_pe()) +
                                 " of " + std::to_string(nvshmem_n_pes()) + ", expected " +
                                 std::to_string(rank) + " of " + std::to_string(world_size));
  }
  return Status::Ok();
}

}  // namespace

Status join_process_nvshmem(Bootstrap& bootstrap, int device, const std::string& heap_size) {
  ProcessNvshmem& process = process_nvshmem();
  std::lock_guard<std::mutex> lock(process.mutex);
  // NVSHMEM binds to the device current at init: make it ours for the scope.
  cuda::DeviceGuard guard(device);
  ODC_CUDA_CHECK(cudaSetDevice(device));
  if (!process.initialized) ODC_RETURN_IF_ERROR(configure_process_nvshmem(process, heap_size));
  auto id = agree_unique_id(process, bootstrap, device);
  if (!id.ok()) return id.status();
  if (process.initialized) return Status::Ok();  // the same job again
  return start_nvshmem(process, bootstrap, id.value(), device);
}

Result<int> agree_ranks_per_node(Bootstrap& bootstrap, int configured) {
  const int world_size = bootstrap.world_size();
  const int local_size = configured > 0 ? configured : nvshmem_team_n_pes(NVSHMEMX_TEAM_NODE);
  if (local_size <= 0 || world_size % local_size != 0) {
    return Status::InvalidArgument(
        "ranks per node (ODC_LOCAL_WORLD_SIZE / LOCAL_WORLD_SIZE / NVSHMEM's node team) is " +
        std::to_string(local_size) + ", which does not divide the world size " +
        std::to_string(world_size));
  }
  const auto mine = static_cast<uint64_t>(local_size);
  std::vector<uint64_t> sizes(static_cast<size_t>(world_size));
  ODC_RETURN_IF_ERROR(
      bootstrap.allgather(&mine, sizes.data(), sizeof(mine), "nvshmem ranks per node"));
  for (int r = 0; r < world_size; ++r) {
    if (sizes[static_cast<size_t>(r)] != mine) {
      return Status::InvalidArgument("rank " + std::to_string(r) + " has " +
                                     std::to_string(sizes[static_cast<size_t>(r)]) +
                                     " ranks per node, this rank " + std::to_string(mine) +
                                     " (ODC_LOCAL_WORLD_SIZE must agree)");
    }
  }
  return local_size;
}

std::string symmetric_heap_size() {
  ProcessNvshmem& process = process_nvshmem();
  std::lock_guard<std::mutex> lock(process.mutex);
  return process.heap_size;
}

std::string nvshmem_version_text() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Status agree_on_success(Bootstrap& bootstrap, const Status& mine, const char* operation,
                        const std::string& failure) {
  const uint64_t ok = mine.ok() ? 1 : 0;
  std::vector<uint64_t> oks(static_cast<size_t>(bootstrap.world_size()));
  ODC_RETURN_IF_ERROR(bootstrap.allgather(&ok, oks.data(), sizeof(ok), operation));
  for (int r = 0; r < bootstrap.world_size(); ++r) {
    if (oks[static_cast<size_t>(r)] != 0) continue;
    return Status::SystemError("rank " + std::to_string(r) + " " + failure +
                               (r == bootstrap.rank() ? ": " + mine.message() : ""));
  }
  return Status::Ok();
}

}  // namespace odc::nvshmem
