// NVSHMEM transport: one process per GPU, on one node or many; a byte mover. NVSHMEM is joined
// once per process (nvshmem_process.h); regions live on its symmetric heap. No remote fp32 add
// (NVSHMEM has none), so the core streams pushes (core/device_streamed_staging.h): chunks put into
// bounded rings at their owners, folded by the owners' devices, credited back. What every device
// transport shares (error record, host barrier, exchange, local operations, the barrier word)
// comes from device::DeviceTransport. Everything is enqueued on the caller's stream:
//   get_all,        per owner: this GPU's own shard and peers whose heap NVSHMEM maps into this
//   get_from        GPU (same node, NVLink; "direct", ODC_NVSHMEM_DIRECT, default on) through
//                   odc's copy kernels over those mappings (the put kernel's copy jobs, or the
//                   narrowing copy); every other owner by nvshmemx_getmem_nbi_on_stream and one
//                   quiet (narrowed: into a stream-ordered fp32 temporary first). get_from serves
//                   the core's node cache (core/node_gather_cache.h) on the background stream;
//   put, put_signal nvshmemx_putmem_on_stream / nvshmemx_putmem_signal_on_stream (or, with
//                   ODC_NVSHMEM_SIGNAL_PUT, a put, a quiet and a put of the value);
//   signal          a quiet, then nvshmemx_signal_op_on_stream (or the put of the value);
//   fold_streamed   the core's fold kernel (kernels/streamed_fold.cuh), crediting senders with
//                   NVSHMEM's device-side single-word put (the plugin links NVSHMEM's device
//                   library for it);
//   barrier         each rank puts its barrier word (epoch and collective) to every peer, then a
//                   kernel waits for every peer's word with a deadline: a peer in another
//                   collective is a mismatch naming both, as on the CUDA transport;
//   signal waits    NVSHMEM's waits never time out, so odc's kernels poll the local words with a
//                   deadline and record (site, rank, peer, expected, seen); poll_error() reports.
// Invariant: a streamed chunk is read only after its signal (acquired at system scope), and
// NVSHMEM's own collectives (malloc, free) are entered only after a bounded bootstrap barrier saw
// every rank.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bootstrap/bootstrap.h"
#include "core/transport.h"
#include "core/transport_spec.h"
#include "kernels/kernels.h"
#include "transport/device/device_transport.h"

namespace odc::nvshmem {

struct SymmetricHeap;

class NvshmemTransport final : public device::DeviceTransport {
 public:
  // Collective: joins NVSHMEM (once per process) over spec.bootstrap on GPU spec.device.
  static Result<std::unique_ptr<NvshmemTransport>> create(const TransportSpec& spec);
  ~NvshmemTransport() override;

  bool maps_directly(int peer) const override { return mapped_[static_cast<size_t>(peer)] != 0; }
  // Peers reached with odc's own kernels over NVSHMEM's NVLink mappings (same node, direct on).
  int num_direct_peers() const;
  int local_world_size() const { return local_size_; }

  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle stream) override;
  void mark_failed(const std::string& reason) override;
  // As get_from() of every rank, but each rank starts at the owner after itself, so that ranks
  // do not all pull from the same owner first.
  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle stream) override;
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  Status wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers, uint64_t value,
                      const std::string& what, StreamHandle stream) override;
  // Reductions, not plain adds: the streamed fold may add into the same sums from another stream.
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override;
  Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) override;
  // ODC_NVSHMEM_TEST_FETCH_DELAY_US (tests): the background stream first waits that long.
  Result<StreamHandle> fork_background(StreamHandle stream) override;

 private:
  // One part of a gather: dst part `index` = `count` elements of `region` at `peer` from `offset`.
  struct PulledPart {
    size_t index;
    const SymmetricRegion* region;
    int peer;
    size_t offset;
  };

  explicit NvshmemTransport(const TransportSpec& spec);
  // compare_swap(): the symmetric address of the word (region.local() + offset) at PE op.peer,
  // NVSHMEM's device-side atomic compare-and-swap (nvshmem_claim.cu).
  uint64_t* claim_word(const CompareSwapOp& op) const override;
  cudaError_t launch_compare_swap(const kernels::CompareSwapJob* jobs, int count,
                                  uint64_t* old_values, cudaStream_t stream) override;
  // Joins NVSHMEM, then the base's device state, then the steps below.
  Status init();
  Status allocate_control_words();
  void map_direct_peers();  // after the ranks per node are agreed
  // Runs every stream operation of a minibatch once, to this rank itself, and waits for them
  // (the definition says why). Collective: it allocates and frees two small regions.
  Status warm_up_stream_operations();

  int node_of(int rank) const { return rank / local_size_; }
  // Counts `bytes` moved to or from `peer` into *total where `peer` is on another node.
  void count_remote(int peer, size_t bytes, uint64_t* total) const;
  // Every rank's region as the parts of a gather, from the owner after this rank on.
  std::vector<PulledPart> every_owner(const SymmetricRegion& region) const;
  // The gathers' one path: mapped parts (and this rank's) through odc's copy kernels, the others
  // by NVSHMEM's gets; parts `count` elements of `element_bytes` in the source, narrowed to
  // bfloat16 in dst where `narrowed`. Parts are issued in the order given.
  Status pull_parts(void* dst, const std::vector<PulledPart>& parts, size_t count,
                    size_t element_bytes, bool narrowed, StreamHandle stream);
  // signal@peer = value, after this rank's earlier puts landed (NVSHMEM's signal atomic, or with
  // ODC_NVSHMEM_SIGNAL_PUT a quiet and a put of the value).
  Status send_signal(uint64_t* signal, uint64_t value, int peer, cudaStream_t stream);
  void print_stats() const;

  NvshmemSettings settings_;             // TransportSpec::nvshmem (core/comm_config.h)
  int configured_ranks_per_node_ = 0;    // TransportSpec::ranks_per_node (0: the node team)
  std::shared_ptr<SymmetricHeap> heap_;  // shared with regions: frees only while the job is whole
  std::vector<char> mapped_;             // mapped_[p]: peer p reached with direct loads/stores
  int local_size_ = 1;                   // ranks per node (contiguous)
  uint64_t remote_get_bytes_ = 0;        // enqueued to / from other nodes (ODC_NVSHMEM_STATS)
  uint64_t remote_put_bytes_ = 0;
  bool signal_by_put_ = false;
  // world_size uint64 slots per rank: slot p holds the barrier word rank p last announced here.
  std::unique_ptr<SymmetricRegion> barrier_words_;
  std::unique_ptr<SymmetricRegion> barrier_outbox_;  // the words this rank announced, per peer
  // Signal values sent as puts, per peer: the caller's streams', then the background stream's,
  // then the send lane's (DeviceStagingOps::fork_sends).
  static constexpr size_t kSignalOutboxParts = 3;
  std::unique_ptr<SymmetricRegion> outbox_;
  // The copy kernel's per-job block counters (device memory, kernels::kMaxRanks of them).
  struct CudaFree {
    void operator()(uint32_t* memory) const { cudaFree(memory); }
  };
  std::unique_ptr<uint32_t, CudaFree> push_done_;
};

}  // namespace odc::nvshmem
