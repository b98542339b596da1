// What every device transport (CUDA IPC within a node, NVSHMEM across nodes) does the same way,
// so that each of them holds only how it moves bytes: the device-wait error record and its
// host mirror (poll_error reads it with no CUDA call), the host barrier and the record exchange
// over the job's bootstrap, the local operations on the transport's GPU, the background stream,
// and the word a device barrier announces, which always carries the collective op.
// Invariant: ranks that meet in different collectives fail naming both, host barrier or device
// barrier, on every device transport (docs/runtime.md promises it).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "core/device_staging_ops.h"
#include "core/transport.h"
#include "kernels/kernels.h"
#include "transport/device/device_local.h"

namespace odc::device {

// kernels::WaitError in device memory, where every device wait reads it first (fail fast), and
// its mirror in host-mapped pinned memory, where an expired wait copies it so that poll_error()
// needs no CUDA call and no stream operation. Freed on destruction.
class WaitErrorRecord {
 public:
  WaitErrorRecord() = default;
  WaitErrorRecord(const WaitErrorRecord&) = delete;
  WaitErrorRecord& operator=(const WaitErrorRecord&) = delete;
  ~WaitErrorRecord();
  // Both copies zeroed (no failure) on `device`; once only.
  Status create(int device);
  kernels::WaitError* on_device() const { return on_device_; }
  // What the device recorded so far (site kWaitNone: nothing), read site first: the device
  // writes the site last.
  kernels::WaitError read_mirror() const;

 private:
  int device_ = -1;
  kernels::WaitError* on_device_ = nullptr;
  kernels::WaitError* host_mirror_ = nullptr;
};

// Also the device staging's hooks (core/device_staging_ops.h), all but the fold kernel, which
// each device transport supplies (fold_streamed).
class DeviceTransport : public Transport, private DeviceStagingOps {
 public:
  ~DeviceTransport() override;

  int device() const { return device_; }

  // ---- collectives over the bootstrap --------------------------------------------------------
  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) final;
  // This rank's queued work completes, then every rank names its collective, so a mismatch is
  // an error naming both whatever the bootstrap (the caller's barrier callback cannot compare).
  Status host_barrier(CollectiveOp op) final;
  Status drain() final;
  // What a device wait recorded (device/wait_status.h), else a sticky CUDA error, else Ok.
  Status poll_error() final;

  // ---- claims (the work board) ----------------------------------------------------------------
  // The ops as kernels::CompareSwapJob in pinned mapped host memory, the transport's kernel
  // (launch_compare_swap) on a private non-blocking stream of the highest priority (never the
  // caller's: a claim must not wait behind the current microbatch's GPU work), then a sync of
  // that stream only. A failure a device wait recorded is reported first (poll_error); a peer's
  // death otherwise surfaces where this transport's other one-sided ops see it: in the next
  // barrier, naming it.
  Status compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) final;

  // ---- the background stream (the core's node fetches) --------------------------------------
  Result<StreamHandle> fork_background(StreamHandle stream) override;
  Status join_background(StreamHandle stream) final;

  // ---- local operations on this GPU, on the caller's stream ---------------------------------
  Status zero(void* dst, size_t bytes, StreamHandle stream) final;

  // ---- the device staging's hooks -----------------------------------------------------------
  DeviceStagingOps* device_staging() final { return this; }
  // fold_streamed() unless the last fold enqueued here has not finished (an event's query).
  Result<bool> fold_streamed_if_idle(const kernels::StreamedFold& fold, StreamHandle stream) final;
  Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src, size_t bytes,
                    StreamHandle stream) final;
  Status read_local(void* host_dst, const void* src, size_t bytes) final;
  // The send lane: a stream of its own (sends_), marks as cuda::BackgroundStream's.
  Result<StreamHandle> fork_sends(StreamHandle stream) final;
  Status mark_sends(int index) final;
  Status wait_sends(int index, StreamHandle stream) final;
  Status join_sends(StreamHandle stream) final;

 protected:
  // Nothing touches the device until init_device_state().
  DeviceTransport(std::shared_ptr<Bootstrap> bootstrap, int device,
                  std::chrono::duration<double> timeout, TransportCaps caps);
  // InvalidArgument unless this process sees CUDA device `device` (before anything uses it).
  static Status check_device_exists(int device);
  // The first step of a transport's init: the data kernels' grid budget (`max_sms` SMs, or all
  // of the device's where fewer or <= 0) and the error record.
  Status init_device_state(int max_sms);

  // compare_swap()'s per-transport half: the address its kernel gives `op`'s word (CUDA: the
  // peer's mapping; NVSHMEM: the symmetric address, with op.peer as the PE), and the kernel.
  virtual uint64_t* claim_word(const CompareSwapOp& op) const = 0;
  virtual cudaError_t launch_compare_swap(const kernels::CompareSwapJob* jobs, int count,
                                          uint64_t* old_values, cudaStream_t stream) = 0;

  // The word this rank announces in its next device barrier: one epoch more than the last, and
  // `op`, so that a peer in another collective at the same epoch records a mismatch naming both
  // (kernels/wait_record.h) instead of pairing up.
  uint64_t next_barrier_word(CollectiveOp op);

  Bootstrap& bootstrap() const { return *bootstrap_; }
  const std::shared_ptr<Bootstrap>& shared_bootstrap() const { return bootstrap_; }
  int64_t timeout_ns() const { return timeout_ns_; }
  int num_sms() const { return num_sms_; }
  kernels::WaitError* device_error() const { return error_.on_device(); }
  kernels::RankInfo rank_info() const;
  cuda::DeviceLocal local() const {
    return cuda::DeviceLocal{device_, rank_info(), device_error()};
  }
  // The background stream, null before the first fork_background().
  cudaStream_t background_stream() const { return background_.stream(); }
  // The device staging's send lane, null before the first fork_sends().
  cudaStream_t sends_stream() const { return sends_.stream(); }

 private:
  std::shared_ptr<Bootstrap> bootstrap_;
  int device_;
  int64_t timeout_ns_;
  int num_sms_ = 0;
  uint64_t barrier_epoch_ = 0;
  WaitErrorRecord error_;
  // Recorded after each fold_streamed_if_idle() (null before the first).
  cudaEvent_t idle_fold_done_ = nullptr;
  cuda::BackgroundStream background_;  // destroyed first: its stream may still read error_
  cuda::BackgroundStream sends_;       // the send lane (fork_sends), likewise
  // compare_swap(): its stream and pinned mapped jobs and old values (room for claim_capacity_
  // ops), made at the first call.
  cudaStream_t claim_stream_ = nullptr;
  kernels::CompareSwapJob* claim_jobs_ = nullptr;
  uint64_t* claim_old_ = nullptr;
  size_t claim_capacity_ = 0;
};

}  // namespace odc::device
