// CUDA transport within a node: one process per GPU; every rank's device buffers are mapped into
// every other rank's address space with CUDA IPC, exchanged through the job's bootstrap (shared
// memory or the caller's, e.g. a torch store), which also serves host barriers and failure flags.
// Data movement is enqueued on the caller's stream and never blocks the host:
//   get_all            one SM kernel pulling every peer's region with 16-byte loads (narrowed:
//                      fp32 read, bf16 written, in the same pass);
//   add_all            vectorized fp32 reductions (red.global.add.v4.f32, system scope) straight
//                      into each peer's region: atomic, so caps().remote_fp32_add;
//   put, signals       an SM copy kernel whose last block raises the peer's signal (release);
//                      signal waits and barriers are device kernels on peer-visible flags whose
//                      bounded wait records (rank, peer, value seen) instead of hanging;
//                      poll_error() reports it.
// The choices and their numbers: docs/cuda_lab.md.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "bootstrap/bootstrap.h"
#include "core/transport.h"
#include "kernels/kernels.h"
#include "transport/device/device_transport.h"

namespace odc::cuda {

class CudaTransport final : public device::DeviceTransport {
 public:
  // Collective over `bootstrap`'s ranks; this rank uses GPU `device`. Device-side waits are
  // bounded by `timeout` (infinite: forever). `max_sms`: the SMs odc's data kernels size their
  // grids for (0: all; more than the device has: all), ODC_CUDA_SMS as core/comm_config.cc
  // resolved it.
  static Result<std::unique_ptr<CudaTransport>> create(std::shared_ptr<Bootstrap> bootstrap,
                                                       std::chrono::duration<double> timeout,
                                                       int device, int max_sms = 0);
  ~CudaTransport() override;

  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle stream) override;
  // Members meet in a shared-memory bootstrap of their own under the group's name (they share
  // this host) and map each other's memory anew, on the same device.
  Result<std::unique_ptr<Transport>> split(const SplitGroup& group) override;
  // Also tells peers' device barriers (kernels::kBarrierPeerFailed), so they end at once.
  void mark_failed(const std::string& reason) override;
  // One kernel over every peer's mapping (kernels::gather_sm, or gather_sm_narrow), faster than
  // get_from()'s copy jobs for the whole world (docs/cuda_lab.md).
  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle stream) override;
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  // Every source is mapped (one node): one copy kernel per kMaxRanks sources.
  Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers, uint64_t value,
                      const std::string& what, StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  Status add_all(const void* src, DataType src_type, const SymmetricRegion& region, size_t count,
                 StreamHandle stream) override;
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override;
  // InternalError: pushes are added remotely here (caps().remote_fp32_add), so the core never
  // streams them to this transport and it has no fold kernel.
  Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) override;

 private:
  CudaTransport(std::shared_ptr<Bootstrap> bootstrap, int device,
                std::chrono::duration<double> timeout);
  Status init(int max_sms);
  // compare_swap(): the peer's mapping of the word, atomicCAS_system (kernels::claim).
  uint64_t* claim_word(const CompareSwapOp& op) const override;
  cudaError_t launch_compare_swap(const kernels::CompareSwapJob* jobs, int count,
                                  uint64_t* old_values, cudaStream_t stream) override;
  kernels::PeerPointers peer_pointers(const SymmetricRegion& region) const;
  Status launch_puts(const kernels::PutSignalJobs& jobs, size_t bytes, uint64_t value,
                     StreamHandle stream);

  std::unique_ptr<SymmetricRegion> signals_;  // one kernels::SignalBlock per rank
  // mark_failed(): the words it writes into peers' memory, on a stream of their own (the
  // caller's streams may be blocked in a device wait).
  uint64_t* failed_words_ = nullptr;  // pinned: kBarrierPeerFailed, and kWaitSelfFailed
  cudaStream_t failure_stream_ = nullptr;
};

}  // namespace odc::cuda
