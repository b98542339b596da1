// C API of the communicator. Handles are checked before anything reads them: communicators against
// a registry of live ones (a destroyed handle gives odcInvalidUsage), buffers against their
// communicator's table. A buffer handle is a number never reused in the process (not a pointer), so
// a freed handle stays invalid even once a new buffer takes its memory.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "api/api_errors.h"
#include "bootstrap/bootstrap.h"
#include "bootstrap/shm_bootstrap.h"
#include "common/env.h"
#include "common/interrupt.h"
#include "core/comm_config.h"
#include "core/communicator.h"
#include "core/node_traffic.h"
#include "odc/odc.h"
#include "transport/registry.h"

struct odcComm {
  std::unique_ptr<odc::Communicator> communicator;
  std::string last_error;
  // Live buffers by handle (odcBuffer_t is the number, cast).
  std::map<uint64_t, odc::Buffer*> buffers;
  // The process that created it: only it may use or destroy it. A forked child shares its control
  // blocks and mappings; its calls (or its destroy, e.g. from a Python finalizer) would act as this
  // rank in the parent's job.
  pid_t creator = ::getpid();
  // Calls running now, and whether a destroy waits for them (both under registry_mutex).
  int num_in_flight = 0;
  bool destroying = false;
  // Set by destroy: waits of calls in flight (other threads) end (common/interrupt.h).
  std::atomic<bool> closing{false};
  // The thread inside a call of this communicator (its kernel thread id; 0: none) and that call's
  // function: a communicator is used by one thread at a time, so a call entering from another
  // thread meanwhile is refused at once (UserThread below).
  std::atomic<pid_t> user_thread{0};
  std::atomic<const char*> user_function{nullptr};
};

namespace {

using odc::Status;
using odc::api::guarded;
using odc::api::report;
using odc::api::success;

std::mutex registry_mutex;
std::condition_variable calls_left;  // a call of a communicator being destroyed has returned
std::set<const odcComm*> live_comms;
// Destroyed communicators keep their (emptied) handle object, so that no later communicator gets
// the same address: a stale handle stays "used after destroy" instead of reaching a new one.
std::set<const odcComm*>* retired_comms = new std::set<const odcComm*>();

// Records a failure on the communicator and the thread.
odcResult_t report_on(odcComm* comm, const Status& status) {
  if (comm != nullptr) comm->last_error = status.message();
  return report(status);
}

odcResult_t succeed_on(odcComm* comm) {
  comm->last_error.clear();
  return success();
}

std::string forked_use(const char* function, const odcComm* comm) {
  return std::string(function) + ": this communicator was created by process " +
         std::to_string(comm->creator) + "; process " + std::to_string(::getpid()) +
         " (a forked child?) cannot use it (its destroy only forgets the handle, leaving the "
         "parent's communicator as it is)";
}

// The communicator behind a handle, or the error for a NULL / destroyed one. Requires
// registry_mutex.
Status lookup_locked(odcComm_t comm, const char* function) {
  if (comm == nullptr) return Status::InvalidArgument(std::string(function) + ": comm is NULL");
  if (live_comms.count(comm) == 0) {
    return Status::InvalidUsage(std::string(function) +
                                ": communicator used after destroy (or never created)");
  }
  if (comm->creator != ::getpid()) return Status::InvalidUsage(forked_use(function, comm));
  if (comm->destroying) {
    return Status::InvalidUsage(std::string(function) +
                                ": communicator is being destroyed by another thread");
  }
  return Status::Ok();
}

Status lookup(odcComm_t comm, const char* function) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return lookup_locked(comm, function);
}

// A call in flight on a live communicator: a destroy from another thread ends its waits and waits
// for it to return before freeing anything.
class InFlight {
 public:
  explicit InFlight(odcComm* comm) : comm_(comm), scope_(&comm->closing) {}
  ~InFlight() {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (--comm_->num_in_flight == 0 && comm_->destroying) calls_left.notify_all();
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  odcComm* comm_;
  odc::CallScope scope_;
};

// This thread's kernel id (what `ps -L`, gdb and Python's threading.get_native_id() show),
// cached per thread; a forked child's forking thread has a new id, so fork clears its cache.
thread_local pid_t cached_thread_id = 0;

pid_t this_thread_id() {
  if (cached_thread_id == 0) {
    static const bool forget_at_fork =
        ::pthread_atfork(nullptr, nullptr, [] { cached_thread_id = 0; }) == 0;
    (void)forget_at_fork;
    cached_thread_id = static_cast<pid_t>(::syscall(SYS_gettid));
  }
  return cached_thread_id;
}

// `12345 ("name")`: a thread's id and its name as the kernel keeps it (pthread_setname_np;
// Python sets it for threads it starts from 3.14 on), or the id alone where none can be read.
std::string describe_thread(pid_t id) {
  std::string text = std::to_string(id);
  char name[64] = {};
  if (id == this_thread_id()) {
    if (pthread_getname_np(pthread_self(), name, sizeof(name)) != 0) name[0] = '\0';
  } else if (FILE* file =
                 std::fopen(("/proc/self/task/" + std::to_string(id) + "/comm").c_str(), "r")) {
    if (std::fgets(name, sizeof(name), file) == nullptr) name[0] = '\0';
    std::fclose(file);
  }
  std::string shown(name, strnlen(name, sizeof(name)));
  while (!shown.empty() && shown.back() == '\n') shown.pop_back();
  return shown.empty() ? text : text + " (\"" + shown + "\")";
}

// The calling thread's turn on a communicator for the length of one call: a communicator is used
// by one thread at a time (odc.h), and two threads inside one interleave its sequence numbers and
// signals (before this guard, concurrent pushes timed out with a sequence no rank had sent). One
// compare-and-swap per call. A call entering while another thread is inside one is the caller's
// mistake: it is refused before it touches anything, so the other thread's call goes on
// unaffected and the communicator stays usable. The same thread may nest (a callback of a call,
// e.g. a Python signal handler run by the interrupt check, calling odcCommAbort): it already
// holds the turn. odcCommDestroy and odcCommGetLastError take no turn: destroy from another
// thread is the documented way to end a call in flight.
class UserThread {
 public:
  UserThread(odcComm* comm, const char* function) : comm_(comm) {
    const pid_t me = this_thread_id();
    pid_t holder = 0;
    if (comm->user_thread.compare_exchange_strong(holder, me, std::memory_order_acquire)) {
      comm->user_function.store(function, std::memory_order_relaxed);
      held_ = true;
    } else if (holder != me) {
      const char* inside = comm->user_function.load(std::memory_order_relaxed);
      const odc::Communicator& c = *comm->communicator;  // rank and label never change
      refusal_ = Status::InvalidUsage(
          (c.label().empty() ? "" : c.label() + ": ") + "rank " + std::to_string(c.rank()) + ": " +
          function + ": refused: thread " + describe_thread(me) + " called it while thread " +
          describe_thread(holder) + " is inside " + (inside != nullptr ? inside : "a call") +
          " of the same communicator; a communicator is used by one thread at a time (give "
          "each thread its own, or serialize the calls): this call changed nothing and the "
          "other goes on");
    }
  }
  ~UserThread() {
    if (held_) comm_->user_thread.store(0, std::memory_order_release);
  }
  UserThread(const UserThread&) = delete;
  UserThread& operator=(const UserThread&) = delete;

  // Ok, or why this thread may not call now.
  const Status& refusal() const { return refusal_; }

 private:
  odcComm* comm_;
  bool held_ = false;
  Status refusal_ = Status::Ok();
};

// Buffer handles: 1, 2, 3, ... across every communicator of the process, never reused.
std::atomic<uint64_t> next_buffer_handle{1};

// The buffer behind a handle of `comm`, looked up without reading through it: NULL stays NULL (the
// communicator names it), an unknown handle (garbage, freed, or another communicator's) is refused.
odc::Result<odc::Buffer*> as_buffer(const odcComm* comm, const odc::Communicator& c,
                                    odcBuffer_t buffer, const char* operation) {
  if (buffer == nullptr) return static_cast<odc::Buffer*>(nullptr);
  const auto found = comm->buffers.find(reinterpret_cast<uintptr_t>(buffer));
  if (found != comm->buffers.end()) return found->second;
  return Status::InvalidArgument("rank " + std::to_string(c.rank()) + ": " + operation +
                                 ": buffer does not belong to this communicator (freed, never "
                                 "allocated, or allocated by another one)");
}

// Out-of-range values stay out of range here; the communicator rejects them by name.
odc::DataType as_dtype(const odcDataType_t& dtype) {
  return static_cast<odc::DataType>(static_cast<uint32_t>(odc::api::raw_enum_value(dtype)));
}

// Runs `body(communicator)` on a live handle, recording any failure on it.
template <typename Body>
odcResult_t with_comm(odcComm_t comm, const char* function, Body&& body) {
  return guarded([&]() -> odcResult_t {
    {
      std::lock_guard<std::mutex> lock(registry_mutex);
      if (Status status = lookup_locked(comm, function); !status.ok()) return report(status);
      ++comm->num_in_flight;
    }
    InFlight in_flight(comm);
    const UserThread turn(comm, function);
    // Refused: the thread's last error only; the communicator's belongs to the call in flight.
    if (!turn.refusal().ok()) return report(turn.refusal());
    Status status = body(*comm->communicator);
    return status.ok() ? succeed_on(comm) : report_on(comm, status);
  });
}

}  // namespace

namespace {

// Shared by the init calls: resolves the config (every ODC_* variable it leaves unset), builds
// the transport through the registry, agrees the config across ranks and registers the new
// communicator.
odcResult_t init_comm(odcComm_t* comm, int rank, int world_size, const odc::CommConfig& config,
                      const char* key, const odcBootstrap_t* external = nullptr) {
  return guarded([&]() -> odcResult_t {
    if (comm == nullptr) return report(Status::InvalidArgument("odcCommInit: comm is NULL"));
    if (key == nullptr && external == nullptr) {
      return report(Status::InvalidArgument("odcCommInit: key is NULL (and no bootstrap given)"));
    }
    std::shared_ptr<odc::Bootstrap> bootstrap;
    auto fail = [&](const Status& status) {
      Status named = status.with_context("rank " + std::to_string(rank) + ": init");
      if (bootstrap) bootstrap->mark_failed(named.message());
      return report(named);
    };
    if (external != nullptr) {
      if (key != nullptr) {
        return fail(Status::InvalidArgument("give a key or a bootstrap, not both"));
      }
      if (external->version != ODC_BOOTSTRAP_VERSION) {
        return fail(Status::InvalidArgument(
            "bootstrap has version " + std::to_string(external->version) +
            "; this library expects " + std::to_string(ODC_BOOTSTRAP_VERSION)));
      }
      auto made = odc::make_external_bootstrap(
          rank, world_size,
          odc::ExternalBootstrapCallbacks{external->ctx, external->allgather, external->barrier,
                                          external->mark_failed});
      if (!made.ok()) return fail(made.status());
      bootstrap = std::move(made).value();
    }
    auto resolved = odc::resolve(config);
    if (!resolved.ok()) return fail(resolved.status());
    const odc::ResolvedConfig& settings = resolved.value();
    auto info = odc::find_transport(settings.transport);
    if (!info.ok()) return fail(info.status());
    const auto timeout = std::chrono::duration<double>(settings.timeout_seconds);
    std::string agreed_key = key != nullptr ? key : "";
    if (bootstrap) {
      // The local transports' shared memory is named by a key only this job knows.
      auto agreed = odc::agree_on_key(*bootstrap);
      if (!agreed.ok()) return fail(agreed.status());
      agreed_key = agreed.value();
    } else {
      // Key-based init: the ranks meet in local shared memory (this is where a key in use, a
      // missing or dead rank, or a forged peer segment is reported).
      auto made = odc::shm::ShmBootstrap::create(rank, world_size, agreed_key, timeout, nullptr,
                                                 nullptr, settings.launch_identity);
      if (!made.ok())
        return report(made.status().with_context("rank " + std::to_string(rank) + ": init"));
      bootstrap = std::move(made).value();
    }
    odc::TransportSpec spec;
    spec.rank = rank;
    spec.world_size = world_size;
    spec.bootstrap = bootstrap;
    spec.key = agreed_key;
    spec.timeout = timeout;
    spec.device = settings.device;
    spec.cuda_sms = settings.cuda_sms;
    spec.ranks_per_node = settings.ranks_per_node;  // 0: the transport's report
    spec.nvshmem = settings.nvshmem;
    spec.launch_identity = settings.launch_identity;
    auto transport = info.value()->create(spec);
    if (!transport.ok()) return fail(transport.status());
    // Every rank's transport exists before any rank returns (a rank whose init failed has marked
    // itself failed, so this ends with an error instead of waiting out a timeout).
    if (Status status = bootstrap->barrier("init transport"); !status.ok()) {
      transport.value()->mark_failed("init: " + status.message());
      return fail(status);
    }
    // One exchange: every rank's node layout, scheme and budgets (a knob that cannot be read or
    // a budget that differs fails every rank, naming each).
    const bool streamed = !settings.deterministic && !transport.value()->caps().remote_fp32_add;
    auto topology = odc::agree_config(*transport.value(), settings, streamed);
    if (!topology.ok()) return fail(topology.status());
    odc::CommOptions options;
    options.deterministic = settings.deterministic;
    options.bootstrap = bootstrap;
    options.staging_bytes = settings.staging_bytes.value;
    options.topology = std::move(topology).value();
    options.node_cache_bytes = settings.node_cache_bytes.value;
    options.node_aggregation_bytes = settings.node_aggregation_bytes.value;
    options.node_stats = settings.node_stats;
    auto* created = new odcComm();
    created->communicator =
        std::make_unique<odc::Communicator>(std::move(transport).value(), std::move(options));
    {
      std::lock_guard<std::mutex> lock(registry_mutex);
      live_comms.insert(created);
    }
    *comm = created;
    return success();
  });
}

// <= 0: unset (the environment's, else 60 s); NaN is kept for resolve() to refuse.
std::optional<double> timeout_or_unset(double timeout_seconds) {
  if (timeout_seconds > 0 || std::isnan(timeout_seconds)) return timeout_seconds;
  return std::nullopt;
}

std::optional<size_t> bytes_or_unset(size_t bytes) {
  if (bytes == ODC_BYTES_FROM_ENVIRONMENT) return std::nullopt;
  return bytes;
}

}  // namespace

extern "C" odcResult_t odcCommInit(odcComm_t* comm, int rank, int world_size, const char* key,
                                   double timeout_seconds) {
  odc::CommConfig config;
  config.transport = "shm";
  config.timeout_seconds = timeout_or_unset(timeout_seconds);
  return init_comm(comm, rank, world_size, config, key);
}

extern "C" odcResult_t odcCommInitCuda(odcComm_t* comm, int rank, int world_size, const char* key,
                                       double timeout_seconds, int cuda_device) {
  odc::CommConfig config;
  config.transport = "cuda";
  config.device = cuda_device;
  config.timeout_seconds = timeout_or_unset(timeout_seconds);
  return init_comm(comm, rank, world_size, config, key);
}

// The size of each version of odcCommConfig_t, as its header declared the struct: version v
// ended where version v+1's first field begins (odc.h, "Compatibility").
constexpr size_t kConfigSizes[] = {
    offsetof(odcCommConfig_t, bootstrap),         // version 1
    offsetof(odcCommConfig_t, staging_bytes),     // version 2
    offsetof(odcCommConfig_t, node_cache_bytes),  // version 3
    offsetof(odcCommConfig_t, cuda_sms),          // version 4
    sizeof(odcCommConfig_t),                      // version 5
};
static_assert(std::size(kConfigSizes) == ODC_COMM_CONFIG_VERSION);
static_assert(sizeof(odcCommConfig_t) == 96, "odc.h documents version 5 as 96 bytes");
// The defaults live in the public header (ODC_COMM_CONFIG_INIT) only; odcCommConfigInit copies
// them.
constexpr odcCommConfig_t kDefaultConfig = ODC_COMM_CONFIG_INIT;

extern "C" odcResult_t odcCommConfigInit(odcCommConfig_t* config) {
  return guarded([&]() -> odcResult_t {
    if (config == nullptr) {
      return report(Status::InvalidArgument("odcCommConfigInit: config is NULL"));
    }
    // The header (16 bytes every version has) is checked before anything is written: only an
    // exact (size, version) pair of a known version says how large the caller's struct is.
    const unsigned int version = config->version;
    if (version < 1 || version > ODC_COMM_CONFIG_VERSION ||
        config->size != kConfigSizes[version - 1]) {
      return report(Status::InvalidArgument(
          "odcCommConfigInit: config has size " + std::to_string(config->size) + " and version " +
          std::to_string(version) + ", not the header of a version this library knows (version " +
          std::to_string(ODC_COMM_CONFIG_VERSION) + ": size " +
          std::to_string(sizeof(odcCommConfig_t)) +
          "): declare it with ODC_COMM_CONFIG_INIT (a caller built against an odc header without "
          "it must be rebuilt)"));
    }
    constexpr size_t header_bytes = offsetof(odcCommConfig_t, transport);
    std::memcpy(reinterpret_cast<char*>(config) + header_bytes,
                reinterpret_cast<const char*>(&kDefaultConfig) + header_bytes,
                config->size - header_bytes);
    return success();
  });
}

namespace {

// The caller's odcCommConfig_t as the core's CommConfig: only the fields its version has (later
// ones stay unset), every "from the environment" value (ODC_BYTES_FROM_ENVIRONMENT, 0 for the
// staging budget, ranks per node and SMs, a timeout <= 0) as unset.
odc::Result<odc::CommConfig> read_config(const odcCommConfig_t* config, const std::string& where) {
  if (config == nullptr) return Status::InvalidArgument(where + "config is NULL");
  // The version the caller declared, when its size holds that version's fields.
  unsigned int version = 0;
  if (config->version >= 1 && config->version <= ODC_COMM_CONFIG_VERSION &&
      config->size >= kConfigSizes[config->version - 1]) {
    version = config->version;
  }
  if (version == 0) {
    return Status::InvalidArgument(
        where + "config has version " + std::to_string(config->version) + " and size " +
        std::to_string(config->size) + "; this library expects version " +
        std::to_string(ODC_COMM_CONFIG_VERSION) + " and size " +
        std::to_string(sizeof(odcCommConfig_t)) + " (declare it with ODC_COMM_CONFIG_INIT)");
  }
  odc::CommConfig out;
  switch (static_cast<int>(odc::api::raw_enum_value(config->transport))) {
    case odcTransportAuto:
      break;  // resolve() picks: shm without a device, else $ODC_TRANSPORT or cuda
    case odcTransportShm:
      out.transport = "shm";
      break;
    case odcTransportCuda:
      out.transport = "cuda";
      break;
    case odcTransportNvshmem:
      out.transport = "nvshmem";
      break;
    default:
      return Status::InvalidArgument(
          where + "unknown transport " +
          std::to_string(static_cast<int>(odc::api::raw_enum_value(config->transport))));
  }
  out.device = config->device;
  out.timeout_seconds = timeout_or_unset(config->timeout_seconds);
  out.deterministic = config->deterministic != 0;
  if (version >= 3) {
    if (config->staging_bytes != 0) out.staging_bytes = bytes_or_unset(config->staging_bytes);
    if (config->ranks_per_node != 0) out.ranks_per_node = config->ranks_per_node;
  }
  if (version >= 4) {
    out.node_cache_bytes = bytes_or_unset(config->node_cache_bytes);
    out.node_aggregation_bytes = bytes_or_unset(config->node_aggregation_bytes);
  }
  if (version >= 5) {
    if (config->cuda_sms != 0) out.cuda_sms = config->cuda_sms;
    out.nvshmem_heap_bytes = bytes_or_unset(config->nvshmem_heap_bytes);
  }
  return out;
}

}  // namespace

extern "C" odcResult_t odcCommInitConfig(odcComm_t* comm, int rank, int world_size,
                                         const odcCommConfig_t* config) {
  return guarded([&]() -> odcResult_t {
    auto read = read_config(config, "rank " + std::to_string(rank) + ": init: ");
    if (!read.ok()) return report(read.status());
    const bool has_bootstrap = config->version >= 2;  // version 1 ended before `bootstrap`
    return init_comm(comm, rank, world_size, read.value(), config->key,
                     has_bootstrap ? config->bootstrap : nullptr);
  });
}

extern "C" odcResult_t odcCommConfigResolve(const odcCommConfig_t* config,
                                            odcCommConfig_t* resolved) {
  return guarded([&]() -> odcResult_t {
    const std::string where = "odcCommConfigResolve: ";
    auto read = read_config(config, where);
    if (!read.ok()) return report(read.status());
    if (resolved == nullptr || resolved->size != config->size ||
        resolved->version != config->version) {
      return report(Status::InvalidArgument(
          where + "resolved must carry the config's header (size and version)"));
    }
    auto made = odc::resolve(read.value());
    if (!made.ok()) return report(made.status());
    const odc::ResolvedConfig& settings = made.value();
    std::memmove(resolved, config, config->size);
    resolved->transport = settings.transport == "shm"    ? odcTransportShm
                          : settings.transport == "cuda" ? odcTransportCuda
                                                         : odcTransportNvshmem;
    resolved->timeout_seconds = settings.timeout_seconds;
    auto bytes = [](const odc::ResolvedBytes& budget) {
      return budget.invalid.empty() ? budget.value : ODC_BYTES_FROM_ENVIRONMENT;
    };
    const unsigned int version = config->version;
    if (version >= 3) {
      resolved->staging_bytes = bytes(settings.staging_bytes);
      const bool known = settings.ranks_per_node_invalid.empty() &&
                         settings.ranks_per_node_source != odc::RanksPerNodeSource::kTransport;
      resolved->ranks_per_node = known ? settings.ranks_per_node : 0;
    }
    if (version >= 4) {
      resolved->node_cache_bytes = bytes(settings.node_cache_bytes);
      resolved->node_aggregation_bytes = bytes(settings.node_aggregation_bytes);
    }
    if (version >= 5) {
      resolved->cuda_sms = settings.cuda_sms;
      // Digits unless NVSHMEM_SYMMETRIC_SIZE (NVSHMEM's own syntax) was set.
      const auto heap = odc::parse_count(settings.nvshmem.heap_size, SIZE_MAX);
      resolved->nvshmem_heap_bytes = heap ? static_cast<size_t>(*heap) : ODC_BYTES_FROM_ENVIRONMENT;
    }
    return success();
  });
}

extern "C" odcResult_t odcMemoryNeed(const odcCommConfig_t* config, int world_size,
                                     size_t published_bytes, size_t accumulator_elements,
                                     odcMemoryNeed_t* need) {
  return guarded([&]() -> odcResult_t {
    if (need == nullptr) return report(Status::InvalidArgument("odcMemoryNeed: need is NULL"));
    auto read = read_config(config, "odcMemoryNeed: ");
    if (!read.ok()) return report(read.status());
    odc::CommConfig wanted = read.value();
    wanted.transport = "shm";  // the budgets only: no transport or device is asked for
    wanted.device = -1;
    auto resolved = odc::resolve(wanted);
    if (!resolved.ok()) return report(resolved.status());
    odc::ResolvedConfig settings = resolved.value();
    if (settings.ranks_per_node_source == odc::RanksPerNodeSource::kTransport ||
        !settings.ranks_per_node_invalid.empty()) {
      settings.ranks_per_node = 1;  // unknown: one node per rank, every node scheme counted
    }
    auto counted = odc::memory_need(settings, world_size, published_bytes, accumulator_elements);
    if (!counted.ok()) return report(counted.status());
    const odc::MemoryNeed& bytes = counted.value();
    *need =
        odcMemoryNeed_t{bytes.published,   bytes.accumulators,  bytes.staging,     bytes.node_cache,
                        bytes.aggregation, bytes.deterministic, bytes.heap_bytes()};
    return success();
  });
}

extern "C" odcResult_t odcCommDestroy(odcComm_t comm) {
  return guarded([&]() -> odcResult_t {
    std::unique_lock<std::mutex> lock(registry_mutex);
    if (comm != nullptr && live_comms.count(comm) != 0 && comm->creator != ::getpid()) {
      // A forked child's copy: forget the handle here and touch nothing the parent shares (no
      // "closed" mark, no unlinked names, no device calls). What the copy maps goes at its exit.
      live_comms.erase(comm);
      retired_comms->insert(comm);
      return success();
    }
    if (Status status = lookup_locked(comm, "odcCommDestroy"); !status.ok()) {
      return report(status);
    }
    // Calls in flight on other threads end their waits (interrupted) and return first.
    comm->destroying = true;
    comm->closing.store(true, std::memory_order_release);
    calls_left.wait(lock, [&] { return comm->num_in_flight == 0; });
    live_comms.erase(comm);
    lock.unlock();
    comm->buffers.clear();
    comm->communicator.reset();  // may wait (device communicators meet their peers first)
    comm->last_error = "communicator destroyed";
    lock.lock();
    retired_comms->insert(comm);
    return success();
  });
}

extern "C" odcResult_t odcCommRank(odcComm_t comm, int* rank) {
  return with_comm(comm, "odcCommRank", [&](odc::Communicator& c) {
    if (rank == nullptr) return Status::InvalidArgument("odcCommRank: rank is NULL");
    *rank = c.rank();
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommWorldSize(odcComm_t comm, int* world_size) {
  return with_comm(comm, "odcCommWorldSize", [&](odc::Communicator& c) {
    if (world_size == nullptr)
      return Status::InvalidArgument("odcCommWorldSize: world_size is NULL");
    *world_size = c.world_size();
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommGetMemory(odcComm_t comm, size_t* buffer_bytes,
                                        size_t* scheme_bytes) {
  return with_comm(comm, "odcCommGetMemory", [&](odc::Communicator& c) {
    const odc::Communicator::Memory memory = c.memory();
    if (buffer_bytes != nullptr) *buffer_bytes = memory.buffer_bytes;
    if (scheme_bytes != nullptr) *scheme_bytes = memory.scheme_bytes;
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommGetNodeCacheBytes(odcComm_t comm, size_t* bytes) {
  return with_comm(comm, "odcCommGetNodeCacheBytes", [&](odc::Communicator& c) {
    if (bytes == nullptr) return Status::InvalidArgument("odcCommGetNodeCacheBytes: bytes is NULL");
    *bytes = c.memory().node_cache_bytes;
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommGetStreamStats(odcComm_t comm, uint64_t* chunks_sent,
                                             uint64_t* credit_waits) {
  return with_comm(comm, "odcCommGetStreamStats", [&](odc::Communicator& c) {
    const odc::StreamedStaging* staging = c.staging();
    if (chunks_sent != nullptr) *chunks_sent = staging != nullptr ? staging->chunks_sent() : 0;
    if (credit_waits != nullptr) {
      *credit_waits = 0;
      if (staging != nullptr) {
        auto waits = staging->credit_waits();
        if (!waits.ok()) return waits.status();
        *credit_waits = waits.value();
      }
    }
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommGetNodeTraffic(odcComm_t comm, uint64_t* during_minibatches,
                                             uint64_t* in_minibatch_end) {
  return with_comm(comm, "odcCommGetNodeTraffic", [&](odc::Communicator& c) {
    const odc::StreamedStaging* staging = c.staging();
    const odc::NodeTraffic traffic =
        staging != nullptr ? staging->node_traffic() : odc::NodeTraffic{};
    if (during_minibatches != nullptr) *during_minibatches = traffic.during_minibatches;
    if (in_minibatch_end != nullptr) *in_minibatch_end = traffic.in_minibatch_end;
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommGetTopology(odcComm_t comm, int* num_nodes, int* node_of) {
  return with_comm(comm, "odcCommGetTopology", [&](odc::Communicator& c) {
    const odc::Topology* topology = c.topology();
    if (topology == nullptr) return Status::InternalError("odcCommGetTopology: not agreed yet");
    if (num_nodes != nullptr) *num_nodes = topology->num_nodes;
    if (node_of != nullptr) {
      for (int r = 0; r < c.world_size(); ++r) node_of[r] = topology->node(r);
    }
    return Status::Ok();
  });
}

extern "C" const char* odcCommGetLastError(odcComm_t comm) {
  if (!lookup(comm, "odcCommGetLastError").ok()) return "invalid or destroyed communicator";
  return comm->last_error.c_str();
}

namespace {

odcResult_t buffer_alloc(odcComm_t comm, const char* function, size_t count, odcDataType_t dtype,
                         odcBufferKind_t kind, const char* name, odcBuffer_t* buffer,
                         void** local) {
  return with_comm(comm, function, [&](odc::Communicator& c) -> Status {
    if (buffer == nullptr || local == nullptr) {
      return Status::InvalidArgument("rank " + std::to_string(c.rank()) +
                                     ": alloc: buffer and local must not be NULL");
    }
    if (kind != odcBufferShards && kind != odcBufferAccumulator && kind != odcBufferPublished) {
      return Status::InvalidArgument(
          "rank " + std::to_string(c.rank()) + ": alloc: unknown buffer kind " +
          std::to_string(static_cast<int>(kind)) +
          " (odcBufferShards, odcBufferAccumulator, odcBufferPublished)");
    }
    // Every size the runtime derives from count must fit: the shard (count x element), the
    // gathered buffer and the per-sender staging (world x count x element, float32 for
    // accumulators). A wrapped product would map too little and let a later push write past it.
    const odc::DataType type = as_dtype(dtype);
    const size_t element = odc::is_valid(type) ? odc::element_bytes(type) : 1;
    const size_t most = static_cast<size_t>(PTRDIFF_MAX) / element /
                        static_cast<size_t>(std::max(c.world_size(), 1));
    if (count > most) {
      return Status::InvalidArgument(
          "rank " + std::to_string(c.rank()) + ": alloc: count " + std::to_string(count) +
          " is too large: at most " + std::to_string(most) + " elements of " +
          std::to_string(element) + " bytes with " + std::to_string(c.world_size()) + " ranks");
    }
    std::string tag;
    if (name != nullptr) {
      // Bounded read: a missing terminator must not run through memory.
      const size_t length = strnlen(name, odc::kMaxBufferNameBytes + 1);
      if (length == 0) {
        return Status::InvalidArgument("rank " + std::to_string(c.rank()) +
                                       ": alloc: name is empty (pass NULL for an unnamed buffer)");
      }
      tag.assign(name, length);  // a name that is too long is refused by allocate()
    }
    auto allocated =
        c.allocate(count, type, kind == odcBufferAccumulator, tag, kind == odcBufferPublished);
    if (!allocated.ok()) return allocated.status();
    const uint64_t handle = next_buffer_handle.fetch_add(1);
    comm->buffers.emplace(handle, allocated.value());
    *buffer = reinterpret_cast<odcBuffer_t>(static_cast<uintptr_t>(handle));
    *local = allocated.value()->local();
    return Status::Ok();
  });
}

}  // namespace

extern "C" odcResult_t odcBufferAlloc(odcComm_t comm, size_t count, odcDataType_t dtype,
                                      int accumulator, odcBuffer_t* buffer, void** local) {
  return buffer_alloc(comm, "odcBufferAlloc", count, dtype,
                      accumulator != 0 ? odcBufferAccumulator : odcBufferShards, nullptr, buffer,
                      local);
}

extern "C" odcResult_t odcBufferAllocNamed(odcComm_t comm, size_t count, odcDataType_t dtype,
                                           int accumulator, const char* name, odcBuffer_t* buffer,
                                           void** local) {
  return buffer_alloc(comm, "odcBufferAllocNamed", count, dtype,
                      accumulator != 0 ? odcBufferAccumulator : odcBufferShards, name, buffer,
                      local);
}

extern "C" odcResult_t odcBufferAllocKind(odcComm_t comm, size_t count, odcDataType_t dtype,
                                          odcBufferKind_t kind, const char* name,
                                          odcBuffer_t* buffer, void** local) {
  return buffer_alloc(comm, "odcBufferAllocKind", count, dtype, kind, name, buffer, local);
}

extern "C" odcResult_t odcBufferFree(odcComm_t comm, odcBuffer_t buffer) {
  return with_comm(comm, "odcBufferFree", [&](odc::Communicator& c) -> Status {
    auto found = as_buffer(comm, c, buffer, "free");
    if (!found.ok()) return found.status();
    ODC_RETURN_IF_ERROR(c.release(found.value()));
    comm->buffers.erase(reinterpret_cast<uintptr_t>(buffer));
    return Status::Ok();
  });
}

extern "C" odcResult_t odcAccumulatorKeepSums(odcComm_t comm, odcBuffer_t accumulator) {
  return with_comm(comm, "odcAccumulatorKeepSums", [&](odc::Communicator& c) -> Status {
    auto found = as_buffer(comm, c, accumulator, "keep_sums");
    if (!found.ok()) return found.status();
    return c.keep_sums(found.value());
  });
}

extern "C" odcResult_t odcGather(odcComm_t comm, void* dst, size_t dst_count, odcBuffer_t buffer,
                                 odcStream_t stream) {
  return with_comm(comm, "odcGather", [&](odc::Communicator& c) -> Status {
    auto found = as_buffer(comm, c, buffer, "gather");
    if (!found.ok()) return found.status();
    return c.gather(dst, dst_count, found.value(), stream);
  });
}

extern "C" odcResult_t odcGatherAs(odcComm_t comm, void* dst, size_t dst_count,
                                   odcDataType_t dst_dtype, odcBuffer_t buffer,
                                   odcStream_t stream) {
  return with_comm(comm, "odcGatherAs", [&](odc::Communicator& c) -> Status {
    auto found = as_buffer(comm, c, buffer, "gather");
    if (!found.ok()) return found.status();
    return c.gather_as(dst, dst_count, as_dtype(dst_dtype), found.value(), stream);
  });
}

extern "C" odcResult_t odcScatterAccumulate(odcComm_t comm, const void* src, size_t src_count,
                                            odcDataType_t src_dtype, odcBuffer_t accumulator,
                                            odcStream_t stream) {
  return with_comm(comm, "odcScatterAccumulate", [&](odc::Communicator& c) -> Status {
    auto found = as_buffer(comm, c, accumulator, "scatter_accumulate");
    if (!found.ok()) return found.status();
    return c.scatter_accumulate(src, src_count, as_dtype(src_dtype), found.value(), stream);
  });
}

extern "C" odcResult_t odcMinibatchBegin(odcComm_t comm, odcStream_t stream) {
  return with_comm(comm, "odcMinibatchBegin",
                   [&](odc::Communicator& c) { return c.minibatch_begin(stream); });
}

extern "C" odcResult_t odcMinibatchEnd(odcComm_t comm, odcStream_t stream) {
  return with_comm(comm, "odcMinibatchEnd",
                   [&](odc::Communicator& c) { return c.minibatch_end(stream); });
}

extern "C" odcResult_t odcWorkBoardOpen(odcComm_t comm, int num_queues, const int32_t* counts,
                                        const double* costs) {
  return with_comm(comm, "odcWorkBoardOpen", [&](odc::Communicator& c) {
    return c.work_board_open(num_queues, counts, costs);
  });
}

extern "C" odcResult_t odcWorkBoardTake(odcComm_t comm, int32_t* queue, int32_t* index) {
  return with_comm(comm, "odcWorkBoardTake", [&](odc::Communicator& c) -> Status {
    if (queue == nullptr || index == nullptr) {
      return Status::InvalidArgument("odcWorkBoardTake: queue and index must not be NULL");
    }
    auto claim = c.work_board_take();
    if (!claim.ok()) return claim.status();
    *queue = claim.value().queue;
    *index = claim.value().index;
    return Status::Ok();
  });
}

extern "C" odcResult_t odcWorkBoardStats(odcComm_t comm, int64_t* own_this, int64_t* stolen_this,
                                         int64_t* own_total, int64_t* stolen_total) {
  return with_comm(comm, "odcWorkBoardStats", [&](odc::Communicator& c) {
    const odc::WorkBoardStats stats = c.work_board_stats();
    if (own_this != nullptr) *own_this = stats.own_this;
    if (stolen_this != nullptr) *stolen_this = stats.stolen_this;
    if (own_total != nullptr) *own_total = stats.own_total;
    if (stolen_total != nullptr) *stolen_total = stats.stolen_total;
    return Status::Ok();
  });
}

extern "C" odcResult_t odcBarrier(odcComm_t comm, odcStream_t stream) {
  return with_comm(comm, "odcBarrier", [&](odc::Communicator& c) { return c.barrier(stream); });
}

extern "C" odcResult_t odcCommSplit(odcComm_t comm, int color, int key, odcComm_t* child) {
  odcComm* created = nullptr;
  const odcResult_t result = with_comm(comm, "odcCommSplit", [&](odc::Communicator& c) -> Status {
    if (child == nullptr) {
      return Status::InvalidArgument("rank " + std::to_string(c.rank()) + ": split: child is NULL");
    }
    auto made = c.split(color, key);
    if (!made.ok()) return made.status();
    if (made.value() != nullptr) {
      created = new odcComm();
      created->communicator = std::move(made).value();
    }
    return Status::Ok();
  });
  if (result != odcSuccess) return result;
  if (created != nullptr) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    live_comms.insert(created);
  }
  *child = created;
  return result;
}

extern "C" odcResult_t odcCommPollError(odcComm_t comm) {
  return with_comm(comm, "odcCommPollError", [&](odc::Communicator& c) { return c.poll_error(); });
}

extern "C" odcResult_t odcCommAbort(odcComm_t comm, const char* reason) {
  return with_comm(comm, "odcCommAbort", [&](odc::Communicator& c) {
    c.abort(reason != nullptr ? std::string(reason, strnlen(reason, 200)) : std::string());
    return odc::Status::Ok();
  });
}

extern "C" odcResult_t odcSetInterruptCheck(int (*check)(void* ctx), void* ctx) {
  odc::set_interrupt_check(check, ctx);
  return success();
}

extern "C" int odcHasCuda(void) {
  return odc::find_transport("cuda").ok() ? 1 : 0;
}
