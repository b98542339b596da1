// The transport registry (see transport_registry.h). The one place that knows which transports
// were compiled in.
#include "core/transport_registry.h"

#include "transport/shm/shm_transport.h"
#if ODC_WITH_CUDA
#include "transport/cuda/cuda_transport.h"
#endif

namespace odc {
namespace {

Result<std::unique_ptr<Transport>> create_shm(const TransportSpec& spec) {
  // The host transport's signal waits sleep on the shared-memory bootstrap's futex words and
  // check liveness through it: reuse the job's when it is one, else meet again under the key.
  if (auto local = std::dynamic_pointer_cast<shm::ShmBootstrap>(spec.bootstrap)) {
    return std::unique_ptr<Transport>(new shm::ShmTransport(std::move(local)));
  }
  auto made = shm::ShmTransport::create(spec.rank, spec.world_size, spec.key, spec.timeout);
  if (!made.ok()) return made.status();
  return std::unique_ptr<Transport>(std::move(made).value());
}

#if ODC_WITH_CUDA
Result<std::unique_ptr<Transport>> create_cuda(const TransportSpec& spec) {
  if (!spec.bootstrap) return Status::InternalError("the CUDA transport needs a bootstrap");
  auto made = cuda::CudaTransport::create(spec.bootstrap, spec.timeout, spec.device);
  if (!made.ok()) return made.status();
  return std::unique_ptr<Transport>(std::move(made).value());
}
#endif

}  // namespace

const std::vector<TransportInfo>& transports() {
  static const std::vector<TransportInfo> all = {
    {"shm", false, TransportCaps{false, false}, &create_shm},
#if ODC_WITH_CUDA
    {"cuda", true, TransportCaps{true, true}, &create_cuda},
#endif
  };
  return all;
}

Result<const TransportInfo*> find_transport(const std::string& name) {
  std::string known;
  for (const TransportInfo& info : transports()) {
    if (name == info.name) return &info;
    known += (known.empty() ? "" : ", ") + std::string(info.name);
  }
  return Status::InvalidUsage(
      "transport '" + name + "' is not in this build (it has: " + known + ")" +
      (name == "cuda" ? ": odc was built without CUDA (ODC_WITH_CUDA=OFF)" : ""));
}

}  // namespace odc
