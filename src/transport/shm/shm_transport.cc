// Host shared-memory transport. Each rank writes only its own control block (single writer);
// peers read it. A collective is an arrival word (epoch << 8 | op) stored with release semantics
// plus a futex word bumped after it, so waiting ranks sleep in the kernel instead of spinning.
#include "transport/shm/shm_transport.h"

#include "transport/host_ops.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <thread>

namespace odc::shm {

namespace {
constexpr uint64_t kMagic = 0x316d68732d63646fULL;  // "odc-shm1"

enum BlockState : uint32_t { kStarting = 0, kAlive = 1, kFailed = 2, kClosed = 3 };
}  // namespace

struct ControlBlock {
  std::atomic<uint64_t> magic;  // kMagic once every other field is set
  uint32_t world_size;
  int32_t rank;
  int32_t pid;
  std::atomic<uint32_t> state;
  std::atomic<uint64_t> num_allocations;      // allocation segments named so far (for reclaiming)
  alignas(64) std::atomic<uint64_t> arrival;  // (epoch << 8) | CollectiveOp
  std::atomic<uint32_t> wake;                 // futex word, bumped after every arrival
  alignas(64) ExchangeRecord records[2];      // exchange() slots, alternating
  char failure[256];                          // why this rank failed (state == kFailed)
};

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be 32 bits");

namespace {

using Clock = std::chrono::steady_clock;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto nanos = std::max<int64_t>(timeout.count(), 0);
  timespec relative{static_cast<time_t>(nanos / 1000000000), static_cast<long>(nanos % 1000000000)};
  // Shared (not FUTEX_PRIVATE) because the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &relative, nullptr,
          0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// True when `pid` exists and is not a zombie (a dead child its parent has not reaped yet).
bool pid_alive(int32_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  const size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return true;
  const char state = line[close_paren + 2];
  return state != 'Z' && state != 'X';
}

std::string seconds_text(std::chrono::duration<double> duration) {
  std::ostringstream out;
  out << duration.count() << " s";
  return out.str();
}

bool valid_key(const std::string& key) {
  if (key.empty() || key.size() > 200) return false;
  return std::all_of(key.begin(), key.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

class ShmRegion final : public SymmetricRegion {
 public:
  ShmRegion(std::vector<std::unique_ptr<Segment>> segments, std::vector<void*> peers, int rank,
            size_t bytes)
      : SymmetricRegion(std::move(peers), rank, bytes), segments_(std::move(segments)) {}

 private:
  std::vector<std::unique_ptr<Segment>> segments_;  // unmapped on destruction
};

}  // namespace

ShmTransport::ShmTransport(int rank, int world_size, std::string key,
                           std::chrono::duration<double> timeout)
    : rank_(rank), world_size_(world_size), key_(std::move(key)), timeout_(timeout) {
  controls_.resize(static_cast<size_t>(world_size));
}

Result<std::unique_ptr<ShmTransport>> ShmTransport::create(int rank, int world_size,
                                                           const std::string& key,
                                                           std::chrono::duration<double> timeout) {
  if (world_size < 1) {
    return Status::InvalidArgument("world size must be at least 1, got " +
                                   std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is outside world size " +
                                   std::to_string(world_size));
  }
  if (!valid_key(key)) {
    return Status::InvalidArgument("invalid key '" + key +
                                   "': use 1 to 200 letters, digits, '_', '-' or '.'");
  }
  if (!(timeout.count() > 0)) {
    return Status::InvalidArgument("timeout must be positive, got " + seconds_text(timeout));
  }
  std::unique_ptr<ShmTransport> transport(new ShmTransport(rank, world_size, key, timeout));
  if (Status status = transport->join(); !status.ok()) {
    transport->mark_failed("init: " + status.message());
    return status;
  }
  return transport;
}

ShmTransport::~ShmTransport() {
  if (ControlBlock* own = controls_[rank_] ? &block(rank_) : nullptr) {
    uint32_t expected = kAlive;
    own->state.compare_exchange_strong(expected, kClosed, std::memory_order_acq_rel);
    own->wake.fetch_add(1, std::memory_order_release);
    futex_wake_all(&own->wake);
  }
}

ControlBlock& ShmTransport::block(int rank) const {
  return *static_cast<ControlBlock*>(controls_[static_cast<size_t>(rank)]->data());
}

std::string ShmTransport::segment_name(int rank, const std::string& suffix) const {
  return "/odc." + key_ + ".r" + std::to_string(rank) + suffix;
}

Status ShmTransport::create_control_segment() {
  const std::string name = segment_name(rank_, "");
  // A segment that exists but was never initialized may belong to a rank that is still starting:
  // give it this long before treating it as debris of a crash.
  const auto grace_deadline = Clock::now() + std::chrono::seconds(1);
  for (int reclaimed = 0; reclaimed < 4;) {
    auto created = Segment::create(name, sizeof(ControlBlock));
    if (created.ok()) {
      auto* own = new (created.value()->data()) ControlBlock{};
      own->world_size = static_cast<uint32_t>(world_size_);
      own->rank = rank_;
      own->pid = static_cast<int32_t>(::getpid());
      own->state.store(kAlive, std::memory_order_relaxed);
      own->magic.store(kMagic, std::memory_order_release);
      controls_[rank_] = std::move(created).value();
      return Status::Ok();
    }
    if (created.status().code() != StatusCode::kInvalidArgument) return created.status();

    auto existing = Segment::open(name, sizeof(ControlBlock));
    if (!existing.ok()) {
      if (existing.status().code() == StatusCode::kInvalidUsage && Clock::now() < grace_deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;  // vanished or still being sized: look again
      }
      if (existing.status().code() != StatusCode::kInvalidUsage) return existing.status();
    } else {
      auto* old = static_cast<ControlBlock*>(existing.value()->data());
      if (old->magic.load(std::memory_order_acquire) == kMagic) {
        const uint32_t state = old->state.load(std::memory_order_acquire);
        if (pid_alive(old->pid) && (state == kAlive || state == kStarting)) {
          return Status::InvalidUsage("key '" + key_ + "' is in use: rank " +
                                      std::to_string(rank_) + " is held by live process " +
                                      std::to_string(old->pid) +
                                      "; use another key or end that process");
        }
        const uint64_t stale_allocations = old->num_allocations.load(std::memory_order_acquire);
        for (uint64_t i = 0; i < stale_allocations; ++i) {
          ODC_RETURN_IF_ERROR(Segment::unlink_name(segment_name(rank_, ".a" + std::to_string(i))));
        }
        std::fprintf(stderr, "odc: reclaimed shared memory of key '%s' rank %d left by pid %d\n",
                     key_.c_str(), rank_, old->pid);
      } else if (Clock::now() < grace_deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
    }
    ODC_RETURN_IF_ERROR(Segment::unlink_name(name));
    ++reclaimed;
  }
  return Status::SystemError("could not create shared memory segment " + name +
                             ": it keeps reappearing");
}

Status ShmTransport::map_peer(int peer, Clock::time_point deadline) {
  const std::string name = segment_name(peer, "");
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    auto opened = Segment::open(name, sizeof(ControlBlock));
    if (opened.ok()) {
      auto* peer_block = static_cast<ControlBlock*>(opened.value()->data());
      // A block without magic is still being set up; one whose owner is dead is debris that the
      // peer will reclaim when it starts. Either way: look again.
      if (peer_block->magic.load(std::memory_order_acquire) == kMagic &&
          pid_alive(peer_block->pid)) {
        if (peer_block->world_size != static_cast<uint32_t>(world_size_)) {
          return Status::InvalidArgument("rank " + std::to_string(peer) + " joined key '" + key_ +
                                         "' with world size " +
                                         std::to_string(peer_block->world_size) +
                                         ", this rank with " + std::to_string(world_size_));
        }
        controls_[peer] = std::move(opened).value();
        return Status::Ok();
      }
    } else if (opened.status().code() != StatusCode::kInvalidUsage) {
      return opened.status();
    }
    if (Clock::now() >= deadline) {
      return Status::Timeout("timed out after " + seconds_text(timeout_) + " waiting for rank " +
                             std::to_string(peer) + " to join key '" + key_ + "'");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

Status ShmTransport::join() {
  ODC_RETURN_IF_ERROR(create_control_segment());
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) ODC_RETURN_IF_ERROR(map_peer(peer, deadline));
  }
  ODC_RETURN_IF_ERROR(arrive_and_wait(CollectiveOp::kInit));
  // Every rank has mapped our block: the name is no longer needed.
  return controls_[rank_]->unlink();
}

void ShmTransport::wake_peers() {
  ControlBlock& own = block(rank_);
  own.wake.fetch_add(1, std::memory_order_release);
  futex_wake_all(&own.wake);
}

Status ShmTransport::arrive_and_wait(CollectiveOp op) {
  ++epoch_;
  ControlBlock& own = block(rank_);
  own.arrival.store((epoch_ << 8) | static_cast<uint64_t>(op), std::memory_order_release);
  wake_peers();
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) ODC_RETURN_IF_ERROR(wait_for_peer(peer, epoch_, op, deadline));
  }
  return Status::Ok();
}

Status ShmTransport::wait_for_peer(int peer, uint64_t epoch, CollectiveOp op,
                                   Clock::time_point deadline) {
  ControlBlock& other = block(peer);
  const std::string who = "rank " + std::to_string(peer);
  auto next_liveness_check = Clock::now();
  // 1: the peer reached this collective; 0: not yet; -1: it is in a different one.
  auto reached = [&](uint64_t word) {
    const uint64_t peer_epoch = word >> 8;
    if (peer_epoch > epoch) return 1;
    if (peer_epoch < epoch) return 0;
    return static_cast<CollectiveOp>(word & 0xff) == op ? 1 : -1;
  };
  // A peer may arrive, pass the collective and exit between our reads: before reporting that it
  // failed, closed or died, look once more whether it arrived.
  auto unless_arrived = [&](Status failure) {
    const uint64_t word = other.arrival.load(std::memory_order_acquire);
    return reached(word) == 1 ? Status::Ok() : failure;
  };
  for (int attempt = 0;; ++attempt) {
    const uint32_t seen_wake = other.wake.load(std::memory_order_acquire);
    const uint64_t word = other.arrival.load(std::memory_order_acquire);
    const uint64_t peer_epoch = word >> 8;
    const auto peer_op = static_cast<CollectiveOp>(word & 0xff);
    const int state_of_peer = reached(word);
    if (state_of_peer == 1) return Status::Ok();
    if (state_of_peer == -1) {
      return Status::RemoteError(std::string("collective mismatch: ") + who + " called " +
                                 collective_op_name(peer_op) + " where this rank called " +
                                 collective_op_name(op));
    }
    const uint32_t state = other.state.load(std::memory_order_acquire);
    if (state == kFailed) {
      const std::string reason(other.failure, strnlen(other.failure, sizeof(other.failure)));
      return unless_arrived(Status::RemoteError(who + " failed: " + reason));
    }
    if (state == kClosed) {
      return unless_arrived(Status::RemoteError(who + " destroyed its communicator"));
    }
    const auto now = Clock::now();
    if (now >= next_liveness_check) {
      if (!pid_alive(other.pid)) {
        return unless_arrived(
            Status::RemoteError(who + " (pid " + std::to_string(other.pid) + ") died"));
      }
      next_liveness_check = now + std::chrono::milliseconds(10);
    }
    if (now >= deadline) {
      const std::string last = peer_epoch == 0 ? std::string("none")
                                               : std::string(collective_op_name(peer_op)) + " #" +
                                                     std::to_string(peer_epoch);
      return unless_arrived(Status::Timeout("timed out after " + seconds_text(timeout_) +
                                            " waiting for " + who +
                                            " (its last collective: " + last + ")"));
    }
    if (attempt < 64) {
      std::this_thread::yield();
      continue;
    }
    futex_wait(&other.wake, seen_wake,
               std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(20)));
  }
}

Result<std::vector<ExchangeRecord>> ShmTransport::exchange(const ExchangeRecord& mine) {
  const size_t slot = exchanges_++ % 2;
  block(rank_).records[slot] = mine;  // published by the release store of the arrival
  ODC_RETURN_IF_ERROR(arrive_and_wait(CollectiveOp::kExchange));
  std::vector<ExchangeRecord> all(static_cast<size_t>(world_size_));
  for (int r = 0; r < world_size_; ++r) all[r] = block(r).records[slot];
  return all;
}

Result<std::unique_ptr<SymmetricRegion>> ShmTransport::allocate(size_t bytes) {
  const std::string suffix = ".a" + std::to_string(allocations_++);
  block(rank_).num_allocations.store(allocations_, std::memory_order_release);

  // Phase 1: create ours. A leftover with our name can only be debris of a crashed run (our
  // control block is new and names are unlinked once mapped), so it is replaced.
  const std::string own_name = segment_name(rank_, suffix);
  auto created = Segment::create(own_name, bytes);
  if (!created.ok() && created.status().code() == StatusCode::kInvalidArgument) {
    ODC_RETURN_IF_ERROR(Segment::unlink_name(own_name));
    created = Segment::create(own_name, bytes);
  }
  // Every rank learns whether every rank succeeded, so all fail (and stay usable) together.
  auto agree = [&](bool ok, const std::string& what) -> Status {
    ExchangeRecord record;
    record.words[0] = ok ? 1 : 0;
    auto all = exchange(record);
    if (!all.ok()) return all.status();
    for (int r = 0; r < world_size_; ++r) {
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
  std::vector<void*> pointers(static_cast<size_t>(world_size_), nullptr);
  Status mapped = Status::Ok();
  for (int peer = 0; peer < world_size_ && mapped.ok(); ++peer) {
    if (peer == rank_) {
      pointers[peer] = created.value()->data();
      continue;
    }
    auto opened = Segment::open(segment_name(peer, suffix), bytes);
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
  ODC_RETURN_IF_ERROR(created.value()->unlink());
  segments.push_back(std::move(created).value());
  return std::unique_ptr<SymmetricRegion>(
      new ShmRegion(std::move(segments), std::move(pointers), rank_, bytes));
}

void ShmTransport::mark_failed(const std::string& reason) {
  if (!controls_[rank_]) return;
  ControlBlock& own = block(rank_);
  if (own.state.load(std::memory_order_acquire) == kFailed) return;
  const size_t length = std::min(reason.size(), sizeof(own.failure) - 1);
  std::memcpy(own.failure, reason.data(), length);
  own.failure[length] = '\0';
  own.state.store(kFailed, std::memory_order_release);
  own.wake.fetch_add(1, std::memory_order_release);
  futex_wake_all(&own.wake);
}

Status ShmTransport::get_all(void* dst, const SymmetricRegion& region, size_t bytes, StreamHandle) {
  auto* out = static_cast<char*>(dst);
  for (int r = 0; r < world_size_; ++r) {
    std::memcpy(out + static_cast<size_t>(r) * bytes, region.peer(r), bytes);
  }
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
  std::atomic_ref<uint64_t> slot(static_cast<uint64_t*>(signals.peer(peer))[rank_]);
  slot.store(value, std::memory_order_release);
  wake_peers();
  return Status::Ok();
}

Status ShmTransport::wait_signals(const SymmetricRegion& signals, uint64_t value,
                                  const char* operation, StreamHandle) {
  auto* slots = static_cast<uint64_t*>(signals.local());
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  for (int peer = 0; peer < world_size_; ++peer) {
    std::atomic_ref<uint64_t> slot(slots[peer]);
    if (peer == rank_) {
      if (slot.load(std::memory_order_acquire) >= value) continue;
      return Status::InternalError(std::string(operation) + ": own signal " +
                                   std::to_string(slot.load()) + " below " + std::to_string(value));
    }
    ControlBlock& other = block(peer);
    const std::string who = "rank " + std::to_string(peer);
    auto next_liveness_check = Clock::now();
    for (int attempt = 0;; ++attempt) {
      const uint32_t seen_wake = other.wake.load(std::memory_order_acquire);
      const uint64_t seen = slot.load(std::memory_order_acquire);
      if (seen >= value) break;
      const uint32_t state = other.state.load(std::memory_order_acquire);
      // A peer may signal and then fail or exit: look at the slot once more before blaming it.
      auto unless_signaled = [&](Status failure) {
        return slot.load(std::memory_order_acquire) >= value ? Status::Ok() : failure;
      };
      Status failure = Status::Ok();
      if (state == kFailed) {
        const std::string reason(other.failure, strnlen(other.failure, sizeof(other.failure)));
        failure = unless_signaled(Status::RemoteError(who + " failed: " + reason));
      } else if (state == kClosed) {
        failure = unless_signaled(Status::RemoteError(who + " destroyed its communicator"));
      }
      const auto now = Clock::now();
      if (failure.ok() && now >= next_liveness_check) {
        if (!pid_alive(other.pid)) {
          failure = unless_signaled(
              Status::RemoteError(who + " (pid " + std::to_string(other.pid) + ") died"));
        }
        next_liveness_check = now + std::chrono::milliseconds(10);
      }
      if (failure.ok() && now >= deadline) {
        failure = unless_signaled(Status::Timeout(
            std::string("signal wait (") + operation + ") timed out after " +
            seconds_text(timeout_) + ": rank " + std::to_string(rank_) + " waited for " + who +
            " (expected " + std::to_string(value) + ", saw " + std::to_string(seen) + ")"));
      }
      if (!failure.ok()) return failure;
      if (slot.load(std::memory_order_acquire) >= value) break;
      if (attempt < 64) {
        std::this_thread::yield();
        continue;
      }
      futex_wait(&other.wake, seen_wake,
                 std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(20)));
    }
  }
  return Status::Ok();
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

Status ShmTransport::sum_slots(float* dst, const float* slots, size_t stride, int num_slots,
                               size_t count, StreamHandle) {
  host::sum_in_order(dst, slots, stride, num_slots, count);
  return Status::Ok();
}

}  // namespace odc::shm
