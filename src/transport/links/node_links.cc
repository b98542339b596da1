// Network-like node links (see node_links.h). Lock order: NodeLinks::mutex_ is never held while
// an inner transport is called (deliveries run unlocked), so it nests under nothing.
#include "transport/links/node_links.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

namespace odc::links {

std::shared_ptr<NodeLinks> NodeLinks::create(int world_size, LinkOptions options) {
  return std::shared_ptr<NodeLinks>(new NodeLinks(world_size, options));
}

NodeLinks::NodeLinks(int world_size, LinkOptions options)
    : options_(options), links_(static_cast<size_t>(world_size)) {
  deliverer_ = std::thread([this] { deliver_loop(); });
}

NodeLinks::~NodeLinks() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  deliverer_.join();
}

std::unique_ptr<LinkTransport> NodeLinks::wrap(std::unique_ptr<Transport> inner) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Link& link = links_[static_cast<size_t>(inner->rank())];
    link.node_key = inner->node_key();
    link.joined = true;
  }
  return std::make_unique<LinkTransport>(shared_from_this(), std::move(inner));
}

bool NodeLinks::crosses(int from, int to) {
  if (from == to) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  // Every rank joined before its first transfer: transfers need a region, and allocating one is
  // a collective every rank enters through its wrapper.
  const Link& a = links_[static_cast<size_t>(from)];
  const Link& b = links_[static_cast<size_t>(to)];
  return a.joined && b.joined && a.node_key != b.node_key;
}

NodeLinks::Clock::time_point NodeLinks::reserve(int from, size_t bytes, Clock::time_point earliest,
                                                bool counted_put) {
  const auto sending = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / options_.bytes_per_second));
  const auto latency = std::chrono::duration_cast<Clock::duration>(options_.latency);
  std::lock_guard<std::mutex> lock(mutex_);
  Link& link = links_[static_cast<size_t>(from)];
  link.free_at = std::max(link.free_at, earliest) + sending;
  if (counted_put) link.departing.emplace_back(link.free_at, bytes);
  return link.free_at + latency;
}

void NodeLinks::post(int from, Clock::time_point arrival, std::function<void()> deliver) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push(Delivery{arrival, next_order_++, from, std::move(deliver)});
    ++links_[static_cast<size_t>(from)].in_flight;
  }
  changed_.notify_all();  // the deliverer may sleep until a later arrival
}

void NodeLinks::quiet(int from) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return links_[static_cast<size_t>(from)].in_flight == 0; });
}

size_t NodeLinks::bytes_put_departed(int from) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  Link& link = links_[static_cast<size_t>(from)];
  while (!link.departing.empty() && link.departing.front().first <= now) {
    link.departed_bytes += link.departing.front().second;
    link.departing.pop_front();
  }
  return link.departed_bytes;
}

void NodeLinks::deliver_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (queue_.empty()) {
      if (stopping_) return;
      changed_.wait(lock);
      continue;
    }
    const Clock::time_point arrival = queue_.top().arrival;
    if (Clock::now() < arrival) {
      changed_.wait_until(lock, arrival);  // or an earlier arrival was posted meanwhile
      continue;
    }
    Delivery delivery = queue_.top();
    queue_.pop();
    lock.unlock();
    delivery.deliver();
    lock.lock();
    --links_[static_cast<size_t>(delivery.from)].in_flight;
    changed_.notify_all();
  }
}

LinkTransport::LinkTransport(std::shared_ptr<NodeLinks> links, std::unique_ptr<Transport> wrapped)
    : TransportWrapper(std::move(wrapped)), links_(std::move(links)) {}

LinkTransport::~LinkTransport() {
  // Deliveries in flight call the inner transport: they land before it goes (as a NIC's queue
  // drains before a process's memory is unmapped).
  links_->quiet(rank());
}

void LinkTransport::record_delivery(const Status& status) {
  if (status.ok()) return;
  std::lock_guard<std::mutex> lock(delivery_mutex_);
  if (delivery_error_.ok()) delivery_error_ = status;
}

Status LinkTransport::quiet() {
  links_->quiet(rank());
  std::lock_guard<std::mutex> lock(delivery_mutex_);
  return delivery_error_;
}

Status LinkTransport::poll_error() {
  {
    std::lock_guard<std::mutex> lock(delivery_mutex_);
    if (!delivery_error_.ok()) return delivery_error_;
  }
  return inner().poll_error();
}

Result<std::vector<ExchangeRecord>> LinkTransport::exchange(const ExchangeRecord& mine) {
  ODC_RETURN_IF_ERROR(quiet());
  return inner().exchange(mine);
}

Result<std::unique_ptr<SymmetricRegion>> LinkTransport::allocate(size_t bytes) {
  ODC_RETURN_IF_ERROR(quiet());
  return inner().allocate(bytes);
}

Status LinkTransport::barrier(CollectiveOp op, StreamHandle stream) {
  // Work issued before a barrier is visible after it: this rank's transfers land first.
  ODC_RETURN_IF_ERROR(quiet());
  return inner().barrier(op, stream);
}

Status LinkTransport::host_barrier(CollectiveOp op) {
  ODC_RETURN_IF_ERROR(quiet());
  return inner().host_barrier(op);
}

Result<std::unique_ptr<Transport>> LinkTransport::split(const SplitGroup& group) {
  return Transport::split(group);
}

Status LinkTransport::drain() {
  ODC_RETURN_IF_ERROR(quiet());
  return inner().drain();
}

void LinkTransport::wait_for_reads(const std::vector<int>& owners, size_t bytes) {
  const auto now = std::chrono::steady_clock::now();
  const auto request = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 links_->options().latency);
  auto last = now;
  for (int owner : owners) {
    if (!links_->crosses(owner, rank())) continue;
    last = std::max(last, links_->reserve(owner, bytes, request, /*counted_put=*/false));
    bytes_fetched_ += bytes;
  }
  std::this_thread::sleep_until(last);
}

Status LinkTransport::get_all(void* dst, const SymmetricRegion& region, size_t count,
                              DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  std::vector<int> owners(static_cast<size_t>(world_size()));
  for (int r = 0; r < world_size(); ++r) owners[static_cast<size_t>(r)] = r;
  // The source's elements cross (narrowed ones as fp32, narrowed on arrival).
  wait_for_reads(owners, count * element_bytes(src_dtype));
  return inner().get_all(dst, region, count, src_dtype, dst_dtype, stream);
}

Status LinkTransport::get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                          size_t bytes, StreamHandle stream) {
  wait_for_reads({peer}, bytes);
  return inner().get(dst, region, peer, offset, bytes, stream);
}

Status LinkTransport::get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                               DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  std::vector<int> owners;
  for (const GatherSource& source : sources) owners.push_back(source.peer);
  wait_for_reads(owners, count * element_bytes(src_dtype));
  return inner().get_from(dst, sources, count, src_dtype, dst_dtype, stream);
}

Status LinkTransport::put(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                          size_t bytes, StreamHandle stream) {
  if (!links_->crosses(rank(), peer)) return inner().put(src, region, peer, offset, bytes, stream);
  // The bytes leave the caller's memory now (a NIC copies them out; the caller may reuse src).
  auto data = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                  static_cast<const char*>(src) + bytes);
  const auto arrival =
      links_->reserve(rank(), bytes, std::chrono::steady_clock::now(), /*counted_put=*/true);
  bytes_put_ += bytes;
  const SymmetricRegion* target = &region;
  links_->post(rank(), arrival, [this, data, target, peer, offset, stream] {
    Status delivered = inner().put(data->data(), *target, peer, offset, data->size(), stream);
    record_delivery(delivered.with_context("rank " + std::to_string(rank()) + ": put of " +
                                           std::to_string(data->size()) + " bytes to rank " +
                                           std::to_string(peer) + " over its node link"));
  });
  return Status::Ok();
}

Status LinkTransport::put_signal(const void* src, const SymmetricRegion& region, int peer,
                                 size_t offset, size_t bytes, const SymmetricRegion& signals,
                                 uint64_t value, StreamHandle stream) {
  if (!links_->crosses(rank(), peer)) {
    return inner().put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }
  ODC_RETURN_IF_ERROR(put(src, region, peer, offset, bytes, stream));
  return signal(signals, peer, value, stream);
}

Status LinkTransport::signal(const SymmetricRegion& signals, int peer, uint64_t value,
                             StreamHandle stream) {
  if (!links_->crosses(rank(), peer)) return inner().signal(signals, peer, value, stream);
  // Behind this rank's earlier puts on the same link, so it lands after them (the contract).
  const auto arrival = links_->reserve(rank(), sizeof(uint64_t), std::chrono::steady_clock::now(),
                                       /*counted_put=*/false);
  const SymmetricRegion* target = &signals;
  links_->post(rank(), arrival, [this, target, peer, value, stream] {
    Status delivered = inner().signal(*target, peer, value, stream);
    record_delivery(delivered.with_context("rank " + std::to_string(rank()) + ": signal to rank " +
                                           std::to_string(peer) + " over its node link"));
  });
  return Status::Ok();
}

Status LinkTransport::add_all(const void* src, DataType src_type, const SymmetricRegion& region,
                              size_t count, StreamHandle stream) {
  if (!caps().remote_fp32_add) return Transport::add_all(src, src_type, region, count, stream);
  // A remote add completes when its data arrived: the caller waits for the slowest owner, then
  // the inner transport adds (atomically) everywhere.
  const size_t bytes = count * element_bytes(src_type);
  const auto now = std::chrono::steady_clock::now();
  auto last = now;
  for (int peer = 0; peer < world_size(); ++peer) {
    if (!links_->crosses(rank(), peer)) continue;
    last = std::max(last, links_->reserve(rank(), bytes, now, /*counted_put=*/true));
    bytes_put_ += bytes;
  }
  std::this_thread::sleep_until(last);
  return inner().add_all(src, src_type, region, count, stream);
}

}  // namespace odc::links
