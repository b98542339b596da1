// C API of the communicator. Handles are checked against a registry of live communicators, so a
// destroyed handle gives odcInvalidUsage instead of undefined behaviour.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "api/api_errors.h"
#include "common/env.h"
#include "core/communicator.h"
#include "odc/odc.h"
#include "transport/shm/shm_transport.h"
#if ODC_WITH_CUDA
#include "transport/cuda/cuda_transport.h"
#endif

namespace {

// Default for every wait on another rank when the caller passes no timeout.
ODC_ENV_DOUBLE(default_timeout_seconds, "ODC_TIMEOUT", 60.0)

}  // namespace

struct odcComm {
  std::unique_ptr<odc::Communicator> communicator;
  std::string last_error;
};

namespace {

using odc::Status;
using odc::api::guarded;
using odc::api::report;
using odc::api::success;

std::mutex registry_mutex;
std::set<const odcComm*> live_comms;

// Records a failure on the communicator and the thread.
odcResult_t report_on(odcComm* comm, const Status& status) {
  if (comm != nullptr) comm->last_error = status.message();
  return report(status);
}

odcResult_t succeed_on(odcComm* comm) {
  comm->last_error.clear();
  return success();
}

// The communicator behind a handle, or the error for a NULL / destroyed one.
Status lookup(odcComm_t comm, const char* function) {
  if (comm == nullptr) return Status::InvalidArgument(std::string(function) + ": comm is NULL");
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (live_comms.count(comm) == 0) {
    return Status::InvalidUsage(std::string(function) +
                                ": communicator used after destroy (or never created)");
  }
  return Status::Ok();
}

odc::Buffer* as_buffer(odcBuffer_t buffer) {
  return reinterpret_cast<odc::Buffer*>(buffer);
}

// Out-of-range values stay out of range here; the communicator rejects them by name.
odc::DataType as_dtype(const odcDataType_t& dtype) {
  return static_cast<odc::DataType>(static_cast<uint32_t>(odc::api::raw_enum_value(dtype)));
}

// Runs `body(communicator)` on a live handle, recording any failure on it.
template <typename Body>
odcResult_t with_comm(odcComm_t comm, const char* function, Body&& body) {
  return guarded([&]() -> odcResult_t {
    if (Status status = lookup(comm, function); !status.ok()) return report(status);
    Status status = body(*comm->communicator);
    return status.ok() ? succeed_on(comm) : report_on(comm, status);
  });
}

}  // namespace

namespace {

// Shared by the init calls: validates, builds the transport with `make_transport(timeout)`, and
// registers the new communicator.
template <typename MakeTransport>
odcResult_t init_comm(odcComm_t* comm, int rank, const char* key, double timeout_seconds,
                      MakeTransport&& make_transport) {
  return guarded([&]() -> odcResult_t {
    if (comm == nullptr) return report(Status::InvalidArgument("odcCommInit: comm is NULL"));
    if (key == nullptr) return report(Status::InvalidArgument("odcCommInit: key is NULL"));
    const double timeout = timeout_seconds > 0 ? timeout_seconds : default_timeout_seconds();
    odc::Result<std::unique_ptr<odc::Transport>> transport =
        make_transport(std::chrono::duration<double>(timeout));
    if (!transport.ok()) {
      return report(transport.status().with_context("rank " + std::to_string(rank) + ": init"));
    }
    auto* created = new odcComm{std::make_unique<odc::Communicator>(std::move(transport).value()),
                                std::string()};
    {
      std::lock_guard<std::mutex> lock(registry_mutex);
      live_comms.insert(created);
    }
    *comm = created;
    return success();
  });
}

}  // namespace

extern "C" odcResult_t odcCommInit(odcComm_t* comm, int rank, int world_size, const char* key,
                                   double timeout_seconds) {
  return init_comm(
      comm, rank, key, timeout_seconds,
      [&](std::chrono::duration<double> timeout) -> odc::Result<std::unique_ptr<odc::Transport>> {
        auto made = odc::shm::ShmTransport::create(rank, world_size, key, timeout);
        if (!made.ok()) return made.status();
        return std::unique_ptr<odc::Transport>(std::move(made).value());
      });
}

extern "C" odcResult_t odcCommInitCuda(odcComm_t* comm, int rank, int world_size, const char* key,
                                       double timeout_seconds, int cuda_device) {
#if ODC_WITH_CUDA
  return init_comm(
      comm, rank, key, timeout_seconds,
      [&](std::chrono::duration<double> timeout) -> odc::Result<std::unique_ptr<odc::Transport>> {
        auto made = odc::cuda::CudaTransport::create(rank, world_size, key, timeout, cuda_device);
        if (!made.ok()) return made.status();
        return std::unique_ptr<odc::Transport>(std::move(made).value());
      });
#else
  (void)comm, (void)world_size, (void)key, (void)timeout_seconds, (void)cuda_device;
  return report(Status::InvalidUsage("rank " + std::to_string(rank) +
                                     ": init: odc was built without CUDA (ODC_WITH_CUDA=OFF)"));
#endif
}

#ifndef ODC_WITH_CUDA
#define ODC_WITH_CUDA 0
#endif
extern "C" int odcHasCuda(void) {
  return ODC_WITH_CUDA;
}

extern "C" odcResult_t odcCommDestroy(odcComm_t comm) {
  return guarded([&]() -> odcResult_t {
    if (Status status = lookup(comm, "odcCommDestroy"); !status.ok()) return report(status);
    {
      std::lock_guard<std::mutex> lock(registry_mutex);
      live_comms.erase(comm);
    }
    delete comm;
    return success();
  });
}

extern "C" odcResult_t odcCommRank(odcComm_t comm, int* rank) {
  return with_comm(comm, "odcCommRank", [&](odc::Communicator& c) {
    if (rank == nullptr) return Status::InvalidArgument("odcCommRank: rank is NULL");
    *rank = c.rank();
    return Status::Ok();
  });
}

extern "C" odcResult_t odcCommWorldSize(odcComm_t comm, int* world_size) {
  return with_comm(comm, "odcCommWorldSize", [&](odc::Communicator& c) {
    if (world_size == nullptr)
      return Status::InvalidArgument("odcCommWorldSize: world_size is NULL");
    *world_size = c.world_size();
    return Status::Ok();
  });
}

extern "C" const char* odcCommGetLastError(odcComm_t comm) {
  if (!lookup(comm, "odcCommGetLastError").ok()) return "invalid or destroyed communicator";
  return comm->last_error.c_str();
}

extern "C" odcResult_t odcBufferAlloc(odcComm_t comm, size_t count, odcDataType_t dtype,
                                      int accumulator, odcBuffer_t* buffer, void** local) {
  return with_comm(comm, "odcBufferAlloc", [&](odc::Communicator& c) -> Status {
    if (buffer == nullptr || local == nullptr) {
      return Status::InvalidArgument("rank " + std::to_string(c.rank()) +
                                     ": alloc: buffer and local must not be NULL");
    }
    // Every size the runtime derives from count must fit: the shard (count x element), the
    // gathered buffer and the per-sender staging (world x count x element, float32 for
    // accumulators). A wrapped product would map too little and let a later push write past it.
    const odc::DataType type = as_dtype(dtype);
    const size_t element = odc::is_valid(type) ? odc::element_bytes(type) : 1;
    const size_t most = static_cast<size_t>(PTRDIFF_MAX) / element /
                        static_cast<size_t>(std::max(c.world_size(), 1));
    if (count > most) {
      return Status::InvalidArgument(
          "rank " + std::to_string(c.rank()) + ": alloc: count " + std::to_string(count) +
          " is too large: at most " + std::to_string(most) + " elements of " +
          std::to_string(element) + " bytes with " + std::to_string(c.world_size()) + " ranks");
    }
    auto allocated = c.allocate(count, type, accumulator != 0);
    if (!allocated.ok()) return allocated.status();
    *buffer = reinterpret_cast<odcBuffer_t>(allocated.value());
    *local = allocated.value()->local();
    return Status::Ok();
  });
}

extern "C" odcResult_t odcBufferFree(odcComm_t comm, odcBuffer_t buffer) {
  return with_comm(comm, "odcBufferFree",
                   [&](odc::Communicator& c) { return c.release(as_buffer(buffer)); });
}

extern "C" odcResult_t odcGather(odcComm_t comm, void* dst, size_t dst_count, odcBuffer_t buffer,
                                 odcStream_t stream) {
  return with_comm(comm, "odcGather", [&](odc::Communicator& c) {
    return c.gather(dst, dst_count, as_buffer(buffer), stream);
  });
}

extern "C" odcResult_t odcScatterAccumulate(odcComm_t comm, const void* src, size_t src_count,
                                            odcDataType_t src_dtype, odcBuffer_t accumulator,
                                            odcStream_t stream) {
  return with_comm(comm, "odcScatterAccumulate", [&](odc::Communicator& c) {
    return c.scatter_accumulate(src, src_count, as_dtype(src_dtype), as_buffer(accumulator),
                                stream);
  });
}

extern "C" odcResult_t odcMinibatchBegin(odcComm_t comm, odcStream_t stream) {
  return with_comm(comm, "odcMinibatchBegin",
                   [&](odc::Communicator& c) { return c.minibatch_begin(stream); });
}

extern "C" odcResult_t odcMinibatchEnd(odcComm_t comm, odcStream_t stream) {
  return with_comm(comm, "odcMinibatchEnd",
                   [&](odc::Communicator& c) { return c.minibatch_end(stream); });
}

extern "C" odcResult_t odcBarrier(odcComm_t comm, odcStream_t stream) {
  return with_comm(comm, "odcBarrier", [&](odc::Communicator& c) { return c.barrier(stream); });
}
