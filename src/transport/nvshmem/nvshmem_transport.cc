// NVSHMEM transport (see nvshmem_transport.h), built into the plugin libodc_nvshmem.so.
// Invariants: every NVSHMEM collective (init, malloc, free) is preceded by a bounded bootstrap
// collective that saw every rank, and skipped (memory leaked until exit) once the job is known
// to be broken, because NVSHMEM's own collectives wait forever for a missing PE.
#include "transport/nvshmem/nvshmem_transport.h"

#include <cuda_runtime.h>
#include <nvshmem_host.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "common/env.h"
#include "transport/cuda/cuda_check.h"
#include "transport/cuda/device_local.h"
#include "transport/nvshmem/nvshmem_kernels.h"
#include "transport/nvshmem/nvshmem_plugin.h"

namespace odc::nvshmem {

// Heap size odc asks NVSHMEM for when NVSHMEM_SYMMETRIC_SIZE is not set (docs/multinode.md).
ODC_ENV_DOUBLE(heap_gib_knob, "ODC_NVSHMEM_HEAP_GIB", 4.0)
// 0: always use NVSHMEM's get / put-with-signal calls, even where peers' heaps are mapped.
ODC_ENV_DOUBLE(direct_knob, "ODC_NVSHMEM_DIRECT", 1.0)
// Ranks per node (contiguous ranks share a node). 0: NVSHMEM's node team (or LOCAL_WORLD_SIZE).
// Smaller than the real node: pretend node boundaries on one host (tests).
ODC_ENV_DOUBLE(local_world_size_knob, "ODC_LOCAL_WORLD_SIZE", 0.0)
// Tests: microseconds the core's node fetch waits on the background stream before it starts (a
// late fetcher, so gathers meet its ready words unset and the minibatch's end waits for it).
ODC_ENV_DOUBLE(fetch_delay_us_knob, "ODC_NVSHMEM_TEST_FETCH_DELAY_US", 0.0)
// 1: signals travel as ordinary puts after a quiet instead of NVSHMEM's signal atomics (remote
// transports without atomics, e.g. UCX without GDRCopy).
ODC_ENV_DOUBLE(signal_put_knob, "ODC_NVSHMEM_SIGNAL_PUT", 0.0)
// 1: each rank prints the bytes it sent to and fetched from other nodes when it closes.
ODC_ENV_DOUBLE(stats_knob, "ODC_NVSHMEM_STATS", 0.0)

struct HeapState {
  std::shared_ptr<Bootstrap> bootstrap;
  int device = 0;
  std::atomic<bool> failed{false};
};

namespace {

using cuda::as_stream;
using cuda::check_device_pointer;
using cuda::DeviceGuard;

// NVSHMEM is initialized once per process and never finalized by odc (finalize is a collective
// that waits forever for a dead PE; a second init is not supported): later communicators with
// the same rank, world size and unique id reuse it.
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

std::string version_text() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// A block of NVSHMEM's symmetric heap; peer(r) is NVSHMEM's mapping of rank r's copy into this
// GPU (nvshmem_ptr), nullptr where rank r is reached only through NVSHMEM's calls (another node).
class NvshmemRegion final : public SymmetricRegion {
 public:
  NvshmemRegion(std::vector<void*> peers, int rank, size_t bytes, std::shared_ptr<HeapState> heap)
      : SymmetricRegion(std::move(peers), rank, bytes), heap_(std::move(heap)) {}
  ~NvshmemRegion() override {
    if (heap_->failed.load()) return;  // nvshmem_free would wait for every PE: leak instead
    DeviceGuard guard(heap_->device);
    cudaDeviceSynchronize();  // nothing queued may still touch it
    // Every rank frees (regions go in the same order on every rank); only free once all came.
    if (!heap_->bootstrap->barrier("nvshmem free").ok()) {
      heap_->failed.store(true);
      return;
    }
    nvshmem_free(local());
  }

 private:
  std::shared_ptr<HeapState> heap_;
};

}  // namespace

NvshmemTransport::NvshmemTransport(const TransportSpec& spec)
    : bootstrap_(spec.bootstrap),
      heap_(std::make_shared<HeapState>()),
      rank_(spec.rank),
      world_size_(spec.world_size),
      device_(spec.device),
      timeout_ns_(static_cast<int64_t>(spec.timeout.count() * 1e9)) {
  heap_->bootstrap = bootstrap_;
  heap_->device = device_;
}

Result<std::unique_ptr<NvshmemTransport>> NvshmemTransport::create(const TransportSpec& spec) {
  if (!spec.bootstrap) {
    return Status::InvalidUsage("the NVSHMEM transport needs a bootstrap (none was given)");
  }
  if (spec.bootstrap->rank() != spec.rank || spec.bootstrap->world_size() != spec.world_size) {
    return Status::InvalidArgument("bootstrap is rank " + std::to_string(spec.bootstrap->rank()) +
                                   " of " + std::to_string(spec.bootstrap->world_size()) +
                                   ", the communicator rank " + std::to_string(spec.rank) + " of " +
                                   std::to_string(spec.world_size));
  }
  int num_devices = 0;
  if (cudaGetDeviceCount(&num_devices) != cudaSuccess) num_devices = 0;
  if (spec.device < 0 || spec.device >= num_devices) {
    return Status::InvalidArgument("CUDA device " + std::to_string(spec.device) +
                                   " does not exist (this process sees " +
                                   std::to_string(num_devices) + ")");
  }
  std::unique_ptr<NvshmemTransport> transport(new NvshmemTransport(spec));
  if (Status status = transport->init(); !status.ok()) {
    transport->mark_failed("init: " + status.message());
    return status;
  }
  return transport;
}

Status NvshmemTransport::init() {
  ProcessNvshmem& process = process_nvshmem();
  std::lock_guard<std::mutex> lock(process.mutex);
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(cudaSetDevice(device_));
  // NVSHMEM binds to the device current at init; make sure it is ours.
  struct IdRecord {
    uint64_t ok;
    nvshmemx_uniqueid_t id;
  };
  IdRecord mine{};
  std::string problem;
  if (process.initialized) {
    if (process.rank != rank_ || process.world_size != world_size_ || process.device != device_) {
      problem = "NVSHMEM is already initialized in this process as rank " +
                std::to_string(process.rank) + " of " + std::to_string(process.world_size) +
                " on device " + std::to_string(process.device) +
                " (it cannot be initialized twice)";
    } else {
      mine.ok = 1;
      mine.id = process.id;
    }
  } else if (rank_ == 0) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (nvshmemx_get_uniqueid(&id) == 0) {
      mine.ok = 1;
      mine.id = id;
    } else {
      problem = "nvshmemx_get_uniqueid failed";
    }
  } else {
    mine.ok = 1;
  }
  std::vector<IdRecord> all(static_cast<size_t>(world_size_));
  ODC_RETURN_IF_ERROR(
      bootstrap_->allgather(&mine, all.data(), sizeof(IdRecord), "nvshmem unique id"));
  for (int r = 0; r < world_size_; ++r) {
    if (all[r].ok == 0) {
      return Status::SystemError("rank " + std::to_string(r) + " could not start NVSHMEM" +
                                 (r == rank_ ? ": " + problem : ""));
    }
  }
  if (process.initialized) {
    for (int r = 0; r < world_size_; ++r) {
      if (std::memcmp(&all[r].id, &all[0].id, sizeof(nvshmemx_uniqueid_t)) != 0) {
        return Status::InvalidUsage(
            "ranks 0 and " + std::to_string(r) +
            " run different NVSHMEM jobs (NVSHMEM stays initialized for the life of a process; "
            "a later communicator must have the same ranks)");
      }
    }
  } else {
    // The heap is reserved at init: odc sets its size unless the user did (docs/multinode.md).
    if (const char* given = std::getenv("NVSHMEM_SYMMETRIC_SIZE"); given != nullptr) {
      process.heap_size = given;
    } else {
      const auto bytes = static_cast<uint64_t>(heap_gib_knob() * 1024.0 * 1024.0 * 1024.0);
      process.heap_size = std::to_string(bytes);
      setenv("NVSHMEM_SYMMETRIC_SIZE", process.heap_size.c_str(), 1);
    }
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    nvshmemx_uniqueid_t id = all[0].id;
    int status = nvshmemx_set_attr_uniqueid_args(rank_, world_size_, &id, &attr);
    if (status == 0) {
      // What nvshmemx_init_attr() does, but returning an error instead of exiting: the host
      // library's init, and the device state of this plugin's kernels that call NVSHMEM (the
      // streamed fold's credits), from NVSHMEM's static device library.
      nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                    NVSHMEM_VENDOR_PATCH_VERSION};
      nvshmemx_init_init_attr_ver_only(attr);
      int provided = 0;
      status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                    NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
    }
    uint64_t ok = status == 0 ? 1 : 0;
    std::vector<uint64_t> oks(static_cast<size_t>(world_size_));
    ODC_RETURN_IF_ERROR(bootstrap_->allgather(&ok, oks.data(), sizeof(ok), "nvshmem init"));
    for (int r = 0; r < world_size_; ++r) {
      if (oks[r] == 0) {
        return Status::SystemError("rank " + std::to_string(r) + " could not initialize NVSHMEM" +
                                   (r == rank_
                                        ? " (status " + std::to_string(status) +
                                              "; NVSHMEM_DEBUG=WARN prints why, docs/multinode.md)"
                                        : ""));
      }
    }
    process.initialized = true;
    process.rank = rank_;
    process.world_size = world_size_;
    process.device = device_;
    process.id = all[0].id;
    if (nvshmem_my_pe() != rank_ || nvshmem_n_pes() != world_size_) {
      return Status::InternalError("NVSHMEM made this rank PE " + std::to_string(nvshmem_my_pe()) +
                                   " of " + std::to_string(nvshmem_n_pes()) + ", expected " +
                                   std::to_string(rank_) + " of " + std::to_string(world_size_));
    }
  }

  ODC_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  ODC_CUDA_CHECK(cudaHostAlloc(&host_error_, sizeof(kernels::WaitError), cudaHostAllocMapped));
  std::memset(host_error_, 0, sizeof(kernels::WaitError));
  kernels::WaitError initial{};
  ODC_CUDA_CHECK(cudaHostGetDevicePointer(&initial.host_mirror, host_error_, 0));
  ODC_CUDA_CHECK(cudaMalloc(&device_error_, sizeof(kernels::WaitError)));
  ODC_CUDA_CHECK(cudaMemcpy(device_error_, &initial, sizeof(initial), cudaMemcpyHostToDevice));
  ODC_CUDA_CHECK(cudaMalloc(&push_done_, sizeof(uint32_t) * kernels::kMaxRanks));
  ODC_CUDA_CHECK(cudaMemset(push_done_, 0, sizeof(uint32_t) * kernels::kMaxRanks));
  auto signals = allocate(static_cast<size_t>(world_size_) * sizeof(uint64_t));
  if (!signals.ok()) return signals.status();
  barrier_signals_ = std::move(signals).value();
  // Two halves: the caller's streams' signals, and the background stream's (the node cache's
  // ready words), so that a value stored for one is never put by the other.
  auto outbox = allocate(2 * static_cast<size_t>(world_size_) * sizeof(uint64_t));
  if (!outbox.ok()) return outbox.status();
  outbox_ = std::move(outbox).value();
  auto barrier_outbox = allocate(static_cast<size_t>(world_size_) * sizeof(uint64_t));
  if (!barrier_outbox.ok()) return barrier_outbox.status();
  barrier_outbox_ = std::move(barrier_outbox).value();
  signal_by_put_ = signal_put_knob() != 0.0;
  // Node boundaries: contiguous blocks of local_size_ ranks, agreed by every rank.
  int local_size = static_cast<int>(local_world_size_knob());
  if (local_size <= 0) {
    if (const char* torchrun = std::getenv("LOCAL_WORLD_SIZE"); torchrun != nullptr) {
      local_size = std::atoi(torchrun);
    } else {
      local_size = nvshmem_team_n_pes(NVSHMEMX_TEAM_NODE);
    }
  }
  if (local_size <= 0 || world_size_ % local_size != 0) {
    return Status::InvalidArgument(
        "ranks per node (ODC_LOCAL_WORLD_SIZE / LOCAL_WORLD_SIZE / NVSHMEM's node team) is " +
        std::to_string(local_size) + ", which does not divide the world size " +
        std::to_string(world_size_));
  }
  local_size_ = local_size;
  // Same-node peers whose heap NVSHMEM mapped into this GPU (NVLink) get odc's kernels.
  mapped_.assign(static_cast<size_t>(world_size_), 0);
  for (int r = 0; r < world_size_; ++r) {
    mapped_[r] = direct_knob() != 0.0 && node_of(r) == node_of(rank_) &&
                 barrier_signals_->peer(r) != nullptr;
  }
  // The node boundaries this transport counts its bytes by: the same on every rank.
  const uint64_t my_size = static_cast<uint64_t>(local_size_);
  std::vector<uint64_t> sizes(static_cast<size_t>(world_size_));
  ODC_RETURN_IF_ERROR(
      bootstrap_->allgather(&my_size, sizes.data(), sizeof(my_size), "nvshmem ranks per node"));
  for (int r = 0; r < world_size_; ++r) {
    if (sizes[static_cast<size_t>(r)] != my_size) {
      return Status::InvalidArgument("rank " + std::to_string(r) + " has " +
                                     std::to_string(sizes[static_cast<size_t>(r)]) +
                                     " ranks per node, this rank " + std::to_string(my_size) +
                                     " (ODC_LOCAL_WORLD_SIZE must agree)");
    }
  }
  return Status::Ok();
}

int NvshmemTransport::num_direct_peers() const {
  int count = 0;
  for (char mapped : mapped_) count += mapped != 0;
  return count;
}

NvshmemTransport::~NvshmemTransport() {
  if (stats_knob() != 0.0) {
    char line[256];
    const int length = std::snprintf(
        line, sizeof(line),
        "odc nvshmem rank %d: to/from other nodes: %llu bytes put, %llu bytes fetched "
        "(%d ranks per node, %d direct peers)\n",
        rank_, static_cast<unsigned long long>(remote_put_bytes_),
        static_cast<unsigned long long>(remote_get_bytes_), local_size_, num_direct_peers());
    // One write, so that the lines of ranks sharing a terminal or file do not interleave.
    if (length > 0) {
      const ssize_t written =
          ::write(STDERR_FILENO, line, std::min(static_cast<size_t>(length), sizeof(line) - 1));
      (void)written;
    }
  }
  DeviceGuard guard(device_);
  cudaDeviceSynchronize();
  outbox_.reset();
  barrier_outbox_.reset();
  barrier_signals_.reset();
  if (push_done_ != nullptr) cudaFree(push_done_);
  if (device_error_ != nullptr) cudaFree(device_error_);
  if (host_error_ != nullptr) cudaFreeHost(host_error_);
}

kernels::RankInfo NvshmemTransport::rank_info() const {
  kernels::RankInfo info;
  info.rank = rank_;
  info.num_ranks = world_size_;
  info.num_sms = num_sms_;
  return info;
}

void NvshmemTransport::mark_failed(const std::string& reason) {
  heap_->failed.store(true);
  bootstrap_->mark_failed(reason);
}

Result<std::vector<ExchangeRecord>> NvshmemTransport::exchange(const ExchangeRecord& mine) {
  std::vector<ExchangeRecord> all(static_cast<size_t>(world_size_));
  ODC_RETURN_IF_ERROR(bootstrap_->allgather(&mine, all.data(), sizeof(ExchangeRecord), "exchange"));
  return all;
}

Result<std::unique_ptr<SymmetricRegion>> NvshmemTransport::allocate(size_t bytes) {
  if (heap_->failed.load()) {
    return Status::RemoteError("the NVSHMEM transport failed earlier: nothing more is allocated");
  }
  DeviceGuard guard(device_);
  // Every rank is here and asks for the same size before NVSHMEM's collective (unbounded) malloc.
  const uint64_t mine = bytes;
  std::vector<uint64_t> sizes(static_cast<size_t>(world_size_));
  ODC_RETURN_IF_ERROR(bootstrap_->allgather(&mine, sizes.data(), sizeof(mine), "nvshmem alloc"));
  for (int r = 0; r < world_size_; ++r) {
    if (sizes[r] != mine) {
      return Status::InvalidArgument("NVSHMEM allocation sizes differ: rank " + std::to_string(r) +
                                     " asked for " + std::to_string(sizes[r]) +
                                     " bytes, this rank for " + std::to_string(bytes));
    }
  }
  void* memory = nvshmem_malloc(bytes);
  cudaError_t error = cudaSuccess;
  if (memory != nullptr) {
    error = cudaMemset(memory, 0, bytes);
    if (error == cudaSuccess) error = cudaDeviceSynchronize();
  }
  const uint64_t ok = memory != nullptr && error == cudaSuccess ? 1 : 0;
  std::vector<uint64_t> oks(static_cast<size_t>(world_size_));
  ODC_RETURN_IF_ERROR(bootstrap_->allgather(&ok, oks.data(), sizeof(ok), "nvshmem alloc"));
  for (int r = 0; r < world_size_; ++r) {
    if (oks[r] != 0) continue;
    // A block that some ranks got stays allocated (freeing it is a collective the others miss).
    if (memory != nullptr && r == rank_) {
      return Status::SystemError("rank " + std::to_string(r) + " could not zero " +
                                 std::to_string(bytes) +
                                 " bytes of the NVSHMEM heap: " + cudaGetErrorString(error));
    }
    return Status::SystemError(
        "rank " + std::to_string(r) + " could not allocate " + std::to_string(bytes) +
        " bytes on the NVSHMEM symmetric heap (NVSHMEM_SYMMETRIC_SIZE=" +
        process_nvshmem().heap_size +
        " bytes per GPU, fixed at init: raise it, or ODC_NVSHMEM_HEAP_GIB, before the first "
        "communicator; docs/multinode.md says how much odc needs)");
  }
  std::vector<void*> peers(static_cast<size_t>(world_size_), nullptr);
  for (int r = 0; r < world_size_; ++r) peers[r] = nvshmem_ptr(memory, r);
  peers[rank_] = memory;
  return std::unique_ptr<SymmetricRegion>(new NvshmemRegion(std::move(peers), rank_, bytes, heap_));
}

Status NvshmemTransport::barrier(CollectiveOp, StreamHandle stream) {
  DeviceGuard guard(device_);
  ++barrier_epoch_;
  cudaStream_t cuda_stream = as_stream(stream);
  // Our earlier NVSHMEM puts are complete at their targets before anyone sees our arrival (direct
  // puts fenced at system scope in their kernel; gets completed in stream order).
  nvshmemx_quiet_on_stream(cuda_stream);
  // Announced by a put of the epoch from this rank's barrier outbox, written by a kernel that
  // writes nothing once a device wait of this rank failed: a failed rank stays silent (its peers
  // time out naming it), as on the CUDA transport, instead of letting them pass the barrier.
  auto* slots = static_cast<uint64_t*>(barrier_signals_->local());
  auto* announced = static_cast<uint64_t*>(barrier_outbox_->local());
  for (int i = 0; i < world_size_; ++i) {
    const int peer = (rank_ + 1 + i) % world_size_;
    ODC_CUDA_CHECK(publish_u64(announced + peer, barrier_epoch_, device_error_, cuda_stream));
    nvshmemx_putmem_on_stream(slots + rank_, announced + peer, sizeof(uint64_t), peer, cuda_stream);
  }
  ODC_CUDA_CHECK(cudaGetLastError());
  ODC_CUDA_CHECK(wait_all_at_least(slots, world_size_, barrier_epoch_, rank_, 0,
                                   kernels::kWaitBarrier, timeout_ns_, device_error_, cuda_stream));
  return Status::Ok();
}

Status NvshmemTransport::drain() {
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(cudaDeviceSynchronize());
  return Status::Ok();
}

Status NvshmemTransport::host_barrier(CollectiveOp op) {
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(cudaDeviceSynchronize());
  ODC_RETURN_IF_ERROR(poll_error());
  // The bootstrap's barrier is anonymous: compare the collectives so a mismatch is named.
  const auto mine = static_cast<uint32_t>(op);
  std::vector<uint32_t> all(static_cast<size_t>(world_size_));
  ODC_RETURN_IF_ERROR(
      bootstrap_->allgather(&mine, all.data(), sizeof(mine), collective_op_name(op)));
  for (int r = 0; r < world_size_; ++r) {
    if (all[r] != mine) {
      return Status::RemoteError("collective mismatch: rank " + std::to_string(r) + " called " +
                                 collective_op_name(static_cast<CollectiveOp>(all[r])) +
                                 " where this rank called " + collective_op_name(op));
    }
  }
  return Status::Ok();
}

Status NvshmemTransport::poll_error() {
  return cuda::device_wait_status(static_cast<volatile kernels::WaitError*>(host_error_),
                                  timeout_ns_, device_);
}

Status NvshmemTransport::get_all(void* dst, const SymmetricRegion& region, size_t bytes,
                                 StreamHandle stream) {
  DeviceGuard guard(device_);
  ODC_RETURN_IF_ERROR(check_device_pointer(device_, dst, "destination"));
  auto* out = static_cast<char*>(dst);
  std::vector<void*> to;
  std::vector<const void*> from;
  int num_gets = 0;
  for (int i = 0; i < world_size_; ++i) {
    const int owner = (rank_ + 1 + i) % world_size_;  // ranks start at different owners
    char* part = out + static_cast<size_t>(owner) * bytes;
    if (mapped_[owner]) {
      to.push_back(part);
      from.push_back(region.peer(owner));
    } else if (owner == rank_) {
      ODC_CUDA_CHECK(cudaMemcpyAsync(part, region.local(), bytes, cudaMemcpyDeviceToDevice,
                                     as_stream(stream)));
    } else {
      // Non-blocking, so the gets from different owners may overlap; the quiet below completes
      // them all before anything later on the stream.
      nvshmemx_getmem_nbi_on_stream(part, region.local(), bytes, owner, as_stream(stream));
      ++num_gets;
      if (node_of(owner) != node_of(rank_)) remote_get_bytes_ += bytes;
    }
  }
  if (num_gets > 0) nvshmemx_quiet_on_stream(as_stream(stream));
  ODC_CUDA_CHECK(cudaGetLastError());
  return local().copy_many(to, from, bytes, push_done_, stream);
}

Status NvshmemTransport::get_all_narrowed(void* dst, const SymmetricRegion& region, size_t count,
                                          StreamHandle stream) {
  DeviceGuard guard(device_);
  ODC_RETURN_IF_ERROR(check_device_pointer(device_, dst, "destination"));
  auto* out = static_cast<uint16_t*>(dst);
  const size_t shard_bytes = count * sizeof(float);
  std::vector<int> fetched;  // owners NVSHMEM's gets must bring in first
  std::vector<void*> to;
  std::vector<const void*> from;
  for (int i = 0; i < world_size_; ++i) {
    const int owner = (rank_ + 1 + i) % world_size_;
    if (mapped_[owner] || owner == rank_) {
      to.push_back(out + static_cast<size_t>(owner) * count);
      from.push_back(owner == rank_ ? region.local() : region.peer(owner));
    } else {
      fetched.push_back(owner);
    }
  }
  // Fetched shards land in float32 first (NVSHMEM's gets move bytes): a stream-ordered temporary
  // of their size only, freed in stream order once the narrowing copy has read it.
  void* temporary = nullptr;
  if (!fetched.empty()) {
    ODC_CUDA_CHECK(cudaMallocAsync(&temporary, fetched.size() * shard_bytes, as_stream(stream)));
    for (size_t j = 0; j < fetched.size(); ++j) {
      const int owner = fetched[j];
      void* slot = static_cast<char*>(temporary) + j * shard_bytes;
      nvshmemx_getmem_nbi_on_stream(slot, region.local(), shard_bytes, owner, as_stream(stream));
      if (node_of(owner) != node_of(rank_)) remote_get_bytes_ += shard_bytes;
      to.push_back(out + static_cast<size_t>(owner) * count);
      from.push_back(slot);
    }
    nvshmemx_quiet_on_stream(as_stream(stream));
    ODC_CUDA_CHECK(cudaGetLastError());
  }
  const Status launched = local().narrow_many(to, from, count, stream);
  // Freed in stream order even when a launch failed (nothing may still read it then).
  if (temporary != nullptr) ODC_CUDA_CHECK(cudaFreeAsync(temporary, as_stream(stream)));
  return launched;
}

Status NvshmemTransport::get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  DeviceGuard guard(device_);
  ODC_RETURN_IF_ERROR(check_device_pointer(device_, dst, "destination"));
  const size_t src_bytes = count * element_bytes(src_dtype);
  const size_t part_bytes = count * element_bytes(dst_dtype);
  const bool narrowed = dst_dtype != src_dtype;
  std::vector<void*> to;
  std::vector<const void*> from;
  std::vector<size_t> fetched;  // sources NVSHMEM's gets must bring in
  for (size_t j = 0; j < sources.size(); ++j) {
    const GatherSource& source = sources[j];
    if (source.peer == rank_ || mapped_[source.peer]) {
      to.push_back(static_cast<char*>(dst) + j * part_bytes);
      from.push_back(static_cast<const char*>(source.region->peer(source.peer)) + source.offset);
    } else {
      fetched.push_back(j);
    }
  }
  // Unmapped sources land in place, or (narrowed) in a stream-ordered fp32 temporary of their
  // size only, freed in stream order once the narrowing copy has read it.
  void* temporary = nullptr;
  if (!fetched.empty()) {
    if (narrowed) {
      ODC_CUDA_CHECK(cudaMallocAsync(&temporary, fetched.size() * src_bytes, as_stream(stream)));
    }
    for (size_t k = 0; k < fetched.size(); ++k) {
      const GatherSource& source = sources[fetched[k]];
      char* part = static_cast<char*>(dst) + fetched[k] * part_bytes;
      char* landing = narrowed ? static_cast<char*>(temporary) + k * src_bytes : part;
      nvshmemx_getmem_nbi_on_stream(
          landing, static_cast<const char*>(source.region->local()) + source.offset, src_bytes,
          source.peer, as_stream(stream));
      if (node_of(source.peer) != node_of(rank_)) remote_get_bytes_ += src_bytes;
      if (narrowed) {
        to.push_back(part);
        from.push_back(landing);
      }
    }
    nvshmemx_quiet_on_stream(as_stream(stream));
    ODC_CUDA_CHECK(cudaGetLastError());
  }
  const Status copied = narrowed ? local().narrow_many(to, from, count, stream)
                                 : local().copy_many(to, from, src_bytes, push_done_, stream);
  // Freed in stream order even when a launch failed (nothing may still read it then).
  if (temporary != nullptr) ODC_CUDA_CHECK(cudaFreeAsync(temporary, as_stream(stream)));
  return copied;
}

Status NvshmemTransport::wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers,
                                      uint64_t value, const std::string&, StreamHandle stream) {
  // NVSHMEM's peers announce no failure on the device (as for its folds): a dead fetcher is
  // named when the wait expires.
  return local().wait_slots(static_cast<const uint64_t*>(signals.local()), peers, value,
                            timeout_ns_, nullptr, stream);
}

Result<StreamHandle> NvshmemTransport::fork_background(StreamHandle stream) {
  auto background = background_.fork(stream);
  if (!background.ok()) return background;
  if (const double delay_us = fetch_delay_us_knob(); delay_us > 0) {
    DeviceGuard guard(device_);
    ODC_CUDA_CHECK(spin_for(static_cast<int64_t>(delay_us * 1e3), as_stream(background.value())));
  }
  return background;
}

Status NvshmemTransport::get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                             size_t bytes, StreamHandle stream) {
  DeviceGuard guard(device_);
  ODC_RETURN_IF_ERROR(check_device_pointer(device_, dst, "destination"));
  if (peer == rank_ || mapped_[peer]) {  // this GPU's memory, or a peer's mapped over NVLink
    const void* from = static_cast<const char*>(region.peer(peer)) + offset;
    ODC_CUDA_CHECK(cudaMemcpyAsync(dst, from, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)));
    return Status::Ok();
  }
  nvshmemx_getmem_on_stream(dst, static_cast<const char*>(region.local()) + offset, bytes, peer,
                            as_stream(stream));
  if (node_of(peer) != node_of(rank_)) remote_get_bytes_ += bytes;
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::put(const void* src, const SymmetricRegion& region, int peer,
                             size_t offset, size_t bytes, StreamHandle stream) {
  DeviceGuard guard(device_);
  ODC_RETURN_IF_ERROR(check_device_pointer(device_, src, "source"));
  nvshmemx_putmem_on_stream(static_cast<char*>(region.local()) + offset, src, bytes, peer,
                            as_stream(stream));
  if (node_of(peer) != node_of(rank_)) remote_put_bytes_ += bytes;
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::put_signal(const void* src, const SymmetricRegion& region, int peer,
                                    size_t offset, size_t bytes, const SymmetricRegion& signals,
                                    uint64_t value, StreamHandle stream) {
  if (signal_by_put_) {  // no signal atomics on this path: a put, a quiet, a put of the value
    return Transport::put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }
  DeviceGuard guard(device_);
  ODC_RETURN_IF_ERROR(check_device_pointer(device_, src, "source"));
  // One operation: NVSHMEM delivers the signal after the data, with no quiet of this rank's
  // other operations in flight (a streamed chunk to one owner does not wait for another's).
  nvshmemx_putmem_signal_on_stream(static_cast<char*>(region.local()) + offset, src, bytes,
                                   static_cast<uint64_t*>(signals.local()) + rank_, value,
                                   NVSHMEM_SIGNAL_SET, peer, as_stream(stream));
  if (node_of(peer) != node_of(rank_)) remote_put_bytes_ += bytes;
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::signal(const SymmetricRegion& signals, int peer, uint64_t value,
                                StreamHandle stream) {
  DeviceGuard guard(device_);
  nvshmemx_quiet_on_stream(as_stream(stream));  // earlier puts are visible before the signal
  ODC_RETURN_IF_ERROR(
      send_signal(static_cast<uint64_t*>(signals.local()) + rank_, value, peer, as_stream(stream)));
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::send_signal(uint64_t* signal, uint64_t value, int peer,
                                     cudaStream_t stream) {
  if (!signal_by_put_) {
    nvshmemx_signal_op_on_stream(signal, value, NVSHMEM_SIGNAL_SET, peer, stream);
    ODC_CUDA_CHECK(cudaGetLastError());
    return Status::Ok();
  }
  // A put of the value, after a quiet: every earlier put of this rank has landed at its target
  // before the signal is sent. The value goes out from this rank's outbox slot for `peer`
  // (symmetric memory, as remote transports need), reusable once the put completes in stream
  // order. Values fit in 32 bits in practice, so a torn 8-byte write cannot fake a larger one.
  // The background stream has its own half: its puts and the caller's run concurrently.
  nvshmemx_quiet_on_stream(stream);
  const bool background = background_.stream() != nullptr && stream == background_.stream();
  const size_t half = background ? static_cast<size_t>(world_size_) : 0;
  uint64_t* slot = static_cast<uint64_t*>(outbox_->local()) + half + peer;
  ODC_CUDA_CHECK(store_u64(slot, value, stream));
  nvshmemx_putmem_on_stream(signal, slot, sizeof(uint64_t), peer, stream);
  ODC_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status NvshmemTransport::zero(void* dst, size_t bytes, StreamHandle stream) {
  return local().zero(dst, bytes, stream);
}

Status NvshmemTransport::accumulate(float* dst, const void* src, DataType src_type, size_t count,
                                    StreamHandle stream) {
  // Reductions, not plain adds: the streamed fold may add into the same sums from another
  // stream at the same time (a gather's fold while a push adds this rank's own slice).
  return local().accumulate_reducing(dst, src, src_type, count, stream);
}

Status NvshmemTransport::fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) {
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(nvshmem::fold_streamed(fold, device_error_, as_stream(stream)));
  return Status::Ok();
}

Status NvshmemTransport::pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src,
                                    size_t bytes, StreamHandle stream) {
  return local().pack_chunk(dst, header, src, bytes, stream);
}

Status NvshmemTransport::read_local(void* host_dst, const void* src, size_t bytes) {
  return local().read_local(host_dst, src, bytes);
}

}  // namespace odc::nvshmem

extern "C" __attribute__((visibility("default"))) int odc_nvshmem_plugin_abi() {
  return ODC_NVSHMEM_PLUGIN_ABI;
}

extern "C" __attribute__((visibility("default"))) odc::Transport* odc_nvshmem_create(
    const odc::TransportSpec* spec, odc::Status* status) {
  auto made = odc::nvshmem::NvshmemTransport::create(*spec);
  if (!made.ok()) {
    *status = made.status().with_context("NVSHMEM " + odc::nvshmem::version_text());
    return nullptr;
  }
  *status = odc::Status::Ok();
  return std::move(made).value().release();
}
