// NVSHMEM transport: one process per GPU, on one node or many. NVSHMEM is initialized from a
// unique id that rank 0 makes and every rank receives through odc's Bootstrap (so a torchrun job
// works unchanged on several nodes); regions live on NVSHMEM's symmetric heap. No remote fp32 add
// (NVSHMEM has none), so the core streams pushes (core/device_streamed_staging.h): chunks put into
// bounded rings at their owners, folded by the owners' devices, credited back. Everything is
// enqueued on the caller's stream:
//   get_all         nvshmemx_getmem_on_stream per owner (network or NVLink), or, where NVSHMEM
//                   maps every peer's heap into this GPU (one node, NVLink), the CUDA transport's
//                   SM gather kernel over those mappings ("direct", ODC_NVSHMEM_DIRECT, default
//                   on); narrowed (fp32 shards into bf16): mapped owners through the narrowing
//                   copy kernel, the others fetched into a stream-ordered fp32 temporary first;
//   put, signal     nvshmemx_putmem_on_stream; a quiet, then nvshmemx_signal_op_on_stream (or,
//                   with ODC_NVSHMEM_SIGNAL_PUT, a put of the value);
//   fold_streamed   the core's fold kernel (kernels/streamed_fold.cuh), crediting senders with
//                   NVSHMEM's device-side single-word put (the plugin links NVSHMEM's device
//                   library for it);
//   signal waits    NVSHMEM's waits never time out, so a kernel polls the local signal words with
//   and barriers    a deadline and records (site, rank, peer, expected, seen); poll_error()
//                   reports it, worded as the CUDA transport's;
//   get_from        the core's node cache (core/node_gather_cache.h): mapped sources (this node's
//                   shards and fetchers' rows over NVLink) through the copy kernels, others by
//                   NVSHMEM's gets; its fetches run on the transport's background stream.
// Invariant: a streamed chunk is read only after its signal (acquired at system scope), and
// NVSHMEM's own collectives (malloc, free) are entered only after a bounded bootstrap barrier saw
// every rank.
#pragma once

#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bootstrap/bootstrap.h"
#include "core/transport.h"
#include "kernels/kernels.h"
#include "transport/cuda/device_local.h"
#include "transport/registry.h"

namespace odc::nvshmem {

struct HeapState;

class NvshmemTransport final : public Transport {
 public:
  // Collective: initializes NVSHMEM (once per process) over spec.bootstrap on GPU spec.device.
  static Result<std::unique_ptr<NvshmemTransport>> create(const TransportSpec& spec);
  ~NvshmemTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  TransportCaps caps() const override { return TransportCaps{false, true}; }
  bool maps_directly(int peer) const override { return mapped_[static_cast<size_t>(peer)] != 0; }
  std::chrono::duration<double> timeout() const override {
    return std::chrono::duration<double>(timeout_ns_ == INT64_MAX
                                             ? std::numeric_limits<double>::infinity()
                                             : static_cast<double>(timeout_ns_) / 1e9);
  }
  // Peers reached with odc's own kernels over NVSHMEM's NVLink mappings (same node, direct on).
  int num_direct_peers() const;
  int local_world_size() const { return local_size_; }
  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override;
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle stream) override;
  Status host_barrier(CollectiveOp op) override;
  Status drain() override;
  Status poll_error() override;
  void mark_failed(const std::string& reason) override;
  Status get_all(void* dst, const SymmetricRegion& region, size_t bytes,
                 StreamHandle stream) override;
  Status get_all_narrowed(void* dst, const SymmetricRegion& region, size_t count,
                          StreamHandle stream) override;
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  Status zero(void* dst, size_t bytes, StreamHandle stream) override;
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override;
  Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) override;
  Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src, size_t bytes,
                    StreamHandle stream) override;
  Status read_local(void* host_dst, const void* src, size_t bytes) override;
  Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) override;
  Status wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers, uint64_t value,
                      const std::string& what, StreamHandle stream) override;
  // ODC_NVSHMEM_TEST_FETCH_DELAY_US (tests): the background stream first waits that long.
  Result<StreamHandle> fork_background(StreamHandle stream) override;
  Status join_background(StreamHandle stream) override { return background_.join(stream); }

 private:
  NvshmemTransport(const TransportSpec& spec);
  Status init();
  cuda::DeviceLocal local() const { return cuda::DeviceLocal{device_, rank_info(), device_error_}; }
  kernels::RankInfo rank_info() const;
  int node_of(int rank) const { return rank / local_size_; }
  // signal@peer = value, after this rank's earlier puts landed (NVSHMEM's signal atomic, or with
  // ODC_NVSHMEM_SIGNAL_PUT a quiet and a put of the value).
  Status send_signal(uint64_t* signal, uint64_t value, int peer, cudaStream_t stream);
  std::shared_ptr<Bootstrap> bootstrap_;
  std::shared_ptr<HeapState> heap_;  // shared with regions: frees only while the job is whole
  int rank_;
  int world_size_;
  int device_;
  int num_sms_ = 0;
  int64_t timeout_ns_;
  std::vector<char> mapped_;       // mapped_[p]: peer p reached with direct loads/stores
  int local_size_ = 1;             // ranks per node (contiguous)
  uint64_t remote_get_bytes_ = 0;  // enqueued to / from other nodes (ODC_NVSHMEM_STATS)
  uint64_t remote_put_bytes_ = 0;
  uint64_t barrier_epoch_ = 0;
  std::unique_ptr<SymmetricRegion> barrier_signals_;  // world_size uint64 slots per rank
  // Signal values sent as puts, per peer: the caller's streams', then the background stream's.
  std::unique_ptr<SymmetricRegion> outbox_;
  std::unique_ptr<SymmetricRegion> barrier_outbox_;  // barrier epochs announced, per peer
  bool signal_by_put_ = false;
  uint32_t* push_done_ = nullptr;               // direct puts' block counters
  kernels::WaitError* device_error_ = nullptr;  // written by expired device waits
  kernels::WaitError* host_error_ = nullptr;    // host-mapped mirror of it
  cuda::BackgroundStream background_{device_};  // the core's node fetches
};

}  // namespace odc::nvshmem
