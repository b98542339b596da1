// Names of collectives, for error messages, and the transport operations with a generic default.
#include "core/transport.h"

#include <vector>

#include <unistd.h>

#include "common/deadline.h"
#include "common/interrupt.h"
#include "core/host_ops.h"

namespace odc {

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kInit:
      return "init";
    case CollectiveOp::kExchange:
      return "exchange";
    case CollectiveOp::kAllocate:
      return "alloc";
    case CollectiveOp::kRelease:
      return "free";
    case CollectiveOp::kMinibatchBegin:
      return "minibatch_begin";
    case CollectiveOp::kMinibatchEnd:
      return "minibatch_end";
    case CollectiveOp::kBarrier:
      return "barrier";
    case CollectiveOp::kDestroy:
      return "destroy";
  }
  return "unknown collective";
}

Result<std::unique_ptr<Transport>> Transport::split(const SplitGroup& group) {
  (void)group;
  return Status::InvalidUsage(
      "this transport cannot split into sub-communicators (not supported: shm, cuda and the "
      "in-memory transport can)");
}

Status Transport::compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) {
  (void)ops;
  (void)old_values;
  return Status::InvalidUsage(
      "this transport has no remote compare-and-swap, which the work board needs (mem, shm, "
      "cuda and nvshmem have one)");
}

Status Transport::put_signal(const void* src, const SymmetricRegion& region, int peer,
                             size_t offset, size_t bytes, const SymmetricRegion& signals,
                             uint64_t value, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(put(src, region, peer, offset, bytes, stream));
  return signal(signals, peer, value, stream);
}

Status Transport::add_all(const void*, DataType, const SymmetricRegion&, size_t, StreamHandle) {
  return Status::InternalError("this transport has no atomic remote fp32 add (caps)");
}

Result<bool> Transport::poll_signals(const std::vector<SignalWatch>&, size_t,
                                     std::chrono::duration<double>, std::vector<uint64_t>*) {
  return Status::InternalError(
      "this transport is stream-ordered: signal polls run on its device, not the host");
}

uint64_t Transport::node_key() const {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return 0;
  uint64_t hash = 14695981039346656037ull;  // FNV-1a
  for (const char* c = host; *c != '\0'; ++c) {
    hash ^= static_cast<unsigned char>(*c);
    hash *= 1099511628211ull;
  }
  return hash;
}

bool Transport::maps_directly(int) const {
  return true;
}

Status Transport::check_gather_dtypes(DataType src_dtype, DataType dst_dtype) {
  const bool narrowing = src_dtype == DataType::kFloat32 && dst_dtype == DataType::kBfloat16;
  if (is_valid(src_dtype) && (dst_dtype == src_dtype || narrowing)) return Status::Ok();
  return Status::InvalidArgument(
      "a gather moves float32 or bfloat16 as it is, or narrows float32 to bfloat16; asked for " +
      std::string(is_valid(src_dtype) ? dtype_name(src_dtype) : "an unknown type") + " -> " +
      std::string(is_valid(dst_dtype) ? dtype_name(dst_dtype) : "an unknown type"));
}

Status Transport::get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                           DataType src_dtype, DataType dst_dtype, StreamHandle stream) {
  ODC_RETURN_IF_ERROR(check_gather_dtypes(src_dtype, dst_dtype));
  const size_t src_bytes = count * element_bytes(src_dtype);
  const size_t part_bytes = count * element_bytes(dst_dtype);
  const bool narrowed = dst_dtype != src_dtype;
  std::vector<float> wide(narrowed ? count : 0);
  for (size_t j = 0; j < sources.size(); ++j) {
    const GatherSource& source = sources[j];
    char* part = static_cast<char*>(dst) + j * part_bytes;
    ODC_RETURN_IF_ERROR(get(narrowed ? static_cast<void*>(wide.data()) : part, *source.region,
                            source.peer, source.offset, src_bytes, stream));
    if (narrowed) host::narrow_into(reinterpret_cast<uint16_t*>(part), wide.data(), count);
  }
  return Status::Ok();
}

Status Transport::wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers,
                               uint64_t value, const std::string& what, StreamHandle) {
  std::vector<SignalWatch> watches;
  for (int peer : peers) watches.push_back({&signals, peer, value});
  if (watches.empty()) return Status::Ok();
  // Slices as the staging's host waits: a poll wakes at once when a watched signal arrives.
  constexpr std::chrono::duration<double> kSlice = std::chrono::milliseconds(20);
  const auto deadline = deadline_after(timeout());
  std::vector<uint64_t> seen;
  for (bool first = true;; first = false) {
    auto polled = poll_signals(watches, watches.size(),
                               first ? std::chrono::duration<double>::zero() : kSlice, &seen);
    if (!polled.ok()) return polled.status();
    if (polled.value()) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline) {
      size_t late = 0;
      while (late + 1 < watches.size() && seen[late] >= value) ++late;
      return Status::Timeout(what + " timed out after " + timeout_text(timeout()) + ": rank " +
                             std::to_string(rank()) + " waited for rank " +
                             std::to_string(watches[late].peer) + " (expected " +
                             std::to_string(value) + ", saw " + std::to_string(seen[late]) + ")");
    }
    ODC_RETURN_IF_ERROR(poll_interrupt(what));
  }
}

Result<StreamHandle> Transport::fork_background(StreamHandle stream) {
  return stream;
}

Status Transport::join_background(StreamHandle) {
  return Status::Ok();
}

}  // namespace odc
