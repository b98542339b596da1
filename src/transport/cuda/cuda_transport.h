// CUDA transport within a node: one process per GPU; every rank's device buffers are mapped into
// every other rank's address space with CUDA IPC, exchanged through the host transport that also
// serves as the bootstrap (rendezvous, host barriers, failure flags). Data movement is enqueued on
// the caller's stream and never blocks the host:
//   gather             one SM kernel pulling every shard with 16-byte loads from peer memory;
//   scatter-accumulate vectorized fp32 reductions (red.global.add.v4.f32, system scope) straight
//                      into each owner's accumulator: no staging, no owner action, exact once;
//   minibatch barriers a device kernel on peer-visible epoch flags whose bounded wait records
//                      (rank, peer, value seen) instead of hanging; poll_error() reports it.
// The choices and their numbers: docs/cuda_lab.md.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/transport.h"
#include "kernels/kernels.h"
#include "transport/shm/shm_transport.h"

namespace odc::cuda {

class CudaTransport final : public Transport {
 public:
  // Collective: joins `world_size` ranks under `key`; this rank uses GPU `device`.
  static Result<std::unique_ptr<CudaTransport>> create(int rank, int world_size,
                                                       const std::string& key,
                                                       std::chrono::duration<double> timeout,
                                                       int device);
  ~CudaTransport() override;

  int rank() const override { return bootstrap_->rank(); }
  int world_size() const override { return bootstrap_->world_size(); }
  int device() const { return device_; }
  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override {
    return bootstrap_->exchange(mine);
  }
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Result<std::unique_ptr<AccumulatorRegion>> allocate_accumulator(size_t count) override;
  Status barrier(CollectiveOp op, StreamHandle stream) override;
  Status poll_error() override;
  void mark_failed(const std::string& reason) override { bootstrap_->mark_failed(reason); }
  Status gather(void* dst, const SymmetricRegion& shards, size_t shard_bytes,
                StreamHandle stream) override;
  Status reset(AccumulatorRegion& accumulator, StreamHandle stream) override;
  Status push(const void* src, DataType src_type, AccumulatorRegion& accumulator,
              StreamHandle stream) override;
  Status settle(AccumulatorRegion&, StreamHandle) override { return Status::Ok(); }

 private:
  CudaTransport(std::unique_ptr<shm::ShmTransport> bootstrap, int device,
                std::chrono::duration<double> timeout);
  Status init_device_state();
  Status check_device_pointer(const void* pointer, const char* what) const;
  kernels::RankInfo rank_info() const;
  kernels::PeerPointers peer_pointers(const SymmetricRegion& region) const;

  std::unique_ptr<shm::ShmTransport> bootstrap_;
  int device_;
  int num_sms_ = 0;
  int64_t timeout_ns_;
  uint64_t barrier_epoch_ = 0;
  std::unique_ptr<SymmetricRegion> signals_;    // one kernels::SignalBlock per rank
  kernels::WaitError* device_error_ = nullptr;  // written by expired device waits
  kernels::WaitError* host_error_ = nullptr;    // pinned copy, refreshed after each barrier
};

}  // namespace odc::cuda
