// CUDA transport (see cuda_transport.h). Invariant: every operation that touches peers' memory is
// enqueued on the caller's stream after a device barrier that ordered the peers' writes, and
// every device-side wait is bounded.
#include "transport/cuda/cuda_transport.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bootstrap/shm_bootstrap.h"
#include "transport/device/cuda_check.h"
#include "transport/device/device_local.h"

namespace odc::cuda {
namespace {

// This rank's device allocation ([rank]) and the peers' opened through CUDA IPC (the others),
// released on destruction: freed, respectively closed.
class IpcMapping {
 public:
  IpcMapping(int device, int rank, int world_size)
      : device_(device), rank_(rank), pointers_(static_cast<size_t>(world_size), nullptr) {}
  IpcMapping(IpcMapping&& other) noexcept
      : device_(other.device_), rank_(other.rank_), pointers_(std::move(other.pointers_)) {
    other.pointers_.clear();
  }
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  ~IpcMapping() {
    if (pointers_.empty()) return;
    DeviceGuard guard(device_);
    for (size_t r = 0; r < pointers_.size(); ++r) {
      if (pointers_[r] == nullptr) continue;
      if (static_cast<int>(r) == rank_) {
        cudaFree(pointers_[r]);
      } else {
        cudaIpcCloseMemHandle(pointers_[r]);
      }
    }
  }
  void*& operator[](int rank) { return pointers_[static_cast<size_t>(rank)]; }
  const std::vector<void*>& pointers() const { return pointers_; }
  int rank() const { return rank_; }

 private:
  int device_;
  int rank_;
  std::vector<void*> pointers_;
};

// Device memory of this rank plus every peer's, opened through CUDA IPC.
class CudaRegion final : public SymmetricRegion {
 public:
  CudaRegion(IpcMapping mapping, size_t bytes)
      : SymmetricRegion(mapping.pointers(), mapping.rank(), bytes), mapping_(std::move(mapping)) {}

 private:
  IpcMapping mapping_;
};

}  // namespace

CudaTransport::CudaTransport(std::shared_ptr<Bootstrap> bootstrap, int device,
                             std::chrono::duration<double> timeout)
    : DeviceTransport(std::move(bootstrap), device, timeout,
                      TransportCaps{/*remote_fp32_add=*/true, /*stream_ordered=*/true}) {}

Result<std::unique_ptr<CudaTransport>> CudaTransport::create(std::shared_ptr<Bootstrap> bootstrap,
                                                             std::chrono::duration<double> timeout,
                                                             int device, int max_sms) {
  const int world_size = bootstrap->world_size();
  if (world_size > kernels::kMaxRanks) {
    return Status::InvalidArgument(
        "the CUDA transport joins at most " + std::to_string(kernels::kMaxRanks) +
        " GPUs of one node, got world size " + std::to_string(world_size));
  }
  ODC_RETURN_IF_ERROR(check_device_exists(device));
  std::unique_ptr<CudaTransport> transport(
      new CudaTransport(std::move(bootstrap), device, timeout));
  if (Status status = transport->init(max_sms); !status.ok()) {
    transport->mark_failed("init: " + status.message());
    return status;
  }
  return transport;
}

Status CudaTransport::init(int max_sms) {
  // A budget over the device's SMs means all of them (init_device_state clamps it).
  ODC_RETURN_IF_ERROR(init_device_state(max_sms));
  DeviceGuard guard(device());
  auto signals = allocate(sizeof(kernels::SignalBlock));
  if (!signals.ok()) return signals.status();
  signals_ = std::move(signals).value();
  ODC_CUDA_CHECK(cudaHostAlloc(&failed_words_, 2 * sizeof(uint64_t), cudaHostAllocDefault));
  failed_words_[0] = kernels::kBarrierPeerFailed;
  failed_words_[1] = static_cast<uint64_t>(kernels::kWaitSelfFailed);
  ODC_CUDA_CHECK(cudaStreamCreateWithFlags(&failure_stream_, cudaStreamNonBlocking));
  return Status::Ok();
}

void CudaTransport::mark_failed(const std::string& reason) {
  bootstrap().mark_failed(reason);
  if (signals_ == nullptr || failed_words_ == nullptr || failure_stream_ == nullptr) return;
  DeviceGuard guard(device());
  // First silence this rank's own kernels (a barrier queued behind the failure announces nothing:
  // its error record is set), then tell every peer's barrier words. Best effort: a broken
  // device leaves the peers to their timeout, as before.
  (void)cudaMemcpyAsync(&device_error()->site, &failed_words_[1], sizeof(int32_t),
                        cudaMemcpyHostToDevice, failure_stream_);
  for (int peer = 0; peer < world_size(); ++peer) {
    if (peer == rank()) continue;
    auto* block = static_cast<kernels::SignalBlock*>(signals_->peer(peer));
    (void)cudaMemcpyAsync(&block->barrier[rank()], &failed_words_[0], sizeof(uint64_t),
                          cudaMemcpyDefault, failure_stream_);
  }
  (void)cudaStreamSynchronize(failure_stream_);
}

CudaTransport::~CudaTransport() {
  DeviceGuard guard(device());
  cudaDeviceSynchronize();  // nothing of ours may still run when the memory goes
  signals_.reset();
  if (failure_stream_ != nullptr) cudaStreamDestroy(failure_stream_);
  if (failed_words_ != nullptr) cudaFreeHost(failed_words_);
}

kernels::PeerPointers CudaTransport::peer_pointers(const SymmetricRegion& region) const {
  kernels::PeerPointers pointers;
  for (int r = 0; r < world_size(); ++r) pointers.ptr[r] = region.peer(r);
  return pointers;
}

Result<std::unique_ptr<SymmetricRegion>> CudaTransport::allocate(size_t bytes) {
  DeviceGuard guard(device());
  // Released again unless every rank succeeds and it is handed to the region.
  IpcMapping mapping(device(), rank(), world_size());
  cudaIpcMemHandle_t handle{};
  cudaError_t error = cudaMalloc(&mapping[rank()], bytes);
  // Zeroed before any rank can use it: cudaMemset runs on the legacy default stream behind the
  // caller's queued work, and neither the peers' kernels nor this rank's private non-blocking
  // streams (the work board's claims) are ordered after it. So zero on a stream of our own and
  // wait for that alone (not for the caller's work), as the NVSHMEM heap does.
  if (error == cudaSuccess) {
    cudaStream_t zeroing = nullptr;
    error = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
    if (error == cudaSuccess) error = cudaMemsetAsync(mapping[rank()], 0, bytes, zeroing);
    if (error == cudaSuccess) error = cudaStreamSynchronize(zeroing);
    if (zeroing != nullptr) {
      const cudaError_t destroyed = cudaStreamDestroy(zeroing);
      if (error == cudaSuccess) error = destroyed;
    }
  }
  if (error == cudaSuccess) error = cudaIpcGetMemHandle(&handle, mapping[rank()]);
  std::string problem = error == cudaSuccess ? "" : cudaGetErrorString(error);
  static_assert(sizeof(cudaIpcMemHandle_t) <= sizeof(ExchangeRecord::words) - sizeof(uint64_t));

  // Every rank learns whether every rank succeeded, so all fail (and stay usable) together.
  ExchangeRecord mine;
  mine.words[0] = error == cudaSuccess ? 1 : 0;
  std::memcpy(&mine.words[1], &handle, sizeof(handle));
  auto all = exchange(mine);
  if (!all.ok()) return all.status();
  for (int r = 0; r < world_size(); ++r) {
    if (all.value()[r].words[0] == 0) {
      return Status::SystemError("rank " + std::to_string(r) + " could not allocate " +
                                 std::to_string(bytes) + " bytes of device memory" +
                                 (r == rank() ? " (" + problem + ")" : ""));
    }
  }
  for (int peer = 0; peer < world_size() && error == cudaSuccess; ++peer) {
    if (peer == rank()) continue;
    cudaIpcMemHandle_t peer_handle;
    std::memcpy(&peer_handle, &all.value()[peer].words[1], sizeof(peer_handle));
    error = cudaIpcOpenMemHandle(&mapping[peer], peer_handle, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess) {
      mapping[peer] = nullptr;
      problem = "rank " + std::to_string(peer) + ": " + cudaGetErrorString(error);
    }
  }
  ExchangeRecord mapped;
  mapped.words[0] = error == cudaSuccess ? 1 : 0;
  auto agreed = exchange(mapped);
  if (!agreed.ok()) return agreed.status();
  for (int r = 0; r < world_size(); ++r) {
    if (agreed.value()[r].words[0] == 0) {
      return Status::SystemError("rank " + std::to_string(r) + " could not map its peers' memory" +
                                 (r == rank() ? " (" + problem + ")" : ""));
    }
  }
  return std::unique_ptr<SymmetricRegion>(new CudaRegion(std::move(mapping), bytes));
}

Status CudaTransport::barrier(CollectiveOp op, StreamHandle stream) {
  DeviceGuard guard(device());
  // The collective travels with the epoch, so ranks in different collectives fail (poll_error)
  // instead of pairing up.
  const uint64_t word = next_barrier_word(op);
  ODC_CUDA_CHECK(kernels::device_barrier(peer_pointers(*signals_), rank_info(),
                                         kernels::barrier_epoch(word), kernels::barrier_op(word),
                                         timeout_ns(), device_error(), as_stream(stream)));
  return Status::Ok();
}

Result<std::unique_ptr<Transport>> CudaTransport::split(const SplitGroup& group) {
  if (group.rank < 0) return std::unique_ptr<Transport>();
  // Members that fail or die in this transport's bootstrap before they meet are seen through it.
  const shm::ShmBootstrap::SplitParent parent{&this->bootstrap(), group.members};
  auto bootstrap = shm::ShmBootstrap::create(group.rank, static_cast<int>(group.members.size()),
                                             group.name, timeout(), /*outer=*/nullptr, &parent);
  if (!bootstrap.ok()) return bootstrap.status();
  std::shared_ptr<shm::ShmBootstrap> members = std::move(bootstrap).value();
  auto made = create(members, timeout(), device(), num_sms());
  if (!made.ok()) {
    members->mark_failed("split: " + made.status().message());
    return made.status();
  }
  // Every member's transport exists before any member uses it (as at init; a member whose
  // creation failed marked itself failed, so this ends with an error naming it).
  if (Status status = members->barrier("split transport"); !status.ok()) {
    made.value()->mark_failed("split: " + status.message());
    return status;
  }
  return std::unique_ptr<Transport>(std::move(made).value());
}

Status CudaTransport::get_all(void* dst, const SymmetricRegion& region, size_t count,
                              DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(check_gather_dtypes(src_dtype, dst_dtype));
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), dst, "destination"));
  if (dst_dtype != src_dtype) {
    ODC_CUDA_CHECK(kernels::gather_sm_narrow(dst, peer_pointers(region), count, rank_info(),
                                             /*num_blocks=*/0, as_stream(stream), device_error()));
    return Status::Ok();
  }
  ODC_CUDA_CHECK(kernels::gather_sm(dst, peer_pointers(region), count * element_bytes(src_dtype),
                                    rank_info(), /*num_blocks=*/0, as_stream(stream),
                                    device_error()));
  return Status::Ok();
}

Status CudaTransport::launch_puts(const kernels::PutSignalJobs& jobs, size_t bytes, uint64_t value,
                                  StreamHandle stream) {
  // The local SignalBlock's push_done counters: one per job, reset by each job's last block.
  auto* done = static_cast<kernels::SignalBlock*>(signals_->local())->push_done;
  ODC_CUDA_CHECK(kernels::put_signal(jobs, bytes, value, done, rank_info(), device_error(),
                                     as_stream(stream)));
  return Status::Ok();
}

Status CudaTransport::get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                          size_t bytes, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), dst, "destination"));
  // The put kernel copies between any mapped pointers; here from the peer's memory (NVLink) into
  // ours, and like every data kernel it moves nothing after a failed device wait.
  kernels::PutSignalJobs jobs;
  jobs.dst[0] = dst;
  jobs.src[0] = static_cast<const char*>(region.peer(peer)) + offset;
  jobs.num_jobs = 1;
  return launch_puts(jobs, bytes, 0, stream);
}

Status CudaTransport::get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                               DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(check_gather_dtypes(src_dtype, dst_dtype));
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), dst, "destination"));
  const size_t part_bytes = count * element_bytes(dst_dtype);
  std::vector<void*> to;
  std::vector<const void*> from;
  for (size_t j = 0; j < sources.size(); ++j) {
    to.push_back(static_cast<char*>(dst) + j * part_bytes);
    from.push_back(static_cast<const char*>(sources[j].region->peer(sources[j].peer)) +
                   sources[j].offset);
  }
  if (dst_dtype != src_dtype) return local().narrow_many(to, from, count, stream);
  auto* done = static_cast<kernels::SignalBlock*>(signals_->local())->push_done;
  return local().copy_many(to, from, part_bytes, done, stream);
}

Status CudaTransport::wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers,
                                   uint64_t value, const std::string&, StreamHandle stream) {
  // A peer that failed writes kBarrierPeerFailed into its barrier word here (mark_failed):
  // the wait ends at once naming it.
  const uint64_t* peer_failed = static_cast<kernels::SignalBlock*>(signals_->local())->barrier;
  return local().wait_slots(static_cast<const uint64_t*>(signals.local()), peers, value,
                            timeout_ns(), peer_failed, stream);
}

Status CudaTransport::put(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                          size_t bytes, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), src, "source"));
  kernels::PutSignalJobs jobs;
  jobs.dst[0] = static_cast<char*>(region.peer(peer)) + offset;
  jobs.src[0] = src;
  jobs.num_jobs = 1;
  return launch_puts(jobs, bytes, 0, stream);
}

Status CudaTransport::signal(const SymmetricRegion& signals, int peer, uint64_t value,
                             StreamHandle stream) {
  DeviceGuard guard(device());
  kernels::PutSignalJobs jobs;
  jobs.signal[0] = static_cast<uint64_t*>(signals.peer(peer)) + rank();
  jobs.num_jobs = 1;
  return launch_puts(jobs, 0, value, stream);
}

Status CudaTransport::add_all(const void* src, DataType src_type, const SymmetricRegion& region,
                              size_t count, StreamHandle stream) {
  DeviceGuard guard(device());
  ODC_RETURN_IF_ERROR(check_device_pointer(device(), src, "source"));
  const auto type = elem_type(src_type);
  // After a failed device wait nothing more moves (the kernel checks the error record first).
  ODC_CUDA_CHECK(kernels::scatter_accumulate_reduce(
      src, type, peer_pointers(region), count, rank_info(), /*num_blocks=*/0, as_stream(stream),
      /*sys_scope=*/true, device_error()));
  return Status::Ok();
}

Status CudaTransport::accumulate(float* dst, const void* src, DataType src_type, size_t count,
                                 StreamHandle stream) {
  return local().accumulate(dst, src, src_type, count, stream);
}

Status CudaTransport::fold_streamed(const kernels::StreamedFold&, StreamHandle) {
  return Status::InternalError(
      "the CUDA transport has no device fold: it adds pushes remotely, so none are streamed");
}

uint64_t* CudaTransport::claim_word(const CompareSwapOp& op) const {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(op.region->peer(op.peer)) + op.offset);
}

cudaError_t CudaTransport::launch_compare_swap(const kernels::CompareSwapJob* jobs, int count,
                                               uint64_t* old_values, cudaStream_t stream) {
  return kernels::compare_swap_system(jobs, count, old_values, stream);
}

}  // namespace odc::cuda
