// In-memory transport (see mem_transport.h). Lock order: a Mailbox mutex may be held while taking
// the world mutex (to name a failed peer), never the other way round.
#include "transport/mem/mem_transport.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "common/deadline.h"
#include "core/device_staging_ops.h"
#include "core/host_ops.h"

namespace odc::mem {
namespace {

using Clock = std::chrono::steady_clock;

std::string seconds_text(std::chrono::duration<double> duration) {
  std::ostringstream out;
  out << duration.count() << " s";
  return out.str();
}

class MemRegion final : public SymmetricRegion {
 public:
  MemRegion(std::vector<void*> peers, int rank, size_t bytes)
      : SymmetricRegion(std::move(peers), rank, bytes) {}
};

}  // namespace

// Where caps() say stream-ordered it also offers the device staging's hooks, its fold emulated on
// the host (HostFold below).
class MemTransport final : public Transport, private DeviceStagingOps {
 public:
  MemTransport(std::shared_ptr<MemWorld> world, int rank)
      : Transport(traits_of(*world, rank)), world_(std::move(world)) {}
  ~MemTransport() override { world_->set_status(rank(), MemWorld::RankStatus::kClosed, ""); }

  uint64_t node_key() const override { return world_->node_key(rank()); }
  bool maps_directly(int) const override { return true; }

  Result<std::vector<ExchangeRecord>> exchange(const ExchangeRecord& mine) override {
    std::vector<ExchangeRecord> all;
    ODC_RETURN_IF_ERROR(world_->collective(rank(), CollectiveOp::kExchange, &mine, &all));
    return all;
  }

  Result<std::unique_ptr<SymmetricRegion>> allocate(size_t bytes) override {
    ExchangeRecord mine;
    mine.words[0] = reinterpret_cast<uintptr_t>(world_->allocate_bytes(bytes));
    auto all = exchange(mine);
    if (!all.ok()) return all.status();
    std::vector<void*> pointers;
    for (int r = 0; r < world_size(); ++r) {  // all fail together when one could not allocate
      if (all.value()[r].words[0] == 0) {
        return Status::SystemError("rank " + std::to_string(r) + " could not allocate " +
                                   std::to_string(bytes) + " bytes");
      }
    }
    for (const ExchangeRecord& record : all.value()) {
      pointers.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(record.words[0])));
    }
    // The fold emulation finds a region from its local address (the world keeps the memory).
    {
      std::lock_guard<std::mutex> lock(regions_mutex_);
      regions_[pointers[static_cast<size_t>(rank())]] =
          std::make_unique<const MemRegion>(pointers, rank(), bytes);
    }
    return std::unique_ptr<SymmetricRegion>(new MemRegion(std::move(pointers), rank(), bytes));
  }

  Status barrier(CollectiveOp op, StreamHandle) override {
    return world_->collective(rank(), op, nullptr, nullptr);
  }
  Result<std::unique_ptr<Transport>> split(const SplitGroup& group) override {
    if (group.rank < 0) return std::unique_ptr<Transport>();
    return world_->split_world(group)->join(group.rank);
  }
  Status host_barrier(CollectiveOp op) override {
    return world_->collective(rank(), op, nullptr, nullptr);
  }
  Status poll_error() override { return Status::Ok(); }
  void mark_failed(const std::string& reason) override {
    world_->set_status(rank(), MemWorld::RankStatus::kFailed, reason);
  }

  Status get_all(void* dst, const SymmetricRegion& region, size_t count, DataType src_dtype,
                 DataType dst_dtype, StreamHandle) override {
    ODC_RETURN_IF_ERROR(check_gather_dtypes(src_dtype, dst_dtype));
    const size_t part_bytes = count * element_bytes(dst_dtype);
    for (int r = 0; r < world_size(); ++r) {
      char* part = static_cast<char*>(dst) + static_cast<size_t>(r) * part_bytes;
      if (dst_dtype == src_dtype) {
        std::memcpy(part, region.peer(r), part_bytes);
      } else {
        host::narrow_into(reinterpret_cast<uint16_t*>(part),
                          static_cast<const float*>(region.peer(r)), count);
      }
    }
    return Status::Ok();
  }

  Status get(void* dst, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle) override {
    // Visible once the peer's writes were published by a barrier (the world's mutex).
    std::memcpy(dst, static_cast<const char*>(region.peer(peer)) + offset, bytes);
    return Status::Ok();
  }

  Status put(const void* src, const SymmetricRegion& region, int peer, size_t offset, size_t bytes,
             StreamHandle) override {
    // Published to the owner by the next signal (its mailbox mutex) or barrier (the world's).
    std::memcpy(static_cast<char*>(region.peer(peer)) + offset, src, bytes);
    return Status::Ok();
  }

  Status signal(const SymmetricRegion& signals, int peer, uint64_t value, StreamHandle) override {
    MemWorld::Mailbox& box = *world_->mailboxes_[static_cast<size_t>(peer)];
    auto* slots = static_cast<uint64_t*>(signals.peer(peer));
    std::lock_guard<std::mutex> lock(box.mutex);
    const uint64_t old = slots[rank()];
    slots[rank()] = std::max(old, value);
    if (value > old) {
      for (size_t i = 0; i < box.num_polled; ++i) {
        const MemWorld::Mailbox::Polled& entry = box.polled[i];
        if (entry.slots != slots) continue;
        const uint64_t any_at = entry.any_at[rank()];
        const uint64_t all_at = entry.all_at[rank()];
        const bool counts = old < all_at && value >= all_at && --box.all_missing == 0;
        if (counts || (old < any_at && value >= any_at)) box.wake.notify_all();
        break;
      }
    }
    return Status::Ok();
  }

  Status add_all(const void* src, DataType src_type, const SymmetricRegion& region, size_t count,
                 StreamHandle stream) override {
    if (!caps().remote_fp32_add) return Transport::add_all(src, src_type, region, count, stream);
    const size_t element = element_bytes(src_type);
    for (int i = 0; i < world_size(); ++i) {
      const int peer = (rank() + 1 + i) % world_size();
      // The owner's mailbox mutex makes the emulated remote add atomic.
      std::lock_guard<std::mutex> lock(world_->mailboxes_[static_cast<size_t>(peer)]->mutex);
      host::add_into(static_cast<float*>(region.peer(peer)),
                     static_cast<const char*>(src) + static_cast<size_t>(peer) * count * element,
                     src_type, count);
    }
    return Status::Ok();
  }

  Status compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) override {
    // A dead rank's memory stays (mem_transport.h), so the op itself would succeed: the
    // failure of a peer of the call is what the caller must hear, as from any other op.
    if (world_->num_not_alive_.load(std::memory_order_acquire) > 0) {
      for (const CompareSwapOp& op : ops) {
        if (op.peer != rank()) ODC_RETURN_IF_ERROR(world_->peer_failure(op.peer));
      }
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      const CompareSwapOp& op = ops[i];
      auto* word =
          reinterpret_cast<uint64_t*>(static_cast<char*>(op.region->peer(op.peer)) + op.offset);
      uint64_t expected = op.expected;
      // On failure the builtin stores the value it found into `expected`: the old value either way.
      __atomic_compare_exchange_n(word, &expected, op.desired, /*weak=*/false, __ATOMIC_SEQ_CST,
                                  __ATOMIC_SEQ_CST);
      old_values[i] = expected;
    }
    return Status::Ok();
  }

  Result<bool> poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                            std::chrono::duration<double> limit,
                            std::vector<uint64_t>* seen) override {
    MemWorld::Mailbox& box = *world_->mailboxes_[static_cast<size_t>(rank())];
    const auto deadline = deadline_after(limit);
    seen->assign(watches.size(), 0);
    std::unique_lock<std::mutex> lock(box.mutex);  // the slots are written under it
    for (;;) {
      bool all = num_all > 0;
      bool any = false;
      size_t all_missing = 0;
      for (size_t i = 0; i < watches.size(); ++i) {
        const auto* slots = static_cast<const uint64_t*>(watches[i].signals->local());
        (*seen)[i] = slots[watches[i].peer];
        const bool reached = (*seen)[i] >= watches[i].value;
        if (i < num_all) {
          all = all && reached;
          all_missing += reached ? 0 : 1;
        } else {
          any = any || reached;
        }
      }
      if (all || any) return true;
      if (world_->num_not_alive_.load(std::memory_order_acquire) > 0) {
        for (const SignalWatch& watch : watches) {
          ODC_RETURN_IF_ERROR(world_->peer_failure(watch.peer));
        }
      }
      if (Clock::now() >= deadline) return false;
      // Woken only by the signals that make a condition hold (or a rank's failure), so that
      // ranks waiting on many peers do not wake for every signal of a large world.
      box.num_polled = 0;
      box.all_missing = all_missing;
      const auto world = static_cast<size_t>(world_size());
      for (size_t i = 0; i < watches.size(); ++i) {
        const SignalWatch& watch = watches[i];
        const auto* slots = static_cast<const uint64_t*>(watch.signals->local());
        const auto live_end = box.polled.begin() + static_cast<std::ptrdiff_t>(box.num_polled);
        auto found = std::find_if(box.polled.begin(), live_end,
                                  [&](const auto& entry) { return entry.slots == slots; });
        if (found == live_end) {
          if (box.num_polled == box.polled.size()) box.polled.emplace_back();
          found = box.polled.begin() + static_cast<std::ptrdiff_t>(box.num_polled++);
          found->slots = slots;
          found->any_at.assign(world, UINT64_MAX);
          found->all_at.assign(world, UINT64_MAX);
        }
        uint64_t& at = (i < num_all ? found->all_at : found->any_at)[watch.peer];
        at = std::min(at, watch.value);
      }
      box.wake.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
      box.num_polled = 0;
    }
  }

  DeviceStagingOps* device_staging() override { return caps().stream_ordered ? this : nullptr; }

  // The device fold (kernels/streamed_fold.cuh) emulated on the host where caps() say
  // stream-ordered, so that the protocol tests run the device staging's steps: the same order,
  // checks and credits; waits sleep in poll_signals() instead of spinning, and a failure is
  // returned at once instead of recorded.
  // One emulated fold at a time on a rank (the device's per-sender locks, coarser): the progress
  // thread's passes (fold_streamed_if_idle) run beside the caller's calls.
  Status fold_streamed(const kernels::StreamedFold& fold, StreamHandle) override {
    std::lock_guard<std::mutex> folding(fold_mutex_);
    return HostFold(*this, fold).run();
  }
  // A fold that runs (a caller's wait) folds what this pass would: then nothing, as a device
  // pass still queued behind the last one.
  Result<bool> fold_streamed_if_idle(const kernels::StreamedFold& fold, StreamHandle) override {
    std::unique_lock<std::mutex> folding(fold_mutex_, std::try_to_lock);
    if (!folding.owns_lock()) return false;
    ODC_RETURN_IF_ERROR(HostFold(*this, fold).run());
    return true;
  }
  Status pack_chunk(void* dst, const kernels::ChunkHeader& header, const void* src, size_t bytes,
                    StreamHandle) override {
    std::memcpy(dst, &header, sizeof(header));
    std::memcpy(static_cast<char*>(dst) + sizeof(header), src, bytes);
    return Status::Ok();
  }
  Status read_local(void* host_dst, const void* src, size_t bytes) override {
    std::memcpy(host_dst, src, bytes);
    return Status::Ok();
  }
  // Calls complete on return: the send lane is the caller's own order, nothing to wait for.
  Result<StreamHandle> fork_sends(StreamHandle stream) override { return stream; }
  Status mark_sends(int) override { return Status::Ok(); }
  Status wait_sends(int, StreamHandle) override { return Status::Ok(); }
  Status join_sends(StreamHandle) override { return Status::Ok(); }

  Status zero(void* dst, size_t bytes, StreamHandle) override {
    std::memset(dst, 0, bytes);
    return Status::Ok();
  }
  Status accumulate(float* dst, const void* src, DataType src_type, size_t count,
                    StreamHandle) override {
    // Stream-ordered: a pass of the progress thread may add into the same sums (the device adds
    // with reductions).
    std::unique_lock<std::mutex> folding(fold_mutex_, std::defer_lock);
    if (caps().stream_ordered) folding.lock();
    host::add_into(dst, src, src_type, count);
    return Status::Ok();
  }

 private:
  static TransportTraits traits_of(const MemWorld& world, int rank) {
    const MemOptions& options = world.options();
    return TransportTraits{rank, world.world_size(),
                           TransportCaps{options.remote_fp32_add, options.stream_ordered},
                           options.timeout};
  }

  // A region of this transport by its local address (the fold gets only addresses).
  // Regions stay until the transport closes (the world keeps their memory), so a reference does.
  const MemRegion& region_of(const void* local) const {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    return *regions_.at(local);
  }

  class HostFold {
   public:
    HostFold(MemTransport& transport, const kernels::StreamedFold& fold)
        : t_(transport),
          f_(fold),
          arrivals_(t_.region_of(fold.arrivals)),
          credits_(t_.region_of(fold.credits)),
          end_marks_(t_.region_of(fold.end_marks)),
          end_sequences_(t_.region_of(fold.end_sequences)),
          meetings_(t_.region_of(fold.meetings)) {}

    Status run() {
      const auto deadline = deadline_after(t_.timeout());
      bool final_pass = false;
      // A credit already there needs no pass (the device's first pass only serves peers sooner;
      // the push's own pass at entry folds what arrived).
      if (f_.until == kernels::FoldUntil::kCredit && read(f_.credits, f_.peer) >= f_.value) {
        return Status::Ok();
      }
      if (f_.until == kernels::FoldUntil::kCredit) ++*f_.credit_waits;  // as the device counts
      std::vector<uint64_t> arrived(static_cast<size_t>(f_.world_size));
      for (;;) {
        {  // one look at every arrival (written under this rank's mailbox mutex)
          std::lock_guard<std::mutex> lock(
              t_.world_->mailboxes_[static_cast<size_t>(t_.rank())]->mutex);
          std::copy(f_.arrivals, f_.arrivals + f_.world_size, arrived.begin());
        }
        for (int s = 0; s < f_.world_size; ++s) {
          if (s != f_.rank && arrived[s] > f_.folded[s]) {
            ODC_RETURN_IF_ERROR(fold_sender(s, arrived[s], 0));
          }
        }
        if (f_.until == kernels::FoldUntil::kOnce || final_pass) return Status::Ok();
        std::vector<SignalWatch> watches;  // the condition first (all of them), then arrivals
        const char* what = "credit wait (scatter_accumulate)";
        if (f_.until == kernels::FoldUntil::kCredit) {
          watches.push_back({&credits_, f_.peer, f_.value});
        } else {
          const bool ends = f_.until == kernels::FoldUntil::kEnds;
          what = ends ? "push wait (minibatch_end)"
                      : "meeting of every rank before a collective inside a minibatch";
          for (int s = 0; s < f_.world_size; ++s) {
            if (ends ? awaits_end(s) : s != f_.rank) {
              watches.push_back(
                  {ends ? &end_marks_ : &meetings_, s, ends ? f_.minibatch : f_.value});
            }
          }
          // An end counts once its mark and its sequence (two signals, either may come first)
          // are both there.
          for (int s = 0; ends && s < f_.world_size; ++s) {
            if (awaits_end(s)) watches.push_back({&end_sequences_, s, f_.folded[s] + 1});
          }
        }
        const size_t num_all = watches.size();
        for (int s = 0; s < f_.world_size; ++s) {
          if (s != f_.rank) watches.push_back({&arrivals_, s, f_.folded[s] + 1});
        }
        std::vector<uint64_t> seen;
        auto polled = t_.poll_signals(watches, num_all, std::chrono::milliseconds(20), &seen);
        if (!polled.ok()) return polled.status();
        size_t missing = 0;
        while (missing < num_all && seen[missing] >= watches[missing].value) ++missing;
        if (missing == num_all) {
          if (f_.until == kernels::FoldUntil::kCredit) {
            return Status::Ok();
          }
          if (f_.until == kernels::FoldUntil::kMeetings) {
            final_pass = true;
            continue;
          }
          for (int s = 0; s < f_.world_size; ++s) {  // kEnds: fold up to each end, consume it
            if (!awaits_end(s)) continue;
            const uint64_t end = read(f_.end_sequences, s);
            ODC_RETURN_IF_ERROR(fold_sender(s, end - 1, end));
            f_.ended[s] = f_.minibatch;
          }
          return Status::Ok();
        }
        if (Clock::now() >= deadline) {
          return Status::Timeout(std::string(what) + " timed out after " +
                                 seconds_text(t_.timeout()) + ": rank " + std::to_string(f_.rank) +
                                 " waited for rank " + std::to_string(watches[missing].peer) +
                                 " (expected " + std::to_string(watches[missing].value) + ", saw " +
                                 std::to_string(seen[missing]) + ")");
        }
      }
    }

   private:
    // As the kernel's awaits_end: one of [ends_from, ends_to), not this rank, not consumed yet.
    bool awaits_end(int s) const {
      return s != f_.rank && s >= f_.ends_from && s < f_.ends_to && f_.ended[s] != f_.minibatch;
    }
    // A slot of this rank's signal words (written by peers under this rank's mailbox mutex).
    uint64_t read(const uint64_t* slots, int peer) const {
      std::lock_guard<std::mutex> lock(
          t_.world_->mailboxes_[static_cast<size_t>(t_.rank())]->mutex);
      return slots[peer];
    }

    Status refuse(int sender, uint64_t expected, uint64_t seen) const {
      return Status::InternalError(
          "streamed fold: rank " + std::to_string(f_.rank) + " refused chunk " +
          std::to_string(expected) + " from rank " + std::to_string(sender) + ": saw " +
          std::to_string(seen) +
          " instead (a slot holding another chunk, a signal or end beyond what the ring holds, or "
          "a chunk for no live accumulator: a lost put, a stray or doubled signal or credit); "
          "nothing of it was added");
    }

    Status fold_sender(int sender, uint64_t last, uint64_t end) {
      const uint64_t start = f_.folded[sender];
      if (end != 0 && end <= start) return refuse(sender, start + 1, end);
      if (last > start + f_.depth) return refuse(sender, start + 1, last);
      const char* ring = f_.rings + static_cast<uint64_t>(sender) * f_.depth * f_.slot_bytes;
      uint64_t folded = start;
      while (folded < last) {
        const uint64_t sequence = folded + 1;
        const char* slot = ring + ((sequence - 1) % f_.depth) * f_.slot_bytes;
        kernels::ChunkHeader header;
        std::memcpy(&header, slot, sizeof(header));
        float* sums = nullptr;
        const auto dtype = static_cast<DataType>(header.dtype);
        const bool in_order = header.sequence == sequence && is_valid(dtype) &&
                              header.count * element_bytes(dtype) <= f_.slot_bytes - sizeof(header);
        if (in_order && header.minibatch == f_.minibatch) {
          for (int i = 0; i < f_.num_targets; ++i) {
            const kernels::FoldTarget& target = f_.targets[i];
            if (target.buffer_id == header.buffer_id && header.first <= target.count &&
                header.count <= target.count - header.first) {
              sums = target.sums + header.first;
            }
          }
        }
        // As the kernel: a progress pass leaves what its table does not know to the caller.
        if (sums == nullptr && in_order && f_.leave_unknown) break;
        if (sums == nullptr) return refuse(sender, sequence, header.sequence);
        host::add_into(sums, slot + sizeof(header), dtype, header.count);
        uint64_t now = 0;  // rewritten while added (a stray credit)? as the kernel looks again
        std::memcpy(&now, slot, sizeof(now));
        if (now != sequence) return refuse(sender, sequence, now);
        folded = sequence;
      }
      if (end != 0) folded = end;
      if (folded != start) {
        f_.folded[sender] = folded;
        ODC_RETURN_IF_ERROR(t_.signal(region_for_credits(), sender, folded, nullptr));
      }
      return Status::Ok();
    }

    const SymmetricRegion& region_for_credits() const { return credits_; }

    MemTransport& t_;
    const kernels::StreamedFold& f_;
    const MemRegion& arrivals_;
    const MemRegion& credits_;
    const MemRegion& end_marks_;
    const MemRegion& end_sequences_;
    const MemRegion& meetings_;
  };

  std::shared_ptr<MemWorld> world_;
  // Every region this rank allocated, by its local address (a copy: the caller owns its own).
  std::map<const void*, std::unique_ptr<const MemRegion>> regions_;
  mutable std::mutex regions_mutex_;  // regions_: the progress thread's folds look regions up too
  std::mutex fold_mutex_;  // held by every emulated fold, and by accumulate when stream-ordered
};

MemWorld::MemWorld(int world_size, MemOptions options)
    : world_size_(world_size),
      options_(options),
      arrived_at_(static_cast<size_t>(world_size), 0),
      last_op_(static_cast<size_t>(world_size), CollectiveOp::kInit),
      arriving_(static_cast<size_t>(world_size)),
      status_(static_cast<size_t>(world_size), RankStatus::kAlive),
      reason_(static_cast<size_t>(world_size)) {
  for (int r = 0; r < world_size; ++r) mailboxes_.push_back(std::make_unique<Mailbox>());
}

std::shared_ptr<MemWorld> MemWorld::create(int world_size, MemOptions options) {
  return std::shared_ptr<MemWorld>(new MemWorld(world_size, options));
}

std::unique_ptr<Transport> MemWorld::join(int rank) {
  return std::make_unique<MemTransport>(shared_from_this(), rank);
}

void MemWorld::kill(int rank) {
  set_status(rank, RankStatus::kDead, "");
  std::vector<std::pair<std::shared_ptr<MemWorld>, int>> groups;  // killed outside mutex_
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [name, split] : split_worlds_) {
      auto found = std::find(split.members.begin(), split.members.end(), rank);
      std::shared_ptr<MemWorld> world = split.world.lock();
      if (found != split.members.end() && world != nullptr) {
        groups.emplace_back(std::move(world), static_cast<int>(found - split.members.begin()));
      }
    }
  }
  for (auto& [world, member] : groups) world->kill(member);
}

uint64_t MemWorld::node_key(int rank) const {
  if (!node_keys_.empty()) return node_keys_[static_cast<size_t>(rank)];
  const int per_node = options_.ranks_per_node;
  return per_node > 0 ? static_cast<uint64_t>(rank / per_node) : 0;
}

std::shared_ptr<MemWorld> MemWorld::split_world(const SplitGroup& group) {
  std::shared_ptr<MemWorld> world;
  std::vector<int> dead;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = split_worlds_.begin(); it != split_worlds_.end();) {  // forget ended groups
      it = it->second.world.expired() ? split_worlds_.erase(it) : std::next(it);
    }
    SplitWorld& split = split_worlds_[group.name];
    if (split.joining == nullptr && split.num_joined == 0) {
      MemOptions options = options_;
      options.ranks_per_node = 0;  // node keys below instead
      split.joining =
          std::shared_ptr<MemWorld>(new MemWorld(static_cast<int>(group.members.size()), options));
      split.world = split.joining;
      split.members = group.members;
      for (size_t i = 0; i < group.members.size(); ++i) {
        split.joining->node_keys_.push_back(node_key(group.members[i]));
        if (status_[static_cast<size_t>(group.members[i])] == RankStatus::kDead) {
          dead.push_back(static_cast<int>(i));
        }
      }
    }
    world = split.world.lock();
    if (++split.num_joined == split.members.size()) split.joining.reset();
  }
  for (int member : dead) world->kill(member);
  return world;
}

void* MemWorld::allocate_bytes(size_t bytes) {
  // Zeroed and 16-byte aligned; large ones as untouched pages, so that staging rings of many
  // ranks cost only what the protocol writes.
  std::unique_ptr<void, FreeDeleter> memory(std::calloc(1, std::max<size_t>(bytes, 1)));
  if (memory == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  memory_.push_back(std::move(memory));
  return memory_.back().get();
}

void MemWorld::set_status(int rank, RankStatus status, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    RankStatus& current = status_[static_cast<size_t>(rank)];
    if (current != RankStatus::kAlive) return;  // the first failure is the one to report
    current = status;
    reason_[static_cast<size_t>(rank)] = reason;
    num_not_alive_.fetch_add(1, std::memory_order_release);
  }
  collective_done_.notify_all();
  for (auto& box : mailboxes_) {
    std::lock_guard<std::mutex> lock(box->mutex);
    box->wake.notify_all();
  }
}

Status MemWorld::peer_failure_locked(int peer) const {
  const std::string who = "rank " + std::to_string(peer);
  switch (status_[static_cast<size_t>(peer)]) {
    case RankStatus::kAlive:
      return Status::Ok();
    case RankStatus::kFailed:
      return Status::RemoteError(who + " failed: " + reason_[static_cast<size_t>(peer)]);
    case RankStatus::kDead:
      return Status::RemoteError(who + " died");
    case RankStatus::kClosed:
      return Status::RemoteError(who + " destroyed its communicator");
  }
  return Status::InternalError("unknown rank status");
}

Status MemWorld::peer_failure(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  return peer_failure_locked(peer);
}

Status MemWorld::collective(int rank, CollectiveOp op, const ExchangeRecord* mine,
                            std::vector<ExchangeRecord>* all) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t generation = generation_;
  if (num_arrived_ == 0) {
    op_ = op;
    op_rank_ = rank;
  } else if (op != op_) {
    return Status::RemoteError(std::string("collective mismatch: rank ") +
                               std::to_string(op_rank_) + " called " + collective_op_name(op_) +
                               " where this rank called " + collective_op_name(op));
  }
  if (mine != nullptr) arriving_[static_cast<size_t>(rank)] = *mine;
  arrived_at_[static_cast<size_t>(rank)] = generation + 1;
  last_op_[static_cast<size_t>(rank)] = op;
  if (++num_arrived_ == world_size_) {
    num_arrived_ = 0;
    ++generation_;
    if (all != nullptr || mine != nullptr) completed_ = arriving_;
    if (all != nullptr) *all = completed_;
    lock.unlock();
    collective_done_.notify_all();
    return Status::Ok();
  }
  const auto deadline = deadline_after(options_.timeout);
  while (generation_ == generation) {
    // A peer that has not arrived and failed, died or closed never will.
    for (int peer = 0; peer < world_size_ && num_not_alive_.load() > 0; ++peer) {
      if (arrived_at_[static_cast<size_t>(peer)] == generation + 1) continue;
      ODC_RETURN_IF_ERROR(peer_failure_locked(peer));
    }
    if (collective_done_.wait_until(lock, deadline) == std::cv_status::timeout &&
        generation_ == generation) {
      for (int peer = 0; peer < world_size_; ++peer) {
        if (arrived_at_[static_cast<size_t>(peer)] == generation + 1) continue;
        const uint64_t last = arrived_at_[static_cast<size_t>(peer)];
        return Status::Timeout(
            "timed out after " + seconds_text(options_.timeout) + " waiting for rank " +
            std::to_string(peer) + " (its last collective: " +
            (last == 0 ? std::string("none")
                       : std::string(collective_op_name(last_op_[static_cast<size_t>(peer)])) +
                             " #" + std::to_string(last)) +
            ")");
      }
    }
  }
  // The next collective needs this rank's arrival, so completed_ still holds this one's records.
  if (all != nullptr) *all = completed_;
  return Status::Ok();
}

}  // namespace odc::mem
