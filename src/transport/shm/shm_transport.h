// Host shared-memory transport: every local rank maps every other rank's segments, so gets and
// puts are plain copies; a signal is a release store into the peer's slot followed by a futex
// wake. No remote fp32 add (the core stages pushes); nothing is stream-ordered.
// It lives on a shared-memory bootstrap (bootstrap/shm_bootstrap.h): its collectives, names,
// failure flags and liveness checks. Allocation segments are named only until every rank has
// mapped them; a rank that dies in between leaves them to whoever finds it dead.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap/shm_bootstrap.h"
#include "core/transport.h"

namespace odc::shm {

class ShmTransport final : public Transport {
 public:
  // Over an existing shared-memory bootstrap (this job's ranks have met through it).
  explicit ShmTransport(std::shared_ptr<ShmBootstrap> bootstrap);
  // Collective: meets every rank of `world_size` under `key` (a new shared-memory bootstrap;
  // `outer`: the bootstrap the key was agreed through; `launch`: this process's launch identity;
  // see ShmBootstrap::create).
  static Result<std::unique_ptr<ShmTransport>> create(int rank, int world_size,
                                                      const std::string& key,
                                                      std::chrono::duration<double> timeout,
                                                      Bootstrap* outer = nullptr,
                                                      const std::string& launch = "");

  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override;
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle) override {
    return bootstrap_->barrier(collective_op_name(op));
  }
  Status host_barrier(CollectiveOp op) override {
    return bootstrap_->barrier(collective_op_name(op));
  }
  // Members meet under the group's name in a shared-memory bootstrap of their own.
  Result<std::unique_ptr<Transport>> split(const SplitGroup& group) override;
  Status poll_error() override { return Status::Ok(); }
  void mark_failed(const std::string& reason) override { bootstrap_->mark_failed(reason); }
  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle stream) override;
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  // std::atomic_ref on the mapped words; the peers' liveness checked at most every 10 ms (it
  // reads /proc).
  Status compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) override;
  Result<bool> poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                            std::chrono::duration<double> limit,
                            std::vector<uint64_t>* seen) override;
  Status zero(void* dst, size_t bytes, StreamHandle stream) override;
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override;

 private:
  std::shared_ptr<ShmBootstrap> bootstrap_;
  uint64_t allocations_ = 0;  // allocate() calls so far (names the segments)
  ShmBootstrap::Clock::time_point next_claim_liveness_check_{};  // compare_swap()
};

}  // namespace odc::shm
