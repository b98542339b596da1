// The transports this build has, by name, and how to make one: the floor of the transports, so
// that the core never includes a concrete transport. The C API picks a transport here instead of
// knowing which backends were compiled in.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "common/status.h"
#include "core/comm_config.h"
#include "core/transport.h"

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

struct TransportInfo {
  const char* name;  // "shm", "cuda", "nvshmem"
  Result<std::unique_ptr<Transport>> (*create)(const TransportSpec& spec);
};

// Every transport compiled into this build.
const std::vector<TransportInfo>& transports();
// The transport called `name`, or an InvalidUsage naming the ones this build has.
Result<const TransportInfo*> find_transport(const std::string& name);

}  // namespace odc
