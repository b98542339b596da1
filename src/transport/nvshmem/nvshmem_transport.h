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
//   gather windows  with more than one node (ODC_NVSHMEM_HIERARCHICAL_GATHER, default on), each
//                   remote shard of a minibatch's buffers is fetched once per node at
//                   minibatch_begin, on a side stream, by local rank owner % ranks_per_node, into
//                   that rank's node cache; every local rank's gathers read it over NVLink after a
//                   bounded wait on the fetcher's ready flag.
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
struct GatherCache;

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
  bool hierarchical_gather() const { return hierarchical_gather_; }
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
  // Hierarchical gathers: the window's remote shards are fetched once per node (see the top).
  Status open_gather_window(const std::vector<const SymmetricRegion*>& regions,
                            StreamHandle stream) override;
  Status close_gather_window(StreamHandle stream) override;

 private:
  NvshmemTransport(const TransportSpec& spec);
  Status init();
  cuda::DeviceLocal local() const { return cuda::DeviceLocal{device_, rank_info(), device_error_}; }
  kernels::RankInfo rank_info() const;
  int node_of(int rank) const { return rank / local_size_; }
  // Copies the jobs whose target is mapped into this GPU (direct gathers): odc's put-with-signal
  // kernel, kernels::kMaxRanks jobs per launch.
  Status launch_direct(const std::vector<void*>& dst, const std::vector<const void*>& src,
                       const std::vector<uint64_t*>& signal, size_t bytes, uint64_t value,
                       cudaStream_t stream);
  // Narrowing copies (fp32 to bf16, `count` elements each) from src[j] to dst[j], local or mapped
  // memory on either side, kernels::kMaxRanks jobs per launch.
  Status launch_narrow(const std::vector<void*>& dst, const std::vector<const void*>& src,
                       size_t count, cudaStream_t stream);
  // signal@peer = value, after this rank's earlier puts landed (NVSHMEM's signal atomic, or with
  // ODC_NVSHMEM_SIGNAL_PUT a quiet and a put of the value).
  Status send_signal(uint64_t* signal, uint64_t value, int peer, cudaStream_t stream);
  // The remote owners (other nodes) whose shards the local rank `fetcher` (0 .. local_size-1)
  // fetches for its node, in rank order; the index of an owner in that list is its row in the
  // node cache.
  std::vector<int> owners_fetched_by(int fetcher) const;
  int max_fetched_owners() const;
  // (Re)allocates the node cache for the window's regions when they differ from the last
  // window's (collective: every rank opens windows with the same regions).
  Status prepare_gather_cache(const std::vector<const SymmetricRegion*>& regions);
  // The window's cache index of `region`, or -1 when it is not served from the cache.
  int cached_index(const SymmetricRegion& region) const;
  // Waits (bounded) until every local rank has fetched its part of cached region `index` in this
  // window, then returns, in owner order, where each owner's shard is readable from this GPU.
  Result<std::vector<const void*>> cached_sources(const SymmetricRegion& region, int index,
                                                  cudaStream_t stream);
  // cached_sources as copy jobs: owner o's shard to out + o * part_bytes, appended to to / from.
  Status cached_jobs(const SymmetricRegion& region, int index, void* out, size_t part_bytes,
                     cudaStream_t stream, std::vector<void*>& to, std::vector<const void*>& from);

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
  std::unique_ptr<SymmetricRegion> outbox_;           // signal values sent as puts, per peer
  std::unique_ptr<SymmetricRegion> barrier_outbox_;   // barrier epochs announced, per peer
  bool signal_by_put_ = false;
  bool hierarchical_gather_ = false;
  std::unique_ptr<GatherCache> gather_cache_;
  uint64_t gather_windows_ = 0;  // windows opened so far (the value ready flags carry)
  bool window_open_ = false;
  cudaStream_t fetch_stream_ = nullptr;  // the node fetches, off the caller's stream
  cudaEvent_t window_opened_ = nullptr;  // caller's stream: the minibatch_begin barrier passed
  cudaEvent_t fetches_done_ = nullptr;   // fetch stream: the window's fetches completed
  uint64_t next_region_serial_ = 0;      // names regions for the cache (addresses get reused)
  uint32_t* push_done_ = nullptr;        // direct puts' block counters
  kernels::WaitError* device_error_ = nullptr;  // written by expired device waits
  kernels::WaitError* host_error_ = nullptr;    // host-mapped mirror of it
};

}  // namespace odc::nvshmem
