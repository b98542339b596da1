// The transport registry (see registry.h). The one place that knows which transports were
// compiled in.
#include "transport/registry.h"

#include <dlfcn.h>

#include <mutex>

#include "transport/shm/shm_transport.h"
#if ODC_WITH_CUDA
#include "transport/cuda/cuda_transport.h"
#include "transport/nvshmem/nvshmem_plugin.h"
#endif

namespace odc {
namespace {

Result<std::unique_ptr<Transport>> create_shm(const TransportSpec& spec) {
  // The host transport's signal waits sleep on the shared-memory bootstrap's futex words and
  // check liveness through it: reuse the job's when it is one, else meet again under the key.
  if (auto local = std::dynamic_pointer_cast<shm::ShmBootstrap>(spec.bootstrap)) {
    return std::unique_ptr<Transport>(new shm::ShmTransport(std::move(local)));
  }
  auto made = shm::ShmTransport::create(spec.rank, spec.world_size, spec.key, spec.timeout,
                                        spec.bootstrap.get(), spec.launch_identity);
  if (!made.ok()) return made.status();
  return std::unique_ptr<Transport>(std::move(made).value());
}

#if ODC_WITH_CUDA
Result<std::unique_ptr<Transport>> create_cuda(const TransportSpec& spec) {
  if (!spec.bootstrap) return Status::InternalError("the CUDA transport needs a bootstrap");
  auto made = cuda::CudaTransport::create(spec.bootstrap, spec.timeout, spec.device, spec.cuda_sms);
  if (!made.ok()) return made.status();
  return std::unique_ptr<Transport>(std::move(made).value());
}

// The NVSHMEM transport lives in a plugin (libodc_nvshmem.so) so that libodc loads where NVSHMEM
// is missing: found through $ODC_NVSHMEM_PLUGIN (`given`, resolved by core/comm_config.cc), else
// next to libodc.so, else on the loader's search path. Loaded once, never unloaded (transports it
// made may outlive any communicator).
Result<OdcNvshmemCreateFn> load_nvshmem_plugin(const std::string& given) {
  static std::mutex mutex;
  static OdcNvshmemCreateFn create = nullptr;
  static std::string failure;
  std::lock_guard<std::mutex> lock(mutex);
  if (create != nullptr) return create;
  std::vector<std::string> candidates;
  if (!given.empty()) {
    candidates.push_back(given);
  } else {
    Dl_info self{};
    if (dladdr(reinterpret_cast<void*>(&load_nvshmem_plugin), &self) != 0 &&
        self.dli_fname != nullptr) {
      std::string dir = self.dli_fname;
      const size_t slash = dir.rfind('/');
      if (slash != std::string::npos) {
        candidates.push_back(dir.substr(0, slash + 1) + ODC_NVSHMEM_PLUGIN_NAME);
      }
    }
    candidates.push_back(ODC_NVSHMEM_PLUGIN_NAME);
  }
  std::string tried;
  for (const std::string& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      tried += "\n  " + path + ": " + (why != nullptr ? why : "not found");
      continue;
    }
    auto abi = reinterpret_cast<OdcNvshmemPluginAbiFn>(dlsym(handle, "odc_nvshmem_plugin_abi"));
    auto made = reinterpret_cast<OdcNvshmemCreateFn>(dlsym(handle, "odc_nvshmem_create"));
    if (abi == nullptr || made == nullptr || abi() != ODC_NVSHMEM_PLUGIN_ABI) {
      tried += "\n  " + path + ": not an odc NVSHMEM plugin of this build (ABI " +
               std::to_string(ODC_NVSHMEM_PLUGIN_ABI) + ")";
      continue;
    }
    create = made;
    return create;
  }
  return Status::InvalidUsage(
      "transport 'nvshmem' is unavailable: its plugin " ODC_NVSHMEM_PLUGIN_NAME
      " could not be loaded (build with -DODC_WITH_NVSHMEM=ON; at run time NVSHMEM's "
      "libnvshmem_host.so.3 must be found, e.g. LD_LIBRARY_PATH=.../site-packages/nvidia/nvshmem/"
      "lib; docs/multinode.md). Tried:" +
      tried);
}

Result<std::unique_ptr<Transport>> create_nvshmem(const TransportSpec& spec) {
  auto create = load_nvshmem_plugin(spec.nvshmem.plugin_path);
  if (!create.ok()) return create.status();
  if (!spec.bootstrap) return Status::InternalError("the NVSHMEM transport needs a bootstrap");
  Status status;
  Transport* made = create.value()(&spec, &status);
  if (made == nullptr) return status;
  return std::unique_ptr<Transport>(made);
}
#endif

}  // namespace

const std::vector<TransportInfo>& transports() {
  static const std::vector<TransportInfo> all = {
    {"shm", &create_shm},
#if ODC_WITH_CUDA
    {"cuda", &create_cuda},
    {"nvshmem", &create_nvshmem},
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
      (name == "cuda" || name == "nvshmem" ? ": odc was built without CUDA (ODC_WITH_CUDA=OFF)"
                                           : ""));
}

}  // namespace odc
