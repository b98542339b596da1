// Host shared-memory transport (see shm_transport.h).
#include "transport/shm/shm_transport.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "common/deadline.h"
#include "common/interrupt.h"
#include "core/host_ops.h"

namespace odc::shm {

namespace {

using Clock = ShmBootstrap::Clock;

class ShmRegion final : public SymmetricRegion {
 public:
  ShmRegion(std::vector<std::unique_ptr<Segment>> segments, std::vector<void*> peers, int rank,
            size_t bytes)
      : SymmetricRegion(std::move(peers), rank, bytes), segments_(std::move(segments)) {}

 private:
  std::vector<std::unique_ptr<Segment>> segments_;  // unmapped on destruction
};

}  // namespace

ShmTransport::ShmTransport(std::shared_ptr<ShmBootstrap> bootstrap)
    : Transport(TransportTraits{bootstrap->rank(), bootstrap->world_size(), TransportCaps{},
                                bootstrap->timeout()}),
      bootstrap_(std::move(bootstrap)) {}

Result<std::unique_ptr<ShmTransport>> ShmTransport::create(int rank, int world_size,
                                                           const std::string& key,
                                                           std::chrono::duration<double> timeout,
                                                           Bootstrap* outer,
                                                           const std::string& launch) {
  auto bootstrap = ShmBootstrap::create(rank, world_size, key, timeout, outer, nullptr, launch);
  if (!bootstrap.ok()) return bootstrap.status();
  return std::make_unique<ShmTransport>(std::move(bootstrap).value());
}

Result<std::unique_ptr<Transport>> ShmTransport::split(const SplitGroup& group) {
  if (group.rank < 0) return std::unique_ptr<Transport>();
  // Members that fail or die in this transport before they meet are seen through its blocks.
  const ShmBootstrap::SplitParent parent{bootstrap_.get(), group.members};
  auto made = ShmBootstrap::create(group.rank, static_cast<int>(group.members.size()), group.name,
                                   timeout(), /*outer=*/nullptr, &parent, bootstrap_->launch());
  if (!made.ok()) return made.status();
  return std::unique_ptr<Transport>(new ShmTransport(std::move(made).value()));
}

Result<std::vector<ExchangeRecord>> ShmTransport::exchange(const ExchangeRecord& mine) {
  std::vector<ExchangeRecord> all(static_cast<size_t>(world_size()));
  ODC_RETURN_IF_ERROR(bootstrap_->allgather(&mine, all.data(), sizeof(ExchangeRecord),
                                            collective_op_name(CollectiveOp::kExchange)));
  return all;
}

Result<std::unique_ptr<SymmetricRegion>> ShmTransport::allocate(size_t bytes) {
  const int rank = this->rank();
  const int world_size = this->world_size();
  const uint64_t index = allocations_++;
  // Before the name exists: whoever finds this rank dead removes the names it counts (and the
  // name records this process, so the next job on the host removes it if the whole job dies).
  bootstrap_->note_allocations(allocations_);

  // Phase 1: create ours. A leftover with our name can only be debris of a crashed run (our
  // control block is ours while we live, and names are unlinked once mapped), so it is replaced.
  const std::string own_name = bootstrap_->allocation_name(rank, index);
  auto created = Segment::create(own_name, bytes);
  if (!created.ok() && created.status().code() == StatusCode::kInvalidArgument) {
    ODC_RETURN_IF_ERROR(Segment::unlink_name(own_name));
    created = Segment::create(own_name, bytes);
  }
  // Every rank learns whether every rank succeeded, so all fail (and stay usable) together. A
  // failed allocation removes its name when `created` goes.
  auto agree = [&](bool ok, const std::string& what) -> Status {
    ExchangeRecord record;
    record.words[0] = ok ? 1 : 0;
    auto all = exchange(record);
    if (!all.ok()) return all.status();
    for (int r = 0; r < world_size; ++r) {
      if (all.value()[r].words[0] == 0) {
        return Status::SystemError("rank " + std::to_string(r) + " could not " + what);
      }
    }
    return Status::Ok();
  };
  if (Status status = agree(created.ok(), "create its shared memory segment"); !status.ok()) {
    return created.ok() ? status : created.status();
  }

  // Phase 2: map every peer's.
  std::vector<std::unique_ptr<Segment>> segments;
  std::vector<void*> pointers(static_cast<size_t>(world_size), nullptr);
  Status mapped = Status::Ok();
  for (int peer = 0; peer < world_size && mapped.ok(); ++peer) {
    if (peer == rank) {
      pointers[peer] = created.value()->data();
      continue;
    }
    auto opened = Segment::open(bootstrap_->allocation_name(peer, index), bytes);
    if (!opened.ok()) {
      mapped = opened.status();
      break;
    }
    pointers[peer] = opened.value()->data();
    segments.push_back(std::move(opened).value());
  }
  if (Status status = agree(mapped.ok(), "map its peers' segments"); !status.ok()) {
    return mapped.ok() ? status : mapped;
  }
  // Everyone has mapped everything: no name is needed any more. Each rank removes every rank's,
  // so one that dies right now leaves nothing named behind.
  ODC_RETURN_IF_ERROR(created.value()->unlink());
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer != rank) (void)Segment::unlink_name(bootstrap_->allocation_name(peer, index));
  }
  segments.push_back(std::move(created).value());
  return std::unique_ptr<SymmetricRegion>(
      new ShmRegion(std::move(segments), std::move(pointers), rank, bytes));
}

Status ShmTransport::get_all(void* dst, const SymmetricRegion& region, size_t count,
                             DataType src_dtype, DataType dst_dtype, StreamHandle) {
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

Status ShmTransport::get(void* dst, const SymmetricRegion& region, int peer, size_t offset,
                         size_t bytes, StreamHandle) {
  std::memcpy(dst, static_cast<const char*>(region.peer(peer)) + offset, bytes);
  return Status::Ok();
}

Status ShmTransport::put(const void* src, const SymmetricRegion& region, int peer, size_t offset,
                         size_t bytes, StreamHandle) {
  std::memcpy(static_cast<char*>(region.peer(peer)) + offset, src, bytes);
  return Status::Ok();
}

Status ShmTransport::signal(const SymmetricRegion& signals, int peer, uint64_t value,
                            StreamHandle) {
  // The release store publishes every earlier put of this rank; waiters sleep on our futex word.
  std::atomic_ref<uint64_t> slot(static_cast<uint64_t*>(signals.peer(peer))[rank()]);
  slot.store(value, std::memory_order_release);
  bootstrap_->wake_peers();
  bootstrap_->wake_inbox(peer);
  return Status::Ok();
}

Status ShmTransport::compare_swap(const std::vector<CompareSwapOp>& ops, uint64_t* old_values) {
  const auto now = Clock::now();
  if (now >= next_claim_liveness_check_) {
    for (const CompareSwapOp& op : ops) {
      if (op.peer != rank()) ODC_RETURN_IF_ERROR(bootstrap_->peer_status(op.peer));
    }
    next_claim_liveness_check_ = now + std::chrono::milliseconds(10);
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const CompareSwapOp& op = ops[i];
    auto* word =
        reinterpret_cast<uint64_t*>(static_cast<char*>(op.region->peer(op.peer)) + op.offset);
    uint64_t expected = op.expected;
    // On failure compare_exchange stores the value it found into `expected`.
    std::atomic_ref<uint64_t>(*word).compare_exchange_strong(expected, op.desired,
                                                             std::memory_order_seq_cst);
    old_values[i] = expected;
  }
  return Status::Ok();
}

Result<bool> ShmTransport::poll_signals(const std::vector<SignalWatch>& watches, size_t num_all,
                                        std::chrono::duration<double> limit,
                                        std::vector<uint64_t>* seen) {
  const auto deadline = deadline_after(limit);
  auto next_liveness_check = Clock::now() + std::chrono::milliseconds(10);
  seen->assign(watches.size(), 0);
  for (;;) {
    const uint32_t seen_inbox = bootstrap_->inbox_count();  // before the check: no lost wake-up
    bool all = num_all > 0;
    bool any = false;
    for (size_t i = 0; i < watches.size(); ++i) {
      auto* slots = static_cast<uint64_t*>(watches[i].signals->local());
      (*seen)[i] =
          std::atomic_ref<uint64_t>(slots[watches[i].peer]).load(std::memory_order_acquire);
      const bool reached = (*seen)[i] >= watches[i].value;
      if (i < num_all) {
        all = all && reached;
      } else {
        any = any || reached;
      }
    }
    if (all || any) return true;
    const auto now = Clock::now();
    if (now >= next_liveness_check) {  // reads /proc: rate-limited, each peer once
      std::vector<char> checked(static_cast<size_t>(world_size()), 0);
      for (const SignalWatch& watch : watches) {
        if (checked[static_cast<size_t>(watch.peer)] != 0) continue;
        checked[static_cast<size_t>(watch.peer)] = 1;
        ODC_RETURN_IF_ERROR(bootstrap_->peer_status(watch.peer));
      }
      ODC_RETURN_IF_ERROR(bootstrap_->check_claim());  // another job with this key came
      next_liveness_check = now + std::chrono::milliseconds(10);
    }
    if (now >= deadline) return false;
    bootstrap_->sleep_on_inbox(
        seen_inbox, std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(10)));
  }
}

Status ShmTransport::zero(void* dst, size_t bytes, StreamHandle) {
  std::memset(dst, 0, bytes);
  return Status::Ok();
}

Status ShmTransport::accumulate(float* dst, const void* src, DataType src_type, size_t count,
                                StreamHandle) {
  host::add_into(dst, src, src_type, count);
  return Status::Ok();
}

}  // namespace odc::shm
