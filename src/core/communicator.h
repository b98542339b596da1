// The ODC protocol on top of a Transport: symmetric buffers, gather, scatter-accumulate and the
// one synchronization per minibatch. The communicator picks how pushes land from the transport's
// capabilities (AccumulationScheme); transports only move bytes. Invariants:
//   - a pushed contribution is added exactly once at its owner: by an atomic remote fp32 add
//     straight into the owner's sums (remote add); or in chunks through this sender's bounded
//     staging ring at the owner, folded by the owner in sequence order while the minibatch runs
//     (streamed, core/streamed_staging.h); or by summing it into this sender's pending buffer,
//     from which the owner pulls its slice of every sender's sums in sender order once a barrier
//     made them complete (pulled, deterministic);
//   - the sums an owner exposes after minibatch_end stay valid for every rank until the next
//     minibatch starts filling them (remote adds and streamed: the owner zeroes only after every
//     rank entered minibatch_begin; pulled: the pull assigns, inside the next minibatch_end);
//   - a failed call that is the caller's mistake changes nothing; a failure of another rank or a
//     timeout leaves the communicator failed (every later call reports the original error) and
//     silent, so that its peers fail too: no partial sum is ever reported as success;
//   - a sub-communicator (split) is a communicator of its own over a transport of its members
//     only: its buffers exist on its members, its minibatches and barriers meet only them; a
//     failure of the communicator it was split from fails it too, never the other way round.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "common/status.h"
#include "core/dtype.h"
#include "core/host_progress.h"
#include "core/node_gather_cache.h"
#include "core/node_relay.h"
#include "core/streamed_staging.h"
#include "core/topology.h"
#include "core/transport.h"
#include "core/work_board.h"

namespace odc {

class Communicator;

// Longest buffer name allocate() takes.
inline constexpr size_t kMaxBufferNameBytes = 256;

// The colour of a rank that joins no sub-communicator in split() (NCCL's NCCL_SPLIT_NOCOLOR); any
// negative colour means the same.
inline constexpr int kSplitNoColor = -1;

// How pushes reach their owners.
enum class AccumulationScheme {
  // add_all() straight into the owners' sums: the transport's remote fp32 add is atomic (CUDA).
  kRemoteAdd,
  // Pushes travel while the minibatch runs, in chunks through a bounded staging ring per sender
  // at each owner, folded by the owner into its sums whenever it enters odc, with credits back
  // (core/streamed_staging.h): on the host for host transports, by a kernel on the caller's
  // stream for device ones (core/device_streamed_staging.h). For every transport without a
  // remote fp32 add; costs at most the staging budget per rank and communicator, whatever the
  // model and the world size (host rings: what the largest accumulator's shard needs, up to it).
  kStreamed,
  // Deterministic mode: pushes are summed locally into a pending buffer (world_size x count fp32,
  // 4 bytes per full-gradient element); at minibatch_end, once every sender's pending is complete
  // (a barrier), each owner pulls its slice from every sender in rank order, through one scratch
  // of kPullChunkBytes per communicator, and adds it. Fixed order (sender rank, then push index),
  // bitwise identical whatever the timing, on every transport.
  kPulled,
};

// The scratch a kPulled owner pulls each sender's slice through, in chunks: a fixed budget,
// independent of the model and the world size.
inline constexpr size_t kPullChunkBytes = size_t{4} << 20;

const char* scheme_name(AccumulationScheme scheme);

// A communicator's resolved settings (core/comm_config.h resolves and agrees them at init; the
// communicator reads no variable).
struct CommOptions {
  // Add contributions in a fixed order (kPulled) even where remote atomic adds exist.
  bool deterministic = false;
  // The bootstrap the ranks met through, when it is not the transport's own (the external one):
  // a fault also marks this rank failed there. Kept alive as long as the communicator.
  std::shared_ptr<Bootstrap> bootstrap;
  // kStreamed: the staging budget per rank (rings and their signals). Every rank must use the
  // same.
  size_t staging_bytes = kDefaultStagingBytes;
  // Ranks per node (consecutive ranks share a node); 0: the transport's report
  // (core/topology.h). Unused when `topology` is given.
  int ranks_per_node = 0;
  // The node layout every rank agreed on at init (agree_config); unset: agreed at the first
  // allocation or split from `ranks_per_node`.
  std::optional<Topology> topology = std::nullopt;
  // With more than one node: the budget per rank of the node cache of published buffers
  // (core/node_gather_cache.h); 0: off (every gather reads remote owners itself). Every rank
  // must use the same.
  size_t node_cache_bytes = kDefaultNodeCacheBytes;
  // kStreamed with more than one node (of consecutive ranks): the budget per rank of the relay
  // rows of node-aggregated pushes (core/streamed_staging.h), which cost (nodes - 1) x the shard
  // in fp32 per relayed accumulator; accumulators are relayed in allocation order while it lasts.
  // 0: off (every rank pushes to every owner itself). Every rank must use the same.
  size_t node_aggregation_bytes = 0;
  // Print the streamed chunks' bytes to other nodes when the communicator goes (ODC_NODE_STATS).
  bool node_stats = false;
};

// A symmetric buffer: `count` elements of `dtype` on every rank. Accumulators are fp32; pulled
// ones carry their pending sums.
struct Buffer {
  uint64_t id = 0;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  bool accumulator = false;
  // Owners rewrite these shards only between minibatches (after minibatch_end, before the next
  // minibatch_begin): a minibatch's gathers may be served from copies fetched at its
  // minibatch_begin (the node cache). Not an accumulator.
  bool published = false;
  std::string name;  // the caller's tag, checked across ranks at allocation ("" = none)
  std::unique_ptr<SymmetricRegion> data;     // the shards (an accumulator's sums)
  std::unique_ptr<SymmetricRegion> pending;  // kPulled: this sender's sum of its pushes
  // kStreamed, node-aggregated: the relay rows (one per remote owner this rank carries).
  std::unique_ptr<SymmetricRegion> relay;
  // Accumulators: the next minibatch adds to the current sums instead of starting from zero
  // (keep_sums(), once); `sums_kept` says so for the minibatch that is open.
  bool keep_sums_next = false;
  bool sums_kept = false;

  bool is_accumulator() const { return accumulator; }
  bool is_pulled() const { return pending != nullptr; }
  const SymmetricRegion& shards() const { return *data; }
  void* local() const { return data->local(); }
  size_t bytes() const { return count * element_bytes(dtype); }
};

enum class CommState {
  kReady,        // between minibatches
  kInMinibatch,  // after minibatch_begin, before minibatch_end
  kFailed,       // a peer died, a wait timed out, or ranks disagreed: unusable
};

// One thread calls a communicator at a time (the C API refuses a second); its calls hold
// call_mutex_. Streamed communicators are also served by the process's progress thread
// (core/host_progress.h), wherever this rank's thread or stream waits (design.md's progress
// rule): host-streamed ones while no call of theirs runs (it takes call_mutex_ without waiting),
// device-streamed ones under their staging's own lock.
class Communicator final : private ProgressClient {
 public:
  explicit Communicator(std::unique_ptr<Transport> transport, CommOptions options = {});
  ~Communicator();

  int rank() const { return transport_->rank(); }
  int world_size() const { return transport_->world_size(); }
  CommState state() const { return state_; }
  AccumulationScheme scheme() const { return scheme_; }
  // The node of every rank and the peers this rank maps directly (null before it is agreed).
  const Topology* topology() const { return topology_.get(); }
  // Collective: agrees on the topology (core/topology.h) unless done; the C API agrees it at
  // init with the rest of the config (CommOptions::topology), the first allocation otherwise.
  Status agree_on_topology();
  // kStreamed: the rings (made with the first accumulator), else null.
  const StreamedStaging* staging() const { return staging_.get(); }
  // With more than one node: the node cache of published buffers (made with the first one),
  // else null.
  const NodeGatherCache* node_cache() const { return node_cache_.get(); }
  Transport& transport() { return *transport_; }

  // Collective. Every rank must ask for the same count, dtype, kind (shards, accumulator or
  // published shards) and name (at most kMaxBufferNameBytes printable ASCII characters; "" =
  // unnamed): else every rank fails with an error naming what both sides asked for, and nothing
  // is allocated.
  Result<Buffer*> allocate(size_t count, DataType dtype, bool accumulator,
                           const std::string& name = "", bool published = false);
  // Collective. `buffer` is invalid afterwards.
  Status release(Buffer* buffer);
  // Local, between minibatches: the next minibatch_begin leaves this accumulator's sums on this
  // rank as they are, so that minibatch's contributions add to them (gradient accumulation
  // across minibatches, as FSDP2 accumulates into .grad until it is zeroed). Once: the
  // minibatch after that starts from zero again unless asked anew.
  Status keep_sums(Buffer* buffer);
  // dst[r*count:(r+1)*count] = rank r's shard, for all r; dst holds world_size*count elements of
  // the buffer's dtype. `stream` orders the work on stream-ordered transports. Inside a
  // minibatch a published buffer's gathers may be served from copies fetched once at
  // minibatch_begin (its owners rewrite it only between minibatches); other buffers are read as
  // they are when the gather runs.
  Status gather(void* dst, size_t dst_count, const Buffer* buffer, StreamHandle stream);
  // As gather(), with dst elements of `dst_dtype`: the buffer's own dtype, or bfloat16 from a
  // float32 buffer (narrowed while it is pulled, rounded to nearest even).
  Status gather_as(void* dst, size_t dst_count, DataType dst_dtype, const Buffer* buffer,
                   StreamHandle stream);
  // For every owner r: accumulator@r += src[r*count:(r+1)*count] (fp32 accumulation).
  Status scatter_accumulate(const void* src, size_t src_count, DataType src_dtype,
                            Buffer* accumulator, StreamHandle stream);
  // Collective: meet every rank (owners rewrote their shards before it), then open the minibatch.
  Status minibatch_begin(StreamHandle stream);
  // Collective: every push of every rank is applied everywhere when it completes; the sums stay
  // valid for every rank until the next minibatch starts filling them.
  Status minibatch_end(StreamHandle stream);
  Status barrier(StreamHandle stream);  // collective
  // Collective over this communicator (every rank, same order; between minibatches or inside
  // one, where every rank meets first, as for alloc): the ranks that pass the same `color` (>= 0)
  // form a sub-communicator, ranked by `key`, then by their rank here; a negative colour
  // (kSplitNoColor) joins none and gets null. The sub-communicator has its own buffers (on its
  // members only), minibatches and barriers, this one's scheme, budgets and timeout, and its
  // members' node layout here; members meet only each other after the colours are exchanged.
  // Either may be destroyed first; a failure of this communicator (a fault, abort) fails the
  // sub-communicators alive on this rank, whose peers then name this rank.
  Result<std::unique_ptr<Communicator>> split(int color, int key);
  // ---- the work board (core/work_board.h; work stealing inside a minibatch) ----------------
  // Collective per minibatch (every rank, after minibatch_begin, the same plan): opens this
  // minibatch's board, num_queues (== world_size) queues of counts[r] microbatches with costs
  // (counts[0] + ... values queue by queue; NULL: all 1.0). The first open of a communicator
  // allocates its claim words (8 bytes per rank), meeting every rank. Refused in deterministic
  // mode, outside a minibatch and a second time in one minibatch (InvalidUsage).
  Status work_board_open(int num_queues, const int32_t* counts, const double* costs);
  // Local: claims one microbatch (done() when none is left for this rank). Before this
  // minibatch's open: InvalidUsage. Ranks that passed different plans: InvalidUsage naming the
  // queue, and the communicator fails (its ranks no longer agree on the work).
  Result<WorkClaim> work_board_take();
  // Local: what this rank took from its own queue and from others', this minibatch and in all.
  WorkBoardStats work_board_stats() const;

  // "" for a communicator that was not split from another; else what its errors start with
  // ("split colour 1, parent ranks 0, 3, 5"), so that its rank numbers can be read as the parent's.
  const std::string& label() const { return label_; }
  // Local, never blocks: a failure the transport detected asynchronously (stream-ordered: a device
  // wait that expired or met another collective) fails the communicator and is returned; else the
  // earlier failure, or Ok.
  Status poll_error();
  // Local, never blocks: fails the communicator for the caller's `reason` (an exception inside a
  // minibatch): peers waiting on this rank end naming it and the reason. Keeps an earlier failure.
  void abort(const std::string& reason);

  // Symmetric memory this rank holds: the live buffers' shards, and what the accumulation scheme
  // adds (rings and signals, pending and staging buffers, scratch).
  struct Memory {
    size_t buffer_bytes = 0;
    size_t scheme_bytes = 0;
    size_t node_cache_bytes = 0;  // the node cache's rows and ready words
    size_t work_board_bytes = 0;  // the claim words (8 bytes), after the first work_board_open
  };
  Memory memory() const;

  // Is `buffer` a live buffer of this communicator?
  bool owns(const Buffer* buffer) const;

 private:
  // Prefixes "rank R: <operation>: " to a failure and, for faults (or whatever the status where
  // `fails`), fails the communicator.
  Status finish(const char* operation, Status status, bool fails = false);
  Status usable(const char* operation) const;
  Status check_buffer(const char* operation, const Buffer* buffer) const;
  // kPulled, inside minibatch_end: once every sender's pending sums are complete (a barrier), adds
  // this owner's slice of every sender's, in sender order, into its sums.
  Status pull_slices(const std::vector<Buffer*>& accs, StreamHandle stream);
  // kStreamed, inside a minibatch, before a collective: every rank meets first (see
  // StreamedStaging::meet); elsewhere nothing.
  Status meet_inside_minibatch(const char* operation, StreamHandle stream);
  // kStreamed: the rings for the accumulators allocated so far (make_staging: collective), and,
  // at minibatch_begin after its barrier (every peer done with the rings), larger ones where a
  // later accumulator's slice needs larger slots than the rings have (host rings only).
  Status make_staging();
  Status grow_staging();
  // kStreamed, at the allocation of accumulator `buffer` (collective): its relay rows where the
  // aggregation budget (and the device fold's target table) has room.
  Status add_relay(Buffer& buffer);
  // The relayed accumulators, as the staging takes them.
  std::vector<NodeRelay::Relay> relays() const;
  // With the first published buffer on more than one node: the cache (budget 0: none; every
  // rank has the same budget, agreed at init).
  Status create_node_cache();
  // kStreamed: this rank's sums of accumulator `buffer_id`, elements [first, first + count) (host
  // folds), and every live accumulator's sums (device folds).
  Result<float*> fold_destination(uint64_t buffer_id, size_t first, size_t count) const;
  std::vector<kernels::FoldTarget> fold_targets() const;

  // Live buffers in allocation order (the same on every rank), and only the accumulators.
  std::vector<Buffer*> buffers_in_order() const;
  std::vector<Buffer*> accumulators() const;

  // The progress thread: StreamedStaging::progress() (host: unless a call runs).
  bool serve_waiting_senders() override;
  using CallLock = std::lock_guard<std::recursive_mutex>;

  // The sub-communicators split from a communicator and alive on this rank: its failure fails
  // them. Shared with them, so that either side may be destroyed first.
  struct SplitChildren {
    std::mutex mutex;
    std::vector<Communicator*> live;
    // The first failure of a sub-communicator on this rank (""; none): the parent's destroy
    // tells its peers, who would otherwise only learn that this rank destroyed it. Its own mutex:
    // a child records it from finish(), which fail_children() calls holding `mutex`.
    std::mutex failure_mutex;
    std::string failure;
  };
  // Fails every live sub-communicator split from this one (after this one failed).
  void fail_children();

  // Held by every public call (recursive: calls call each other) and by the progress thread
  // while it serves a host-streamed communicator (device staging has a lock of its own).
  mutable std::recursive_mutex call_mutex_;
  bool served_by_progress_ = false;  // registered with HostProgress (streamed staging)
  bool device_progress_ = false;     // ... with device staging: served without call_mutex_
  std::unique_ptr<Transport> transport_;
  std::shared_ptr<Bootstrap> bootstrap_;
  std::string label_;  // label()
  std::shared_ptr<SplitChildren> children_ = std::make_shared<SplitChildren>();
  std::shared_ptr<SplitChildren> siblings_;  // the parent's children_ (null: not split)
  AccumulationScheme scheme_;
  uint64_t minibatch_ = 0;  // minibatches opened so far: the value staged signals carry
  CommState state_ = CommState::kReady;
  std::string failure_;  // the error that failed the communicator
  uint64_t next_buffer_id_ = 0;
  // kPulled: what owners pull senders' slices through (kPullChunkBytes), made with the first
  // accumulator (collective, like the accumulator itself).
  std::unique_ptr<SymmetricRegion> pull_scratch_;
  size_t staging_bytes_ = 0;  // CommOptions::staging_bytes
  // kStreamed: the largest accumulator's shard in fp32 bytes (its slice per owner of a push) so
  // far, and the one the rings were cut for: rings grow, never shrink, up to the budget.
  size_t largest_slice_bytes_ = 0;
  size_t staged_slice_bytes_ = 0;
  int ranks_per_node_ = 0;  // CommOptions::ranks_per_node as given
  std::unique_ptr<Topology> topology_;
  std::unique_ptr<StreamedStaging> staging_;
  size_t node_cache_bytes_ = 0;         // CommOptions::node_cache_bytes
  size_t node_aggregation_bytes_ = 0;   // CommOptions::node_aggregation_bytes (0: off)
  bool node_stats_ = false;             // CommOptions::node_stats
  size_t relay_bytes_ = 0;              // relay rows allocated
  std::unique_ptr<NodeRoutes> routes_;  // kStreamed, several nodes of consecutive ranks
  bool node_cache_made_ = false;
  std::unique_ptr<NodeGatherCache> node_cache_;
  StreamedStaging::Destination destination_;  // fold_destination, bound to this communicator
  std::map<const Buffer*, std::unique_ptr<Buffer>> buffers_;
  std::map<uint64_t, Buffer*> accumulators_by_id_;  // kStreamed folds look chunks' targets up
  std::unique_ptr<WorkBoard> work_board_;           // made by the first work_board_open
};

}  // namespace odc
