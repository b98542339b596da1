// What a transport is made from (TransportSpec): the one type that both the registry and every
// transport's factory (the NVSHMEM plugin's C entry point included) name. It sits in the core,
// below both, so that no transport includes the registry (transport/) that picks it.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "bootstrap/bootstrap.h"
#include "core/comm_config.h"

namespace odc {

struct TransportSpec {
  int rank = 0;
  int world_size = 1;
  // How the ranks met (always set): collectives before and beside the transport's own (unique
  // ids, handles, host barriers) and failure flags. A shared-memory bootstrap (bootstrap/
  // shm_bootstrap.h) for key-based init, else the caller's.
  std::shared_ptr<Bootstrap> bootstrap;
  std::string key;  // names this job's local shared memory (agreed through the bootstrap)
  std::chrono::duration<double> timeout{60.0};
  int device = -1;  // CUDA device for device transports
  // Resolved by core/comm_config.cc (transports read no variable): the CUDA transport's SM
  // budget (0: all), NVSHMEM's ranks per node (0: its node team) and settings.
  int cuda_sms = 0;
  int ranks_per_node = 0;
  NvshmemSettings nvshmem;
  std::string launch_identity;  // for shared-memory bootstraps (bootstrap/shm_bootstrap.h)
};

}  // namespace odc
