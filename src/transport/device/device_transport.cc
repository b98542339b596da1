// The device transports' shared part (see device_transport.h). Built as the static library
// odc_device_transport, linked into both libodc.so (CUDA transport) and the NVSHMEM plugin with
// hidden visibility: each library holds a private copy, and the two meet only through Transport
// pointers (CMakeLists.txt says why).
#include "transport/device/device_transport.h"

#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "common/deadline.h"
#include "transport/device/cuda_check.h"
#include "transport/device/wait_status.h"

namespace odc::device {

using cuda::as_stream;
using cuda::DeviceGuard;

WaitErrorRecord::~WaitErrorRecord() {
  if (device_ < 0) return;
  DeviceGuard guard(device_);
  if (on_device_ != nullptr) cudaFree(on_device_);
  if (host_mirror_ != nullptr) cudaFreeHost(host_mirror_);
}

Status WaitErrorRecord::create(int device) {
  if (device_ >= 0) return Status::InternalError("the device-wait error record exists already");
  device_ = device;
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(cudaHostAlloc(&host_mirror_, sizeof(kernels::WaitError), cudaHostAllocMapped));
  std::memset(host_mirror_, 0, sizeof(kernels::WaitError));
  kernels::WaitError initial{};
  ODC_CUDA_CHECK(cudaHostGetDevicePointer(&initial.host_mirror, host_mirror_, 0));
  ODC_CUDA_CHECK(cudaMalloc(&on_device_, sizeof(kernels::WaitError)));
  ODC_CUDA_CHECK(cudaMemcpy(on_device_, &initial, sizeof(initial), cudaMemcpyHostToDevice));
  return Status::Ok();
}

kernels::WaitError WaitErrorRecord::read_mirror() const {
  kernels::WaitError record{};
  if (host_mirror_ == nullptr) return record;
  const auto* mirror = static_cast<const volatile kernels::WaitError*>(host_mirror_);
  record.site = mirror->site;
  if (record.site == kernels::kWaitNone) return record;
  record.rank = mirror->rank;
  record.peer = mirror->peer;
  record.expected = mirror->expected;
  record.seen = mirror->seen;
  return record;
}

namespace {

// The traits of a device transport on `bootstrap`'s ranks; the timeout as its device waits count
// it, in whole nanoseconds (or infinite).
TransportTraits device_traits(const Bootstrap& bootstrap, std::chrono::duration<double> timeout,
                              TransportCaps caps) {
  const int64_t timeout_ns = timeout_nanoseconds(timeout);
  return TransportTraits{bootstrap.rank(), bootstrap.world_size(), caps,
                         std::chrono::duration<double>(
                             timeout_ns == INT64_MAX ? std::numeric_limits<double>::infinity()
                                                     : static_cast<double>(timeout_ns) / 1e9)};
}

}  // namespace

DeviceTransport::DeviceTransport(std::shared_ptr<Bootstrap> bootstrap, int device,
                                 std::chrono::duration<double> timeout, TransportCaps caps)
    : Transport(device_traits(*bootstrap, timeout, caps)),
      bootstrap_(std::move(bootstrap)),
      device_(device),
      timeout_ns_(timeout_nanoseconds(timeout)),
      background_(device),
      sends_(device) {}

DeviceTransport::~DeviceTransport() {
  DeviceGuard guard(device_);
  cudaDeviceSynchronize();  // no kernel may still read the error record when it goes
  if (idle_fold_done_ != nullptr) cudaEventDestroy(idle_fold_done_);
  if (claim_stream_ != nullptr) cudaStreamDestroy(claim_stream_);
  if (claim_jobs_ != nullptr) cudaFreeHost(claim_jobs_);
  if (claim_old_ != nullptr) cudaFreeHost(claim_old_);
}

Status DeviceTransport::compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) {
  ODC_RETURN_IF_ERROR(poll_error());
  if (ops.empty()) return Status::Ok();
  DeviceGuard guard(device_);
  if (claim_stream_ == nullptr) {
    int least = 0;
    int greatest = 0;
    ODC_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    ODC_CUDA_CHECK(cudaStreamCreateWithPriority(&claim_stream_, cudaStreamNonBlocking, greatest));
  }
  if (ops.size() > claim_capacity_) {
    if (claim_jobs_ != nullptr) ODC_CUDA_CHECK(cudaFreeHost(claim_jobs_));
    if (claim_old_ != nullptr) ODC_CUDA_CHECK(cudaFreeHost(claim_old_));
    claim_jobs_ = nullptr;
    claim_old_ = nullptr;
    claim_capacity_ = 0;
    ODC_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&claim_jobs_),
                                 ops.size() * sizeof(kernels::CompareSwapJob),
                                 cudaHostAllocMapped));
    ODC_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&claim_old_),
                                 ops.size() * sizeof(uint64_t), cudaHostAllocMapped));
    claim_capacity_ = ops.size();
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].offset % sizeof(uint64_t) != 0) {
      return Status::InvalidArgument("compare_swap: offset " + std::to_string(ops[i].offset) +
                                     " is not a multiple of 8");
    }
    claim_jobs_[i] = kernels::CompareSwapJob{claim_word(ops[i]), ops[i].expected, ops[i].desired,
                                             static_cast<int32_t>(ops[i].peer)};
  }
  kernels::CompareSwapJob* device_jobs = nullptr;
  uint64_t* device_old = nullptr;
  ODC_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_jobs), claim_jobs_, 0));
  ODC_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_old), claim_old_, 0));
  ODC_CUDA_CHECK(
      launch_compare_swap(device_jobs, static_cast<int>(ops.size()), device_old, claim_stream_));
  // Bounded by the transport's timeout, as every wait on a peer: a compare-and-swap to a peer
  // that died (NVSHMEM across nodes) must end in an error naming it, not hang the host. Polled,
  // sleeping after the first microseconds: a claim normally completes in a few.
  const auto deadline = deadline_after(timeout());
  for (int polls = 0;; ++polls) {
    const cudaError_t state = cudaStreamQuery(claim_stream_);
    if (state == cudaSuccess) break;
    if (state != cudaErrorNotReady) ODC_CUDA_CHECK(state);
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string peers;
      for (const CompareSwapOp& op : ops)
        peers += (peers.empty() ? "" : ",") + std::to_string(op.peer);
      return Status::Timeout("compare_swap (work board claim) on rank(s) " + peers +
                             " did not complete within " + timeout_text(timeout()) +
                             ": a peer may have died");
    }
    if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  std::memcpy(old_values, claim_old_, ops.size() * sizeof(uint64_t));
  return Status::Ok();
}

Status DeviceTransport::check_device_exists(int device) {
  int num_devices = 0;
  if (cudaGetDeviceCount(&num_devices) != cudaSuccess) num_devices = 0;  // no driver: none
  if (device < 0 || device >= num_devices) {
    return Status::InvalidArgument("CUDA device " + std::to_string(device) +
                                   " does not exist (this process sees " +
                                   std::to_string(num_devices) + ")");
  }
  return Status::Ok();
}

Status DeviceTransport::init_device_state(int max_sms) {
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device_));
  if (max_sms > 0 && max_sms < num_sms_) num_sms_ = max_sms;
  return error_.create(device_);
}

kernels::RankInfo DeviceTransport::rank_info() const {
  kernels::RankInfo info;
  info.rank = rank();
  info.num_ranks = world_size();
  info.num_sms = num_sms_;
  return info;
}

uint64_t DeviceTransport::next_barrier_word(CollectiveOp op) {
  ++barrier_epoch_;
  return kernels::barrier_word(barrier_epoch_, static_cast<uint32_t>(op));
}

Result<std::vector<ExchangeRecord>> DeviceTransport::exchange(const ExchangeRecord& mine) {
  std::vector<ExchangeRecord> all(static_cast<size_t>(world_size()));
  ODC_RETURN_IF_ERROR(bootstrap_->allgather(&mine, all.data(), sizeof(ExchangeRecord),
                                            collective_op_name(CollectiveOp::kExchange)));
  return all;
}

Status DeviceTransport::host_barrier(CollectiveOp op) {
  DeviceGuard guard(device_);
  // Collectives that change memory (free) must not overtake queued work on any rank.
  ODC_CUDA_CHECK(cudaDeviceSynchronize());
  ODC_RETURN_IF_ERROR(poll_error());
  const auto mine = static_cast<uint32_t>(op);
  std::vector<uint32_t> all(static_cast<size_t>(world_size()));
  // Named by the collective, so a bootstrap timeout says which one a rank never reached.
  ODC_RETURN_IF_ERROR(
      bootstrap_->allgather(&mine, all.data(), sizeof(mine), collective_op_name(op)));
  for (int r = 0; r < world_size(); ++r) {
    if (all[static_cast<size_t>(r)] != mine) {
      return Status::RemoteError(
          std::string("collective mismatch: rank ") + std::to_string(r) + " called " +
          collective_op_name(static_cast<CollectiveOp>(all[static_cast<size_t>(r)])) +
          " where this rank called " + collective_op_name(op));
    }
  }
  return Status::Ok();
}

Status DeviceTransport::drain() {
  DeviceGuard guard(device_);
  ODC_CUDA_CHECK(cudaDeviceSynchronize());
  return Status::Ok();
}

Status DeviceTransport::poll_error() {
  const kernels::WaitError record = error_.read_mirror();
  if (record.site != kernels::kWaitNone) {
    return wait_record_status(record, timeout_ns_,
                              [this](int peer) { return bootstrap_->failure_of(peer); });
  }
  // No wait failed: a sticky CUDA error of this device (a kernel that faulted), if any.
  const cudaError_t sticky = cudaPeekAtLastError();
  if (sticky != cudaSuccess) {
    return Status::SystemError(std::string("CUDA error on device ") + std::to_string(device_) +
                               ": " + cudaGetErrorString(sticky));
  }
  return Status::Ok();
}

Result<StreamHandle> DeviceTransport::fork_background(StreamHandle stream) {
  return background_.fork(stream);
}

Status DeviceTransport::join_background(StreamHandle stream) {
  return background_.join(stream);
}

Result<StreamHandle> DeviceTransport::fork_sends(StreamHandle stream) {
  return sends_.fork(stream);
}

Status DeviceTransport::mark_sends(int index) {
  return sends_.mark(index);
}

Status DeviceTransport::wait_sends(int index, StreamHandle stream) {
  return sends_.wait_mark(index, stream);
}

Status DeviceTransport::join_sends(StreamHandle stream) {
  return sends_.join(stream);
}

Result<bool> DeviceTransport::fold_streamed_if_idle(const kernels::StreamedFold& fold,
                                                    StreamHandle stream) {
  DeviceGuard guard(device_);
  if (idle_fold_done_ == nullptr) {
    ODC_CUDA_CHECK(cudaEventCreateWithFlags(&idle_fold_done_, cudaEventDisableTiming));
  } else if (const cudaError_t done = cudaEventQuery(idle_fold_done_); done == cudaErrorNotReady) {
    return false;  // the last one still folds (or waits for its turn on the stream)
  } else {
    ODC_CUDA_CHECK(done);
  }
  ODC_RETURN_IF_ERROR(fold_streamed(fold, stream));
  ODC_CUDA_CHECK(cudaEventRecord(idle_fold_done_, as_stream(stream)));
  return true;
}

Status DeviceTransport::zero(void* dst, size_t bytes, StreamHandle stream) {
  return local().zero(dst, bytes, stream);
}

Status DeviceTransport::pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src,
                                   size_t bytes, StreamHandle stream) {
  return local().pack_chunk(dst, header, src, bytes, stream);
}

Status DeviceTransport::read_local(void* host_dst, const void* src, size_t bytes) {
  return local().read_local(host_dst, src, bytes);
}

}  // namespace odc::device
