// A transport that wraps another and forwards every method of the table (core/transport.h) to it,
// for the test wrappers (fault injection, node links) to derive from and override only what they
// intercept. Invariant: a method a wrapper does not override reaches the wrapped transport's own,
// never Transport's default (which a wrapped device transport would not run: a host-side signal
// poll, put then signal instead of a fused put-with-signal). So a wrapper that intercepts put(),
// signal() or get() must intercept put_signal() and get_from() too: they no longer go through
// the former.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/transport.h"

namespace odc {

class TransportWrapper : public Transport {
 public:
  // With the wrapped transport's traits (rank, world size, capabilities, timeout).
  explicit TransportWrapper(std::unique_ptr<Transport> inner)
      : Transport(inner->traits()), inner_(std::move(inner)) {}
  // Reporting `traits` instead (a test's transport dressed up as another kind).
  TransportWrapper(std::unique_ptr<Transport> inner, const TransportTraits& traits)
      : Transport(traits), inner_(std::move(inner)) {}

  uint64_t node_key() const override { return inner_->node_key(); }
  bool maps_directly(int peer) const override { return inner_->maps_directly(peer); }

  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override {
    return inner_->exchange(mine);
  }
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override {
    return inner_->allocate(bytes);
  }
  Status barrier(CollectiveOp op, StreamHandle stream) override {
    return inner_->barrier(op, stream);
  }
  Status host_barrier(CollectiveOp op) override { return inner_->host_barrier(op); }
  // The group's transport of the wrapped one, unwrapped: a wrapper that must stay in the path of
  // the group's calls wraps it again (or refuses).
  Result<std::unique_ptr<Transport>> split(const SplitGroup& group) override {
    return inner_->split(group);
  }
  Status drain() override { return inner_->drain(); }

  Status poll_error() override { return inner_->poll_error(); }
  void mark_failed(const std::string& reason) override { inner_->mark_failed(reason); }

  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle stream) override {
    return inner_->get_all(dst, region, count, src_dtype, dst_dtype, stream);
  }
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override {
    return inner_->get(dst, region, peer, offset, bytes, stream);
  }
  Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) override {
    return inner_->get_from(dst, sources, count, src_dtype, dst_dtype, stream);
  }
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override {
    return inner_->put(src, region, peer, offset, bytes, stream);
  }
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override {
    return inner_->put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override {
    return inner_->signal(signals, peer, value, stream);
  }
  Status add_all(const void* src, DataType src_type, const SymmetricRegion& region, size_t count,
                 StreamHandle stream) override {
    return inner_->add_all(src, src_type, region, count, stream);
  }

  Status compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) override {
    return inner_->compare_swap(ops, old_values);
  }

  Result<bool> poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                            std::chrono::duration<double> limit,
                            std::vector<uint64_t>* seen) override {
    return inner_->poll_signals(watches, num_all, limit, seen);
  }
  Status wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers, uint64_t value,
                      const std::string& what, StreamHandle stream) override {
    return inner_->wait_signals(signals, peers, value, what, stream);
  }

  Result<StreamHandle> fork_background(StreamHandle stream) override {
    return inner_->fork_background(stream);
  }
  Status join_background(StreamHandle stream) override { return inner_->join_background(stream); }

  Status zero(void* dst, size_t bytes, StreamHandle stream) override {
    return inner_->zero(dst, bytes, stream);
  }
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override {
    return inner_->accumulate(dst, src, src_type, count, stream);
  }

  DeviceStagingOps* device_staging() override { return inner_->device_staging(); }

 protected:
  Transport& inner() const { return *inner_; }

 private:
  std::unique_ptr<Transport> inner_;
};

}  // namespace odc
