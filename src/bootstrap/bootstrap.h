// The bootstrap: how ranks exchange small records (keys, ids, handles) and meet before any
// transport exists, and how a failed rank tells its peers. Separate from transports; the external
// implementation runs on callbacks supplied by the caller (odcBootstrap_t: the Python package
// wires them to a torch.distributed store, so torchrun's rendezvous serves every node).
// Invariant: every call is collective (every rank, same order) and bounded: a callback that fails
// or times out becomes an error naming the rank and the operation, never a hang.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"

namespace odc {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Collective, host-blocking: all[r*bytes : (r+1)*bytes] = rank r's `mine`, for every rank r.
  // `operation` names the step in errors.
  virtual Status allgather(const void* mine, void* all, size_t bytes, const char* operation) = 0;
  // Collective, host-blocking: returns once every rank has entered it.
  virtual Status barrier(const char* operation) = 0;
  // Local: tells peers this rank failed (`reason`), so their waits end with an error naming it
  // instead of a timeout. Idempotent.
  virtual void mark_failed(const std::string& reason) = 0;
  // What `peer` said when it failed, as ": <reason>", or "" where this bootstrap cannot tell.
  virtual std::string failure_of(int peer) {
    (void)peer;
    return "";
  }
  // Ok while `peer` may still take part; an error naming it once this bootstrap knows it failed,
  // closed or died (a split group's members check their parent's through it). Default: what
  // failure_of tells.
  virtual Status peer_status(int peer) {
    const std::string failure = failure_of(peer);
    if (failure.empty()) return Status::Ok();
    return Status::RemoteError("rank " + std::to_string(peer) + " failed" + failure);
  }
};

// The caller's callbacks (the C API's odcBootstrap_t, minus its version). allgather and barrier
// return 0 on success, nonzero on failure (including their own timeout); mark_failed may be null.
struct ExternalBootstrapCallbacks {
  void* ctx = nullptr;
  int (*allgather)(void* ctx, const void* send, void* recv, size_t bytes) = nullptr;
  int (*barrier)(void* ctx) = nullptr;
  void (*mark_failed)(void* ctx, const char* reason) = nullptr;
};

// A bootstrap over the caller's callbacks; InvalidArgument when allgather or barrier is null.
Result<std::unique_ptr<Bootstrap>> make_external_bootstrap(int rank, int world_size,
                                                           const ExternalBootstrapCallbacks& calls);

// Collective: a fresh random key made by rank 0 (128 bits from the OS) that every rank returns.
// Checks that every rank reports the same world size and sits in its own slot (a miswired
// allgather is named, not trusted). Local transports name their shared memory with it, so two
// jobs with different bootstraps never meet, whatever keys they were given.
Result<std::string> agree_on_key(Bootstrap& bootstrap);

}  // namespace odc
