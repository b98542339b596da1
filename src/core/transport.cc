// Names of collectives, for error messages, and the transport operations with a generic default.
#include "core/transport.h"

#include <cstring>

#include <unistd.h>

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

Status Transport::fold_streamed(const kernels::StreamedFold&, StreamHandle) {
  return Status::InternalError(
      "this transport has no device fold: its streamed folds run on the host");
}

Status Transport::pack_chunk(void*, const kernels::ChunkHeader&, const void*, size_t,
                             StreamHandle) {
  return Status::InternalError(
      "this transport has no device fold: its streamed chunks are not packed");
}

Status Transport::read_local(void* host_dst, const void* src, size_t bytes) {
  std::memcpy(host_dst, src, bytes);
  return Status::Ok();
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

Status Transport::open_gather_window(const std::vector<const SymmetricRegion*>&, StreamHandle) {
  return Status::Ok();
}

Status Transport::close_gather_window(StreamHandle) {
  return Status::Ok();
}

}  // namespace odc
