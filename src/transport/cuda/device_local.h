// What every device transport (CUDA IPC, NVSHMEM) does the same way in its own GPU memory: the
// local operations of core/transport.h (zero, accumulate, sum_slots) on the caller's stream,
// the check that a caller's pointer is device memory of the transport's GPU, and the reading of
// a device-side wait's error record. Header-only, because the NVSHMEM transport is a plugin built
// apart from libodc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/dtype.h"
#include "kernels/kernels.h"
#include "transport/cuda/cuda_check.h"

namespace odc::cuda {

inline cudaStream_t as_stream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

inline kernels::ElemType elem_type(DataType type) {
  return type == DataType::kFloat32 ? kernels::ElemType::kFloat32 : kernels::ElemType::kBfloat16;
}

// InvalidArgument unless `pointer` is device (or managed) memory of `device`: a host pointer
// would fault inside a kernel, far from the call that passed it.
inline Status check_device_pointer(int device, const void* pointer, const char* what) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // clear: an unregistered host pointer is an answer, not a failure
    attributes.type = cudaMemoryTypeUnregistered;
  }
  const bool on_device =
      (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) &&
      attributes.device == device;
  if (!on_device) {
    return Status::InvalidArgument(std::string(what) + " is not device memory of CUDA device " +
                                   std::to_string(device));
  }
  return Status::Ok();
}

// The local operations, on `device`, enqueued on `stream`; after a failed device wait the kernels
// move nothing (they read `error` first).
struct DeviceLocal {
  int device;
  kernels::RankInfo info;
  kernels::WaitError* error;

  Status zero(void* dst, size_t bytes, void* stream) const {
    DeviceGuard guard(device);
    ODC_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, as_stream(stream)));
    return Status::Ok();
  }
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    void* stream) const {
    DeviceGuard guard(device);
    ODC_RETURN_IF_ERROR(check_device_pointer(device, src, "source"));
    ODC_CUDA_CHECK(kernels::accumulate_local(dst, src, elem_type(src_type), count, info, error,
                                             as_stream(stream)));
    return Status::Ok();
  }
  // As accumulate(), with reductions: safe while other kernels add into dst too.
  Status accumulate_reducing(float* dst, const void* src, DataType src_type, size_t count,
                             void* stream) const {
    DeviceGuard guard(device);
    ODC_RETURN_IF_ERROR(check_device_pointer(device, src, "source"));
    kernels::PeerPointers target;
    target.ptr[0] = dst;
    kernels::RankInfo one = info;
    one.rank = 0;
    one.num_ranks = 1;
    ODC_CUDA_CHECK(kernels::scatter_accumulate_reduce(src, elem_type(src_type), target, count, one,
                                                      0, as_stream(stream), /*sys_scope=*/false,
                                                      error));
    return Status::Ok();
  }
  Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src, size_t bytes,
                    void* stream) const {
    DeviceGuard guard(device);
    ODC_RETURN_IF_ERROR(check_device_pointer(device, src, "source"));
    ODC_CUDA_CHECK(kernels::pack_chunk(dst, header, src, bytes, info, error, as_stream(stream)));
    return Status::Ok();
  }
  // to[j][0 : bytes] = from[j][0 : bytes] for every j (local or mapped peer memory), in launches
  // of up to kMaxRanks jobs. `done`: the put kernel's per-job counters (kernels.h).
  Status copy_many(const std::vector<void*>& to, const std::vector<const void*>& from, size_t bytes,
                   uint32_t* done, void* stream) const {
    DeviceGuard guard(device);
    for (size_t first = 0; first < to.size(); first += kernels::kMaxRanks) {
      kernels::PutSignalJobs jobs;
      for (size_t j = first; j < to.size() && j < first + kernels::kMaxRanks; ++j) {
        jobs.dst[jobs.num_jobs] = to[j];
        jobs.src[jobs.num_jobs] = from[j];
        ++jobs.num_jobs;
      }
      ODC_CUDA_CHECK(kernels::put_signal(jobs, bytes, 0, done, info, error, as_stream(stream)));
    }
    return Status::Ok();
  }
  // to[j] (bf16)[i] = from[j] (fp32)[i] for i < count, every j, as copy_many.
  Status narrow_many(const std::vector<void*>& to, const std::vector<const void*>& from,
                     size_t count, void* stream) const {
    DeviceGuard guard(device);
    for (size_t first = 0; first < to.size(); first += kernels::kMaxRanks) {
      kernels::NarrowJobs jobs;
      for (size_t j = first; j < to.size() && j < first + kernels::kMaxRanks; ++j) {
        jobs.dst[jobs.num_jobs] = to[j];
        jobs.src[jobs.num_jobs] = from[j];
        ++jobs.num_jobs;
      }
      ODC_CUDA_CHECK(
          kernels::copy_narrow(jobs, count, info, /*num_blocks=*/0, as_stream(stream), error));
    }
    return Status::Ok();
  }
  // Waits on `stream` until slots[p] >= value for every p in `peers` (this GPU's signal words);
  // an expiry is recorded as a node-fetch wait (kWaitFetch) naming the peer; `peer_failed`
  // (optional, kernels::wait_slots) ends it at once for a peer that failed.
  Status wait_slots(const uint64_t* slots, const std::vector<int>& peers, uint64_t value,
                    int64_t timeout_ns, const uint64_t* peer_failed, void* stream) const {
    DeviceGuard guard(device);
    for (size_t first = 0; first < peers.size(); first += kernels::kMaxRanks) {
      kernels::SlotWaits waits;
      for (size_t j = first; j < peers.size() && j < first + kernels::kMaxRanks; ++j) {
        waits.peer[waits.num++] = peers[j];
      }
      ODC_CUDA_CHECK(kernels::wait_slots(slots, waits, value, info.rank, kernels::kWaitFetch,
                                         timeout_ns, peer_failed, error, as_stream(stream)));
    }
    return Status::Ok();
  }
  // What the device holds now (work queued on streams may still change it). On a stream of its
  // own that waits for nothing: a plain cudaMemcpy would queue behind the legacy stream's work,
  // which may be a fold waiting for peers.
  Status read_local(void* host_dst, const void* src, size_t bytes) const {
    DeviceGuard guard(device);
    cudaStream_t reader = nullptr;
    ODC_CUDA_CHECK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
    cudaError_t copied = cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, reader);
    if (copied == cudaSuccess) copied = cudaStreamSynchronize(reader);
    cudaStreamDestroy(reader);
    ODC_CUDA_CHECK(copied);
    return Status::Ok();
  }
};

// A device transport's background stream (Transport::fork_background): its own non-blocking
// stream, ordered after the caller's stream by events. Made at the first fork.
class BackgroundStream {
 public:
  explicit BackgroundStream(int device) : device_(device) {}
  BackgroundStream(const BackgroundStream&) = delete;
  BackgroundStream& operator=(const BackgroundStream&) = delete;
  ~BackgroundStream() {
    DeviceGuard guard(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (forked_ != nullptr) cudaEventDestroy(forked_);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  // Work enqueued on the returned stream runs after everything on `stream` so far.
  Result<void*> fork(void* stream) {
    DeviceGuard guard(device_);
    if (stream_ == nullptr) {
      ODC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      ODC_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
      ODC_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    ODC_CUDA_CHECK(cudaEventRecord(forked_, as_stream(stream)));
    ODC_CUDA_CHECK(cudaStreamWaitEvent(stream_, forked_, 0));
    return static_cast<void*>(stream_);
  }
  // The background stream (null before the first fork).
  cudaStream_t stream() const { return stream_; }
  // Work enqueued on `stream` from now on runs after everything on the background stream so far.
  Status join(void* stream) {
    if (stream_ == nullptr) return Status::Ok();
    DeviceGuard guard(device_);
    ODC_CUDA_CHECK(cudaEventRecord(done_, stream_));
    ODC_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), done_, 0));
    return Status::Ok();
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t forked_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

inline const char* wait_site_name(int32_t site) {
  switch (site) {
    case kernels::kWaitBarrier:
      return "device barrier";
    case kernels::kWaitSlotFree:
      return "staging slot release";
    case kernels::kWaitSlotReady:
      return "staging slot arrival";
    case kernels::kWaitFetch:
      return "gather of a published buffer: the node's fetch of remote shards";
    case kernels::kWaitPeerFailed:
      return "device barrier (the peer failed)";
    case kernels::kWaitCredit:
      return "credit wait (scatter_accumulate)";
    case kernels::kWaitStreamEnd:
      return "push wait (minibatch_end)";
    case kernels::kWaitFetchPeerFailed:
      return "gather of a published buffer (the fetching rank failed)";
    case kernels::kWaitMeeting:
      return "meeting of every rank before a collective inside a minibatch";
    default:
      return "device wait";
  }
}

// What a device-side wait recorded (a Timeout naming site, rank, peer and the values), else a
// sticky CUDA error of `device`, else Ok. Reads host-mapped memory only: no CUDA call, no sync.
inline Status device_wait_status(const volatile kernels::WaitError* record, int64_t timeout_ns,
                                 int device) {
  const int32_t site = record->site;
  if (site == kernels::kWaitBadChunk) {
    return Status::InternalError(
        "streamed fold: rank " + std::to_string(record->rank) + " refused chunk " +
        std::to_string(record->expected) + " from rank " + std::to_string(record->peer) + ": saw " +
        std::to_string(record->seen) +
        " instead (a slot holding another chunk, a signal or end beyond what the ring holds, or "
        "a chunk for no live accumulator: a lost put, a stray or doubled signal or credit); "
        "nothing of it was added");
  }
  if (site != kernels::kWaitNone) {
    std::ostringstream message;
    message << wait_site_name(site) << " timed out after " << static_cast<double>(timeout_ns) / 1e9
            << " s: rank " << record->rank << " waited for rank " << record->peer << " (expected "
            << record->expected << ", saw " << record->seen << ")";
    return Status::Timeout(message.str());
  }
  const cudaError_t sticky = cudaPeekAtLastError();
  if (sticky != cudaSuccess) {
    return Status::SystemError(std::string("CUDA error on device ") + std::to_string(device) +
                               ": " + cudaGetErrorString(sticky));
  }
  return Status::Ok();
}

}  // namespace odc::cuda
