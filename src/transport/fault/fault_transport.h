// A fault-injecting wrapper around any transport, for protocol tests: random delays before calls,
// reordered signals (held back and delivered after a later one), a rank that dies at a chosen
// call, a dropped, duplicated or inflated signal (or every signal to a peer lost from a call on),
// a collective mismatch. Calls are numbered per rank (every call of the protocol's counts; signal
// polls and waits, the progress thread's folds, local reads and the background stream do not,
// as their number depends on timing), so a fault lands at a reproducible point of the protocol.
// Every method it does not intercept reaches the wrapped transport's own (TransportWrapper).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/device_staging_ops.h"
#include "core/transport.h"
#include "transport/transport_wrapper.h"

namespace odc::fault {

enum class FaultKind {
  kNone,
  kDieAtCall,        // at call `at_call`: die() and return an error from then on
  kDropSignal,       // the first signal to `peer` at or after call `at_call` is never delivered
  kDuplicateSignal,  // every signal to `peer` from call `at_call` on is delivered twice
  kDropSignalsFrom,  // every signal to `peer` from call `at_call` on is lost (a link that broke)
  kInflateSignal,    // every signal to `peer` from call `at_call` on carries one more than sent
  kMismatch,         // the first barrier at or after call `at_call` enters a different collective
};

struct FaultPlan {
  FaultKind kind = FaultKind::kNone;
  int64_t at_call = 0;
  int peer = 0;
  // Sleep up to this many microseconds before a call (each call with probability 1/4).
  int max_delay_us = 0;
  // Hold back about half of the signals and deliver each after this rank's next signal (to any
  // peer), newest first; held ones go out before any wait or collective of this rank, so they
  // are late and out of order, never lost.
  bool reorder = false;
  uint32_t seed = 1;
};

class FaultTransport final : public TransportWrapper, private DeviceStagingOps {
 public:
  // `die` makes the rank dead as its peers see it (default: inner->mark_failed("died")).
  FaultTransport(std::unique_ptr<Transport> inner, FaultPlan plan,
                 std::function<void()> die = nullptr);

  int64_t calls() const { return calls_; }
  bool dead() const { return dead_.load(); }
  // Bytes of symmetric memory this rank allocated through it so far (memory tests).
  size_t allocated_bytes() const { return allocated_bytes_; }
  // Bytes this rank read from `peer`'s regions so far (gets and gathers), and put into them
  // (puts), for the node schemes' tests.
  size_t bytes_read_from(int peer) const { return bytes_read_from_[static_cast<size_t>(peer)]; }
  size_t bytes_put_to(int peer) const { return bytes_put_to_[static_cast<size_t>(peer)]; }

  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override;
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle stream) override;
  Status host_barrier(CollectiveOp op) override;
  // Counted as a call (a fault may land on it); a member's group transport is a FaultTransport
  // too, with this rank's delays and reordering and no fault of its own (so tests count its
  // bytes). Deaths reach it through the inner transport.
  Result<std::unique_ptr<Transport>> split(const SplitGroup& group) override;
  Status poll_error() override;
  void mark_failed(const std::string& reason) override;
  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle stream) override;
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  // One call; the inner transport's own put-with-signal unless a signal fault or reordering
  // applies to this signal: then a put, and the signal as signal() sends it.
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  Status add_all(const void* src, DataType src_type, const SymmetricRegion& region, size_t count,
                 StreamHandle stream) override;
  // Counted (a rank may die at a claim, holding the ones it made before).
  Status compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) override;
  Status zero(void* dst, size_t bytes, StreamHandle stream) override;
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle stream) override;
  // Polls and waits, forwarded without counting: how often a rank polls depends on timing, and
  // call numbers must stay reproducible.
  Result<bool> poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                            std::chrono::duration<double> limit,
                            std::vector<uint64_t>* seen) override;
  Status wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers, uint64_t value,
                      const std::string& what, StreamHandle stream) override;
  // This wrapper's own hooks around the inner transport's, where it has them.
  DeviceStagingOps* device_staging() override;

 private:
  // Counts the call, sleeps when delays are on, and dies when the plan says so.
  Status enter(const char* what);
  bool due(FaultKind kind) const { return plan_.kind == kind && calls_ >= plan_.at_call; }
  // Delivers the signals held back for reordering, newest first.
  Status release_held();
  // Whether a signal to `peer` now would be dropped, doubled, inflated or held back.
  bool alters_signal_to(int peer) const;
  // A signal of this rank to `peer` through the plan's signal faults (counted by the caller).
  Status send_signal(const SymmetricRegion& signals, int peer, uint64_t value, StreamHandle stream);

  // ---- DeviceStagingOps: the inner transport's, counted like the table's calls --------------
  Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) override;
  // The progress thread's folds, forwarded without counting: they run when the timing says.
  Result<bool> fold_streamed_if_idle(const kernels::StreamedFold& fold,
                                     StreamHandle stream) override;
  Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src, size_t bytes,
                    StreamHandle stream) override;
  Status read_local(void* host_dst, const void* src, size_t bytes) override;
  // The send lane's stream order, forwarded without counting (no fault is planned on them).
  Result<StreamHandle> fork_sends(StreamHandle stream) override;
  Status mark_sends(int index) override;
  Status wait_sends(int index, StreamHandle stream) override;
  Status join_sends(StreamHandle stream) override;

  FaultPlan plan_;
  std::function<void()> die_;
  std::mt19937 rng_;
  int64_t calls_ = 0;
  size_t allocated_bytes_ = 0;
  std::vector<size_t> bytes_read_from_;
  std::vector<size_t> bytes_put_to_;
  std::atomic<bool> dead_{false};  // read by the progress thread's passes too
  bool fired_ = false;             // the one-shot fault (drop, mismatch) happened
  struct HeldSignal {
    const SymmetricRegion* signals;
    int peer;
    uint64_t value;
    StreamHandle stream;
  };
  std::vector<HeldSignal> held_;  // reorder: signals not delivered yet
};

}  // namespace odc::fault
