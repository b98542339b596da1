// The transport interface: what the ODC protocol (core/communicator) needs from a backend. A
// transport moves bytes between ranks and synchronizes them: symmetric regions, one-sided get / put
// / put-with-signal, an fp32 remote add only where the hardware does it atomically, signals with
// bounded waits, barriers, and a few local operations in its own memory space (host or device).
// It knows nothing of minibatches, shards or accumulators: the protocol lives in the core.
// Invariant: collective calls (exchange, allocate, barriers) are made by every rank in the same
// order; a transport reports a mismatch or a missing rank as an error, never a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/dtype.h"

namespace odc {

class DeviceStagingOps;  // core/device_staging_ops.h

// Which collective a rank is in: ranks that meet in different collectives fail with a message
// naming both, instead of silently pairing up. Transports only compare and name these tags.
enum class CollectiveOp : uint32_t {
  kInit = 1,
  kExchange,
  kAllocate,
  kRelease,
  kMinibatchBegin,
  kMinibatchEnd,
  kBarrier,
  kDestroy,  // the final barrier of a communicator on stream-ordered transports
};

const char* collective_op_name(CollectiveOp op);

// Memory of the same size on every rank; peer(r) is rank r's copy as addressable from this rank.
class SymmetricRegion {
 public:
  virtual ~SymmetricRegion() = default;
  void* local() const { return peers_[local_rank_]; }
  void* peer(int rank) const { return peers_[static_cast<size_t>(rank)]; }
  size_t bytes() const { return bytes_; }

 protected:
  SymmetricRegion(std::vector<void*> peers, int local_rank, size_t bytes)
      : peers_(std::move(peers)), local_rank_(static_cast<size_t>(local_rank)), bytes_(bytes) {}

 private:
  std::vector<void*> peers_;
  size_t local_rank_;
  size_t bytes_;
};

// A small fixed-size record every rank contributes to exchange() (big enough for a CUDA IPC
// handle or an NCCL unique id).
struct ExchangeRecord {
  uint64_t words[16] = {};
};

// One group of a split (Communicator::split): which of a transport's ranks form it.
struct SplitGroup {
  // The transport's ranks in the group, in the group's rank order; empty where this rank is not
  // a member.
  std::vector<int> members;
  int rank = -1;  // this rank's place in `members` (-1: not a member)
  // Names the group: equal on its members, different for every other group of this job or any
  // other (random, agreed by the core); letters, digits and dots (a key for local shared memory).
  std::string name;
};

// Where stream-ordered transports enqueue work (a cudaStream_t); host transports ignore it.
using StreamHandle = void*;

// What a transport can do; the core picks its protocol from these.
struct TransportCaps {
  // add_all() exists and is atomic at the destination: concurrent adds from every rank into the
  // same memory each land exactly once (CUDA: red.global.add.f32 at system scope over NVLink).
  bool remote_fp32_add = false;
  // Data operations, signals and barrier() are enqueued on the caller's stream and complete in
  // stream order; their failures surface later through poll_error(). Otherwise every call has
  // completed (and its writes are visible to the peer it targets) when it returns.
  bool stream_ordered = false;
};

// One source of get_from(): the bytes at `offset` of `region` on rank `peer`.
struct GatherSource {
  const SymmetricRegion* region = nullptr;
  int peer = 0;
  size_t offset = 0;
};

// One signal slot a host-side wait watches: slot `peer` of this rank's `signals` reaching `value`.
struct SignalWatch {
  const SymmetricRegion* signals = nullptr;
  int peer = 0;
  uint64_t value = 0;
};

// One compare-and-swap of compare_swap(): the 64-bit word at byte `offset` (a multiple of 8) of
// `region` on rank `peer`: if it equals `expected` it becomes `desired`; either way its value
// before is returned. A read is a compare-and-swap with expected == desired.
struct CompareSwapOp {
  const SymmetricRegion* region = nullptr;
  int peer = 0;
  size_t offset = 0;
  uint64_t expected = 0;
  uint64_t desired = 0;
};

// What a transport is for its whole life, given at construction: plain data rather than methods
// of the table, read by the core on every call and copied by wrappers.
struct TransportTraits {
  int rank = 0;
  int world_size = 0;
  TransportCaps caps;
  // What bounds every wait on another rank (infinite: forever). Protocol loops that wait through
  // poll_signals() bound themselves by it.
  std::chrono::duration<double> timeout{0.0};
};

// Signals are symmetric regions of world_size uint64 slots per rank, zeroed at allocation: slot p
// at rank r is written only by rank p (signal(), or a device fold's credit) and read only by
// rank r (poll_signals(), its device's waits). Values only grow.
class Transport {
 public:
  virtual ~Transport() = default;

  int rank() const { return traits_.rank; }
  int world_size() const { return traits_.world_size; }
  TransportCaps caps() const { return traits_.caps; }
  std::chrono::duration<double> timeout() const { return traits_.timeout; }
  const TransportTraits& traits() const { return traits_; }
  // Topology as the transport sees it (core/topology.h asks for it when neither the config nor
  // the launcher says): a key equal on exactly the ranks of one node (default: a hash of the
  // host's name), and whether this rank maps a peer of its own node directly (plain loads and
  // stores; default: yes).
  virtual uint64_t node_key() const;
  virtual bool maps_directly(int peer) const;

  // ---- collectives (every rank, same order) -------------------------------------------------
  // Host-blocking: every rank contributes `mine`; returns all records in rank order.
  virtual Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) = 0;
  // Host-blocking: `bytes` (> 0, equal on every rank; callers check with exchange() first) of
  // zeroed memory on every rank, mapped so that each rank can address every peer's copy. Fails on
  // every rank when it fails on one.
  virtual Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) = 0;
  // Work issued before it on every rank (puts, adds, local operations) is complete and visible
  // after it. Stream-ordered on stream-ordered transports.
  virtual Status barrier(CollectiveOp op, StreamHandle stream) = 0;
  // As barrier(), but host-blocking, and all of this rank's queued work is complete before it
  // (for collectives that change memory: free).
  virtual Status host_barrier(CollectiveOp op) = 0;

  // Collective (every rank, same order; non-members too, with empty `group.members`): a transport
  // of the group's members only (rank group.rank of members.size()) on the same devices, with the
  // same capabilities and timeout, and its own collectives, regions, signals and failure flags
  // among the members; null on a non-member, which returns at once (members meet only each
  // other). A member that dies later is seen dead by the group's peers as by this transport's.
  // Default: InvalidUsage naming the transport as one that cannot split.
  virtual Result<std::unique_ptr<Transport>> split(const SplitGroup& group);

  // ---- local ---------------------------------------------------------------------------------
  // Host-blocking: every operation this rank has queued is complete, so its regions may be freed.
  // A no-op where every call completes before it returns (!caps().stream_ordered).
  virtual Status drain() { return Status::Ok(); }

  // ---- failures ------------------------------------------------------------------------------
  // A failure detected asynchronously (a device-side wait that expired), or Ok.
  virtual Status poll_error() = 0;
  // Marks this rank failed with `reason`, so peers waiting on it fail at once instead of timing
  // out, and makes it silent (it signals and announces nothing more). Idempotent.
  virtual void mark_failed(const std::string& reason) = 0;

  // ---- one-sided operations ------------------------------------------------------------------
  // dst part p = region@p's first `count` elements of `src_dtype`, for every rank p (self
  // included), parts as in get_from() (dst_dtype: src_dtype, or bfloat16 from float32, narrowed:
  // mixed-precision parameters gathered with no float32 copy of the whole result). A special case
  // of get_from() kept in the table because every transport gathers the whole world faster: CUDA
  // in one kernel over every peer's mapping, NVSHMEM starting each rank at a different owner,
  // host transports narrowing straight from each peer's memory (a get_from() through get() and a
  // float32 copy took 1.6 to 10 times as long on the in-memory transport).
  virtual Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                         DataType dst_dtype, StreamHandle stream) = 0;
  // Ok for the pairs get_all() and get_from() move (same -> same, float32 -> bfloat16), else
  // InvalidArgument naming them. Every implementation checks first: the sizes each computes
  // assume one of those pairs, and any other would read past a peer's shard (on a GPU an illegal
  // address that ends the CUDA context, not an error).
  static Status check_gather_dtypes(DataType src_dtype, DataType dst_dtype);
  // dst[0 : bytes] = region@peer[offset : offset+bytes]: a one-sided read of one peer (dst in this
  // transport's memory space), complete in stream order (on return elsewhere).
  virtual Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                     size_t bytes, StreamHandle stream) = 0;
  // For every j: dst part j = sources[j]'s `count` elements of `src_dtype`, where parts are
  // count x element_bytes(dst_dtype) apart; dst_dtype is src_dtype, or bfloat16 from float32
  // (narrowed, rounded to nearest even). One call for a gather whose shards live in different
  // places (the core's node cache). In stream order (on return elsewhere). Default: one get()
  // per source, narrowing on the host (host transports).
  virtual Status get_from(void* dst, const std::vector<GatherSource>& sources, size_t count,
                          DataType src_dtype, DataType dst_dtype, StreamHandle stream);
  // region@peer[offset : offset+bytes] = src[0 : bytes].
  virtual Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                     size_t bytes, StreamHandle stream) = 0;
  // region@peer[offset : offset+bytes] = src[0 : bytes], then slot rank() of `signals` at `peer`
  // = value once those bytes are visible there: the signal follows its own data (not necessarily
  // this rank's other puts). Transports may fuse it (NVSHMEM's put-with-signal); the default is
  // put() then signal().
  virtual Status put_signal(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                            size_t bytes, const SymmetricRegion& signals, uint64_t value,
                            StreamHandle stream);
  // Sets slot rank() of `signals` at `peer` to `value`, after every earlier put of this rank to
  // that peer is visible there (a fence, then the store).
  virtual Status signal(const SymmetricRegion& signals, int peer, uint64_t value,
                        StreamHandle stream) = 0;
  // Only where caps().remote_fp32_add: for every rank p, region@p[0:count] (fp32) +=
  // src[p*count : (p+1)*count] (fp32 or bf16), atomically at p.
  virtual Status add_all(const void* src, DataType src_type, const SymmetricRegion& region,
                         size_t count, StreamHandle stream);

  // ---- claims (the core's work board) -------------------------------------------------------
  // Local, host-blocking: for every i, old_values[i] = the value ops[i] found, each op one
  // atomic compare-and-swap at its peer, atomic against every other rank's compare_swap ops on
  // the same word (words it serves are written by nothing else) and sequentially consistent;
  // the ops of one call are independent and may run in any order or at once. Returns when
  // every op has been done. Never waits for work queued on any of the caller's streams (a claim
  // must not wait behind the current microbatch's GPU work) and never waits on a peer. A peer
  // of the call that failed, died or left: a RemoteError naming it (its op may or may not have
  // been done). Host transports: atomics on the mapped memory; CUDA: atomicCAS_system on the
  // peer mappings; NVSHMEM: device-side nvshmem atomics (work over NVLink and IB without
  // GDRCopy). Default: InvalidUsage naming the transport as one without it.
  virtual Status compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values);

  // ---- host-side signal reads (only where !caps().stream_ordered) ---------------------------
  // Reads the watched slots of this rank's signal regions into seen[i] (acquire: every put a peer
  // made before the signal that set its slot is visible afterwards). The first `num_all`
  // watches form one condition (all of them reached their values); every later watch is a
  // condition by itself. When none holds yet, first waits up to `limit` for one to (sleeping,
  // not spinning, woken by the signals that make one hold). Returns whether one holds; `limit`
  // passing is not an error (the caller bounds its own wait and names what it waited for). A
  // watched peer that failed, died or left ends the wait with a RemoteError naming it (unless
  // its slot reached the value). Stream-ordered transports: InternalError (their devices run
  // the protocol's loops).
  virtual Result<bool> poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                                    std::chrono::duration<double> limit,
                                    std::vector<uint64_t>* seen);

  // Returns once slot p of this rank's `signals` reached `value` for every p in `peers`
  // (acquire: what each peer wrote before raising it is visible after), bounded by timeout(). A
  // watched peer that failed, died or left ends the wait with an error naming it; `what` names
  // the wait in errors. Stream-ordered transports enqueue it on `stream` (their device waits; an
  // expiry is recorded as a node-fetch wait and reported by poll_error()). Default: host polls
  // through poll_signals(), which checks the caller's interrupt between polls.
  virtual Status wait_signals(const SymmetricRegion& signals, const std::vector<int>& peers,
                              uint64_t value, const std::string& what, StreamHandle stream);

  // ---- background work -----------------------------------------------------------------------
  // A stream of the transport's own: work enqueued on it from now on runs after everything
  // enqueued on `stream` so far, and does not wait for `stream`'s later work (the core's node
  // fetch, which the caller's forward must not wait for as a whole). Default (calls complete on
  // return): `stream` itself.
  virtual Result<StreamHandle> fork_background(StreamHandle stream);
  // Work enqueued on `stream` from now on runs after everything enqueued on the background
  // stream so far. Default: nothing to do.
  virtual Status join_background(StreamHandle stream);

  // ---- local operations in this transport's memory space (host or device) -------------------
  virtual Status zero(void* dst, size_t bytes, StreamHandle stream) = 0;
  // dst[i] += src[i] for i < count (src fp32 or bf16), in fp32.
  virtual Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                            StreamHandle stream) = 0;

  // ---- the streamed staging on the device (stream-ordered transports without remote adds) ----
  // Its hooks (core/device_staging_ops.h), owned by this transport; null where the streamed
  // staging runs on the host (default). An accessor rather than a dynamic_cast: the NVSHMEM
  // plugin is built with hidden visibility, where type information need not match across the
  // library boundary.
  virtual DeviceStagingOps* device_staging() { return nullptr; }

 protected:
  explicit Transport(const TransportTraits& traits) : traits_(traits) {}

 private:
  const TransportTraits traits_;
};

}  // namespace odc
