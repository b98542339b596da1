// The transports this build has, by name, and how to make one: the floor of the transports, so
// that the core never includes a concrete transport. The C API picks a transport here instead of
// knowing which backends were compiled in. Transports include core/transport_spec.h, never this
// header: the registry includes them, not the other way round.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/transport.h"
#include "core/transport_spec.h"

namespace odc {

struct TransportInfo {
  const char* name;  // "shm", "cuda", "nvshmem"
  Result<std::unique_ptr<Transport>> (*create)(const TransportSpec& spec);
};

// Every transport compiled into this build.
const std::vector<TransportInfo>& transports();
// The transport called `name`, or an InvalidUsage naming the ones this build has.
Result<const TransportInfo*> find_transport(const std::string& name);

}  // namespace odc
