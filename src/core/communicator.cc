// ODC protocol over any transport (see communicator.h for the invariants).
#include "core/communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
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
    case StatusCode::kInterrupted:  // a wait ended half way: out of step with the peers
      return true;
    default:
      return false;
  }
}

// A failure in the middle of a collective step (after its barrier, e.g. a node fetch half
// queued) leaves this rank out of step with its peers, whatever caused it: it fails the
// communicator.
Status as_fault(const Status& status) {
  if (status.ok() || is_fault(status)) return status;
  return Status::InternalError(status.message());
}

// The kind word of an alloc record.
constexpr uint64_t kKindShards = 0;
constexpr uint64_t kKindAccumulator = 1;
constexpr uint64_t kKindPublished = 2;

std::string describe(size_t count, DataType dtype, uint64_t kind) {
  return std::to_string(count) + " " + std::string(dtype_name(dtype)) +
         (kind == kKindAccumulator ? " (accumulator)"
                                   : (kind == kKindPublished ? " (published)" : ""));
}

// A buffer's name travels in its alloc record: its length, a hash of all of it (the comparison)
// and its first bytes (for the message).
constexpr int kNameLengthWord = 3;
constexpr int kNameHashWord = 4;
constexpr int kNameTextWord = 5;
constexpr size_t kNameTextBytes = (std::size(ExchangeRecord{}.words) - kNameTextWord) * 8;

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

void put_name(ExchangeRecord& record, const std::string& name) {
  record.words[kNameLengthWord] = name.size();
  record.words[kNameHashWord] = fnv1a(name);
  std::memcpy(&record.words[kNameTextWord], name.data(), std::min(name.size(), kNameTextBytes));
}

// `named "params"`, `unnamed`; a name cut to what the record carries ends in "...".
std::string describe_name(const ExchangeRecord& record) {
  const size_t length = record.words[kNameLengthWord];
  if (length == 0) return "unnamed";
  std::string text(reinterpret_cast<const char*>(&record.words[kNameTextWord]),
                   std::min<size_t>(length, kNameTextBytes));
  for (char& c : text) {  // a peer's bytes: never echo control characters
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return "named \"" + text + (length > kNameTextBytes ? "...\"" : "\"");
}

Status check_name(const std::string& name) {
  if (name.size() > kMaxBufferNameBytes) {
    return Status::InvalidArgument("buffer name has " + std::to_string(name.size()) +
                                   " characters; at most " + std::to_string(kMaxBufferNameBytes) +
                                   " are allowed");
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c > 0x7e) {
      return Status::InvalidArgument("buffer name has a byte " + std::to_string(c) +
                                     " at position " + std::to_string(i) +
                                     ": only printable ASCII characters are allowed");
    }
  }
  return Status::Ok();
}

// One line per rank, written at once so that ranks sharing a terminal do not interleave.
void print_node_traffic(int rank, const NodeTraffic& traffic, uint64_t minibatches) {
  char line[256];
  const int length = std::snprintf(
      line, sizeof(line),
      "odc rank %d: streamed chunks to other nodes: %llu bytes during minibatches, %llu bytes in "
      "minibatch_end (%llu minibatches)\n",
      rank, static_cast<unsigned long long>(traffic.during_minibatches),
      static_cast<unsigned long long>(traffic.in_minibatch_end),
      static_cast<unsigned long long>(minibatches));
  if (length > 0)
    std::fwrite(line, 1, std::min(static_cast<size_t>(length), sizeof(line) - 1), stderr);
}

// A split's exchange record: colour and key, rank 0's random name for the split, and a mark that
// tells a split from another collective's exchange (alloc's records compare every word).
constexpr int kSplitColorWord = 0;
constexpr int kSplitKeyWord = 1;
constexpr int kSplitNameWord = 2;  // and the next
constexpr int kSplitMarkWord = 15;
constexpr uint64_t kSplitMark = 0x74696c7073636f64ull;  // "odcsplit"

// Whether an alloc met a split's record: the mark, where an alloc record carries its name's
// bytes 80-87, and no name hash (an alloc record's is never 0, even unnamed: FNV-1a of "").
static_assert(kSplitColorWord < kNameHashWord && kSplitKeyWord < kNameHashWord &&
                  kSplitNameWord + 1 < kNameHashWord,
              "a split record leaves the word of an alloc record's name hash 0");
bool is_split_record(const ExchangeRecord& record) {
  return record.words[kSplitMarkWord] == kSplitMark && record.words[kNameHashWord] == 0;
}

// The node layout of `members` (ranks of `parent`, in the group's order) as the group sees it:
// each member on its node there, nodes renumbered in order of their lowest member.
Topology topology_of_members(const Topology& parent, const std::vector<int>& members) {
  Topology topology;
  std::map<int, int> renumbered;
  for (int member : members) {
    auto found = renumbered.emplace(parent.node(member), static_cast<int>(renumbered.size()));
    topology.node_of.push_back(found.first->second);
    topology.direct.push_back(parent.direct[static_cast<size_t>(member)]);
  }
  topology.num_nodes = static_cast<int>(renumbered.size());
  topology.source = "the parent communicator's (" + parent.source + ")";
  return topology;
}

// "split colour 1, parent ranks 0, 3, 5" (the first 16 members, then how many in all).
std::string split_label(int color, const std::vector<int>& members) {
  std::string text = "split colour " + std::to_string(color) + ", parent ranks ";
  constexpr size_t kShown = 16;
  for (size_t i = 0; i < members.size() && i < kShown; ++i) {
    text += (i == 0 ? "" : ", ") + std::to_string(members[i]);
  }
  if (members.size() > kShown) text += ", ... (" + std::to_string(members.size()) + " ranks)";
  return text;
}

}  // namespace

const char* scheme_name(AccumulationScheme scheme) {
  switch (scheme) {
    case AccumulationScheme::kRemoteAdd:
      return "remote-add";
    case AccumulationScheme::kStreamed:
      return "streamed";
    case AccumulationScheme::kPulled:
      return "pulled";
  }
  return "unknown";
}

Communicator::Communicator(std::unique_ptr<Transport> transport, CommOptions options)
    : transport_(std::move(transport)),
      bootstrap_(std::move(options.bootstrap)),
      // Without a remote add pushes stream: folded on the host by host transports, on the
      // device by stream-ordered ones.
      scheme_(options.deterministic                ? AccumulationScheme::kPulled
              : transport_->caps().remote_fp32_add ? AccumulationScheme::kRemoteAdd
                                                   : AccumulationScheme::kStreamed),
      staging_bytes_(options.staging_bytes),
      ranks_per_node_(options.ranks_per_node),
      node_cache_bytes_(options.node_cache_bytes),
      node_aggregation_bytes_(options.node_aggregation_bytes),
      node_stats_(options.node_stats),
      destination_([this](uint64_t buffer_id, size_t first, size_t count) {
        return fold_destination(buffer_id, first, count);
      }) {
  if (options.topology) topology_ = std::make_unique<Topology>(std::move(*options.topology));
}

Communicator::~Communicator() {
  // First: from here on the progress thread leaves this communicator alone.
  if (served_by_progress_) HostProgress::instance().remove(this);
  // Unlinked first: from here on a failure of the parent no longer reaches this one.
  if (siblings_ != nullptr) {
    std::lock_guard<std::mutex> lock(siblings_->mutex);
    auto& live = siblings_->live;
    live.erase(std::remove(live.begin(), live.end(), this), live.end());
  }
  {
    std::lock_guard<std::mutex> lock(children_->mutex);
    children_->live.clear();  // sub-communicators outlive this one, on their own
  }
  // Stream-ordered transports: a peer's queued gathers and pushes may still reach this rank's
  // buffers after that peer's calls returned. So meet every peer in a final host barrier first
  // (it completes this rank's queued work, then waits, bounded by the timeout and ended early by
  // a peer that failed, died or destroyed): past it no peer's work uses these buffers. A failed
  // communicator's peers are out of step: no barrier (they have failed or will, naming us).
  if (state_ != CommState::kFailed && transport_->caps().stream_ordered) {
    (void)finish("destroy", transport_->host_barrier(CollectiveOp::kDestroy));
  }
  // Nothing of this rank may still run on the buffers when they go.
  (void)transport_->drain();
  // A sub-communicator failed here (say it timed out waiting for a peer that waits in this one):
  // a peer still waiting on this rank learns that failure, not only that this rank destroyed its
  // communicator. Past the final barrier, so device peers' queued work is unaffected.
  std::string child_failure;
  {
    std::lock_guard<std::mutex> lock(children_->failure_mutex);
    child_failure = children_->failure;
  }
  if (state_ != CommState::kFailed && !child_failure.empty()) {
    transport_->mark_failed(
        (label_.empty() ? "" : label_ + ": ") + "rank " + std::to_string(rank()) +
        ": destroyed its communicator after a sub-communicator failed there: " + child_failure);
  }
  if (staging_ != nullptr && node_stats_) {
    print_node_traffic(rank(), staging_->node_traffic(), minibatch_);
  }
  accumulators_by_id_.clear();
  buffers_.clear();  // unmap buffers before the transport's control segments
  pull_scratch_.reset();
  staging_.reset();
  node_cache_.reset();
  transport_.reset();
}

Communicator::Memory Communicator::memory() const {
  const CallLock call(call_mutex_);
  Memory memory;
  for (const auto& [handle, buffer] : buffers_) {
    memory.buffer_bytes += buffer->data->bytes();
    if (buffer->pending != nullptr) memory.scheme_bytes += buffer->pending->bytes();
    if (buffer->relay != nullptr) memory.scheme_bytes += buffer->relay->bytes();
  }
  if (pull_scratch_ != nullptr) memory.scheme_bytes += pull_scratch_->bytes();
  if (staging_ != nullptr) memory.scheme_bytes += staging_->allocated_bytes();
  if (node_cache_ != nullptr) memory.node_cache_bytes = node_cache_->allocated_bytes();
  if (work_board_ != nullptr) memory.work_board_bytes = work_board_->bytes();
  return memory;
}

bool Communicator::owns(const Buffer* buffer) const {
  const CallLock call(call_mutex_);
  return buffers_.count(buffer) != 0;
}

Status Communicator::finish(const char* operation, Status status, bool fails) {
  if (status.ok()) return status;
  Status named = status.with_context((label_.empty() ? "" : label_ + ": ") + "rank " +
                                     std::to_string(rank()) + ": " + operation);
  if ((fails || is_fault(status)) && state_ != CommState::kFailed) {
    state_ = CommState::kFailed;
    failure_ = named.message();
    transport_->mark_failed(failure_);
    if (bootstrap_) bootstrap_->mark_failed(failure_);
    fail_children();
    if (siblings_ != nullptr) {  // a sub-communicator: its parent's destroy will say so
      std::lock_guard<std::mutex> lock(siblings_->failure_mutex);
      if (siblings_->failure.empty()) siblings_->failure = failure_;
    }
  }
  return named;
}

void Communicator::fail_children() {
  std::lock_guard<std::mutex> lock(children_->mutex);
  for (Communicator* child : children_->live) {
    // Its lock: the progress thread may be folding for it (never for long: it does not wait).
    const CallLock child_call(child->call_mutex_);
    // Its peers, waiting on this rank in the sub-communicator, end naming it and why.
    (void)child->finish("the communicator it was split from failed", Status::RemoteError(failure_));
  }
}

void Communicator::abort(const std::string& reason) {
  const CallLock call(call_mutex_);
  // A fault by construction: finish() fails the communicator and tells the transport and the
  // bootstrap, whose peers then name this rank and the reason instead of waiting out a timeout.
  (void)finish("aborted by the caller",
               Status::RemoteError(reason.empty() ? std::string("no reason given") : reason));
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

Result<Buffer*> Communicator::allocate(size_t count, DataType dtype, bool accumulator,
                                       const std::string& name, bool published) {
  const CallLock call(call_mutex_);
  const char* op = "alloc";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(finish(op, check_name(name)));
  if (count == 0) return finish(op, Status::InvalidArgument("count must be positive"));
  if (!is_valid(dtype)) {
    return finish(op, Status::InvalidArgument("unknown dtype " +
                                              std::to_string(static_cast<uint32_t>(dtype))));
  }
  if (accumulator && published) {
    return finish(op, Status::InvalidArgument(
                          "a buffer is either an accumulator or published shards, not both"));
  }
  if (accumulator && dtype != DataType::kFloat32) {
    return finish(op, Status::InvalidArgument("an accumulator must be float32, got " +
                                              std::string(dtype_name(dtype))));
  }
  if (accumulator && scheme_ == AccumulationScheme::kStreamed &&
      transport_->caps().stream_ordered &&
      fold_targets().size() >= static_cast<size_t>(kernels::kMaxFoldTargets)) {
    // Every rank has the same accumulators: all refuse alike, before anything is allocated.
    return finish(
        op, Status::InvalidArgument("the device's streamed fold adds into at most " +
                                    std::to_string(kernels::kMaxFoldTargets) +
                                    " accumulators (and relay rows of node-aggregated pushes) per "
                                    "communicator, and this one has them all (free one, or group "
                                    "parameters into fewer accumulators)"));
  }
  // Every rank must ask for the same buffer: compare before anything is created, so a mismatch
  // fails on every rank and changes nothing.
  ExchangeRecord mine;
  mine.words[0] = count;
  mine.words[1] = static_cast<uint64_t>(dtype);
  const uint64_t kind = accumulator ? kKindAccumulator : (published ? kKindPublished : kKindShards);
  mine.words[2] = kind;
  // The name tells apart buffers of the same size (a rank that allocates its gradients where the
  // others allocate their parameters would otherwise gather gradients as weights).
  put_name(mine, name);
  ODC_RETURN_IF_ERROR(finish(op, meet_inside_minibatch(op, nullptr)));
  // Once, at init or else at the first allocation (collective, like it).
  ODC_RETURN_IF_ERROR(agree_on_topology());
  auto all = transport_->exchange(mine);
  if (!all.ok()) return finish(op, all.status());
  for (int r = 0; r < world_size(); ++r) {
    const ExchangeRecord& theirs = all.value()[r];
    if (is_split_record(theirs)) {  // not a buffer request: its words mean nothing here
      return finish(op, Status::RemoteError("collective mismatch: rank " + std::to_string(r) +
                                            " called split where this rank called alloc"));
    }
    // Every word: count, dtype, kind, the name's length, hash and first bytes (so names up to
    // kNameTextBytes compare exactly, longer ones by those and the hash of the rest).
    if (!std::equal(std::begin(theirs.words), std::end(theirs.words), std::begin(mine.words))) {
      // Names appear when either side gave one.
      const bool named = !name.empty() || theirs.words[kNameLengthWord] != 0;
      const std::string their_name = named ? " " + describe_name(theirs) : "";
      const std::string my_name = named ? " " + describe_name(mine) : "";
      const bool shown_alike = named && their_name == my_name;
      return finish(
          op,
          Status::InvalidArgument(
              "buffers differ across ranks: rank " + std::to_string(r) + " asked for " +
              describe(theirs.words[0], static_cast<DataType>(theirs.words[1]), theirs.words[2]) +
              " elements" + their_name + ", this rank (" + std::to_string(rank()) + ") for " +
              describe(count, dtype, kind) + " elements" + my_name +
              (shown_alike ? " (the names differ after their first " +
                                 std::to_string(kNameTextBytes) + " characters)"
                           : "")));
    }
  }
  auto buffer = std::make_unique<Buffer>();
  buffer->id = next_buffer_id_++;
  buffer->count = count;
  buffer->dtype = dtype;
  buffer->accumulator = accumulator;
  buffer->published = published;
  buffer->name = name;
  auto region = transport_->allocate(buffer->bytes());
  if (!region.ok()) return finish(op, region.status());
  buffer->data = std::move(region).value();
  if (accumulator && scheme_ == AccumulationScheme::kStreamed) {
    // The same on every rank (same accumulators): the rings' slots are cut for it.
    largest_slice_bytes_ = std::max(largest_slice_bytes_, count * sizeof(float));
  }
  if (accumulator && scheme_ == AccumulationScheme::kStreamed && staging_ == nullptr) {
    // Every rank allocates the same accumulators in the same order: all make it here together.
    ODC_RETURN_IF_ERROR(finish(op, make_staging()));
  }
  if (accumulator && scheme_ == AccumulationScheme::kPulled) {
    const size_t all_bytes = static_cast<size_t>(world_size()) * count * sizeof(float);
    auto pending = transport_->allocate(all_bytes);
    if (!pending.ok()) return finish(op, pending.status());
    buffer->pending = std::move(pending).value();
  }
  if (accumulator && scheme_ == AccumulationScheme::kPulled && pull_scratch_ == nullptr) {
    // Every rank allocates the same accumulators in the same order: all make it here together.
    auto scratch = transport_->allocate(kPullChunkBytes);
    if (!scratch.ok()) return finish(op, scratch.status());
    pull_scratch_ = std::move(scratch).value();
  }
  if (published && topology_->num_nodes > 1 && !node_cache_made_) {
    // Every rank allocates the same published buffers in the same order: all make it here.
    ODC_RETURN_IF_ERROR(finish(op, create_node_cache()));
  }
  if (published && node_cache_ != nullptr) {
    ODC_RETURN_IF_ERROR(finish(op, node_cache_->add(buffer->id, *buffer->data, buffer->bytes())));
  }
  if (accumulator && routes_ != nullptr) ODC_RETURN_IF_ERROR(finish(op, add_relay(*buffer)));
  Buffer* handle = buffer.get();
  if (accumulator) accumulators_by_id_.emplace(handle->id, handle);
  buffers_.emplace(handle, std::move(buffer));
  if (accumulator && staging_ != nullptr) {
    // Fits: the limit was checked before anything was allocated (relays only where room is).
    ODC_RETURN_IF_ERROR(finish(op, as_fault(staging_->set_targets(fold_targets()))));
    staging_->set_relays(relays());
  }
  return handle;
}

Status Communicator::agree_on_topology() {
  const CallLock call(call_mutex_);
  if (topology_ != nullptr) return Status::Ok();
  ODC_RETURN_IF_ERROR(usable("topology"));
  auto topology = agree_topology(*transport_, ranks_per_node_);
  if (!topology.ok()) return finish("topology", topology.status());
  topology_ = std::make_unique<Topology>(std::move(topology).value());
  return Status::Ok();
}

Status Communicator::make_staging() {
  auto staging =
      StreamedStaging::create(*transport_, staging_bytes_, destination_, largest_slice_bytes_);
  if (!staging.ok()) return staging.status();
  staged_slice_bytes_ = largest_slice_bytes_;
  staging_ = std::move(staging).value();
  staging_->set_node_of(topology_->node_of);
  // Aggregation needs nodes of consecutive ranks (a node's ends are awaited as one range) and
  // pays only with more than one rank per node (with one, every push to another node would just
  // wait for minibatch_end, in fp32).
  const std::vector<int> node = topology_->ranks_on(topology_->node(rank()));
  bool consecutive = true;
  bool several_per_node = true;
  for (int n = 0; n < topology_->num_nodes; ++n) {
    const std::vector<int> ranks = topology_->ranks_on(n);
    consecutive = consecutive && ranks.back() - ranks.front() + 1 == static_cast<int>(ranks.size());
    several_per_node = several_per_node && ranks.size() > 1;
  }
  if (node_aggregation_bytes_ > 0 && topology_->num_nodes > 1 && consecutive && several_per_node) {
    routes_ = std::make_unique<NodeRoutes>(NodeRoutes::of(*topology_, rank()));
    staging_->set_routes(*routes_, node.front(), node.back() + 1);
  }
  // Folds run inside this rank's calls (host) or on its stream (device), and from the progress
  // thread, whatever this rank waits in (design.md's progress rule). Once: rings that grow
  // (grow_staging) are made anew for the same communicator.
  if (!served_by_progress_) {
    device_progress_ = transport_->caps().stream_ordered;
    HostProgress::instance().add(this);
    served_by_progress_ = true;
  }
  // Made inside a minibatch (an accumulator allocated there): that minibatch is open for it too.
  if (state_ == CommState::kInMinibatch) {
    ODC_RETURN_IF_ERROR(staging_->begin(minibatch_, nullptr));
    HostProgress::instance().wake();
  }
  return Status::Ok();
}

Status Communicator::grow_staging() {
  // Every rank has the same accumulators, budget and geometry: all decide alike.
  staged_slice_bytes_ = largest_slice_bytes_;
  // Device rings are cut from the budget alone (a peer's queued kernels may still use them).
  if (transport_->caps().stream_ordered) return Status::Ok();
  auto wanted = RingGeometry::for_budget(staging_bytes_, world_size(), kMaxChunkPayloadBytes,
                                         largest_slice_bytes_);
  if (!wanted.ok()) return wanted.status();
  if (wanted.value() == staging_->geometry()) return Status::Ok();  // the budget's cut already
  // Every peer passed this minibatch_begin's barrier, hence its previous minibatch_end: none uses
  // the rings any more (host calls complete on return), and every chunk in them was folded. The
  // old rings go first, so that at no time more than the budget is held; a failure to make the
  // new ones is agreed by every rank (the transport's allocate) and fails the communicator.
  const StreamedStaging::Counts counts = staging_->counts();
  staging_.reset();
  ODC_RETURN_IF_ERROR(make_staging());
  staging_->carry_counts(counts);
  staging_->set_relays(relays());
  return Status::Ok();
}

Status Communicator::create_node_cache() {
  node_cache_made_ = true;
  if (node_cache_bytes_ > 0) {
    node_cache_ = std::make_unique<NodeGatherCache>(*transport_, *topology_, node_cache_bytes_);
  }
  return Status::Ok();
}

Status Communicator::add_relay(Buffer& buffer) {
  // The same sizes and counts on every rank: all decide alike.
  const size_t bytes = routes_->max_rows * buffer.count * sizeof(float);
  size_t targets = 0;
  for (const auto& [id, acc] : accumulators_by_id_) targets += acc->relay != nullptr ? 2 : 1;
  const bool fits_device = !transport_->caps().stream_ordered ||
                           targets + 2 <= static_cast<size_t>(kernels::kMaxFoldTargets);
  if (bytes == 0 || relay_bytes_ + bytes > node_aggregation_bytes_ || !fits_device) {
    return Status::Ok();  // pushed to its owners directly
  }
  auto rows = transport_->allocate(bytes);
  if (!rows.ok()) {
    return rows.status().with_context("relay rows of " + std::to_string(bytes) +
                                      " bytes for node-aggregated pushes (lower "
                                      "ODC_NODE_AGGREGATION_BYTES, or 0 to push directly)");
  }
  buffer.relay = std::move(rows).value();
  relay_bytes_ += bytes;
  return Status::Ok();
}

std::vector<NodeRelay::Relay> Communicator::relays() const {
  std::vector<NodeRelay::Relay> relays;
  for (const auto& [id, buffer] : accumulators_by_id_) {
    if (buffer->relay != nullptr) {
      relays.push_back({id, static_cast<float*>(buffer->relay->local()), buffer->count});
    }
  }
  return relays;
}

std::vector<kernels::FoldTarget> Communicator::fold_targets() const {
  std::vector<kernels::FoldTarget> targets;
  for (const auto& [id, buffer] : accumulators_by_id_) {
    targets.push_back({id, static_cast<float*>(buffer->local()), buffer->count});
    if (buffer->relay != nullptr) {  // its rows: the remote owners this rank carries
      targets.push_back({id | kRelayTargetBit, static_cast<float*>(buffer->relay->local()),
                         routes_->my_owners.size() * buffer->count});
    }
  }
  return targets;
}

Result<float*> Communicator::fold_destination(uint64_t target_id, size_t first,
                                              size_t count) const {
  const bool relay = (target_id & kRelayTargetBit) != 0;
  const uint64_t buffer_id = target_id & ~kRelayTargetBit;
  if (auto found = accumulators_by_id_.find(buffer_id); found != accumulators_by_id_.end()) {
    const Buffer* buffer = found->second;
    if (relay && buffer->relay == nullptr) {
      return Status::InternalError("accumulator " + std::to_string(buffer_id) +
                                   " has no relay rows here (a chunk for another owner)");
    }
    const size_t elements = relay ? routes_->my_owners.size() * buffer->count : buffer->count;
    if (first > elements || count > elements - first) {
      return Status::InternalError(
          "elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
          ") lie outside accumulator " + std::to_string(buffer_id) + "'s " +
          (relay ? "relay rows" : "shard") + " of " + std::to_string(elements));
    }
    return static_cast<float*>(relay ? buffer->relay->local() : buffer->local()) + first;
  }
  return Status::InternalError("no live accumulator with id " + std::to_string(buffer_id) +
                               " (freed while a peer still pushed into it?)");
}

Status Communicator::keep_sums(Buffer* buffer) {
  const CallLock call(call_mutex_);
  const char* op = "keep_sums";
  ODC_RETURN_IF_ERROR(check_buffer(op, buffer));
  ODC_RETURN_IF_ERROR(usable(op));
  if (!buffer->is_accumulator()) {
    return finish(op, Status::InvalidArgument("buffer '" + buffer->name +
                                              "' is not an accumulator: it holds no sums"));
  }
  if (state_ == CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("inside a minibatch: ask between minibatches, before "
                                           "the minibatch_begin that should keep the sums"));
  }
  buffer->keep_sums_next = true;
  return Status::Ok();
}

Status Communicator::release(Buffer* buffer) {
  const CallLock call(call_mutex_);
  const char* op = "free";
  ODC_RETURN_IF_ERROR(check_buffer(op, buffer));
  // No fold adds into an accumulator once it is no target (the progress thread's device passes
  // take the table as set_targets leaves it); what was enqueued before ends in the drain or
  // barrier below, before the memory goes. Fewer targets than before always fit.
  const auto stop_folding_into_it = [&] {
    accumulators_by_id_.erase(buffer->id);
    return staging_ != nullptr ? staging_->set_targets(fold_targets()) : Status::Ok();
  };
  if (state_ == CommState::kFailed) {
    // Nothing to coordinate with, but this rank's queued work may still use the buffer.
    (void)stop_folding_into_it();
    (void)transport_->drain();
    if (node_cache_ != nullptr) node_cache_->remove(buffer->id);
    if (buffer->relay != nullptr) relay_bytes_ -= buffer->relay->bytes();
    buffers_.erase(buffer);
    if (staging_ != nullptr) staging_->set_relays(relays());
    return Status::Ok();
  }
  // Peers may still read this buffer until they too arrive here.
  ODC_RETURN_IF_ERROR(finish(op, meet_inside_minibatch(op, nullptr)));
  ODC_RETURN_IF_ERROR(finish(op, stop_folding_into_it()));
  // Every rank's queued work is complete past it (the node fetch and reads of its rows too).
  ODC_RETURN_IF_ERROR(finish(op, transport_->host_barrier(CollectiveOp::kRelease)));
  if (node_cache_ != nullptr) node_cache_->remove(buffer->id);
  if (buffer->relay != nullptr) relay_bytes_ -= buffer->relay->bytes();
  buffers_.erase(buffer);
  if (staging_ != nullptr) staging_->set_relays(relays());
  return Status::Ok();
}

Status Communicator::gather(void* dst, size_t dst_count, const Buffer* buffer,
                            StreamHandle stream) {
  const CallLock call(call_mutex_);
  // The handle is checked before its dtype is read: a freed or foreign one is never dereferenced.
  ODC_RETURN_IF_ERROR(usable("gather"));
  ODC_RETURN_IF_ERROR(check_buffer("gather", buffer));
  return gather_as(dst, dst_count, buffer->dtype, buffer, stream);
}

Status Communicator::gather_as(void* dst, size_t dst_count, DataType dst_dtype,
                               const Buffer* buffer, StreamHandle stream) {
  const CallLock call(call_mutex_);
  const char* op = "gather";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(check_buffer(op, buffer));
  if (dst == nullptr) return finish(op, Status::InvalidArgument("destination is NULL"));
  if (!is_valid(dst_dtype)) {
    return finish(op, Status::InvalidArgument("unknown destination dtype " +
                                              std::to_string(static_cast<uint32_t>(dst_dtype))));
  }
  const bool narrowed = dst_dtype != buffer->dtype;
  if (narrowed && !(buffer->dtype == DataType::kFloat32 && dst_dtype == DataType::kBfloat16)) {
    return finish(op, Status::InvalidArgument(
                          "cannot gather a " + std::string(dtype_name(buffer->dtype)) +
                          " buffer into " + std::string(dtype_name(dst_dtype)) +
                          ": a destination has the buffer's dtype, or bfloat16 for a float32 "
                          "buffer"));
  }
  const size_t expected = static_cast<size_t>(world_size()) * buffer->count;
  if (dst_count != expected) {
    return finish(
        op, Status::InvalidArgument(
                "destination has " + std::to_string(dst_count) +
                " elements; expected world size x shard = " + std::to_string(world_size()) + " x " +
                std::to_string(buffer->count) + " = " + std::to_string(expected)));
  }
  if (staging_ != nullptr && state_ == CommState::kInMinibatch) {
    // Every entry into odc is a chance to fold what has arrived (and free senders' slots).
    ODC_RETURN_IF_ERROR(finish(op, staging_->fold_arrived(stream)));
  }
  if (node_cache_ != nullptr && state_ == CommState::kInMinibatch &&
      node_cache_->serves(buffer->id)) {
    return finish(
        op, node_cache_->gather(dst, buffer->id, buffer->count, buffer->dtype, dst_dtype, stream));
  }
  return finish(op, transport_->get_all(dst, buffer->shards(), buffer->count, buffer->dtype,
                                        dst_dtype, stream));
}

Status Communicator::scatter_accumulate(const void* src, size_t src_count, DataType src_dtype,
                                        Buffer* accumulator, StreamHandle stream) {
  const CallLock call(call_mutex_);
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
  if (scheme_ == AccumulationScheme::kStreamed) {
    return finish(op, staging_->push(src, src_dtype, shard, accumulator->id, stream));
  }
  if (accumulator->pending != nullptr) {  // pulled: summed here, pulled by owners at the end
    return finish(op, transport_->accumulate(static_cast<float*>(accumulator->pending->local()),
                                             src, src_dtype, expected, stream));
  }
  return finish(op, transport_->add_all(src, src_dtype, *accumulator->data, shard, stream));
}

std::vector<Buffer*> Communicator::buffers_in_order() const {
  std::vector<Buffer*> found;
  for (const auto& [handle, buffer] : buffers_) found.push_back(buffer.get());
  std::sort(found.begin(), found.end(),
            [](const Buffer* a, const Buffer* b) { return a->id < b->id; });
  return found;
}

std::vector<Buffer*> Communicator::accumulators() const {
  std::vector<Buffer*> found;
  for (Buffer* buffer : buffers_in_order()) {
    if (buffer->is_accumulator()) found.push_back(buffer);
  }
  return found;
}

Status Communicator::minibatch_begin(StreamHandle stream) {
  const CallLock call(call_mutex_);
  const char* op = "minibatch_begin";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ == CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("a minibatch is already open (call minibatch_end)"));
  }
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  const std::vector<Buffer*> accs = accumulators();
  for (Buffer* acc : accs) {
    acc->sums_kept = acc->keep_sums_next;
    acc->keep_sums_next = false;
  }
  if (scheme_ == AccumulationScheme::kRemoteAdd && !accs.empty()) {
    // Peers may still read the previous minibatch's sums until they arrive here; only then may
    // the owner zero them, and only after that may anyone add into them (the barrier below).
    ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchBegin, stream)));
    for (Buffer* acc : accs) {
      if (acc->sums_kept) continue;
      ODC_RETURN_IF_ERROR(finish(op, transport_->zero(acc->local(), acc->bytes(), stream)));
    }
  }
  for (Buffer* acc : accs) {
    // Pulled: the sums stay as they are until the next pull assigns them; owners read this
    // pending only inside minibatch_end, before its last barrier, which this rank passed.
    if (acc->pending != nullptr) {
      ODC_RETURN_IF_ERROR(
          finish(op, transport_->zero(acc->pending->local(), acc->pending->bytes(), stream)));
    }
  }
  // The progress thread's passes of the previous minibatch end before this barrier, after which
  // peers push chunks of the next one.
  if (staging_ != nullptr) ODC_RETURN_IF_ERROR(finish(op, staging_->end_progress(stream)));
  // Owners rewrite their shards (optimizer step) before this point: nobody gathers before it.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchBegin, stream)));
  if (scheme_ == AccumulationScheme::kStreamed) {
    // Every peer has stopped reading the previous sums (it passed the barrier), and no chunk of
    // this minibatch is folded before this rank's next call: zero, then fold into them.
    for (Buffer* acc : accs) {
      if (!acc->sums_kept) {
        ODC_RETURN_IF_ERROR(finish(op, transport_->zero(acc->local(), acc->bytes(), stream)));
      }
      // Relay rows: read last by this rank's own forward in the previous minibatch_end.
      if (acc->relay != nullptr) {
        ODC_RETURN_IF_ERROR(
            finish(op, transport_->zero(acc->relay->local(), acc->relay->bytes(), stream)));
      }
    }
    if (staging_ != nullptr && largest_slice_bytes_ > staged_slice_bytes_) {
      // An accumulator allocated since the rings were made has larger slices than their slots.
      ODC_RETURN_IF_ERROR(finish(op, as_fault(grow_staging())));
    }
    if (staging_ != nullptr)
      ODC_RETURN_IF_ERROR(finish(op, staging_->begin(minibatch_ + 1, stream)));
  }
  // From here to minibatch_end no owner rewrites a published buffer (its allocation says so):
  // the node cache fetches their remote shards once per node for the whole minibatch. Other
  // buffers may change inside a minibatch under the caller's own synchronization (e.g. a K/V
  // exchange) and are read as they are at each gather.
  if (node_cache_ != nullptr) ODC_RETURN_IF_ERROR(finish(op, as_fault(node_cache_->begin(stream))));
  ++minibatch_;
  state_ = CommState::kInMinibatch;
  if (served_by_progress_) HostProgress::instance().wake();
  return Status::Ok();
}

Status Communicator::minibatch_end(StreamHandle stream) {
  const CallLock call(call_mutex_);
  const char* op = "minibatch_end";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ != CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("no minibatch is open (call minibatch_begin first)"));
  }
  // Gathers of this minibatch (and the node fetch serving them) finish before this rank reaches
  // the barrier below, after which owners may rewrite their shards.
  if (node_cache_ != nullptr) ODC_RETURN_IF_ERROR(finish(op, as_fault(node_cache_->end(stream))));
  const std::vector<Buffer*> accs = accumulators();
  ODC_RETURN_IF_ERROR(finish(op, pull_slices(accs, stream)));
  if (staging_ != nullptr) {
    // This rank's chunks all sent and every sender's end folded here: its sums are complete.
    ODC_RETURN_IF_ERROR(finish(op, staging_->finish(stream)));
  }
  // After this barrier every push (remote adds) or fold (streamed, pulled) is complete
  // everywhere.
  ODC_RETURN_IF_ERROR(finish(op, transport_->barrier(CollectiveOp::kMinibatchEnd, stream)));
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  state_ = CommState::kReady;
  return Status::Ok();
}

Status Communicator::pull_slices(const std::vector<Buffer*>& accs, StreamHandle stream) {
  bool any = false;
  for (const Buffer* acc : accs) any = any || acc->is_pulled();
  if (!any) return Status::Ok();
  // Every sender's pending sums are complete and visible after this barrier; nobody zeroes them
  // again before the barrier that ends minibatch_end, so they are read exactly as they are.
  ODC_RETURN_IF_ERROR(transport_->barrier(CollectiveOp::kMinibatchEnd, stream));
  const size_t chunk = kPullChunkBytes / sizeof(float);
  float* scratch = static_cast<float*>(pull_scratch_->local());
  for (Buffer* acc : accs) {
    if (!acc->is_pulled()) continue;
    auto* sums = static_cast<float*>(acc->local());
    // Assigned: 0 + s0 + s1 + ... in sender order, element by element (kept sums: k + s0 +
    // s1 + ...; chunks only bound the scratch; they do not change any element's order).
    if (!acc->sums_kept) ODC_RETURN_IF_ERROR(transport_->zero(sums, acc->bytes(), stream));
    for (size_t first = 0; first < acc->count; first += chunk) {
      const size_t n = std::min(chunk, acc->count - first);
      const size_t offset = (static_cast<size_t>(rank()) * acc->count + first) * sizeof(float);
      for (int sender = 0; sender < world_size(); ++sender) {
        ODC_RETURN_IF_ERROR(
            transport_->get(scratch, *acc->pending, sender, offset, n * sizeof(float), stream));
        ODC_RETURN_IF_ERROR(
            transport_->accumulate(sums + first, scratch, DataType::kFloat32, n, stream));
      }
    }
  }
  return Status::Ok();
}

Status Communicator::work_board_open(int num_queues, const int32_t* counts, const double* costs) {
  const CallLock call(call_mutex_);
  const char* op = "work_board_open";
  ODC_RETURN_IF_ERROR(usable(op));
  if (scheme_ == AccumulationScheme::kPulled) {
    return finish(op, Status::InvalidUsage(
                          "work stealing changes which rank pushes a microbatch, so the "
                          "deterministic mode's fixed summation order cannot hold: turn one of "
                          "them off"));
  }
  if (state_ != CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage(
                          "no minibatch is open (call minibatch_begin first: the board belongs "
                          "to one minibatch)"));
  }
  const uint32_t tag = claim_tag(minibatch_);
  if (work_board_ != nullptr && work_board_->is_open(tag)) {
    return finish(op, Status::InvalidUsage(
                          "the work board of this minibatch is open already (open it once per "
                          "minibatch, after minibatch_begin)"));
  }
  if (work_board_ == nullptr) {
    // The first open allocates the claim words, a collective: a streamed peer may wait for this
    // rank's credit meanwhile, so every rank meets first (as for alloc inside a minibatch). Before
    // the plan is checked: a plan only this rank refuses must not leave its peers waiting here
    // for the collective until their timeout.
    ODC_RETURN_IF_ERROR(finish(op, meet_inside_minibatch(op, nullptr)));
    auto words = transport_->allocate(sizeof(uint64_t));
    if (!words.ok()) return finish(op, words.status());
    work_board_ = std::make_unique<WorkBoard>(*transport_, std::move(words).value());
  }
  auto plan = WorkPlan::make(world_size(), num_queues, counts, costs);
  if (!plan.ok()) return finish(op, plan.status());
  return finish(op, as_fault(work_board_->open(tag, std::move(plan).value())));
}

Result<WorkClaim> Communicator::work_board_take() {
  const CallLock call(call_mutex_);
  const char* op = "work_board_take";
  ODC_RETURN_IF_ERROR(usable(op));
  if (state_ != CommState::kInMinibatch) {
    return finish(op, Status::InvalidUsage("no minibatch is open (take between minibatch_begin, "
                                           "work_board_open and minibatch_end)"));
  }
  if (work_board_ == nullptr || !work_board_->is_open(claim_tag(minibatch_))) {
    return finish(op, Status::InvalidUsage(
                          "the work board of this minibatch is not open (call work_board_open "
                          "after minibatch_begin, on every rank)"));
  }
  auto claim = work_board_->take();
  if (!claim.ok()) {
    // Ranks that disagree on the plan would lose or repeat microbatches: out of step, as a
    // collective mismatch is.
    const bool disagree = claim.status().code() == StatusCode::kInvalidUsage;
    return finish(op, disagree ? claim.status() : as_fault(claim.status()), disagree);
  }
  return claim;
}

WorkBoardStats Communicator::work_board_stats() const {
  const CallLock call(call_mutex_);
  return work_board_ != nullptr ? work_board_->stats() : WorkBoardStats{};
}

Status Communicator::poll_error() {
  const CallLock call(call_mutex_);
  const char* op = "poll_error";
  ODC_RETURN_IF_ERROR(usable(op));
  return finish(op, transport_->poll_error());
}

bool Communicator::serve_waiting_senders() {
  // Device: the staging's own lock (this rank's host may sit in a push call as long as its stream
  // is blocked); its rings are never remade (grow_staging is host-only).
  if (device_progress_) return staging_->progress();
  std::unique_lock<std::recursive_mutex> call(call_mutex_, std::try_to_lock);
  // A call of this communicator runs: it folds for hungry senders itself while it waits.
  if (!call.owns_lock()) return true;
  if (state_ != CommState::kInMinibatch || staging_ == nullptr) return false;
  return staging_->progress();
}

Status Communicator::meet_inside_minibatch(const char* operation, StreamHandle stream) {
  if (staging_ == nullptr || state_ != CommState::kInMinibatch) return Status::Ok();
  // Streamed: a peer may still wait for this rank's credit; a rank in the transport's collective
  // folds nothing. Meet first, folding for hungry senders meanwhile; then nobody is pushing.
  if (stream == nullptr && transport_->caps().stream_ordered) {
    // A host-side collective (alloc, free): this rank's pushes may still be queued on any of the
    // caller's streams, and the meeting says they were all put. Let them complete first (their
    // credit waits fold on the device meanwhile, and peers in the same place reach their own
    // meeting folds after their drain, which fold for us).
    ODC_RETURN_IF_ERROR(transport_->drain());
  }
  ODC_RETURN_IF_ERROR(staging_->meet(operation, stream));
  // Every peer has put all its chunks by now: fold them, so that a buffer freed next has none
  // left in the rings.
  return staging_->fold_arrived(stream);
}

Result<std::unique_ptr<Communicator>> Communicator::split(int color, int key) {
  const CallLock call(call_mutex_);
  const char* op = "split";
  ODC_RETURN_IF_ERROR(usable(op));
  if (color < 0) color = kSplitNoColor;
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  // Inside a minibatch every rank meets first (streamed: nobody is pushing past it), as alloc.
  ODC_RETURN_IF_ERROR(finish(op, meet_inside_minibatch(op, nullptr)));
  // The sub-communicators take their members' node layout from this one.
  ODC_RETURN_IF_ERROR(agree_on_topology());
  ExchangeRecord mine;
  mine.words[kSplitColorWord] = static_cast<uint64_t>(static_cast<int64_t>(color));
  mine.words[kSplitKeyWord] = static_cast<uint64_t>(static_cast<int64_t>(key));
  if (rank() == 0) {
    // Names this split's groups (their transports' shared memory) apart from every other.
    std::random_device entropy;  // /dev/urandom on Linux
    for (int w = kSplitNameWord; w < kSplitNameWord + 2; ++w) {
      mine.words[w] = (static_cast<uint64_t>(entropy()) << 32) | entropy();
    }
  }
  mine.words[kSplitMarkWord] = kSplitMark;
  auto all = transport_->exchange(mine);
  if (!all.ok()) return finish(op, all.status());
  std::vector<std::pair<int64_t, int>> ordered;  // (key, rank) of this colour's ranks
  for (int r = 0; r < world_size(); ++r) {
    const ExchangeRecord& theirs = all.value()[r];
    if (theirs.words[kSplitMarkWord] != kSplitMark) {
      return finish(op, Status::RemoteError("collective mismatch: rank " + std::to_string(r) +
                                            " exchanged records for another collective (alloc?) "
                                            "where this rank called split"));
    }
    if (color >= 0 && static_cast<int64_t>(theirs.words[kSplitColorWord]) == color) {
      ordered.emplace_back(static_cast<int64_t>(theirs.words[kSplitKeyWord]), r);
    }
  }
  std::sort(ordered.begin(), ordered.end());
  SplitGroup group;
  for (const auto& [their_key, r] : ordered) {
    if (r == rank()) group.rank = static_cast<int>(group.members.size());
    group.members.push_back(r);
  }
  if (color >= 0) {
    char name[64];
    std::snprintf(name, sizeof(name), "s%016llx%016llxc%d",
                  static_cast<unsigned long long>(all.value()[0].words[kSplitNameWord]),
                  static_cast<unsigned long long>(all.value()[0].words[kSplitNameWord + 1]), color);
    group.name = name;
  }
  auto made = transport_->split(group);
  if (!made.ok()) {
    // Past the exchange the other members wait for this one in the group's rendezvous, and see
    // it fail there only through this communicator's failure flag: a member's failure is a
    // fault (EMFILE too), except a transport's "cannot split", which every rank gets alike.
    const bool alike = made.status().code() == StatusCode::kInvalidUsage;
    return finish(op, group.rank >= 0 && !alike ? as_fault(made.status()) : made.status());
  }
  if (made.value() == nullptr) return std::unique_ptr<Communicator>();
  CommOptions options;
  options.deterministic = scheme_ == AccumulationScheme::kPulled;
  options.staging_bytes = staging_bytes_;
  options.node_cache_bytes = node_cache_bytes_;
  options.node_aggregation_bytes = node_aggregation_bytes_;
  options.node_stats = node_stats_;
  auto child = std::make_unique<Communicator>(std::move(made).value(), options);
  child->topology_ = std::make_unique<Topology>(topology_of_members(*topology_, group.members));
  child->label_ = split_label(color, group.members);
  child->siblings_ = children_;
  {
    std::lock_guard<std::mutex> lock(children_->mutex);
    children_->live.push_back(child.get());
  }
  return child;
}

Status Communicator::barrier(StreamHandle stream) {
  const CallLock call(call_mutex_);
  const char* op = "barrier";
  ODC_RETURN_IF_ERROR(usable(op));
  ODC_RETURN_IF_ERROR(finish(op, transport_->poll_error()));
  ODC_RETURN_IF_ERROR(finish(op, meet_inside_minibatch(op, stream)));
  return finish(op, transport_->barrier(CollectiveOp::kBarrier, stream));
}

}  // namespace odc
