// ODC protocol over any transport (see communicator.h for the invariants).
#include "core/communicator.h"

#include <string>

namespace odc {
namespace {

// A peer's death or failure, a timeout or ranks meeting in different collectives leave ranks out
// of step, so the communicator fails. Caller mistakes (invalid argument or usage) and failures all
// ranks agreed on (a system error during alloc) leave it as it was.
bool is_fault(const Status& status) {
  switch (status.code()) {
    case StatusCode::kTimeout:
    case StatusCode::kRemoteError:
    case StatusCode::kInternalError:
      return true;
    default:
      return false;
  }
}

std::string describe(size_t count, DataType dtype, bool accumulator) {
  return std::to_string(count) + " " + std::string(dtype_name(dtype)) +
         (accumulator ? " (accumulator)" : "");
}

}  // namespace

Communicator::Communicator(std::unique_ptr<Transport> transport)
    : transport_(std::move(transport)) {}

Communicator::~Communicator() {
  buffers_.clear();  // unmap buffers before the transport's control segments
  transport_.reset();
}

bool Communicator::owns(const Buffer* buffer) const {
  return buffers_.count(buffer) != 0;
}

Status Communicator::finish(const char* operation, Status status) {
  if (status.ok()) return status;
  Status named = status.with_context("rank " + std::to_string(rank()) + ": " + operation);
  if (is_fault(status) && state_ != CommState::kFailed) {
    state_ = CommState::kFailed;
    failure_ = named.message();
    transport_->mark_failed(failure_);
  }
  return named;
}

Status Communicator::usable(const char* operation) const {
  if (state_ == CommState::kFailed) {
    return Status::RemoteError("rank " + std::to_string(rank()) + ": " + operation +
                               ": communicator failed earlier: " + failure_);
  }
  return Status::Ok();
}

Status Communicator::check_buffer(const char* operation, const Buffer* buffer) const {
  const std::string where = "rank " + std::to_string(rank()) + ": " + operation + ": ";
  if (buffer == nullptr) return Status::InvalidArgument(where + "buffer is NULL");
  if (!owns(buffer)) {
    return Status::InvalidArgument(where +
                                   "buffer does not belong to this communicator (freed, or "
                                   "allocated by another one)");
  }
  return Status::Ok();
}

Result<Buffer*> Communicator::allocate(size_t count, DataType dtype, bool accumulator) {
  const char* op = "alloc";
  ODC_RETURN_IF_ERROR(usable(op));
  if (count == 0) return finish(op, Status::InvalidArgument("count must be positive"));
  if (!is_valid(dtype)) {
    return finish(op, Status::InvalidArgument("unknown dtype " +
                                              std::to_string(static_cast<uint32_t>(dtype))));
  }
  if (accumulator && dtype != DataType::kFloat32) {
    return finish(op, Status::InvalidArgument("an accumulator must be float32, got " +
                                              std::string(dtype_name(dtype))));
  }
  // Every rank must ask for the same buffer: compare before anything is created, so a mismatch
  // fails on every rank and changes nothing.
  ExchangeRecord mine;
  mine.words[0] = count;
  mine.words[1] = static_cast<uint64_t>(dtype);
  mine.words[2] = accumulator ? 1 : 0;
  auto all = transport_->exchange(mine);
  if (!all.ok()) return finish(op, all.status());
  for (int r = 0; r < world_size(); ++r) {
    const ExchangeRecord& theirs = all.value()[r];
    if (theirs.words[0] != mine.words[0] || theirs.words[1] != mine.words[1] ||
        theirs.words[2] != mine.words[2]) {
      return finish(op,
                    Status::InvalidArgument(
                        "buffers differ across ranks: rank " + std::to_string(r) + " asked for " +
                        describe(theirs.words[0], static_cast<DataType>(theirs.words[1]),
                                 theirs.words[2] != 0) +
                        " elements, this rank for " + describe(count, dtype, accumulator)));
    }
  }
  auto buffer = std::make_unique<Buffer>();
  buffer->id = next_buffer_id_++;
  buffer->count = count;
  buffer->dtype = dtype;
  if (accumulator) {
    auto region = transport_->allocate_accumulator(count);
    if (!region.ok()) return finish(op, region.status());
    buffer->accumulation = std::move(region).value();
  } else {
    auto region = transport_->allocate(buffer->bytes());
    if (!region.ok()) return finish(op, region.status());
    buffer->data = std::move(region).value();
  }
  Buffer* handle = buffer.get();
  buffers_.emplace(handle, std::move(buffer));
  return handle;
}

Status Communicator::release(Buffer* buffer) {
  const char* op = "free";
  ODC_RETURN_IF_ERROR(check_buffer(op, buffer));
  if (state_ == CommState::kFailed) {
    buffers_.erase(buffer);  // nothing to coordinate with: just unmap
    return Status::Ok();
  }
  // Peers may still read this buffer until they too arrive here.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kRelease, nullptr)));
  buffers_.erase(buffer);
  return Status::Ok();
}

Status Communicator::gather(void* dst, size_t dst_count, const Buffer* buffer,
                            StreamHandle stream) {
  const char* op = "gather";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(check_buffer(op, buffer));
  if (dst == nullptr) return finish(op, Status::InvalidArgument("destination is NULL"));
  const size_t expected = static_cast<size_t>(world_size()) * buffer->count;
  if (dst_count != expected) {
    return finish(
        op, Status::InvalidArgument(
                "destination has " + std::to_string(dst_count) +
                " elements; expected world size x shard = " + std::to_string(world_size()) + " x " +
                std::to_string(buffer->count) + " = " + std::to_string(expected)));
  }
  return finish(op, transport_->gather(dst, buffer->shards(), buffer->bytes(), stream));
}

Status Communicator::scatter_accumulate(const void* src, size_t src_count, DataType src_dtype,
                                        Buffer* accumulator, StreamHandle stream) {
  const char* op = "scatter_accumulate";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(check_buffer(op, accumulator));
  if (!accumulator->is_accumulator()) {
    return finish(op, Status::InvalidArgument(
                          "buffer was not allocated as an accumulator (accumulator=true)"));
  }
  if (src == nullptr) return finish(op, Status::InvalidArgument("source is NULL"));
  if (!is_valid(src_dtype)) {
    return finish(op, Status::InvalidArgument("unknown source dtype " +
                                              std::to_string(static_cast<uint32_t>(src_dtype))));
  }
  const size_t shard = accumulator->count;
  const size_t expected = static_cast<size_t>(world_size()) * shard;
  if (src_count != expected) {
    return finish(
        op, Status::InvalidArgument(
                "source has " + std::to_string(src_count) +
                " elements; expected world size x shard = " + std::to_string(world_size()) + " x " +
                std::to_string(shard) + " = " + std::to_string(expected)));
  }
  if (state_ != CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("called outside a minibatch (call minibatch_begin "
                                           "first)"));
  }
  return finish(op, transport_->push(src, src_dtype, *accumulator->accumulation, stream));
}

Status Communicator::minibatch_begin(StreamHandle stream) {
  const char* op = "minibatch_begin";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ == CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("a minibatch is already open (call minibatch_end)"));
  }
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  for (auto& [handle, buffer] : buffers_) {
    if (buffer->is_accumulator()) {
      ODC_RETURN_IF_ERROR(finish(op, transport_->reset(*buffer->accumulation, stream)));
    }
  }
  // Nobody may push into an accumulator before its owner has zeroed it.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchBegin, stream)));
  state_ = CommState::kInMinibatch;
  return Status::Ok();
}

Status Communicator::minibatch_end(StreamHandle stream) {
  const char* op = "minibatch_end";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ != CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("no minibatch is open (call minibatch_begin first)"));
  }
  // After this barrier every rank has finished pushing...
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchEnd, stream)));
  for (auto& [handle, buffer] : buffers_) {
    if (buffer->is_accumulator()) {
      ODC_RETURN_IF_ERROR(finish(op, transport_->settle(*buffer->accumulation, stream)));
    }
  }
  // ...and after this one every owner has settled its sums: they are final everywhere.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchApplied, stream)));
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  state_ = CommState::kReady;
  return Status::Ok();
}

Status Communicator::barrier(StreamHandle stream) {
  const char* op = "barrier";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  return finish(op, transport_->barrier(CollectiveOp::kBarrier, stream));
}

}  // namespace odc
