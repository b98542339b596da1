// Fault-injecting transport (see fault_transport.h).
#include "transport/fault/fault_transport.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace odc::fault {

FaultTransport::FaultTransport(std::unique_ptr<Transport> wrapped, FaultPlan plan,
                               std::function<void()> die)
    : TransportWrapper(std::move(wrapped)), plan_(plan), die_(std::move(die)), rng_(plan.seed) {
  bytes_read_from_.assign(static_cast<size_t>(world_size()), 0);
  bytes_put_to_.assign(static_cast<size_t>(world_size()), 0);
  if (!die_) {
    Transport* raw = &inner();
    die_ = [raw] { raw->mark_failed("died"); };
  }
}

Status FaultTransport::release_held() {
  while (!held_.empty()) {
    const HeldSignal signal = held_.back();
    held_.pop_back();
    ODC_RETURN_IF_ERROR(inner().signal(*signal.signals, signal.peer, signal.value, signal.stream));
  }
  return Status::Ok();
}

Status FaultTransport::enter(const char* what) {
  if (dead_) return Status::RemoteError("this rank died earlier (injected)");
  ++calls_;
  if (plan_.kind == FaultKind::kDieAtCall && calls_ >= plan_.at_call) {
    dead_ = true;
    die_();
    return Status::RemoteError(std::string("rank ") + std::to_string(rank()) + " died at call " +
                               std::to_string(calls_) + " (" + what + ", injected)");
  }
  if (plan_.max_delay_us > 0 && rng_() % 4 == 0) {
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::uniform_int_distribution<int>(0, plan_.max_delay_us)(rng_)));
  }
  return Status::Ok();
}

Result<std::vector<ExchangeRecord>> FaultTransport::exchange(const ExchangeRecord& mine) {
  ODC_RETURN_IF_ERROR(enter("exchange"));
  ODC_RETURN_IF_ERROR(release_held());
  return inner().exchange(mine);
}

Result<std::unique_ptr<Transport>> FaultTransport::split(const SplitGroup& group) {
  ODC_RETURN_IF_ERROR(enter("split"));
  ODC_RETURN_IF_ERROR(release_held());
  auto member = inner().split(group);
  if (!member.ok() || member.value() == nullptr) return member;
  FaultPlan plan;
  plan.max_delay_us = plan_.max_delay_us;
  plan.reorder = plan_.reorder;
  plan.seed = plan_.seed * 7919 + static_cast<uint32_t>(group.rank);
  return std::unique_ptr<Transport>(new FaultTransport(std::move(member).value(), plan));
}

Result<std::unique_ptr<SymmetricRegion>> FaultTransport::allocate(size_t bytes) {
  ODC_RETURN_IF_ERROR(enter("allocate"));
  ODC_RETURN_IF_ERROR(release_held());
  auto region = inner().allocate(bytes);
  if (region.ok()) allocated_bytes_ += bytes;
  return region;
}

Status FaultTransport::barrier(CollectiveOp op, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("barrier"));
  ODC_RETURN_IF_ERROR(release_held());
  if (due(FaultKind::kMismatch) && !fired_) {
    fired_ = true;
    op = op == CollectiveOp::kBarrier ? CollectiveOp::kMinibatchEnd : CollectiveOp::kBarrier;
  }
  return inner().barrier(op, stream);
}

Status FaultTransport::host_barrier(CollectiveOp op) {
  ODC_RETURN_IF_ERROR(enter("host_barrier"));
  ODC_RETURN_IF_ERROR(release_held());
  return inner().host_barrier(op);
}

Status FaultTransport::fold_streamed(const kernels::StreamedFold& fold, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("fold_streamed"));
  ODC_RETURN_IF_ERROR(release_held());
  return inner().device_staging()->fold_streamed(fold, stream);
}

Status FaultTransport::pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src,
                                  size_t bytes, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("pack_chunk"));
  return inner().device_staging()->pack_chunk(dst, header, src, bytes, stream);
}

Status FaultTransport::read_local(void* host_dst, const void* src, size_t bytes) {
  return inner().device_staging()->read_local(host_dst, src, bytes);
}

Result<StreamHandle> FaultTransport::fork_sends(StreamHandle stream) {
  return inner().device_staging()->fork_sends(stream);
}

Status FaultTransport::mark_sends(int index) {
  return inner().device_staging()->mark_sends(index);
}

Status FaultTransport::wait_sends(int index, StreamHandle stream) {
  return inner().device_staging()->wait_sends(index, stream);
}

Status FaultTransport::join_sends(StreamHandle stream) {
  return inner().device_staging()->join_sends(stream);
}

Result<bool> FaultTransport::fold_streamed_if_idle(const kernels::StreamedFold& fold,
                                                   StreamHandle stream) {
  if (dead_) return Status::RemoteError("this rank died earlier (injected)");
  return inner().device_staging()->fold_streamed_if_idle(fold, stream);
}

DeviceStagingOps* FaultTransport::device_staging() {
  return inner().device_staging() != nullptr ? this : nullptr;
}

Result<bool> FaultTransport::poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                                          std::chrono::duration<double> limit,
                                          std::vector<uint64_t>* seen) {
  if (dead_) return Status::RemoteError("this rank died earlier (injected)");
  ODC_RETURN_IF_ERROR(release_held());
  return inner().poll_signals(watches, num_all, limit, seen);
}

Status FaultTransport::wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers,
                                    uint64_t value, const std::string& what, StreamHandle stream) {
  if (dead_) return Status::RemoteError("this rank died earlier (injected)");
  ODC_RETURN_IF_ERROR(release_held());
  return inner().wait_signals(signals, peers, value, what, stream);
}

Status FaultTransport::poll_error() {
  if (dead_) return Status::RemoteError("this rank died earlier (injected)");
  return inner().poll_error();
}

void FaultTransport::mark_failed(const std::string& reason) {
  if (!dead_) inner().mark_failed(reason);  // the dead stay dead, not "failed"
}

Status FaultTransport::get_all(void* dst, const SymmetricRegion& region, size_t count,
                               DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("get_all"));
  for (size_t& read : bytes_read_from_) read += count * element_bytes(src_dtype);
  return inner().get_all(dst, region, count, src_dtype, dst_dtype, stream);
}

Status FaultTransport::get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                           size_t bytes, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("get"));
  bytes_read_from_[static_cast<size_t>(peer)] += bytes;
  return inner().get(dst, region, peer, offset, bytes, stream);
}

Status FaultTransport::get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                                DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("get_from"));
  for (const GatherSource& source : sources) {
    bytes_read_from_[static_cast<size_t>(source.peer)] += count * element_bytes(src_dtype);
  }
  return inner().get_from(dst, sources, count, src_dtype, dst_dtype, stream);
}

Status FaultTransport::put(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                           size_t bytes, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("put"));
  bytes_put_to_[static_cast<size_t>(peer)] += bytes;
  return inner().put(src, region, peer, offset, bytes, stream);
}

Status FaultTransport::put_signal(const void* src, const SymmetricRegion& region, int peer,
                                  size_t offset, size_t bytes, const SymmetricRegion& signals,
                                  uint64_t value, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("put_signal"));
  bytes_put_to_[static_cast<size_t>(peer)] += bytes;
  if (!alters_signal_to(peer)) {
    return inner().put_signal(src, region, peer, offset, bytes, signals, value, stream);
  }
  // The data first, then the signal: put-with-signal's order, with the signal's fault.
  ODC_RETURN_IF_ERROR(inner().put(src, region, peer, offset, bytes, stream));
  return send_signal(signals, peer, value, stream);
}

Status FaultTransport::signal(const SymmetricRegion& signals, int peer, uint64_t value,
                              StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("signal"));
  return send_signal(signals, peer, value, stream);
}

bool FaultTransport::alters_signal_to(int peer) const {
  if (plan_.reorder) return true;
  if (peer != plan_.peer) return false;
  return due(FaultKind::kDropSignal) || due(FaultKind::kDuplicateSignal) ||
         due(FaultKind::kDropSignalsFrom) || due(FaultKind::kInflateSignal);
}

Status FaultTransport::send_signal(const SymmetricRegion& signals, int peer, uint64_t value,
                                   StreamHandle stream) {
  if (due(FaultKind::kDropSignal) && !fired_ && peer == plan_.peer) {
    fired_ = true;
    return Status::Ok();  // lost on the way: the sender cannot tell
  }
  if (due(FaultKind::kDropSignalsFrom) && peer == plan_.peer) return Status::Ok();
  if (due(FaultKind::kInflateSignal) && peer == plan_.peer) ++value;
  if (plan_.reorder && rng_() % 2 == 0) {
    held_.push_back({&signals, peer, value, stream});  // late: after this rank's next signal
    return Status::Ok();
  }
  ODC_RETURN_IF_ERROR(inner().signal(signals, peer, value, stream));
  if (due(FaultKind::kDuplicateSignal) && peer == plan_.peer) {
    ODC_RETURN_IF_ERROR(inner().signal(signals, peer, value, stream));
  }
  return release_held();  // the held ones arrive after this newer one
}

Status FaultTransport::add_all(const void* src, DataType src_type, const SymmetricRegion& region,
                               size_t count, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("add_all"));
  return inner().add_all(src, src_type, region, count, stream);
}

Status FaultTransport::compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) {
  ODC_RETURN_IF_ERROR(enter("compare_swap"));
  return inner().compare_swap(ops, old_values);
}

Status FaultTransport::zero(void* dst, size_t bytes, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("zero"));
  return inner().zero(dst, bytes, stream);
}

Status FaultTransport::accumulate(float* dst, const void* src, DataType src_type, size_t count,
                                  StreamHandle stream) {
  ODC_RETURN_IF_ERROR(enter("accumulate"));
  return inner().accumulate(dst, src, src_type, count, stream);
}

}  // namespace odc::fault
