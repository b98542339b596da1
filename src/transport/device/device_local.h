// The kernels of every device transport (CUDA IPC, NVSHMEM) on its own GPU: the local operations
// of core/transport.h on the caller's stream, the check that a caller's pointer is device memory
// of the transport's GPU, and the background stream. Header-only helpers that
// transport/device/device_transport.h (the transports' shared base) holds and calls.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/dtype.h"
#include "kernels/kernels.h"
#include "transport/device/cuda_check.h"

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

// A stream of a device transport's own beside the caller's (the background stream of
// Transport::fork_background, the device staging's send lane): non-blocking, ordered after the
// caller's stream by events, and the caller's after it likewise (join, or a mark). Made at the
// first fork.
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
    for (cudaEvent_t mark : marks_) {
      if (mark != nullptr) cudaEventDestroy(mark);
    }
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
  // Marks: what this stream has enqueued so far is mark `index` (< kMarks), until marked again;
  // wait_mark() makes another stream wait for the mark as last set (none set: no wait). So a
  // caller may wait for an earlier point of this stream than join() would.
  static constexpr int kMarks = 2;
  Status mark(int index) {
    if (stream_ == nullptr || index < 0 || index >= kMarks) {
      return Status::InternalError("a mark " + std::to_string(index) + " of a stream " +
                                   (stream_ == nullptr ? "never forked" : "beyond its marks"));
    }
    DeviceGuard guard(device_);
    cudaEvent_t& event = marks_[static_cast<size_t>(index)];
    if (event == nullptr) ODC_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    ODC_CUDA_CHECK(cudaEventRecord(event, stream_));
    return Status::Ok();
  }
  Status wait_mark(int index, void* stream) {
    if (index < 0 || index >= kMarks) {
      return Status::InternalError("a wait for mark " + std::to_string(index) + " of " +
                                   std::to_string(kMarks));
    }
    const cudaEvent_t event = marks_[static_cast<size_t>(index)];
    if (event == nullptr) return Status::Ok();  // never marked: nothing to wait for
    DeviceGuard guard(device_);
    ODC_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), event, 0));
    return Status::Ok();
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t forked_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::array<cudaEvent_t, kMarks> marks_{};
};

}  // namespace odc::cuda
