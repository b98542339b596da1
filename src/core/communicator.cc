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
  buffer->owner = this;
  buffer->id = next_buffer_id_++;
  buffer->count = count;
  buffer->dtype = dtype;
  buffer->accumulator = accumulator;
  auto data = transport_->allocate(buffer->bytes());
  if (!data.ok()) return finish(op, data.status());
  buffer->data = std::move(data).value();
  if (accumulator) {
    auto slots = transport_->allocate(static_cast<size_t>(world_size()) * count * sizeof(float));
    if (!slots.ok()) return finish(op, slots.status());
    buffer->slots = std::move(slots).value();
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
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kRelease)));
  buffers_.erase(buffer);
  return Status::Ok();
}

Status Communicator::gather(void* dst, size_t dst_count, const Buffer* buffer) {
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
  auto* out = static_cast<char*>(dst);
  for (int r = 0; r < world_size(); ++r) {
    transport_->copy(out + static_cast<size_t>(r) * buffer->bytes(), buffer->data->peer(r),
                     buffer->bytes());
  }
  return Status::Ok();
}

Status Communicator::scatter_accumulate(const void* src, size_t src_count, DataType src_dtype,
                                        Buffer* accumulator) {
  const char* op = "scatter_accumulate";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(check_buffer(op, accumulator));
  if (!accumulator->accumulator) {
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
  const auto* bytes = static_cast<const char*>(src);
  const size_t slice_bytes = shard * element_bytes(src_dtype);
  for (int owner = 0; owner < world_size(); ++owner) {
    // Our own slot at `owner`: nobody else writes it, so plain adds are exact.
    float* slot =
        static_cast<float*>(accumulator->slots->peer(owner)) + static_cast<size_t>(rank()) * shard;
    transport_->accumulate(slot, bytes + static_cast<size_t>(owner) * slice_bytes, src_dtype,
                           shard);
  }
  return Status::Ok();
}

Status Communicator::minibatch_begin() {
  const char* op = "minibatch_begin";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ == CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("a minibatch is already open (call minibatch_end)"));
  }
  for (auto& [handle, buffer] : buffers_) {
    if (!buffer->accumulator) continue;
    transport_->zero(buffer->data->local(), buffer->bytes());
    transport_->zero(buffer->slots->local(), buffer->slots->bytes());
  }
  // Nobody may push into a slot before its owner has zeroed it.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchBegin)));
  state_ = CommState::kInMinibatch;
  return Status::Ok();
}

Status Communicator::minibatch_end() {
  const char* op = "minibatch_end";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ != CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("no minibatch is open (call minibatch_begin first)"));
  }
  // After this barrier every rank has finished pushing.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchEnd)));
  for (auto& [handle, buffer] : buffers_) {
    if (!buffer->accumulator) continue;
    auto* accumulator = static_cast<float*>(buffer->data->local());
    const auto* slots = static_cast<const float*>(buffer->slots->local());
    for (int sender = 0; sender < world_size(); ++sender) {
      transport_->accumulate(accumulator, slots + static_cast<size_t>(sender) * buffer->count,
                             DataType::kFloat32, buffer->count);
    }
  }
  // ...and after this one every owner has folded its slots: sums are final everywhere.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchApplied)));
  state_ = CommState::kReady;
  return Status::Ok();
}

Status Communicator::barrier() {
  const char* op = "barrier";
  ODC_RETURN_IF_ERROR(usable(op));
  return finish(op, transport_->barrier(CollectiveOp::kBarrier));
}

}  // namespace odc
