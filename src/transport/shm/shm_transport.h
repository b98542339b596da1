// Host shared-memory transport: every local rank maps every other rank's segments, so gets and
// puts are plain copies; a signal is a release store into the peer's slot followed by a futex
// wake. No remote fp32 add (the core stages pushes); nothing is stream-ordered.
// Ranks meet through a key, with no server: each rank publishes a control segment
// "/odc.<key>.r<rank>" and maps its peers'. Names are unlinked as soon as every rank has mapped
// them, so a crash after init leaves nothing behind; segments left by a crash during init are
// recognized by their dead owner pid and reclaimed.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/transport.h"
#include "transport/shm/shm_segment.h"

namespace odc::shm {

struct ControlBlock;

class ShmTransport final : public Transport {
 public:
  // Collective: returns once every rank of `world_size` has joined `key` (or fails after
  // `timeout`, naming the missing rank).
  static Result<std::unique_ptr<ShmTransport>> create(int rank, int world_size,
                                                      const std::string& key,
                                                      std::chrono::duration<double> timeout);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  TransportCaps caps() const override { return TransportCaps{}; }
  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override;
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle) override { return arrive_and_wait(op); }
  Status host_barrier(CollectiveOp op) override { return arrive_and_wait(op); }
  Status poll_error() override { return Status::Ok(); }
  void mark_failed(const std::string& reason) override;
  Status get_all(void* dst, const SymmetricRegion& region, size_t bytes,
                 StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  Status wait_signals(const SymmetricRegion& signals, uint64_t value, const char* operation,
                      StreamHandle stream) override;
  Status zero(void* dst, size_t bytes, StreamHandle stream) override;
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override;
  Status sum_slots(float* dst, const float* slots, size_t stride, int num_slots, size_t count,
                   StreamHandle stream) override;

 private:
  ShmTransport(int rank, int world_size, std::string key, std::chrono::duration<double> timeout);
  Status join();  // create our control segment, map every peer's, meet in the init barrier
  Status create_control_segment();
  Status map_peer(int peer, std::chrono::steady_clock::time_point deadline);
  Status arrive_and_wait(CollectiveOp op);
  // Waits until peer's arrival reaches `epoch`; fails on timeout, peer death or failure.
  Status wait_for_peer(int peer, uint64_t epoch, CollectiveOp op,
                       std::chrono::steady_clock::time_point deadline);
  // Wakes peers sleeping on this rank's futex word (after an arrival or a signal).
  void wake_peers();
  ControlBlock& block(int rank) const;
  std::string segment_name(int rank, const std::string& suffix) const;

  int rank_;
  int world_size_;
  std::string key_;
  std::chrono::duration<double> timeout_;
  uint64_t epoch_ = 0;        // collectives entered so far
  uint64_t exchanges_ = 0;    // exchange() calls so far (selects the record slot)
  uint64_t allocations_ = 0;  // allocate() calls so far (names the segments)
  std::vector<std::unique_ptr<Segment>> controls_;  // index = rank
};

}  // namespace odc::shm
