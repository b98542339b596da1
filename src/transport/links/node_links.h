// Network-like node links for CPU tests: a wrapper transport that makes every transfer between
// ranks on different (pretended) nodes take latency + bytes / bandwidth, so the core's schemes run
// under network delays with no network. Each rank has one egress link to other nodes that
// serializes what it sends (puts, signals, the data of its peers' gets from it), as a NIC shares
// its bandwidth; transfers within a node pass straight through. Puts and signals return at once
// and land at the peer only at their modelled arrival, in the order they were sent on the link
// (a signal never overtakes its data), delivered by one thread of the NodeLinks; gets and remote
// adds return once their data would have arrived. Invariants: the model knows bytes, ranks and
// node keys only, never minibatches; barriers, allocations, exchanges and drain() wait for this
// rank's transfers in flight first (a quiet), so "complete and visible after a barrier" holds.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include "core/transport.h"
#include "transport/transport_wrapper.h"

namespace odc::links {

struct LinkOptions {
  // One-way latency of every transfer across a node link.
  std::chrono::duration<double> latency{0.0};
  // Bandwidth of each rank's egress link to other nodes, bytes per second (> 0).
  double bytes_per_second = 1e9;
};

class LinkTransport;

// The links of one job: every rank's egress link and the thread that delivers transfers at their
// modelled arrival. Outlives the LinkTransports it wraps (they hold it).
class NodeLinks : public std::enable_shared_from_this<NodeLinks> {
 public:
  static std::shared_ptr<NodeLinks> create(int world_size, LinkOptions options);
  ~NodeLinks();
  NodeLinks(const NodeLinks&) = delete;
  NodeLinks& operator=(const NodeLinks&) = delete;

  // Rank inner->rank()'s transport behind its link; its node is inner->node_key(). Each rank
  // once. Transfers cross a link when the two ranks' node keys differ.
  std::unique_ptr<LinkTransport> wrap(std::unique_ptr<Transport> inner);
  const LinkOptions& options() const { return options_; }

 private:
  friend class LinkTransport;
  using Clock = std::chrono::steady_clock;
  NodeLinks(int world_size, LinkOptions options);

  bool crosses(int from, int to);
  // Reserves `bytes` on `from`'s egress link, starting no earlier than `earliest`; returns when
  // they arrive at the other end (after the link sent everything reserved before, plus latency).
  // `counted_put`: put bytes of `from`, tracked for bytes_put_departed().
  Clock::time_point reserve(int from, size_t bytes, Clock::time_point earliest, bool counted_put);
  // Runs `deliver` at `arrival` on the delivery thread (after every earlier arrival).
  void post(int from, Clock::time_point arrival, std::function<void()> deliver);
  // Returns once every transfer `from` posted was delivered.
  void quiet(int from);
  size_t bytes_put_departed(int from);
  void deliver_loop();

  struct Delivery {
    Clock::time_point arrival;
    uint64_t order;  // ties: in posting order, so one link's transfers keep theirs
    int from;
    std::function<void()> deliver;
    bool operator>(const Delivery& other) const {
      return arrival != other.arrival ? arrival > other.arrival : order > other.order;
    }
  };
  struct Link {
    uint64_t node_key = 0;
    bool joined = false;
    Clock::time_point free_at;  // when the link has sent everything reserved so far
    size_t in_flight = 0;       // posted, not yet delivered
    // Put bytes not yet past their departure (when the link finished sending them), in order.
    std::deque<std::pair<Clock::time_point, size_t>> departing;
    size_t departed_bytes = 0;
  };

  const LinkOptions options_;
  std::mutex mutex_;
  std::condition_variable changed_;  // a delivery was posted or done, or the thread must stop
  std::vector<Link> links_;
  std::priority_queue<Delivery, std::vector<Delivery>, std::greater<Delivery>> queue_;
  uint64_t next_order_ = 0;
  bool stopping_ = false;
  std::thread deliverer_;
};

// One rank's transport behind its node link (see the top of this file). Counters are this rank's
// payload bytes (signals excluded) across node links. What it does not override (signal polls and
// waits, local operations, the device staging's hooks) goes straight to the inner transport.
class LinkTransport final : public TransportWrapper {
 public:
  LinkTransport(std::shared_ptr<NodeLinks> links, std::unique_ptr<Transport> inner);
  ~LinkTransport() override;

  // Bytes this rank put (and added) into other nodes' memory, from the moment of the call.
  size_t bytes_put_over_links() const { return bytes_put_.load(); }
  // Of those, the bytes its link has finished sending by now (modelled time: a transfer has left
  // once the link sent it and everything queued before it, whatever the delivery thread is at).
  size_t bytes_put_departed() const { return links_->bytes_put_departed(rank()); }
  // Bytes this rank read (gets, gathers) from other nodes' memory.
  size_t bytes_fetched_over_links() const { return bytes_fetched_.load(); }

  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override;
  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override;
  Status barrier(CollectiveOp op, StreamHandle stream) override;
  Status host_barrier(CollectiveOp op) override;
  // Refused (Transport's default): a group's transport would need links of its own, and the
  // links of a job are indexed by the job's ranks.
  Result<std::unique_ptr<Transport>> split(const SplitGroup& group) override;
  Status drain() override;
  Status poll_error() override;

  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle stream) override;
  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                  DataType src_dtype, DataType dst_dtype, StreamHandle stream) override;
  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle stream) override;
  // Across a node link: put() then signal(), so both cross the link in order; within a node the
  // inner transport's own.
  Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                    size_t bytes, const SymmetricRegion& signals, uint64_t value,
                    StreamHandle stream) override;
  Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                StreamHandle stream) override;
  Status add_all(const void* src, DataType src_type, const SymmetricRegion& region, size_t count,
                 StreamHandle stream) override;

 private:
  // A read of `bytes` from each of `owners` (repeats allowed): the request crosses to each owner
  // on another node (latency), the data comes back on that owner's link. Sleeps until the last
  // arrives; returns at once when none crosses.
  void wait_for_reads(const std::vector<int>& owners, size_t bytes);
  // Waits for this rank's transfers in flight, then reports a delivery that failed.
  Status quiet();
  void record_delivery(const Status& status);

  std::shared_ptr<NodeLinks> links_;
  std::atomic<size_t> bytes_put_{0};  // read by tests from other threads
  std::atomic<size_t> bytes_fetched_{0};
  // The first delivery that failed on the delivery thread: reported by the next call that waits
  // for this rank's transfers (barriers, drain) and by poll_error().
  std::mutex delivery_mutex_;
  Status delivery_error_;
};

}  // namespace odc::links
